"""Inline snapshots (expecttest) of what users read: the routing table's decisions and refusal
reasons per GPU generation, every op's validation messages, and the op sequence of an exported
NSA layer. A change to any of them shows up here as a diff; after checking it, accept with

    EXPECTTEST_ACCEPT=1 python -m pytest tests/test_snapshots.py
"""
import expecttest
import pytest
import torch

import nsa_ops
from nsa_ops import routing
from nsa_ops.routing import CompressedGeometry, Inputs
from test_export import export_module, nsa_ops_called

PREFILL_OPS = ("compressed_attention", "select_blocks", "selection_attention",
               "sliding_window_attention", "gate_combine")


@pytest.fixture(autouse=True)
def gpu_build(monkeypatch):
    """The decisions of a CUDA build of torch with FA-2 and cuDNN 9, triton installed and
    flash-attn not, whatever this machine has."""
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 90100)
    monkeypatch.setattr(routing, "_module_available", lambda module: module == "triton")


def decisions(sm, dtype=torch.bfloat16, dk=128, dv=128, T=65536) -> str:
    x = Inputs("cuda", sm, dtype, dk, dv, T, compressed=CompressedGeometry(32, 16))
    lines = [x.summary()]
    for op in PREFILL_OPS:
        rows = routing.reasons(op, x)
        lines.append(f"  {op} -> {routing.choose(op, x).impl}")
        lines += [f"    {row.impl} {kind}: {reason}" for row, reason, kind in rows if reason]
    return "\n".join(lines)


def message(fn) -> str:
    with pytest.raises(ValueError) as error:
        fn()
    return str(error.value)


class TestSnapshots(expecttest.TestCase):
    def test_routing_sm80(self):
        self.assertExpectedInline(decisions((8, 0)), """\
cuda sm80 bfloat16 Dk=128 Dv=128 T=65536 l=32 d=16
  compressed_attention -> triton
    cudnn deferred: measured on sm90 only, not sm80: the Triton kernel serves it (force to override)
  select_blocks -> triton
  selection_attention -> triton
  sliding_window_attention -> aten_fa2
    triton deferred: the Triton window kernels were measured faster than FA-2 on sm90 at head dims 33-128 both ways and 129-256 forward only, with the tiles tuned there (H100, bf16, w=512; D=128 at T = 8k / 64k / 128k: forward 0.43 / 3.55 / 7.33 ms against 0.69 / 5.63 / 11.24, backward 1.56 / 13.09 / 25.03 against 1.86 / 14.86 / 30.16, bench_kernels.py --kernels window; D=64 at T = 16k / 64k: forward 0.47 / 1.86 against 1.11 / 5.87, backward 1.59 / 6.26 against 2.18 / 8.56; H200, D=256 (HQ=32, H=2) / 192 / 160 (HQ=64, H=4) at 16k: forward 0.71 / 1.31 / 1.36 against 1.04 / 1.87 / 2.01, backward 4.02 / 8.04 / 8.04 against 3.76 / 5.62 / 5.95); FA-2 runs here (force to override)
    flash_attn refused: flash_attn is not importable
  gate_combine -> triton""")

    def test_routing_sm89(self):
        self.assertExpectedInline(decisions((8, 9), T=4096), """\
cuda sm89 bfloat16 Dk=128 Dv=128 T=4096 l=32 d=16
  compressed_attention -> triton
    cudnn deferred: measured on sm90 only, not sm89: the Triton kernel serves it (force to override)
  select_blocks -> triton
  selection_attention -> packed_sdpa
    triton deferred: sm89 (Ada) runs packed SDPA by design: the kernels are tuned for the 164-228 KB of shared memory per SM of sm80/sm90/sm100, Ada has 100 KB (force to override)
  sliding_window_attention -> aten_fa2
    triton deferred: the Triton window kernels were measured faster than FA-2 on sm90 at head dims 33-128 both ways and 129-256 forward only, with the tiles tuned there (H100, bf16, w=512; D=128 at T = 8k / 64k / 128k: forward 0.43 / 3.55 / 7.33 ms against 0.69 / 5.63 / 11.24, backward 1.56 / 13.09 / 25.03 against 1.86 / 14.86 / 30.16, bench_kernels.py --kernels window; D=64 at T = 16k / 64k: forward 0.47 / 1.86 against 1.11 / 5.87, backward 1.59 / 6.26 against 2.18 / 8.56; H200, D=256 (HQ=32, H=2) / 192 / 160 (HQ=64, H=4) at 16k: forward 0.71 / 1.31 / 1.36 against 1.04 / 1.87 / 2.01, backward 4.02 / 8.04 / 8.04 against 3.76 / 5.62 / 5.95); FA-2 runs here (force to override)
    flash_attn refused: flash_attn is not importable
  gate_combine -> triton""")

    def test_routing_sm90(self):
        self.assertExpectedInline(decisions((9, 0)), """\
cuda sm90 bfloat16 Dk=128 Dv=128 T=65536 l=32 d=16
  compressed_attention -> cudnn
  select_blocks -> triton
  selection_attention -> triton
  sliding_window_attention -> triton
    flash_attn refused: flash_attn is not importable
  gate_combine -> triton""")

    def test_routing_sm90_fp32_wide_heads(self):
        self.assertExpectedInline(decisions((9, 0), torch.float32, 192, 128, 8192), """\
cuda sm90 float32 Dk=192 Dv=128 T=8192 l=32 d=16
  compressed_attention -> triton
    cudnn refused: cuDNN attention takes float16/bfloat16 only, got torch.float32
  select_blocks -> triton
  selection_attention -> triton
  sliding_window_attention -> triton
    flash_attn refused: flash_attn is not importable
    aten_fa2 refused: FlashAttention-2 takes float16/bfloat16 only, got torch.float32
  gate_combine -> triton""")

    def test_routing_sm100(self):
        self.assertExpectedInline(decisions((10, 0)), """\
cuda sm100 bfloat16 Dk=128 Dv=128 T=65536 l=32 d=16
  compressed_attention -> triton
    cudnn deferred: measured on sm90 only, not sm100: the Triton kernel serves it (force to override)
  select_blocks -> triton
  selection_attention -> triton
  sliding_window_attention -> aten_fa2
    triton deferred: the Triton window kernels were measured faster than FA-2 on sm90 at head dims 33-128 both ways and 129-256 forward only, with the tiles tuned there (H100, bf16, w=512; D=128 at T = 8k / 64k / 128k: forward 0.43 / 3.55 / 7.33 ms against 0.69 / 5.63 / 11.24, backward 1.56 / 13.09 / 25.03 against 1.86 / 14.86 / 30.16, bench_kernels.py --kernels window; D=64 at T = 16k / 64k: forward 0.47 / 1.86 against 1.11 / 5.87, backward 1.59 / 6.26 against 2.18 / 8.56; H200, D=256 (HQ=32, H=2) / 192 / 160 (HQ=64, H=4) at 16k: forward 0.71 / 1.31 / 1.36 against 1.04 / 1.87 / 2.01, backward 4.02 / 8.04 / 8.04 against 3.76 / 5.62 / 5.95); FA-2 runs here (force to override)
    flash_attn refused: flash_attn is not importable
  gate_combine -> triton""")

    def test_validation_messages(self):
        torch.manual_seed(0)
        q, k, v = torch.randn(1, 40, 4, 8), torch.randn(1, 40, 2, 8), torch.randn(1, 40, 2, 8)
        k_cmp, v_cmp = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8)
        lse, g = torch.randn(1, 40, 4), torch.rand(1, 40, 4)
        idx = torch.zeros(1, 40, 2, 3, dtype=torch.int32)
        nsa = torch.ops.nsa
        calls = {
            "compressed_attention q rank": lambda: nsa.compressed_attention(
                q[0], k_cmp, v_cmp, 16, 8, 0.3),
            "compressed_attention stride": lambda: nsa.compressed_attention(
                q, k_cmp, v_cmp, 16, 5, 0.3),
            "select_blocks num_sel": lambda: nsa.select_blocks(
                q, k_cmp, lse, 16, 8, 16, 2, 0.3),
            "select_blocks lse shape": lambda: nsa.select_blocks(
                q, k_cmp, lse[:, :7], 16, 8, 16, 3, 0.3),
            "selection_attention block_idx": lambda: nsa.selection_attention(
                q, k, v, idx[:, :5], 16, 0.3),
            "selection_attention heads": lambda: nsa.selection_attention(
                torch.randn(1, 40, 3, 8), k, v, idx, 16, 0.3),
            "sliding_window_attention window": lambda: nsa.sliding_window_attention(
                q, k, v, 0, 0.3),
            "sliding_window_attention scale": lambda: nsa.sliding_window_attention(
                q, k, v, 8, float("nan")),
            "gate_combine gate": lambda: nsa.gate_combine(
                q, q, q, g[:, :3], g, g),
            "nsa_attention k dtype": lambda: nsa_ops.nsa_attention(
                q, k.double(), v, g, g, g, block_len=16, block_stride=8, sel_block=16,
                num_sel=3, window=16),
            "NSAConfig num_heads": lambda: nsa_ops.NSAConfig(
                hidden_size=32, num_heads=3, num_kv_heads=2, head_dim_qk=8, head_dim_v=8),
        }
        text = "\n".join(f"{name}: {message(fn)}" for name, fn in calls.items())
        self.assertExpectedInline(text, """\
compressed_attention q rank: q must have rank 4 ([B, T, HQ, Dk]), got shape (40, 4, 8)
compressed_attention stride: block_stride must divide block_len (d | l), got block_len=16, block_stride=5
select_blocks num_sel: num_sel must be >= 3 (block 0 and the two local blocks are always selected), got 2
select_blocks lse shape: lse must have shape [B, T, HQ] = (1, 40, 4), got (1, 7, 4)
selection_attention block_idx: block_idx must have shape [B, T, H, n] with (B, T, H) = (1, 40, 2), got (1, 5, 2, 3)
selection_attention heads: q heads HQ=3 must be a multiple of k heads H=2 (GQA group HQ/H)
sliding_window_attention window: window must be a positive int, got 0
sliding_window_attention scale: scale must be a finite positive float, got nan
gate_combine gate: g_cmp must have shape [B, T, HQ] = (1, 40, 4), got (1, 3, 4)
nsa_attention k dtype: k must have the same dtype as q (torch.float32), got torch.float64
NSAConfig num_heads: NSAConfig.num_heads must be a multiple of num_kv_heads (GQA), got num_heads=3, num_kv_heads=2""")

    def test_exported_layer_calls(self):
        _, ep = export_module()
        self.assertExpectedInline("\n".join(nsa_ops_called(ep)), """\
nsa.sliding_window_attention.default
nsa.compressed_attention.default
nsa.select_blocks.default
nsa.selection_attention.default
nsa.gate_combine.default""")
