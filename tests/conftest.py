"""Test setup: without CUDA, Triton kernels run in interpreter mode on CPU tensors.

TRITON_INTERPRET must be set before triton is first imported, hence at conftest import time.
"""
import fcntl
import os

import pytest
import torch

import helpers

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    import fast_interpreter
    fast_interpreter.install()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run with -m gpu on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _gpu_turn(request, tmp_path_factory):
    """GPU tests share one device with the other xdist workers of the run: a gpu_memory test
    (tens of GB) holds an exclusive lock, the others a shared one, so that two of those never
    overlap (with -n 2 they ran out of the H100's 80 GB together); after one, its worker hands
    its cached blocks back to the device."""
    if "gpu" not in request.keywords or not torch.cuda.is_available():
        yield
        return
    exclusive = "gpu_memory" in request.keywords
    # the parent of a worker's basetemp is shared by every worker of the run
    with open(tmp_path_factory.getbasetemp().parent / "nsa_ops_gpu.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            if exclusive:
                torch.cuda.empty_cache()
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture
def poisoned_empty():
    """`helpers.poisoned_empty` for the whole test."""
    with helpers.poisoned_empty():
        yield


@pytest.fixture
def deterministic():
    """torch.use_deterministic_algorithms(True) for the test, restored after."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)
