"""Triton decode kernels (nsa_ops.kernels.decode), graph-safe cache append, the "decode" route.

CPU cases run the kernels under TRITON_INTERPRET (conftest) on tiny geometry (test_decode.py's:
l=16, d=8, l'=16, n=4, w=24) at positions on both sides of the compressed-emission, selection-block
and window boundaries, and compare with `nsa_ops.decode`'s reference in float64 computed from the
same (possibly fp16) cache: |kernel - reference| <= ATOL * (1 + |reference|), ATOL fp32 1e-5,
fp16 1e-2. The selection must equal the reference's exactly and the read counter must equal
reads(S). Scratch and outputs come from torch.empty, which the CPU tests make NaN / -7 filled,
so anything the kernels leave unwritten shows up. bf16 is GPU-only (the interpreter's bf16 tl.dot
is wrong).

GPU cases (-m gpu): token-by-token decode of an NSAAttention with random weights equals its
prefill (relative Frobenius error < 1e-2 fp16, < 2e-2 bf16, T=2000 crossing every boundary), the
CUDA-graph decoder equals eager decode step by step, and at 64k both the split-K and the one-launch
kernels equal the float32 reference at a few positions.
"""
import random

import pytest
import torch

from nsa_ops import NSAAttention, NSACache, NSAConfig, reference, routing
from nsa_ops import decode as dec
from nsa_ops.kernels.decode import nsa_decode
from nsa_ops.routing import Inputs
from helpers import poisoned_empty, random_blocks, random_window, rel_err

GEO = dict(block_len=16, block_stride=8, sel_block=16, num_sel=4, window=24)
ATOL = {torch.float32: 1e-5, torch.float16: 1e-2}
# on the GPU: fp32 dots summed in another order than the reference's; bf16 outputs round at 2^-8
ATOL_GPU = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}
REL_GPU = {torch.float16: 1e-2, torch.bfloat16: 2e-2}

# log2 of a block's Eq.9 mass is -inf when no row overlaps it; numpy warns about it
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2")


def config(G, H, Dk, Dv, **geo):
    return NSAConfig(hidden_size=32, num_heads=G * H, num_kv_heads=H, head_dim_qk=Dk,
                     head_dim_v=Dv, **{**GEO, **geo})


def filled_cache(cfg, B, S, capacity, dtype, device="cpu", seed=0):
    """A cache holding S random tokens (mean phi), plus its float64 twin for the reference."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, S, cfg.num_kv_heads, cfg.head_dim_qk, generator=g).to(dtype)
    v = torch.randn(B, S, cfg.num_kv_heads, cfg.head_dim_v, generator=g).to(dtype)
    cache = NSACache(cfg, B, capacity, dtype=dtype, device=device)
    cache.append(k.to(device), v.to(device), reference.compress_mean, reference.compress_mean)
    return cache


def twin(cache, dtype):
    """The same stored tokens and compressed rows, converted to dtype (same length)."""
    out = NSACache(cache.config, cache.batch_size, cache.capacity, dtype=dtype,
                   device=cache.device)
    for name in ("k", "v", "k_cmp", "v_cmp"):
        getattr(out, name).copy_(getattr(cache, name))
    out.length = cache.length
    out.device_length.copy_(cache.device_length)
    return out


def at_length(S, *caches):
    """Caches holding their first S tokens (host and device lengths)."""
    for c in caches:
        c.length = S
        c.device_length.fill_(S)


def query(cfg, B, dtype, device="cpu", seed=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 1, cfg.num_heads, cfg.head_dim_qk, generator=g).to(dtype)
    gates = [torch.rand(B, 1, cfg.num_heads, generator=g).to(dtype) for _ in range(3)]
    return q.to(device), [x.to(device) for x in gates]


def run_kernel(q, cache, gates, splits=None, fused=None):
    c = cache.config
    return nsa_decode(q, cache.k, cache.v, cache.k_cmp, cache.v_cmp, cache.device_length, *gates,
                      block_len=c.block_len, block_stride=c.block_stride, sel_block=c.sel_block,
                      num_sel=c.num_sel, window=c.window, scale=c.scale, splits=splits,
                      fused=fused)


def reference_step(q, cache, gates):
    """(o, reads, block_idx) of the reference for the newest token, in cache's dtype."""
    dt = cache.dtype
    return dec._rows(q.to(dt), cache.length - 1, cache, *(g.to(dt) for g in gates),
                     cache.config.scale)


def assert_close(got, want, atol):
    assert not got.isnan().any(), "NaN in the kernel output"
    err = (got.double() - want.double()).abs() / (1 + want.double().abs())
    assert err.max().item() <= atol, f"error {err.max().item():.3g} > {atol}"


def check_step(S, q, cache, ref_cache, gates, splits):
    """The kernel's step at cache length S against the reference's on ref_cache (float64 twin):
    the same selection and read count, the output within ATOL (ATOL_GPU), in q's dtype and
    shape."""
    at_length(S, cache, ref_cache)
    with poisoned_empty():
        o, reads, block_idx = run_kernel(q, cache, gates, splits)
    want_o, want_reads, want_idx = reference_step(q, ref_cache, gates)
    assert torch.equal(block_idx, want_idx), f"S={S}: selection differs"
    assert reads.tolist() == want_reads.tolist() == [cache.config.reads(S)], f"S={S}"
    assert o.dtype == q.dtype and o.shape == want_o.shape
    assert_close(o, want_o, (ATOL_GPU if q.is_cuda else ATOL)[q.dtype])


# --------------------------------------------------------------------------------------------
# CPU: kernel vs reference (interpreter)
# --------------------------------------------------------------------------------------------

# (B, G, H, Dk, Dv, splits, positions S): splits None is the occupancy heuristic, which on CPU
# (one "SM") picks the one-launch kernel; given splits run the split-K launches
CASES = [
    (2, 2, 2, 16, 24, None, (1, 16, 17, 300)),
    (1, 4, 1, 32, 16, None, (31, 32, 129, 200)),
    (2, 1, 2, 16, 16, (1, 1, 1), (1, 16, 17, 300)),
    (1, 1, 2, 16, 16, (3, 2, 3), (15, 24, 25, 33, 64, 65)),
    (1, 4, 1, 32, 16, (7, 3, 4), (31, 32, 129, 200)),
    (2, 2, 1, 16, 32, (2, 1, 2), (48, 49, 97)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("B,G,H,Dk,Dv,splits,positions", CASES,
                         ids=[f"B{c[0]}-G{c[1]}-H{c[2]}-Dk{c[3]}-Dv{c[4]}-splits{c[5]}"
                              for c in CASES])
def test_kernel_matches_reference(B, G, H, Dk, Dv, splits, positions, dtype):
    if dtype == torch.float16:
        positions = positions[-2:]  # fp16 reruns the same code: its two latest positions
    cfg = config(G, H, Dk, Dv)
    cache = filled_cache(cfg, B, max(positions), capacity=max(positions) + 7, dtype=dtype)
    ref_cache = twin(cache, torch.float64)
    q, gates = query(cfg, B, dtype)
    for S in positions:
        check_step(S, q, cache, ref_cache, gates, splits)


@pytest.mark.parametrize("splits", [(5, 1, 2), None], ids=["split-K", "one-launch"])
def test_kernel_selection_covers_many_blocks(splits):
    """n=6 among 40 blocks at l=32, d=16, l'=64 (two rows straddle each block edge)."""
    cfg = config(2, 1, 16, 16, block_len=32, block_stride=16, sel_block=64, num_sel=6,
                 window=40)
    S = 2531
    cache = filled_cache(cfg, 1, S, capacity=S, dtype=torch.float32)
    q, gates = query(cfg, 1, torch.float32)
    with poisoned_empty():
        o, reads, block_idx = run_kernel(q, cache, gates, splits=splits)
    want_o, want_reads, want_idx = reference_step(q, twin(cache, torch.float64), gates)
    assert torch.equal(block_idx, want_idx)
    cur = (S - 1) // cfg.sel_block
    assert len(set(block_idx.flatten().tolist()) - {0, cur - 1, cur, -1}) == 3, \
        "three blocks beyond the forced ones"
    assert reads.tolist() == want_reads.tolist() == [cfg.reads(S)]
    assert_close(o, want_o, ATOL[torch.float32])


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered")
@pytest.mark.parametrize("splits", [(5, 1, 2), None], ids=["split-K", "one-launch"])
def test_a_nan_query_keeps_its_forced_blocks(splits):
    """A NaN query head (batch row 1, KV head 0's group) selects as the reference does: the
    forced blocks, then the lowest (a NaN score ranks as 0; the top-n keys had ranked its float
    bits above the forced blocks' +inf), and only that head's output is NaN."""
    cfg = config(2, 2, 16, 16, num_sel=6)
    S = 300
    cache = filled_cache(cfg, 2, S, capacity=S, dtype=torch.float32)
    q, gates = query(cfg, 2, torch.float32)
    q[1, 0, 1, 3] = float("nan")
    with poisoned_empty():
        o, _, block_idx = run_kernel(q, cache, gates, splits=splits)
    _, _, want_idx = reference_step(q, twin(cache, torch.float64), gates)
    cur = (S - 1) // cfg.sel_block
    assert block_idx[1, 0, 0].tolist() == [0, 1, 2, 3, cur - 1, cur]
    assert torch.equal(block_idx, want_idx)
    assert o.isnan().any(-1).nonzero().tolist() == [[1, 0, 1]]


def _geometry_draw(index: int, gpu: bool = False) -> dict:
    """A geometry the kernel serves, drawn (seeded by index): block sizes, n, window, group and
    head dims (not only multiples of 16), split-K or one launch; on the GPU longer caches, wider
    groups and heads up to the kernel's 256, bf16 too."""
    rng = random.Random((5000 if gpu else 4000) + index)
    capacity = rng.randint(64, 6000) if gpu else rng.randint(8, 300)

    def refusal(g):
        return routing.decode_geometry_refusal(routing.DecodeGeometry(
            g["block_len"], g["block_stride"], g["sel_block"], capacity))
    dims = (32, 64, 96, 128, 192, 256) if gpu else (16, 24, 40, 64)
    dtypes = (torch.float32, torch.float16, torch.bfloat16) if gpu else (torch.float32,
                                                                          torch.float16)
    split_k = (rng.randint(1, 4), rng.randint(1, 3), rng.randint(1, 4))
    return dict(geo=dict(random_blocks(rng, refusal), window=random_window(rng, capacity)),
                B=rng.randint(1, 4 if gpu else 3), G=rng.randint(1, 16 if gpu else 5),
                H=rng.randint(1, 4 if gpu else 2), Dk=rng.choice(dims), Dv=rng.choice(dims),
                capacity=capacity, dtype=rng.choice(dtypes), splits=rng.choice((None, split_k)),
                seed=rng.randrange(1 << 16))


def _draw_id(draw: dict) -> str:
    g = draw["geo"]
    return (f"B{draw['B']}G{draw['G']}H{draw['H']}-D{draw['Dk']}x{draw['Dv']}-l{g['block_len']}"
            f"d{g['block_stride']}s{g['sel_block']}n{g['num_sel']}w{g['window']}-"
            f"S{draw['capacity']}-{str(draw['dtype'])[6:]}-splits{draw['splits']}")


GEOMETRY_DRAWS = [_geometry_draw(i) for i in range(16)]
GPU_GEOMETRY_DRAWS = [_geometry_draw(i, gpu=True) for i in range(12)]


def _check_drawn(draw: dict, device: str):
    """Beyond CASES' one geometry: at positions beside the first compressed row's emission, the
    first selection blocks' edges and the window's, and at the full cache."""
    g, dtype = draw["geo"], draw["dtype"]
    cfg = config(draw["G"], draw["H"], draw["Dk"], draw["Dv"], **g)
    B, capacity = draw["B"], draw["capacity"]
    edges = {1, g["block_len"], g["block_len"] + g["block_stride"], g["sel_block"] + 1,
             2 * g["sel_block"] + 1, g["window"] + 1}
    inside = sorted(S for S in edges if S < capacity)
    picked = random.Random(draw["seed"]).sample(inside, min(len(inside), 3))
    positions = sorted(picked) + [capacity]
    cache = filled_cache(cfg, B, capacity, capacity, dtype, device, seed=draw["seed"])
    ref_cache = twin(cache, torch.float64)
    q, gates = query(cfg, B, dtype, device, seed=draw["seed"] + 1)
    for S in positions:
        check_step(S, q, cache, ref_cache, gates, draw["splits"])


@pytest.mark.parametrize("draw", GEOMETRY_DRAWS, ids=[_draw_id(d) for d in GEOMETRY_DRAWS])
def test_kernel_matches_reference_at_drawn_geometry(draw):
    _check_drawn(draw, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("draw", GPU_GEOMETRY_DRAWS,
                         ids=[_draw_id(d) for d in GPU_GEOMETRY_DRAWS])
def test_gpu_kernel_matches_reference_at_drawn_geometry(draw):
    """The same on the GPU: its tiles, stages and split heuristic at drawn geometry."""
    _check_drawn(draw, "cuda")


def test_kernel_input_errors():
    cfg = config(2, 2, 16, 16)
    cache = filled_cache(cfg, 1, 20, capacity=30, dtype=torch.float32)
    q, gates = query(cfg, 1, torch.float32)
    with pytest.raises(ValueError, match=r"q must hold one query row per sequence"):
        run_kernel(q.expand(1, 2, -1, -1), cache, gates)
    with pytest.raises(ValueError, match=r"g_slc must be a \[B, 1, HQ\]"):
        run_kernel(q, cache, [gates[0], gates[1][:, :, :2], gates[2]])
    with pytest.raises(ValueError, match="length must be an int64 tensor of shape"):
        c = cache.config
        nsa_decode(q, cache.k, cache.v, cache.k_cmp, cache.v_cmp, 20, *gates,
                   block_len=c.block_len, block_stride=c.block_stride, sel_block=c.sel_block,
                   num_sel=c.num_sel, window=c.window, scale=c.scale)
    with pytest.raises(ValueError, match="k_cmp must be float16/bfloat16/float32"):
        nsa_decode(q, cache.k, cache.v, cache.k_cmp.double(), cache.v_cmp, cache.device_length,
                   *gates, block_len=16, block_stride=8, sel_block=16, num_sel=4, window=24,
                   scale=0.25)
    with pytest.raises(ValueError, match="splits must be three positive ints"):
        run_kernel(q, cache, gates, splits=(1, 0, 1))
    with pytest.raises(ValueError, match="needs the split-K launches"):
        run_kernel(q, cache, gates, splits=(1, 1, 1), fused=True)


# --------------------------------------------------------------------------------------------
# CPU: graph-safe append, routing
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("phi", ["mean", "mlp"])
def test_append_token_equals_append(phi):
    torch.manual_seed(0)
    m = NSAAttention(config(2, 2, 16, 24, phi=phi)).double()
    if phi == "mlp":
        with torch.no_grad():
            for p in list(m.phi_k.parameters()) + list(m.phi_v.parameters()):
                p.normal_(0, 0.3)
    T = 45  # emits rows 0..3 (at positions 15, 23, 31, 39) and crosses two selection blocks
    k = torch.randn(2, T, 2, 16, dtype=torch.float64)
    v = torch.randn(2, T, 2, 24, dtype=torch.float64)
    bulk, stepped, grown = (m.new_cache(2, capacity=T), m.new_cache(2, capacity=T),
                            m.new_cache(2))
    bulk.append(k, v, m.phi_k, m.phi_v)
    for t in range(T):
        for c in (stepped, grown):
            c.append_token(k[:, t:t + 1], v[:, t:t + 1], m.phi_k, m.phi_v)
            assert c.length == t + 1 and c.device_length.tolist() == [t + 1]
    for c in (stepped, grown):
        assert torch.equal(c.selection_kv()[0], bulk.selection_kv()[0])
        assert torch.equal(c.selection_kv()[1], bulk.selection_kv()[1])
        torch.testing.assert_close(c.compressed_kv(), bulk.compressed_kv(), atol=1e-12, rtol=0)
    with pytest.raises(RuntimeError, match="NSACache is full: capacity=45 tokens, 45 cached"):
        stepped.append_token(k[:, :1], v[:, :1], m.phi_k, m.phi_v)
    stepped.reset()
    assert stepped.length == 0 and stepped.device_length.tolist() == [0]


SPEC_GEOMETRY = routing.DecodeGeometry(block_len=32, block_stride=16, sel_block=64,
                                       capacity=65536)


def test_decode_route():
    cuda = Inputs("cuda", (9, 0), torch.bfloat16, 128, 128, 1, decode=SPEC_GEOMETRY)
    assert routing.choose("decode", cuda).impl == "triton"
    several = Inputs("cuda", (9, 0), torch.bfloat16, 128, 128, 4, decode=SPEC_GEOMETRY)
    assert routing.choose("decode", several).impl == "prefill_ops"
    assert "Tq == 1" in dict(routing.explain("decode", several))["triton"]
    assert routing.choose("decode", Inputs("cpu", None, torch.float32, 8, 12, 1,
                                           decode=SPEC_GEOMETRY)).impl == "reference"


@pytest.mark.parametrize("geometry,why", [
    (routing.DecodeGeometry(32, 16, 48, 4096), "l'/d a power of two"),
    (routing.DecodeGeometry(96, 16, 64, 4096), "l <= l' + d"),
    (routing.DecodeGeometry(32, 16, 64, 2 ** 20), "selection blocks (padded)"),
])
def test_decode_geometry_the_kernel_cannot_serve_runs_the_reference(geometry, why):
    x = Inputs("cuda", (9, 0), torch.bfloat16, 128, 128, 1, decode=geometry)
    assert routing.choose("decode", x).impl == "reference"
    assert why in dict(routing.explain("decode", x))["triton"]


def test_forced_reference_decode_on_cpu(monkeypatch):
    monkeypatch.setenv("NSA_OPS_FORCE_IMPL_DECODE", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # with it, forced Triton serves CPU
    x = Inputs("cpu", None, torch.float32, 8, 12, 1, decode=SPEC_GEOMETRY)
    with pytest.raises(ValueError, match="no implementation of nsa.decode"):
        routing.choose("decode", x)


def test_cuda_graph_decoder_needs_static_cuda_cache():
    m = NSAAttention(config(2, 2, 16, 16))
    with pytest.raises(ValueError, match="static capacity"):
        m.cuda_graph_decoder(m.new_cache(1))
    with pytest.raises(ValueError, match="must be a CUDA cache"):
        m.cuda_graph_decoder(m.new_cache(1, capacity=64))


# --------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------

SPEC = dict(hidden_size=256, num_heads=16, num_kv_heads=2, head_dim_qk=64, head_dim_v=64)


def gpu_layer(dtype, seed=0, **over):
    torch.manual_seed(seed)
    m = NSAAttention(NSAConfig(**{**SPEC, **over})).to("cuda", dtype)
    with torch.no_grad():
        m.gate[-1].weight.normal_(0, 0.3)  # every branch matters
    return m


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_token_by_token_equals_prefill(dtype):
    T = 2000
    m = gpu_layer(dtype)
    x = torch.randn(1, T, SPEC["hidden_size"], device="cuda", dtype=dtype)
    with torch.no_grad():
        ref = m(x)
        cache = m.new_cache(1, capacity=T)
        query_like = torch.empty(1, 1, SPEC["num_heads"], SPEC["head_dim_qk"], device="cuda",
                                 dtype=dtype)
        assert routing.choose("decode", Inputs.of_cache(query_like, cache)).impl == "triton"
        outs = [m(x[:, t:t + 1], cache) for t in range(T)]
        reads = cache.total_reads.item()
    out = torch.cat(outs, 1)
    assert rel_err(out, ref) < REL_GPU[dtype]
    assert reads == sum(m.config.reads(S) for S in range(1, T + 1))


@pytest.mark.gpu
@pytest.mark.parametrize("prompt", [0, 100])
def test_gpu_cuda_graph_decoder_equals_eager(prompt):
    steps, dtype = 400, torch.bfloat16
    m = gpu_layer(dtype, seed=1, max_position=1024)
    x = torch.randn(1, prompt + steps, SPEC["hidden_size"], device="cuda", dtype=dtype)
    eager, graphed = m.new_cache(1), m.new_cache(1)
    with torch.no_grad():
        if prompt:
            m(x[:, :prompt], eager)
            m(x[:, :prompt], graphed)
        step = m.cuda_graph_decoder(graphed)
        assert graphed.length == prompt and graphed.device_length.item() == prompt
        for t in range(prompt, prompt + steps):
            want = m(x[:, t:t + 1], eager)
            got = step(x[:, t:t + 1])
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
            assert graphed.length == eager.length == t + 1
            assert graphed.last_reads.tolist() == [m.config.reads(t + 1)]
    assert graphed.device_length.item() == prompt + steps
    assert graphed.total_reads.item() == eager.total_reads.item()
    torch.testing.assert_close(graphed.compressed_kv(), eager.compressed_kv())


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True], ids=["split-K", "one-launch"])
def test_gpu_kernel_64k_matches_reference(fused):
    cfg = NSAConfig(hidden_size=64, num_heads=64, num_kv_heads=4, head_dim_qk=128,
                    head_dim_v=128)
    S = 65536
    cache = filled_cache(cfg, 1, S, capacity=S, dtype=torch.bfloat16, device="cuda")
    ref_cache = twin(cache, torch.float32)
    q, gates = query(cfg, 1, torch.bfloat16, device="cuda")
    for pos in (4097, 40000, 65536):
        at_length(pos, cache, ref_cache)
        o, reads, block_idx = run_kernel(q, cache, gates, fused=fused)
        want_o, _, want_idx = reference_step(q, ref_cache, gates)
        assert reads.tolist() == [cfg.reads(pos)]
        assert (block_idx == want_idx).float().mean().item() > 0.95
        assert rel_err(o, want_o) < REL_GPU[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True], ids=["split-K", "one-launch"])
def test_gpu_float32_head_dim_256(fused):
    """fp32 caches of head dim 256 run the kernels at one stage (kernels/decode.py's
    PIPELINED_ROW_BYTES: pipelined, they asked more shared memory than sm_90 has), spec
    geometry, past the selection and window spans."""
    cfg = NSAConfig(hidden_size=64, num_heads=8, num_kv_heads=2, head_dim_qk=256,
                    head_dim_v=256)
    S = 5000
    cache = filled_cache(cfg, 2, S, capacity=S, dtype=torch.float32, device="cuda")
    ref_cache = twin(cache, torch.float64)
    q, gates = query(cfg, 2, torch.float32, device="cuda")
    for pos in (700, S):
        at_length(pos, cache, ref_cache)
        with poisoned_empty():
            o, reads, block_idx = run_kernel(q, cache, gates, fused=fused)
        want_o, want_reads, want_idx = reference_step(q, ref_cache, gates)
        assert torch.equal(block_idx, want_idx)
        assert reads.tolist() == want_reads.tolist()
        assert_close(o, want_o, 1e-4)
