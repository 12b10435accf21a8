"""kernels.utils.launch / DirectLaunch: which launches reuse a compiled kernel and which go back to
Triton's dispatch, on a stand-in kernel (the CPU has no compiled kernels; the GPU tests compare
the two paths' outputs, tests/test_gpu_review.py)."""
import inspect
from types import SimpleNamespace

import pytest
import torch

from nsa_ops.kernels import utils


class _Compiled:
    def __init__(self, number):
        self.number = number
        self.function = f"function {number}"
        self.packed_metadata = f"metadata {number}"
        self.runs = []

    def launch_metadata(self, grid, stream, *values):
        return ("launch metadata", grid, stream)

    def run(self, gx, gy, gz, stream, function, packed, metadata, enter, leave, *values):
        assert (function, packed, metadata) == (self.function, self.packed_metadata,
                                                ("launch metadata", (gx, gy, gz), stream))
        self.runs.append(((gx, gy, gz), stream, values))


class _Kernel:
    """Triton's JITFunction as DirectLaunch sees it: params, pre_run_hooks, device_caches, and
    kernel[grid](...) returning a compiled kernel (a new one per dispatch, so that tests can tell
    which dispatch's kernel a direct launch reused)."""

    def __init__(self):
        empty = inspect.Parameter.empty
        self.params = [SimpleNamespace(name=name, is_constexpr=c, default=d) for name, c, d in (
            ("x", False, empty), ("n", False, empty), ("scale", False, empty),
            ("flag", False, False), ("BLOCK", True, empty), ("MODE", True, "a"))]
        self.pre_run_hooks = []
        self.device_caches = {}
        self.dispatched = []

    def __getitem__(self, grid):
        def dispatch(*args, **kwargs):
            self.dispatched.append((grid, args, kwargs))
            return _Compiled(len(self.dispatched))
        return dispatch


@pytest.fixture
def kernel(monkeypatch):
    monkeypatch.delenv("NSA_OPS_TRITON_DISPATCH", raising=False)
    monkeypatch.setattr(utils, "traced", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1000 + device,
                        raising=False)
    return _Kernel()


def test_same_key_reuses_the_compiled_kernel(kernel):
    x, y = torch.randn(64), torch.randn(32)
    first = utils.launch(kernel)[(4, 2)](x, 4096, 0.5, BLOCK=64, num_warps=4)
    assert len(kernel.dispatched) == 1 and first.runs == []
    # another tensor, length and scale of the same specialization: launched directly, the
    # values in the kernel's parameter order with its defaults
    again = utils.launch(kernel)[(8,)](y, 8192, 2.0, BLOCK=64, num_warps=4)
    assert again is first and len(kernel.dispatched) == 1
    assert first.runs == [((8, 1, 1), 1000, (y, 8192, 2.0, False, 64, "a"))]
    utils.launch(kernel)[(8,)](y, 16, 2.0, False, MODE="a", BLOCK=64, num_warps=4)
    assert len(first.runs) == 2 and first.runs[-1][2] == (y, 16, 2.0, False, 64, "a")


@pytest.mark.parametrize("change", [
    "unaligned tensor", "other dtype", "n == 1", "n not a multiple of 16", "n past int32",
    "constexpr", "constexpr default", "launch option", "flag"])
def test_another_specialization_dispatches(kernel, change):
    x = torch.randn(64)
    args, kw = [x, 4096, 0.5], dict(BLOCK=64, num_warps=4)
    utils.launch(kernel)[(1,)](*args, **kw)
    if change == "unaligned tensor":
        args[0] = x[1:]  # 4 bytes past a 16-byte boundary
    elif change == "other dtype":
        args[0] = x.half()
    elif change == "n == 1":
        args[1] = 1
    elif change == "n not a multiple of 16":
        args[1] = 4100
    elif change == "n past int32":
        args[1] = 2 ** 32
    elif change == "constexpr":
        kw["BLOCK"] = 128
    elif change == "constexpr default":
        kw["MODE"] = "b"
    elif change == "launch option":
        kw["num_warps"] = 8
    elif change == "flag":
        args.append(True)
    compiled = utils.launch(kernel)[(1,)](*args, **kw)
    assert len(kernel.dispatched) == 2 and compiled.number == 2 and compiled.runs == []


def test_what_it_cannot_key_goes_through_triton(kernel, monkeypatch):
    x = torch.randn(64)
    for _ in range(2):  # an argument of a type without a key, a callable grid, a pre-run hook
        utils.launch(kernel)[(1,)](x, torch.tensor(3.0).numpy(), 0.5, BLOCK=64)
        utils.launch(kernel)[lambda meta: (1,)](x, 16, 0.5, BLOCK=64)
    assert len(kernel.dispatched) == 4
    kernel.pre_run_hooks.append(lambda *a, **k: None)
    utils.launch(kernel)[(1,)](x, 16, 0.5, BLOCK=64)
    utils.launch(kernel)[(1,)](x, 16, 0.5, BLOCK=64)
    assert len(kernel.dispatched) == 6


def test_triton_dispatch_variable_and_interpreter(kernel, monkeypatch):
    monkeypatch.setenv("NSA_OPS_TRITON_DISPATCH", "1")
    assert utils.launch(kernel) is kernel
    monkeypatch.delenv("NSA_OPS_TRITON_DISPATCH")
    assert isinstance(utils.launch(kernel), utils.DirectLaunch)
    interpreted = SimpleNamespace(params=[])  # the interpreter's kernels have no device caches
    assert utils.launch(interpreted) is interpreted
