"""NSAConfig (validation, YAML, check-config CLI) and NSAAttention (shapes, init, gradients)."""
import subprocess
import sys

import pytest
import torch

import nsa_ops
from nsa_ops import NSAAttention, NSAConfig
from nsa_ops.__main__ import main

BASE = dict(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim_qk=8, head_dim_v=12,
            block_len=16, block_stride=8, sel_block=16, num_sel=4, window=24)


def cfg(**over):
    return NSAConfig(**{**BASE, **over})


@pytest.mark.parametrize("field, value", [
    ("num_heads", 5),           # HQ % H
    ("block_stride", 5),        # d | l
    ("sel_block", 20),          # d | l' (names block_stride, the divisor)
    ("num_sel", 2),
    ("window", 0),
    ("hidden_size", -1),
    ("head_dim_v", 1.5),
    ("head_dim_qk", 7),         # RoPE pairs
    ("phi", "max"),
    ("gate_act", "relu"),
    ("max_position", 0),
    ("rope_theta", -1.0),
    ("bias", "yes"),
])
def test_config_errors_name_the_field(field, value):
    named = "block_stride" if field == "sel_block" else field
    with pytest.raises(ValueError, match=f"NSAConfig.{named} "):
        cfg(**{field: value})


def test_validate_catches_mutation():
    c = cfg()
    c.num_sel = 1
    with pytest.raises(ValueError, match="num_sel"):
        c.validate()


def test_derived_numbers():
    c = NSAConfig(hidden_size=2048, num_heads=64, num_kv_heads=4, head_dim_qk=192, head_dim_v=128)
    assert c.group == 16 and c.scale == 192 ** -0.5
    assert c.reads(32768) == 2047 + 16 * 64 + 512
    assert c.reads(10) == 0 + 16 * 64 + 10


def test_yaml_round_trip(tmp_path):
    c = cfg(phi="mlp", gate_act="softmax", max_position=4096, bias=True, rope_theta=5e5)
    path = tmp_path / "nsa.yaml"
    text = c.to_yaml(path)
    assert path.read_text() == text
    assert NSAConfig.from_yaml(path) == c


def test_yaml_unknown_and_missing_keys(tmp_path):
    path = tmp_path / "nsa.yaml"
    path.write_text(cfg().to_yaml() + "blocklen: 3\nextra: 1\n")
    with pytest.raises(ValueError, match="unknown NSAConfig keys: blocklen, extra"):
        NSAConfig.from_yaml(path)
    path.write_text("hidden_size: 8\nnum_heads: 2\n")
    with pytest.raises(ValueError, match="missing NSAConfig keys: num_kv_heads, head_dim_qk"):
        NSAConfig.from_yaml(path)


def test_check_config_cli(tmp_path, capsys):
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    cfg().to_yaml(good)
    bad.write_text(cfg().to_yaml().replace("num_sel: 4", "num_sel: 2"))
    assert main(["check-config", str(good)]) == 0
    out = capsys.readouterr().out
    assert "G = HQ/H = 2" in out and f"= {cfg().reads(4096)} (dense: 4096)" in out
    assert main(["check-config", str(bad)]) == 1
    assert "NSAConfig.num_sel must be >= 3" in capsys.readouterr().err
    run = subprocess.run([sys.executable, "-m", "nsa_ops", "check-config", str(bad)],
                         capture_output=True, text=True)
    assert run.returncode == 1 and "num_sel" in run.stderr


@pytest.mark.parametrize("HQ, H", [(4, 4), (8, 2)])
def test_forward_shapes(HQ, H):
    torch.manual_seed(0)
    m = NSAAttention(cfg(num_heads=HQ, num_kv_heads=H))
    x = torch.randn(2, 50, 32)
    assert m(x).shape == (2, 50, 32)
    cu = torch.tensor([0, 20, 50, 57], dtype=torch.int32)
    out = m(torch.randn(1, 57, 32), cu_seqlens=cu)
    assert out.shape == (1, 57, 32)


def test_varlen_equals_separate_sequences():
    torch.manual_seed(0)
    m = NSAAttention(cfg()).double()
    a, b = torch.randn(1, 40, 32, dtype=torch.float64), torch.randn(1, 27, 32, dtype=torch.float64)
    cu = torch.tensor([0, 40, 67], dtype=torch.int32)
    packed = m(torch.cat([a, b], 1), cu_seqlens=cu)
    torch.testing.assert_close(packed, torch.cat([m(a), m(b)], 1), atol=1e-12, rtol=0)


@pytest.mark.parametrize("act, value", [("sigmoid", 0.5), ("softmax", 1 / 3)])
def test_gates_start_at_act_of_zero(act, value):
    m = NSAAttention(cfg(gate_act=act, bias=True))
    assert all(p.abs().sum() == 0 for p in m.gate[-1].parameters())
    for g in m.gates(torch.randn(2, 9, 32)):
        assert g.shape == (2, 9, 4)
        torch.testing.assert_close(g, torch.full_like(g, value))


def test_phi_mlp_starts_as_mean():
    torch.manual_seed(0)
    mean = NSAAttention(cfg(phi="mean"))
    mlp = NSAAttention(cfg(phi="mlp"))
    mlp.load_state_dict(mean.state_dict(), strict=False)
    x = torch.randn(1, 70, 32)
    torch.testing.assert_close(mlp(x), mean(x), atol=1e-6, rtol=1e-5)


def _materialised(config: NSAConfig) -> NSAAttention:
    """A layer built on the meta device, moved to the CPU with to_empty, every parameter NaN."""
    with torch.device("meta"):
        m = NSAAttention(config)
    m.to_empty(device="cpu")
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(float("nan"))
    return m


@pytest.mark.parametrize("phi", ["mean", "mlp"])
@pytest.mark.parametrize("bias", [False, True])
def test_meta_init_then_reset_parameters_equals_construction(phi, bias):
    """Large models are built on the meta device and materialised with to_empty: the layer's
    reset_parameters gives the weights construction gives for the same seed, and so does the
    per-module loop of FSDP's meta-device initialisation (each module's own reset_parameters,
    root first), where an nn.Linear's own reset would have undone the zero-initialised gate and
    phi layers."""
    torch.manual_seed(0)
    built = NSAAttention(cfg(phi=phi, bias=bias)).state_dict()
    m = _materialised(cfg(phi=phi, bias=bias))
    torch.manual_seed(0)
    m.reset_parameters()
    for name, p in m.state_dict().items():
        assert torch.equal(p, built[name]), name

    m = _materialised(cfg(phi=phi, bias=bias))
    torch.manual_seed(0)
    for module in m.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    assert all(torch.isfinite(p).all() for p in m.parameters())
    zero = list(m.gate[-1].parameters())
    if phi == "mlp":
        zero += [m.phi_k.pos_emb, m.phi_v.pos_emb, *m.phi_k.fc2.parameters(),
                 *m.phi_v.fc2.parameters()]
    assert all(p.abs().sum() == 0 for p in zero)


def test_backward_reaches_every_parameter():
    torch.manual_seed(0)
    m = NSAAttention(cfg(phi="mlp"))
    m(torch.randn(2, 60, 32)).square().sum().backward()
    # grads behind the zero-initialised gate output and phi fc2 are zero at step 0, not missing
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert m.gate[-1].weight.grad.abs().sum() > 0 and m.q_proj.weight.grad.abs().sum() > 0


def test_input_errors():
    m = NSAAttention(cfg(max_position=64))
    with pytest.raises(ValueError, match="hidden size 32"):
        m(torch.randn(1, 5, 31))
    with pytest.raises(ValueError, match="max_position=64"):
        m(torch.randn(1, 65, 32))
    with pytest.raises(ValueError, match="cache must be built"):
        m(torch.randn(1, 1, 32), cache=nsa_ops.NSACache(cfg()))


@pytest.mark.parametrize("phi", ["mean", "mlp"])
def test_bf16_autocast_matches_float32(phi):
    """Under autocast the ops keep their own precision rules (float32 lse) and phi keeps k's
    dtype, so a mixed-precision forward and backward run and stay close to float32."""
    torch.manual_seed(0)
    m = NSAAttention(cfg(phi=phi, head_dim_v=8))
    with torch.no_grad():
        for p in m.gate[-1].parameters():
            p.normal_(0, 0.3)
    x = torch.randn(2, 70, 32, generator=torch.Generator().manual_seed(1))
    ref = m(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(x)
    assert out.dtype == torch.bfloat16
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert rel < 2e-2, rel
    out.float().square().sum().backward()
    grads = [p.grad for p in (m.q_proj.weight, m.k_proj.weight, m.v_proj.weight,
                              m.gate[-1].weight)]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
