"""The geometry arguments every bench script shares (bench/geometry.py): defaults, a config file
with flags overriding it, usage errors, and each script's --help."""
import importlib
import sys
from pathlib import Path

import pytest

import nsa_ops

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))  # the scripts import each other as top-level modules

import geometry  # noqa: E402

# modules the scripts import, not scripts
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py")
                 if p.stem not in ("geometry", "peers", "selection_floor"))


def parse(argv, batch=1):
    return geometry.parse(geometry.parser(None, batch), argv)


def test_default_is_the_spec_geometry():
    args, cfg = parse([])
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim_qk, cfg.head_dim_v) == (64, 4, 128, 128)
    assert (cfg.block_len, cfg.block_stride, cfg.sel_block, cfg.num_sel, cfg.window) == \
        (32, 16, 64, 16, 512)
    assert args.batch == 1


def test_flags_override_the_config_file(tmp_path):
    path = tmp_path / "layer.yaml"
    nsa_ops.NSAConfig(hidden_size=512, num_heads=16, num_kv_heads=2, head_dim_qk=64,
                      head_dim_v=32, block_len=64, block_stride=32, sel_block=64, num_sel=8,
                      window=256, phi="mlp").to_yaml(path)
    args, cfg = parse(["--config", str(path), "--heads", "8", "--dv", "64", "--window", "128",
                       "--batch", "3"])
    assert cfg == nsa_ops.NSAConfig(hidden_size=512, num_heads=8, num_kv_heads=2, head_dim_qk=64,
                                    head_dim_v=64, block_len=64, block_stride=32, sel_block=64,
                                    num_sel=8, window=128, phi="mlp")
    assert args.batch == 3


def test_a_sweeping_script_takes_several_batch_sizes():
    assert parse([], batch=(1, 8))[0].batch == [1, 8]
    assert parse(["--batch", "2", "4"], batch=(1, 8))[0].batch == [2, 4]


@pytest.mark.parametrize("argv, message", [
    (["--block-stride", "24"], "NSAConfig.block_stride must divide block_len"),
    (["--heads", "6"], "NSAConfig.num_heads must be a multiple of num_kv_heads"),
    (["--config", "missing.yaml"], "No such file"),
    (["--batch", "0"], "--batch must be positive"),
])
def test_bad_geometry_is_a_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_takes_the_geometry(script, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [f"{script}.py", "--help"])
    with pytest.raises(SystemExit) as exc:
        importlib.import_module(script).main()
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--config", *(f"--{name}" for name in geometry.FLAGS), "--batch"):
        assert flag in out, (script, flag)
