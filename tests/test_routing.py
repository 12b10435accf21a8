"""The routing table on CPU, with faked devices and SM versions."""
import pytest
import torch

from nsa_ops import routing
from nsa_ops.routing import Inputs

BF16 = torch.bfloat16


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
    assert c["sliding_window_attention"] in ("flash_attn", "aten_fa2")


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


def test_describe_prints_every_op():
    text = routing.describe()
    for op in routing.OPS:
        assert op in text
    assert "refused:" in text


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


def test_short_sequences_go_to_packed_sdpa_below_the_sm_threshold(monkeypatch):
    monkeypatch.setitem(routing.TRITON_SELECTION_MIN_SEQLEN, (9, 0), 1024)
    short = Inputs("cuda", (9, 0), BF16, 128, 128, 1023)
    assert routing.choose("selection_attention", short).impl == "packed_sdpa"
    assert "T=1023 < 1024" in dict(routing.explain("selection_attention", short))["triton"]
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
    ((9, 0), 65544, (32, 16), False, BF16, "triton", "not a multiple of block_stride"),
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


def test_compressed_attention_cudnn_needs_cudnn9(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 8900)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    x = Inputs("cuda", (9, 0), BF16, 128, 128, 65536,
               compressed=routing.CompressedGeometry(32, 16))
    assert "cuDNN >= 9" in dict(routing.explain("compressed_attention", x))["cudnn"]
