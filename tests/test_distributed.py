"""Context-parallel NSA (nsa_ops.distributed) on 2 and 3 gloo ranks equals single-device
nsa_attention: outputs and the gradients of q, k, v and the gates."""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import nsa_ops
from nsa_ops import distributed as cp
from helpers import SMALL, TOL, gates, qkv

GEO = dict(SMALL, window=20)
T = 96  # divisible by 2 * world for world 2 and 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check(rank: int, world: int, port: int, backend: str = "gloo") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dev = "cpu"
    if backend == "nccl":
        dev = f"cuda:{rank}"
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        q, k, v = (x.to(dev).requires_grad_() for x in qkv(2, T, 4, 2, 16, 8, torch.float64, seed=5))
        g = [x.to(dev).requires_grad_() for x in gates(2, T, 4, torch.float64)]
        do = torch.randn(2, T, 4, 8, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(6)).to(dev)
        full = nsa_ops.nsa_attention(q, k, v, *g, **GEO)
        (full * do).sum().backward()
        want = [x.grad.clone() for x in (q, k, v, *g)]

        local = [cp.shard(x.detach(), None).requires_grad_() for x in (q, k, v, *g)]
        out = cp.context_parallel_nsa_attention(*local, **GEO)
        (out * cp.shard(do)).sum().backward()
        atol, rtol = TOL[torch.float64]
        torch.testing.assert_close(out, cp.shard(full.detach()), atol=atol, rtol=rtol)
        for got, expected in zip(local, want):
            torch.testing.assert_close(got.grad, cp.shard(expected), atol=atol, rtol=rtol)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_context_parallel_equals_single_device(world):
    mp.spawn(_check, args=(world, _free_port()), nprocs=world, join=True)


@pytest.mark.gpu
def test_context_parallel_nccl():
    world = torch.cuda.device_count()
    if world < 2:
        pytest.skip("needs two or more GPUs")
    mp.spawn(_check, args=(world, _free_port(), "nccl"), nprocs=world, join=True)


def test_shard_needs_a_divisible_length():
    with pytest.raises(ValueError, match="divisible by 2 \\* world size"):
        cp._chunk_bounds(10, 3, 0)
