"""Context-parallel NSA (nsa_ops.distributed) on 2 and 3 gloo ranks, and on every GPU over NCCL,
equals single-device nsa_attention: outputs and the gradients of q, k, v and the gates. FSDP2
over compiled NSAAttention blocks equals the unsharded model, on gloo and on NCCL."""
import os
import socket
from typing import Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import nsa_ops
from nsa_ops import distributed as cp
from helpers import SMALL, TOL, gates, qkv

# name: (B, T, HQ, H, Dk, Dv, geometry); T divisible by 2 * world for world 2, 3 (and 4, 8)
CASES = {"small": (2, 96, 4, 2, 16, 8, dict(SMALL, window=20)),
         # the spec's block geometry (nsa_attention's defaults): on CUDA the Triton kernels at
         # an offset serve the ranks' chunks, the full-length call's routes the whole sequence
         "spec": (1, 2048, 16, 2, 64, 64, {})}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(rank: int, world: int, port: int, backend: str) -> str:
    """Joins the group; the rank's device: cuda:rank over NCCL, the CPU over gloo."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dev = "cpu"
    if backend == "nccl":
        dev = f"cuda:{rank}"
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, rank=rank, world_size=world)
    torch.set_num_threads(1)
    return dev


def _check(rank: int, world: int, port: int, backend: str = "gloo",
           dtype: torch.dtype = torch.float64, case: str = "small") -> None:
    dev = _join(rank, world, port, backend)
    try:
        B, T, HQ, H, Dk, Dv, geo = CASES[case]
        q, k, v = (x.to(dev).requires_grad_() for x in qkv(B, T, HQ, H, Dk, Dv, dtype, seed=5))
        g = [x.to(dev).requires_grad_() for x in gates(B, T, HQ, dtype)]
        do = torch.randn(B, T, HQ, Dv, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(6)).to(dev, dtype)
        full = nsa_ops.nsa_attention(q, k, v, *g, **geo)
        (full * do).sum().backward()
        want = [x.grad.clone() for x in (q, k, v, *g)]

        local = [cp.shard(x.detach(), None).requires_grad_() for x in (q, k, v, *g)]
        out = cp.context_parallel_nsa_attention(*local, **geo)
        (out * cp.shard(do)).sum().backward()
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(out, cp.shard(full.detach()), atol=atol, rtol=rtol)
        for got, expected in zip(local, want):
            torch.testing.assert_close(got.grad, cp.shard(expected), atol=atol, rtol=rtol)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_context_parallel_equals_single_device(world):
    mp.spawn(_check, args=(world, _free_port()), nprocs=world, join=True)


LAYER = dict(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim_qk=8, head_dim_v=8,
             block_len=16, block_stride=8, sel_block=16, num_sel=3, window=24)


class Block(torch.nn.Module):
    def __init__(self, config: Optional[nsa_ops.NSAConfig] = None):
        super().__init__()
        self.norm = torch.nn.LayerNorm(LAYER["hidden_size"])
        self.attn = nsa_ops.NSAAttention(config or nsa_ops.NSAConfig(**LAYER))

    def forward(self, x):
        return x + self.attn(self.norm(x))

    def reset_parameters(self):
        self.norm.reset_parameters()
        self.attn.reset_parameters()


def _fully_shard(blocks: torch.nn.Sequential, dev: str, world: int) -> torch.nn.Sequential:
    """blocks with each block and the whole sharded by fully_shard over the world's ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(torch.device(dev).type, (world,))
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(blocks, mesh=mesh)
    return blocks


def _fsdp2(rank: int, world: int, port: int, backend: str = "gloo") -> None:
    """Two NSAAttention blocks, each and the whole sharded with fully_shard, compiled: the
    gradients of a data-parallel step equal the unsharded model's on the whole batch."""
    dev = _join(rank, world, port, backend)
    try:
        models = []
        for _ in range(2):
            torch.manual_seed(0)
            models.append(torch.nn.Sequential(Block(), Block()).to(dev))
        ref, sharded = models
        _fully_shard(sharded, dev, world)
        x = torch.randn(2 * world, 40, LAYER["hidden_size"],
                        generator=torch.Generator().manual_seed(1)).to(dev)
        mine = x[2 * rank:2 * rank + 2]
        loss = torch.compile(sharded)(mine).square().mean()
        loss.backward()
        ref_loss = ref(x).square().mean()
        ref_loss.backward()
        losses = [torch.zeros((), device=dev) for _ in range(world)]
        dist.all_gather(losses, loss.detach())
        torch.testing.assert_close(torch.stack(losses).mean(), ref_loss.detach())
        for (name, p), (_, p_ref) in zip(sharded.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), p_ref.grad, atol=1e-6, rtol=1e-4,
                                       msg=name)
    finally:
        dist.destroy_process_group()


def test_fsdp2_compiled_nsa_blocks_equal_unsharded():
    mp.spawn(_fsdp2, args=(2, _free_port()), nprocs=2, join=True)


def _fsdp2_meta(rank: int, world: int, port: int) -> None:
    """Blocks built on the meta device, sharded, materialised with to_empty and initialised by
    reset_parameters (torchtitan's way): finite weights, the zero-starting layers at zero, and
    the sharded model equals an unsharded one given its full weights."""
    dev = _join(rank, world, port, "gloo")
    try:
        config = nsa_ops.NSAConfig(**dict(LAYER, phi="mlp"))
        with torch.device("meta"):
            blocks = torch.nn.Sequential(Block(config), Block(config))
        sharded = _fully_shard(blocks, dev, world)
        sharded.to_empty(device=dev)
        for block in sharded:
            block.reset_parameters()
        weights = {name: p.full_tensor() for name, p in sharded.state_dict().items()}
        assert all(torch.isfinite(p).all() for p in weights.values())
        zero = [name for name in weights if any(z in name for z in ("gate.2", "fc2", "pos_emb"))]
        assert zero and all(weights[name].abs().sum() == 0 for name in zero)
        ref = torch.nn.Sequential(Block(config), Block(config))
        ref.load_state_dict(weights)
        x = torch.randn(2, 40, LAYER["hidden_size"], generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(sharded(x), ref(x), atol=0, rtol=0)
    finally:
        dist.destroy_process_group()


def test_fsdp2_meta_device_init():
    mp.spawn(_fsdp2_meta, args=(2, _free_port()), nprocs=2, join=True)


def _gpu_world() -> int:
    world = torch.cuda.device_count()
    if world < 2:
        pytest.skip("needs two or more GPUs")
    return world


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, case", [(torch.float64, "small"), (torch.float32, "spec"),
                                         (torch.bfloat16, "spec")])
def test_context_parallel_nccl(dtype, case):
    world = _gpu_world()
    mp.spawn(_check, args=(world, _free_port(), "nccl", dtype, case), nprocs=world, join=True)


@pytest.mark.gpu
def test_fsdp2_compiled_nsa_blocks_equal_unsharded_nccl():
    world = _gpu_world()
    mp.spawn(_fsdp2, args=(world, _free_port(), "nccl"), nprocs=world, join=True)


def test_shard_needs_a_divisible_length():
    with pytest.raises(ValueError, match="divisible by 2 \\* world size"):
        cp._chunk_bounds(10, 3, 0)
