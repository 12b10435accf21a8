"""nsa_ops.observe: the routing log, parity mode, and the ops' names in torch.profiler traces."""
import dataclasses
import logging
import re
import warnings

import pytest
import torch

import nsa_ops
from nsa_ops import observe, reference, routing
from helpers import SMALL, compressed, gates, qkv

WINDOW = "sliding_window_attention"


@pytest.fixture(autouse=True)
def fresh_observe(monkeypatch):
    """Each test starts with nothing logged yet and parity off."""
    monkeypatch.setattr(observe, "_logged", set())
    monkeypatch.setattr(observe, "_every", 0)
    monkeypatch.setattr(observe, "_calls", {})


def _serve(monkeypatch, op, route):
    """Route op to `route` whatever the device (the Triton rows refuse CPU tensors)."""
    choose = routing.choose
    monkeypatch.setattr(routing, "choose", lambda o, x: route if o == op else choose(o, x))


def _as_kernel(op, forward=None):
    """The reference row of op under a kernel's name, so that parity checks it."""
    row = routing.route(op, "reference")
    return dataclasses.replace(row, impl="triton", forward=forward or row.forward)


def _window(dtype=torch.float32):
    q, k, v = qkv(1, 40, 4, 2, 16, 16, dtype, seed=3)
    return torch.ops.nsa.sliding_window_attention(q, k, v, 16, 0.25)


def _lines(caplog, needle):
    return [r.getMessage() for r in caplog.records
            if r.name == "nsa_ops" and needle in r.getMessage()]


def test_info_names_the_impl_and_the_refusals_once_per_combination(caplog):
    caplog.set_level(logging.INFO, logger="nsa_ops")
    _window()
    _window()
    _window(torch.float64)
    lines = _lines(caplog, "nsa.sliding_window_attention runs")
    assert len(lines) == 2
    assert lines[0].startswith("nsa.sliding_window_attention runs reference for float32 on cpu")
    assert "triton refused: needs a CUDA device" in lines[0]
    assert "float64" in lines[1]


def test_info_names_the_backward_direction_once(caplog):
    """A backward op is routed on its own (routing.Inputs.backward): its line says so, once."""
    caplog.set_level(logging.INFO, logger="nsa_ops")
    q, k, v = qkv(1, 40, 4, 2, 16, 16, torch.float32, seed=3, requires_grad=True)
    for _ in range(2):
        o, _ = torch.ops.nsa.sliding_window_attention(q, k, v, 16, 0.25)
        o.sum().backward()
    assert len(_lines(caplog, "nsa.sliding_window_attention runs reference")) == 1
    lines = _lines(caplog, "nsa.sliding_window_attention backward runs reference")
    assert len(lines) == 1 and "for float32 on cpu" in lines[0]


def test_debug_logs_every_call_and_backward(caplog):
    caplog.set_level(logging.DEBUG, logger="nsa_ops")
    q, k, v = qkv(1, 40, 4, 2, 16, 16, seed=3, requires_grad=True)
    for _ in range(2):
        o, _ = torch.ops.nsa.sliding_window_attention(q, k, v, 16, 0.25)
    o.sum().backward()
    assert len(_lines(caplog, "nsa.sliding_window_attention: reference")) == 2
    assert len(_lines(caplog, "nsa.sliding_window_attention_backward: reference")) == 1


def test_nothing_logged_or_checked_while_compiling(caplog, monkeypatch):
    caplog.set_level(logging.DEBUG, logger="nsa_ops")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    _serve(monkeypatch, WINDOW, _as_kernel(WINDOW))
    with nsa_ops.parity():
        _window()
    assert not _lines(caplog, "nsa.")


def test_env_log_installs_a_handler_on_the_nsa_ops_logger_only(monkeypatch, capsys):
    root = list(logging.getLogger().handlers)
    monkeypatch.setenv("NSA_OPS_LOG", "info")
    try:
        observe.configure_from_env()
        _window()
    finally:
        monkeypatch.delenv("NSA_OPS_LOG")
        observe.configure_from_env()
    assert "nsa_ops INFO: nsa.sliding_window_attention runs reference" in capsys.readouterr().err
    assert logging.getLogger().handlers == root
    assert not logging.getLogger("nsa_ops").handlers


@pytest.mark.parametrize("name,value", [("NSA_OPS_LOG", "verbose"), ("NSA_OPS_PARITY", "2"),
                                        ("NSA_OPS_PARITY", "often")])
def test_bad_env_values_name_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        observe.configure_from_env()


def test_env_parity_fraction_samples_every_kth_call(monkeypatch):
    monkeypatch.setenv("NSA_OPS_PARITY", "0.25")
    observe.configure_from_env()
    assert observe._every == 4
    with pytest.raises(ValueError, match="fraction"):
        with nsa_ops.parity(1.5):
            pass


def test_parity_of_the_triton_interpreter_is_logged_and_small(caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="nsa_ops")
    _serve(monkeypatch, WINDOW, routing.route(WINDOW, "triton"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with nsa_ops.parity():
            _window()
    line, = _lines(caplog, "parity")
    assert "nsa.sliding_window_attention parity, triton against the reference in float32" in line
    errors = [float(e) for e in re.findall(r"max rel ([0-9.e+-]+)", line)]
    assert len(errors) == 3 and max(errors[:2]) < 1e-5  # o, lse, then the tolerance


def _off_by_a_bit(*args, **kw):
    o, lse = reference.sliding_window_attention(*args, **kw)
    return o + 1e-2, lse


def _off_by_a_lot(*args, **kw):
    """Off by more than bf16's tolerance (relative to max |o|, about 1 here)."""
    o, lse = reference.sliding_window_attention(*args, **kw)
    return o + 0.5, lse


def _one_row_off(*args, **kw):
    idx = reference.select_blocks(*args, **kw)
    idx[0, -1, 0] = idx[0, -1, 0].flip(0)
    return idx


CALLS = []


def _counted(*args, **kw):
    CALLS.append(1)
    return reference.sliding_window_attention(*args, **kw)


def _select_args():
    q, k, v = qkv(1, 48, 4, 2, 16, 16, seed=5)
    k_cmp, v_cmp = compressed(k, v, SMALL)
    L, D = SMALL["block_len"], SMALL["block_stride"]
    _, lse = torch.ops.nsa.compressed_attention(q, k_cmp, v_cmp, L, D, 0.25)
    return q, k_cmp, lse, L, D, SMALL["sel_block"], SMALL["num_sel"], 0.25


@pytest.mark.parametrize("op,wrong,needle", [
    (WINDOW, "_off_by_a_bit", "o max abs 1.00e-02"),
    ("select_blocks", "_one_row_off", "block_idx rows differing 1 of 96"),
])
def test_parity_warns_above_tolerance(caplog, monkeypatch, op, wrong, needle):
    caplog.set_level(logging.INFO, logger="nsa_ops")
    args = _select_args() if op == "select_blocks" else None
    _serve(monkeypatch, op, _as_kernel(op, f"{__name__}:{wrong}"))
    with pytest.warns(RuntimeWarning, match="above tolerance"), nsa_ops.parity():
        torch.ops.nsa.select_blocks(*args) if args else _window()
    assert needle in _lines(caplog, "parity")[0]


def test_parity_samples_every_kth_call_and_is_off_outside(caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="nsa_ops")
    CALLS.clear()
    _serve(monkeypatch, WINDOW, _as_kernel(WINDOW, f"{__name__}:_counted"))
    _window()
    assert not _lines(caplog, "parity") and CALLS == [1]  # off: no reference recomputation
    with nsa_ops.parity(0.5):
        for _ in range(5):
            _window()
    assert [ln.split("call ")[1][0] for ln in _lines(caplog, "parity")] == ["0", "2", "4"]
    assert not observe._every


def test_profiler_names_every_op_and_backward_op():
    q, k, v = qkv(1, 48, 4, 2, 16, 16, requires_grad=True)
    g = gates(1, 48, 4)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        nsa_ops.nsa_attention(q, k, v, *g, window=16, **SMALL).sum().backward()
    names = {e.name for e in prof.events()}
    ops = ["compressed_attention", "select_blocks", "selection_attention", WINDOW, "gate_combine"]
    want = {f"nsa::{op}" for op in ops} | {f"nsa::{op}_backward" for op in ops
                                            if op != "select_blocks"}
    assert want <= names


@pytest.mark.gpu
def test_gpu_parity_bf16(caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="nsa_ops")
    q, k, v = qkv(1, 1024, 16, 2, 64, 64, torch.bfloat16, seed=7, device="cuda")
    g = [x.cuda() for x in gates(1, 1024, 16, torch.bfloat16)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with nsa_ops.parity():
            nsa_ops.nsa_attention(q, k, v, *g)
    lines = _lines(caplog, "parity")
    for op in ("compressed_attention", "select_blocks", "selection_attention", WINDOW,
               "gate_combine"):
        line, = [ln for ln in lines if ln.startswith(f"nsa.{op} parity")]
        assert "bfloat16 on cuda" in line
    wrong = dataclasses.replace(routing.choose(WINDOW, routing.Inputs.of(q, v)),
                                forward=f"{__name__}:_off_by_a_lot", options=())
    _serve(monkeypatch, WINDOW, wrong)
    with pytest.warns(RuntimeWarning, match="above tolerance"), nsa_ops.parity():
        torch.ops.nsa.sliding_window_attention(q, k, v, 512, 0.125)
