"""The routing table on CPU, with faked devices and SM versions; steering it (force(), routing
files, bench_routing.py --write); every prefill row forced against the reference."""
import dataclasses
import math
import threading
from pathlib import Path

import pytest
import torch

import nsa_ops  # noqa: F401  (registers torch.ops.nsa)
from nsa_ops import routing
from nsa_ops.__main__ import main
from nsa_ops.routing import Inputs
from helpers import SMALL, TOL, gates, qkv, selection_for

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def default_thresholds(monkeypatch):
    """Each test starts from the built-in thresholds and leaves them so."""
    monkeypatch.delenv("NSA_OPS_ROUTING", raising=False)
    routing.load(None)
    yield
    routing.load(None)


def chosen(x):
    return {op: routing.choose(op, x).impl for op in routing.OPS}


def test_cpu_runs_reference_with_reasons():
    x = Inputs("cpu", None, torch.float32, 64, 64, 1024)
    c = chosen(x)
    # 1024 query rows over a cache: chunked prefill through the ops (which run the reference)
    assert c.pop("decode") == "prefill_ops"
    assert set(c.values()) == {"reference"}
    assert routing.choose("decode", Inputs("cpu", None, torch.float32, 64, 64, 1)).impl == \
        "reference"
    for op in routing.OPS:
        refused = [(impl, why) for impl, why in routing.explain(op, x) if why]
        assert refused and all(isinstance(why, str) and why for _, why in refused)


def test_hopper_bf16_runs_triton_kernels(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    x = Inputs("cuda", (9, 0), BF16, 128, 128, 32768)
    c = chosen(x)
    assert c["selection_attention"] == c["compressed_attention"] == c["select_blocks"] == "triton"
    # the Triton window kernels, faster than FA-2 both ways on sm90
    assert c["sliding_window_attention"] == "triton"
    sm80 = dataclasses.replace(x, sm=(8, 0))
    assert chosen(sm80)["sliding_window_attention"] in ("flash_attn", "aten_fa2")
    assert "on sm90 at head dims 33-128 both ways" in dict(
        routing.explain("sliding_window_attention", sm80))["triton"]
    # where FA-2 cannot serve (fp32), the Triton kernels run on any SM
    fp32 = dataclasses.replace(sm80, dtype=torch.float32)
    assert chosen(fp32)["sliding_window_attention"] == "triton"
    # D = 64 has its own tuned tiles (faster than FA-2 both ways on an H100); head dims whose
    # tiles were not measured against FA-2 keep FA-2 on sm90 too
    d64 = dataclasses.replace(x, head_dim_qk=64, head_dim_v=64)
    assert chosen(d64)["sliding_window_attention"] == "triton"
    for dims in (16, 32):
        other = dataclasses.replace(x, head_dim_qk=dims, head_dim_v=dims)
        assert chosen(other)["sliding_window_attention"] in ("flash_attn", "aten_fa2")
        assert "33-128 both ways" in dict(
            routing.explain("sliding_window_attention", other))["triton"]


@pytest.mark.parametrize("dims", [160, 192, 256])
def test_wide_equal_head_dims_route_window_by_direction(monkeypatch, dims):
    """Head dims 129-256 with Dk == Dv: the Triton window forward beat FA-2 there on sm90, its
    backward lost, so each direction runs its own row (the backward takes the forward's o and
    lse whichever row made them)."""
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    fwd = Inputs("cuda", (9, 0), BF16, dims, dims, 16384)
    bwd = dataclasses.replace(fwd, backward=True)
    assert routing.choose("sliding_window_attention", fwd).impl == "triton"
    assert routing.choose("sliding_window_attention", bwd).impl in ("flash_attn", "aten_fa2")
    assert "129-256 forward only" in dict(routing.explain("sliding_window_attention", bwd))[
        "triton"]
    assert "backward" in bwd.summary() and "backward" not in fwd.summary()
    # where FA-2 cannot serve the backward (fp32, another SM's kernels, no FA-2), Triton runs it
    for x in (dataclasses.replace(bwd, dtype=torch.float32),
              dataclasses.replace(bwd, head_dim_v=128)):
        assert routing.choose("sliding_window_attention", x).impl == "triton"
    # the other ops choose alike both ways
    for op in ("compressed_attention", "selection_attention", "gate_combine"):
        assert routing.choose(op, fwd).impl == routing.choose(op, bwd).impl


def test_unequal_head_dims_route_window_to_triton(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    x = Inputs("cuda", (9, 0), BF16, 192, 128, 8192)
    assert routing.choose("sliding_window_attention", x).impl == "triton"
    reasons = dict(routing.explain("sliding_window_attention", x))
    assert "Dk == Dv" in reasons["aten_fa2"]


@pytest.mark.parametrize("x,why,gate", [
    (Inputs("cuda", (7, 5), torch.float16, 64, 64, 4096), "sm80+", "reference"),
    (Inputs("cuda", (9, 0), torch.float64, 64, 64, 4096), "float64", "reference"),
    # the gate kernel streams rows of any width
    (Inputs("cuda", (9, 0), BF16, 512, 512, 4096), "head dims must be <= 256", "triton"),
])
def test_refusals_fall_back_to_reference(x, why, gate):
    impls = chosen(x)
    assert impls.pop("gate_combine") == gate
    assert impls.pop("decode") == "prefill_ops"  # several rows: the ops above, at an offset
    assert set(impls.values()) == {"reference"}
    assert why in dict(routing.explain("selection_attention", x))["triton"]


def test_env_forces_an_impl(monkeypatch):
    x = Inputs("cuda", (9, 0), BF16, 128, 128, 4096)
    monkeypatch.setenv("NSA_OPS_FORCE_IMPL_SELECTION_ATTENTION", "reference")
    assert routing.choose("selection_attention", x).impl == "reference"
    assert routing.choose("compressed_attention", x).impl == "triton"
    monkeypatch.setenv("NSA_OPS_FORCE_IMPL", "nonexistent")
    with pytest.raises(ValueError, match="no implementation of nsa.compressed_attention"):
        routing.choose("compressed_attention", x)


def test_kept_answers_follow_forcing_and_thresholds(monkeypatch, tmp_path):
    """Routing keeps its answers; asked again, the same inputs get a new one once the forcing
    (environment, force()) or the thresholds (load) change."""
    x = Inputs("cuda", (9, 0), BF16, 128, 128, 4096)
    op = "selection_attention"
    assert routing.choose(op, x).impl == "triton"
    monkeypatch.setenv("NSA_OPS_FORCE_IMPL_SELECTION_ATTENTION", "reference")
    assert routing.choose(op, x).impl == "reference"
    monkeypatch.delenv("NSA_OPS_FORCE_IMPL_SELECTION_ATTENTION")
    assert routing.choose(op, x).impl == "triton"
    with routing.force(selection_attention="packed_sdpa"):
        assert routing.choose(op, x).impl == "packed_sdpa"
    assert routing.choose(op, x).impl == "triton"
    path = tmp_path / "slow.yaml"
    path.write_text("sm90:\n  selection_min_seqlen: 8192\n")
    routing.load(path)
    assert routing.choose(op, x).impl == "packed_sdpa"
    routing.load(None)
    assert routing.choose(op, x).impl == "triton"


def test_describe_prints_every_op():
    text = routing.describe()
    for op in routing.OPS:
        assert op in text
    assert "refused:" in text
    # what the eager layer folds into a row, from the row's fields
    assert ("triton, in nsa_attention's eager layer: the gated combine in its forward's "
            "epilogue, its backward's index built early on a side stream, the other "
            "branches' dq summed in its backward, its gate taken in its backward") in text
    assert "aten_fa2, in nsa_attention's eager layer" not in text


def test_unknown_op():
    with pytest.raises(ValueError, match="op must be one of"):
        routing.candidates("full_attention")


@pytest.mark.parametrize("sm,T,impl,why", [
    ((9, 0), 32768, "triton", None),
    ((8, 0), 32768, "triton", None),
    ((10, 0), 32768, "triton", None),
    ((8, 9), 32768, "packed_sdpa", "sm89"),
    ((12, 0), 32768, "packed_sdpa", "not sm120"),
    ((8, 6), 32768, "packed_sdpa", "not sm86"),
])
def test_selection_by_sm_and_length(sm, T, impl, why):
    """Faked capabilities: the per-SM rules of the selection op, each refusal with its reason."""
    x = Inputs("cuda", sm, BF16, 128, 128, T)
    assert routing.choose("selection_attention", x).impl == impl
    reasons = dict(routing.explain("selection_attention", x))
    if why:
        assert why in reasons["triton"]
    assert routing.choose("compressed_attention", x).impl == "triton"


def test_forcing_lifts_preferences_not_capabilities(monkeypatch):
    monkeypatch.setenv("NSA_OPS_FORCE_IMPL_SELECTION_ATTENTION", "triton")
    assert routing.choose("selection_attention",
                          Inputs("cuda", (8, 9), BF16, 128, 128, 64)).impl == "triton"
    with pytest.raises(ValueError, match="sm80"):
        routing.choose("selection_attention", Inputs("cuda", (7, 5), BF16, 128, 128, 64))


def test_route_lookup():
    assert routing.route("selection_attention", "packed_sdpa").impl == "packed_sdpa"
    with pytest.raises(ValueError, match="has no impl"):
        routing.route("selection_attention", "cutlass")


def test_short_sequences_go_to_packed_sdpa_below_the_sm_threshold(tmp_path):
    path = tmp_path / "routing.yaml"
    path.write_text("sm90:\n  selection_min_seqlen: 1024\n")
    routing.load(path)
    short = Inputs("cuda", (9, 0), BF16, 128, 128, 1023)
    assert routing.choose("selection_attention", short).impl == "packed_sdpa"
    assert f"T=1023 < 1024, the selection_min_seqlen of sm90 ({path})" in \
        dict(routing.explain("selection_attention", short))["triton"]
    assert routing.choose("selection_attention",
                          Inputs("cuda", (9, 0), BF16, 128, 128, 1024)).impl == "triton"


@pytest.fixture
def cudnn9(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 90100)


@pytest.mark.parametrize("sm,T,geometry,varlen,dtype,impl,why", [
    ((9, 0), 65536, (32, 16), False, BF16, "cudnn", None),
    ((9, 0), 65536, (64, 64), False, BF16, "cudnn", None),
    ((9, 0), 32768, (64, 64), False, BF16, "triton", "T/d = 512 queries per residue"),
    ((9, 0), 8192, (32, 16), False, BF16, "triton", "T/d = 512 queries per residue"),
    ((8, 0), 65536, (32, 16), False, BF16, "triton", "measured on sm90 only"),
    ((9, 0), 65544, (32, 16), False, BF16, "cudnn", None),  # T % d != 0: a tail part serves it
    ((9, 0), 65536, (32, 16), True, BF16, "triton", "varlen"),
    ((9, 0), 65536, (32, 16), False, torch.float32, "triton", "float16/bfloat16 only"),
    ((9, 0), 65536, None, False, BF16, "triton", "no block_len/block_stride"),
])
def test_compressed_attention_cudnn_rows(cudnn9, sm, T, geometry, varlen, dtype, impl, why):
    cmp = routing.CompressedGeometry(*geometry) if geometry else None
    x = Inputs("cuda", sm, dtype, 128, 128, T, varlen, compressed=cmp)
    assert routing.choose("compressed_attention", x).impl == impl
    if why:
        assert why in dict(routing.explain("compressed_attention", x))["cudnn"]


@pytest.mark.parametrize("dk,dv,version,impl,why", [
    (192, 128, 91900, "cudnn", None),
    (192, 128, 91200, "triton", "needs cuDNN >= 9.13"),
    (192, 128, 91300, "cudnn", None),
    (160, 96, 91900, "triton", "got Dk=160, Dv=96"),
    (256, 256, 91900, "triton", "Dk = Dv <= 128 and Dk = 192 with Dv = 128"),
    (128, 192, 91900, "triton", "got Dk=128, Dv=192"),
    (64, 64, 90100, "cudnn", None),
])
def test_compressed_attention_cudnn_head_dims(monkeypatch, dk, dv, version, impl, why):
    """cuDNN serves the head dims measured against the Triton kernel; unequal ones only from the
    cuDNN version whose Hopper backward handles them."""
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: version)
    x = Inputs("cuda", (9, 0), BF16, dk, dv, 65536, compressed=routing.CompressedGeometry(32, 16))
    assert routing.choose("compressed_attention", x).impl == impl
    if why:
        assert why in dict(routing.explain("compressed_attention", x))["cudnn"]


def test_compressed_attention_cudnn_needs_cudnn9(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 8900)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    x = Inputs("cuda", (9, 0), BF16, 128, 128, 65536,
               compressed=routing.CompressedGeometry(32, 16))
    assert "cuDNN >= 9" in dict(routing.explain("compressed_attention", x))["cudnn"]


# ---- force() ----------------------------------------------------------------------------------

def test_force_nests_restores_and_beats_the_env(monkeypatch):
    x = Inputs("cuda", (8, 9), BF16, 128, 128, 32768)
    sel = lambda: routing.choose("selection_attention", x).impl
    monkeypatch.setenv("NSA_OPS_FORCE_IMPL", "reference")
    assert sel() == "reference"
    with routing.force(selection_attention="triton"):
        assert sel() == "triton"  # sm89 defers; forcing lifts it, and beats the env
        assert routing.choose("select_blocks", x).impl == "reference"  # the env still holds
        with routing.force("triton"):
            assert routing.choose("select_blocks", x).impl == "triton"
            with routing.force(selection_attention="packed_sdpa"):
                assert sel() == "packed_sdpa"
                assert "not the forced impl (routing.force)" in \
                    dict(routing.explain("selection_attention", x))["triton"]
            assert sel() == "triton"
        assert routing.choose("select_blocks", x).impl == "reference"
    assert sel() == "reference"


def test_force_is_per_thread():
    x = Inputs("cuda", (9, 0), BF16, 128, 128, 32768)
    seen = []
    with routing.force(selection_attention="reference"):
        thread = threading.Thread(
            target=lambda: seen.append(routing.choose("selection_attention", x).impl))
        thread.start()
        thread.join()
        assert routing.choose("selection_attention", x).impl == "reference"
    assert seen == ["triton"]


@pytest.mark.parametrize("args,kw,match", [
    (("packed_sdpa",), {}, "every op has triton, reference, not 'packed_sdpa'"),
    ((), {"full_attention": "triton"}, "unknown op 'full_attention'; ops are compressed_attention"),
    ((), {"selection_attention": "cutlass"}, "has no impl 'cutlass'; it has triton, packed_sdpa"),
])
def test_force_names_unknown_ops_and_impls(args, kw, match):
    with pytest.raises(ValueError, match=match), routing.force(*args, **kw):
        pass


def test_forced_triton_rows_serve_cpu_tensors_only_in_the_interpreter(monkeypatch):
    x = Inputs("cpu", None, torch.float32, 64, 64, 256)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert routing.choose("selection_attention", x).impl == "reference"  # slow: only when forced
    with routing.force("triton"):
        assert {routing.choose(op, x).impl for op in routing.PREFILL_OPS} == {"triton"}
        with pytest.raises(ValueError, match="mis-computes bfloat16"):
            routing.choose("selection_attention", Inputs("cpu", None, BF16, 64, 64, 256))
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(ValueError, match="needs a CUDA device"):
            routing.choose("selection_attention", x)


def test_error_lists_the_inputs_then_every_row():
    x = Inputs("cuda", (7, 5), BF16, 128, 128, 64, varlen=True)
    with routing.force(selection_attention="triton"), pytest.raises(routing.RoutingError) as e:
        routing.choose("selection_attention", x)
    assert str(e.value).splitlines() == [
        "no implementation of nsa.selection_attention serves these inputs",
        "  inputs: cuda sm75 bfloat16 Dk=128 Dv=128 T=64 varlen",
        "  triton (forced): needs sm80+ (Ampere or newer), device is sm75",
        "  packed_sdpa: needs sm80+ (Ampere or newer), device is sm75",
        "  reference: not the forced impl (routing.force)"]
    assert e.value.brief == ("routing.force: triton cannot serve nsa.selection_attention for cuda "
                             "sm75 bfloat16 Dk=128 Dv=128 T=64 varlen: needs sm80+ (Ampere or "
                             "newer), device is sm75")


# ---- routing files ----------------------------------------------------------------------------

def test_routing_file_from_env_is_read_once_and_load_overrides_it(tmp_path, monkeypatch):
    x = Inputs("cuda", (8, 6), BF16, 128, 128, 4096)
    env_file, code_file = tmp_path / "env.yaml", tmp_path / "code.yaml"
    env_file.write_text("# measured on an A6000\nsm86:\n  selection_min_seqlen: 2048\n")
    code_file.write_text("sm86:\n  selection_min_seqlen: 8192\n")
    monkeypatch.setenv("NSA_OPS_ROUTING", str(env_file))
    routing.load(None)
    assert routing.choose("selection_attention", x).impl == "triton"  # sm86: tuned by the file
    env_file.write_text("sm86:\n  selection_min_seqlen: 8192\n")  # read once: no effect
    assert routing.choose("selection_attention", x).impl == "triton"
    assert routing.thresholds().get("selection_min_seqlen", (8, 6)) == (2048, str(env_file))
    assert routing.thresholds().get("selection_min_seqlen", (9, 0)) == (0, "default")
    routing.load(code_file)
    assert routing.choose("selection_attention", x).impl == "packed_sdpa"
    routing.load(None)
    monkeypatch.delenv("NSA_OPS_ROUTING")
    assert "tuned for sm80, sm90, sm100, not sm86" in \
        dict(routing.explain("selection_attention", x))["triton"]


@pytest.mark.parametrize("text,match", [
    ("sm90:\n  selection_min_len: 5\n",
     ("unknown threshold 'selection_min_len' under sm90; valid: selection_min_seqlen, "
      "cudnn_compressed_min_rows")),
    ("hopper:\n  selection_min_seqlen: 5\n", "key 'hopper' is not an SM; keys are SMs such as"),
    ("sm90:\n  selection_min_seqlen: -1\n", "sm90.selection_min_seqlen must be a non-negative"),
    ("sm90: 5\n", "sm90 must map threshold names to values"),
    ("sm90: [", "not a YAML file"),
    (None, "routing.yaml: cannot read the routing file: No such file"),
])
def test_bad_routing_files_name_the_key(tmp_path, text, match):
    path = tmp_path / "routing.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ValueError, match=match):
        routing.load(path)


def test_bench_routing_writes_what_load_reads(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(Path(__file__).resolve().parents[1] / "bench")
    import bench_routing
    ms = {(1, 256): (2.0, 1.0), (1, 512): (1.0, 2.0), (1, 1024): (1.0, 3.0),
          (8, 256): (4.0, 1.0), (8, 512): (3.0, 2.0), (8, 1024): (2.0, 6.0)}  # (triton, packed)
    rows = [dict(impl=impl, B=B, T=T, fwd_ms=t) for (B, T), times in ms.items()
            for impl, t in zip(("triton", "packed_sdpa"), times, strict=True)]
    path = tmp_path / "routing.yaml"
    bench_routing.write_thresholds(path, rows, (8, 6), [1, 8], "device=A6000 commit=abc")
    assert path.read_text() == ("# bench/bench_routing.py: device=A6000 commit=abc\n"
                                "sm86:\n  selection_min_seqlen: 1024\n")
    routing.load(path)
    assert routing.thresholds().get("selection_min_seqlen", (8, 6)) == (1024, str(path))
    assert routing.choose("selection_attention",
                          Inputs("cuda", (8, 6), BF16, 128, 128, 1023)).impl == "packed_sdpa"
    never = [dict(r, fwd_ms=9.0) if r["impl"] == "triton" else r for r in rows]
    assert bench_routing.thresholds(never, (8, 6), [1]) == {(8, 6): {"selection_min_seqlen":
                                                                     math.inf}}
    always = [dict(r, fwd_ms=0.5) if r["impl"] == "triton" else r for r in rows]
    assert bench_routing.thresholds(always, (8, 6), [1, 8]) == {(8, 6): {"selection_min_seqlen": 0}}
    bench_routing.write_thresholds(path, never, (8, 6), [1], "")
    routing.load(path)
    assert "T=8192 < .inf" in dict(routing.explain(
        "selection_attention", Inputs("cuda", (8, 6), BF16, 128, 128, 8192)))["triton"]


# ---- python -m nsa_ops routing ----------------------------------------------------------------

@pytest.mark.parametrize("var,impl,message", [
    ("NSA_OPS_FORCE_IMPL", "cudnn",
     ("NSA_OPS_FORCE_IMPL=cudnn: cudnn cannot serve nsa.compressed_attention for cpu float32 "
      "Dk=128 Dv=128 T=4096 l=32 d=16: needs a CUDA device, inputs are on cpu")),
    ("NSA_OPS_FORCE_IMPL_SELECTION_ATTENTION", "cutlass",
     ("NSA_OPS_FORCE_IMPL_SELECTION_ATTENTION=cutlass: nsa.selection_attention has no impl "
      "'cutlass'; it has triton, packed_sdpa, reference")),
])
def test_cli_routing_with_an_impossible_force_is_a_one_line_error(monkeypatch, capsys, var, impl,
                                                                   message):
    monkeypatch.setenv(var, impl)
    assert main(["routing"]) == 2
    out, err = capsys.readouterr()
    assert err == f"python -m nsa_ops routing: {message}\n" and not out


def test_cli_routing_prints_the_thresholds_and_their_source(monkeypatch, capsys, tmp_path):
    path = tmp_path / "routing.yaml"
    path.write_text("sm90:\n  cudnn_compressed_min_rows: 2048\n")
    monkeypatch.setenv("NSA_OPS_ROUTING", str(path))
    routing.load(None)
    assert main(["routing"]) == 0
    out = capsys.readouterr().out
    assert f"thresholds (NSA_OPS_ROUTING={path} over the defaults):" in out
    assert f"sm90     2048  {path}" in out and "sm100       0  default" in out
    path.write_text("sm90:\n  cudnn_min_rows: 2048\n")
    routing.load(None)
    assert main(["routing"]) == 2
    assert "unknown threshold 'cudnn_min_rows'" in capsys.readouterr().err


# ---- every prefill row, forced, against the reference ----------------------------------------

def _op_args(op):
    """Small float32 CPU arguments of op (T=48, D=16: the interpreter is slow)."""
    geo, scale = SMALL, 0.25
    q, k, v = qkv(1, 48, 4, 1, 16, 16)
    l, d = geo["block_len"], geo["block_stride"]
    if op in ("compressed_attention", "select_blocks"):
        k_cmp, v_cmp = (nsa_ops.reference.compress_mean(t, l, d) for t in (k, v))
        if op == "compressed_attention":
            return q, k_cmp, v_cmp, l, d, scale
        lse = nsa_ops.reference.compressed_attention(q, k_cmp, v_cmp, l, d, scale)[1]
        return q, k_cmp, lse, l, d, geo["sel_block"], geo["num_sel"], scale
    if op == "selection_attention":
        return q, k, v, selection_for(q, k, v, geo), geo["sel_block"], scale
    if op == "sliding_window_attention":
        return q, k, v, 16, scale
    o_cmp, o_slc, o_win = qkv(1, 48, 4, 4, 16, 16, seed=1)
    return (o_cmp, o_slc, o_win, *gates(1, 48, 4))


@pytest.mark.parametrize("op,impl", [pytest.param(r.op, r.impl, id=f"{r.op}-{r.impl}")
                                     for r in routing.TABLE if r.op in routing.PREFILL_OPS])
def test_every_row_forced_matches_the_reference(op, impl):
    args = _op_args(op)
    with routing.force(**{op: impl}):
        try:
            got = getattr(torch.ops.nsa, op)(*args)
        except routing.RoutingError as e:
            pytest.skip(e.brief)
    want = routing.resolve(routing.route(op, "reference").forward)(*args)
    atol, rtol = TOL[torch.float32]
    got, want = ((t,) if isinstance(t, torch.Tensor) else t for t in (got, want))
    for g, w in zip(got, want, strict=True):
        if g.is_floating_point():
            torch.testing.assert_close(g, w, atol=atol, rtol=rtol)
        else:
            assert torch.equal(g, w)


def test_cudnn_compressed_refuses_inside_cuda_graph_capture():
    """A first cuDNN call allocates while building its plan, which capture forbids: inside a
    capture the Triton kernel serves compressed attention, unless an eager call built the plans
    of this layout on this thread before."""
    x = routing.Inputs.of_compressed(torch.empty(1, 65536, 64, 128, device="meta"),
                                     torch.empty(1, 4096, 4, 128, device="meta"), 32, 16)
    x = dataclasses.replace(x, device_type="cuda", sm=(9, 0), dtype=torch.bfloat16)
    captured = dataclasses.replace(x, capturing=True)
    assert routing.choose("compressed_attention", captured).impl == "triton"
    assert "capture" in dict(routing.explain("compressed_attention", captured))["cudnn"]
    # an eager call of this layout on the capturing thread built the plans: capture refuses
    # nothing (a machine without cuDNN 9 refuses for that)
    planned = dataclasses.replace(captured, cudnn_planned=True)
    assert "capture" not in (dict(routing.explain("compressed_attention", planned))["cudnn"] or "")
    assert "cuDNN's plans built" in planned.summary()


def test_cudnn_compressed_refuses_under_deterministic_algorithms(deterministic):
    """cuDNN's attention backward differed bitwise between two runs (tests/test_determinism.py):
    under torch.use_deterministic_algorithms(True) the Triton kernel, whose split dk/dv adds in
    order, serves compressed attention."""
    x = routing.Inputs.of_compressed(torch.empty(1, 65536, 64, 128, device="meta"),
                                     torch.empty(1, 4096, 4, 128, device="meta"), 32, 16)
    assert x.deterministic
    x = dataclasses.replace(x, device_type="cuda", sm=(9, 0), dtype=torch.bfloat16)
    assert routing.choose("compressed_attention", x).impl == "triton"
    assert "deterministic" in dict(routing.explain("compressed_attention", x))["cudnn"]


def test_backward_routes_under_the_forcing_its_forward_saw(monkeypatch):
    """A backward run after the force block (as autograd's device threads run it) still takes the
    forced impl."""
    seen = []
    real = routing.choose
    monkeypatch.setattr(routing, "choose",
                        lambda op, x: seen.append((op, real(op, x).impl)) or real(op, x))
    q, k, v = qkv(1, 40, 4, 2, 16, 16, requires_grad=True)
    with routing.force(sliding_window_attention="triton"):  # the interpreter on CPU
        o, _ = torch.ops.nsa.sliding_window_attention(q, k, v, 8, 0.25)
    seen.clear()
    o.sum().backward()  # unforced, CPU tensors would take the reference
    assert seen and all(impl == "triton" for _, impl in seen)
