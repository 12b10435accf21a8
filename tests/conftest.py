"""Test setup: without CUDA, Triton kernels run in interpreter mode on CPU tensors.

TRITON_INTERPRET must be set before triton is first imported, hence at conftest import time.
"""
import os

import pytest
import torch

import helpers

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run with -m gpu on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
