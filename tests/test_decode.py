"""Decode through NSACache equals prefill at every position; the read counter equals reads(S).
Under autocast the cache takes the dtype autocast gives k and v, and decode equals autocast
prefill."""
import random

import pytest
import torch

from nsa_ops import NSAAttention, NSACache, NSAConfig, reference
from nsa_ops.decode import decode_attention
from helpers import TOL, random_blocks, random_window, rel_err

# l=16, d=8, l'=16, n=4, w=24: T=300 crosses every cmp / selection / window boundary many times
CFG = dict(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim_qk=8, head_dim_v=12,
           block_len=16, block_stride=8, sel_block=16, num_sel=4, window=24)
T = 300


def layer(phi="mean", gate_act="sigmoid", seed=0):
    torch.manual_seed(seed)
    m = NSAAttention(NSAConfig(**CFG, phi=phi, gate_act=gate_act)).double()
    # move off the initial point so every branch and the phi MLP matter
    with torch.no_grad():
        for p in list(m.gate[-1].parameters()) + (
                list(m.phi_k.parameters()) + list(m.phi_v.parameters()) if phi == "mlp" else []):
            p.normal_(0, 0.3)
    return m


def inputs(B, seed=1):
    return torch.randn(B, T, CFG["hidden_size"], dtype=torch.float64,
                       generator=torch.Generator().manual_seed(seed))


def decode(m, x, cache, chunks):
    """Feed x in the given chunk sizes; returns outputs and per-row read counts."""
    outs, reads, t = [], [], 0
    for n in chunks:
        outs.append(m(x[:, t:t + n], cache))
        reads.append(cache.last_reads)
        t += n
    return torch.cat(outs, 1), torch.cat(reads)


def chunk_sizes(seed, total=T):
    g = torch.Generator().manual_seed(seed)
    sizes, t = [], 0
    while t < total:
        sizes.append(min(total - t, int(torch.randint(3, 8, (), generator=g))))
        t += sizes[-1]
    return sizes


def expected_reads(c):
    return torch.tensor([c.reads(S) for S in range(1, T + 1)])


@pytest.mark.parametrize("phi, gate_act, B", [("mean", "sigmoid", 1), ("mlp", "softmax", 2)])
def test_token_by_token_equals_prefill(phi, gate_act, B):
    m, x = layer(phi, gate_act), inputs(B)
    with torch.no_grad():
        ref = m(x)
        cache = m.new_cache(B)
        out, reads = decode(m, x, cache, [1] * T)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    assert torch.equal(reads, expected_reads(m.config))
    assert int(cache.total_reads) == int(expected_reads(m.config).sum())


@pytest.mark.parametrize("seed", [0, 1])
def test_chunks_equal_prefill(seed):
    m, x = layer("mlp" if seed else "mean"), inputs(2, seed)
    with torch.no_grad():
        ref = m(x)
        out, reads = decode(m, x, m.new_cache(2), chunk_sizes(seed))
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    assert torch.equal(reads, expected_reads(m.config))


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_fixed_chunks_equal_prefill(chunk):
    """Chunked prefill of any chunk length (one call per chunk, through the prefill ops at an
    offset when it holds several tokens) equals the full prefill at every position."""
    m = layer("mlp")
    x = torch.randn(1, 1000 if chunk > 1 else 90, CFG["hidden_size"], dtype=torch.float64,
                    generator=torch.Generator().manual_seed(chunk))
    with torch.no_grad():
        ref = m(x)
        cache = m.new_cache(1)
        outs = [m(x[:, t:t + chunk], cache) for t in range(0, x.shape[1], chunk)]
    torch.testing.assert_close(torch.cat(outs, 1), ref, atol=1e-10, rtol=0)
    assert cache.total_reads == sum(m.config.reads(S) for S in range(1, x.shape[1] + 1))


@pytest.mark.parametrize("seed", range(8))
def test_chunks_equal_prefill_at_drawn_geometry(seed):
    """CFG's geometry is one of many: drawn block geometry (l'/d any integer, l up to 4d), window,
    group, head dims, phi and gate; single tokens and chunks mixed; a static or growing cache."""
    rng = random.Random(seed)
    T = rng.randint(20, 160)
    G, H = rng.randint(1, 4), rng.randint(1, 2)
    cfg = NSAConfig(hidden_size=16, num_heads=G * H, num_kv_heads=H,
                    head_dim_qk=rng.choice((8, 12, 16)), head_dim_v=rng.choice((8, 12, 16)),
                    window=random_window(rng, T), phi=rng.choice(("mean", "mlp")),
                    gate_act=rng.choice(("sigmoid", "softmax")), **random_blocks(rng))
    torch.manual_seed(seed)
    m = NSAAttention(cfg).double()
    with torch.no_grad():
        for p in m.gate[-1].parameters():
            p.normal_(0, 0.3)
    B = rng.randint(1, 2)
    x = torch.randn(B, T, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    chunks, t = [], 0
    while t < T:
        chunks.append(min(T - t, rng.choice((1, 1, rng.randint(2, 40)))))
        t += chunks[-1]
    with torch.no_grad():
        ref = m(x)
        out, reads = decode(m, x, m.new_cache(B, capacity=rng.choice((T, None))), chunks)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    assert reads.tolist() == [cfg.reads(S) for S in range(1, T + 1)]


def test_forked_cache_serves_several_continuations():
    m, x = layer(), inputs(1)
    with torch.no_grad():
        prefix = m.new_cache(1)
        m(x[:, :100], prefix)
        for seed in (3, 4):
            cont = torch.randn(1, 50, CFG["hidden_size"], dtype=torch.float64,
                               generator=torch.Generator().manual_seed(seed))
            cache = prefix.fork()
            got = m(cont, cache)
            full = m(torch.cat([x[:, :100], cont], 1))[:, 100:]
            torch.testing.assert_close(got, full, atol=1e-10, rtol=0)
        assert prefix.length == 100  # the forks left it alone


def test_whole_prompt_then_tokens():
    m, x = layer(), inputs(1)
    with torch.no_grad():
        ref = m(x)
        out, reads = decode(m, x, m.new_cache(1, capacity=T), [T - 40] + [1] * 40)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    assert torch.equal(reads, expected_reads(m.config))


def test_cache_emits_compressed_rows_on_schedule():
    m, x = layer("mlp"), inputs(1)
    c = m.config
    with torch.no_grad():
        cache = m.new_cache(1)
        for t in range(T):
            m(x[:, t:t + 1], cache)
            assert cache.num_cmp == reference.num_cmp(t + 1, c.block_len, c.block_stride)
        k, v = cache.selection_kv()
        k_cmp, v_cmp = cache.compressed_kv()
        rows = k_cmp.shape[1]  # phi pads its output to cmp_rows(T): the emitted rows lead
        torch.testing.assert_close(k_cmp, m.phi_k(k, c.block_len, c.block_stride)[:, :rows],
                                   atol=1e-12, rtol=0)
        torch.testing.assert_close(v_cmp, m.phi_v(v, c.block_len, c.block_stride)[:, :rows],
                                   atol=1e-12, rtol=0)


def test_decode_from_empty_cache_directly():
    m, x = layer(), inputs(1)
    c = m.config
    with torch.no_grad():
        ref = m(x[:, :50])
        cache = m.new_cache(1)
        pos = torch.arange(50)
        q, k, v = m._qkv(x[:, :50], pos)
        cache.append(k, v, m.phi_k, m.phi_v)
        o = decode_attention(q, cache, *m.gates(x[:, :50]), scale=c.scale)
    torch.testing.assert_close(m.o_proj(o.flatten(-2)), ref, atol=1e-10, rtol=0)


def test_static_capacity_is_preallocated_and_raises_when_full():
    m, x = layer(), inputs(2)
    cache = m.new_cache(2, capacity=20)
    ptrs = [t.data_ptr() for t in (cache.k, cache.v, cache.k_cmp, cache.v_cmp)]
    with torch.no_grad():
        m(x[:, :15], cache)
        m(x[:, 15:20], cache)
        assert [t.data_ptr() for t in (cache.k, cache.v, cache.k_cmp, cache.v_cmp)] == ptrs
        with pytest.raises(RuntimeError, match="NSACache is full: capacity=20 tokens, 20 cached"):
            m(x[:, 20:21], cache)
        assert cache.length == 20
        cache.reset()
        ref = m(x[:, :20])
        out, _ = decode(m, x, cache, [7, 13])
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)


def test_cache_input_errors():
    m = layer()
    cache = m.new_cache(2)
    with pytest.raises(ValueError, match=r"k must have shape \[B, Tq, H, Dk\] = \(2, 1, 2, 8\)"):
        m(torch.randn(1, 1, 32, dtype=torch.float64), cache)
    with pytest.raises(ValueError, match="must be torch.float64"):
        m.float()(torch.randn(2, 1, 32), cache)
    with pytest.raises(ValueError, match="capacity must be a positive int"):
        NSACache(m.config, capacity=0)


# ---- autocast ---------------------------------------------------------------------------------

BF16 = dict(device_type="cpu", dtype=torch.bfloat16)
T_AMP = 96  # crosses every compressed, selection and window boundary a few times


def test_new_cache_takes_the_dtype_autocast_gives_k():
    m = layer().float()
    assert m.new_cache().dtype == m.kv_dtype() == torch.float32
    with torch.autocast(**BF16):
        assert m.kv_dtype() == torch.bfloat16
        assert m.new_cache(2, capacity=8).dtype == torch.bfloat16
        assert m.new_cache(dtype=torch.float32).dtype == torch.float32
        assert layer().new_cache().dtype == torch.float64  # autocast leaves float64 alone
        _, k, v = m._qkv(inputs(1).float()[:, :3], torch.arange(3))
        assert k.dtype == v.dtype == m.kv_dtype()


@pytest.mark.parametrize("phi, gate_act, B, tokens", [("mean", "sigmoid", 1, True),
                                                      ("mlp", "softmax", 2, False)])
def test_autocast_decode_equals_autocast_prefill(phi, gate_act, B, tokens):
    """A float32 layer under bf16 autocast, as nsa_ops.train trains the gpu preset: a prompt
    then single tokens, or random chunks."""
    m = layer(phi, gate_act).float()
    x = inputs(B).float()[:, :T_AMP]
    chunks = [T_AMP // 2] + [1] * (T_AMP // 2) if tokens else chunk_sizes(B, T_AMP)
    with torch.no_grad(), torch.autocast(**BF16):
        ref = m(x)
        cache = m.new_cache(B)
        out, reads = decode(m, x, cache, chunks)
    assert cache.dtype == out.dtype == ref.dtype == torch.bfloat16
    atol, rtol = TOL[torch.bfloat16]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    # the same arithmetic as prefill's ops (float32 inside, autocast off): equal up to a few
    # roundings; autocast's bf16 matmuls inside decode would be off by about 1e-2
    assert rel_err(out, ref) < 1e-3
    assert torch.equal(reads, expected_reads(m.config)[:T_AMP])


def test_autocast_decode_rejects_a_cache_of_another_dtype():
    m = layer().float()
    cache = m.new_cache(1)  # float32: built outside the autocast that decoding runs in
    with pytest.raises(ValueError, match=r"k must be torch.float32 on cpu like the cache, got "
                                         r"torch.bfloat16 on cpu \(build the cache in k's dtype"):
        with torch.no_grad(), torch.autocast(**BF16):
            m(inputs(1).float()[:, :3], cache)


@pytest.mark.gpu
def test_gpu_autocast_decode_and_cuda_graph_equal_autocast_prefill():
    """CUDA, float32 weights under bf16 autocast: eager decode (the Triton kernel) and a CUDA
    graph step captured under autocast equal autocast prefill. The capture must not keep
    autocast's cached weight casts, which die with the autocast context: replays run after it,
    once other tensors have taken their memory."""
    T = 600
    torch.manual_seed(0)
    m = NSAAttention(NSAConfig(hidden_size=256, num_heads=16, num_kv_heads=2, head_dim_qk=64,
                               head_dim_v=64, max_position=T)).cuda()
    with torch.no_grad():
        m.gate[-1].weight.normal_(0, 0.3)
    x = torch.randn(1, T, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    amp = dict(device_type="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        with torch.autocast(**amp):
            ref = m(x)
            eager, graphed = m.new_cache(1), m.new_cache(1)
            assert eager.dtype == graphed.dtype == torch.bfloat16
            with pytest.raises(ValueError, match=r"torch.bfloat16 on cuda:0: module.new_cache"):
                m.cuda_graph_decoder(m.new_cache(1, dtype=torch.float32))
            out = torch.cat([m(x[:, t:t + 1], eager) for t in range(T // 2)], 1)
            m(x[:, :T // 2], graphed)
            step = m.cuda_graph_decoder(graphed)
        scratch = [torch.randn(1 << 20, device="cuda") for _ in range(64)]
        stepped = torch.cat([step(x[:, t:t + 1]).clone() for t in range(T // 2, T)], 1)
    del scratch
    assert rel_err(out, ref[:, :T // 2]) < 2e-2
    assert rel_err(stepped, ref[:, T // 2:]) < 2e-2
    assert graphed.length == T


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_gpu_fixed_chunks_equal_prefill(chunk):
    """CUDA, float32: chunked prefill through the kernels (the decode kernel for one token, the
    prefill ops at an offset for several) equals the full prefill at every position."""
    torch.manual_seed(chunk)
    m = NSAAttention(NSAConfig(hidden_size=256, num_heads=16, num_kv_heads=2, head_dim_qk=64,
                               head_dim_v=64, block_len=32, block_stride=16, sel_block=64,
                               num_sel=4, window=128, max_position=2000)).cuda()
    with torch.no_grad():
        m.gate[-1].weight.normal_(0, 0.3)
    x = torch.randn(1, 2000 if chunk > 1 else 300, 256, device="cuda")
    with torch.no_grad():
        ref = m(x)
        cache = m.new_cache(1)
        outs = [m(x[:, t:t + chunk], cache) for t in range(0, x.shape[1], chunk)]
    assert rel_err(torch.cat(outs, 1), ref) < 1e-4
