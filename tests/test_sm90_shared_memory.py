"""Every Triton kernel the routed ops (decode included) launch on an H100 fits its shared
memory, and at the spec's geometry spills few registers and moves 16-bit tiles in wide
accesses, checked without a GPU: tests/sm90_compile.py compiles them for sm_90 through ptxas
with the GPU's tile tables and the specialization Triton's JIT gives real launches. A tile that asks for more shared memory cannot
launch (OutOfResources on the first call), one that spills runs slowly, and the CPU suite runs the
interpreter, which takes any tile. The head rows are the widest each routed path serves: 16-bit
D = 256 (the Triton rows' limit, where FA-2 and cuDNN refuse or the queries sit at an offset) and
fp32 D = 256 (the last tile tier); 16-bit Dk = 192 with Dv = 128 is the widest key of the window
kernels' 768-byte tier, whose forward pipelines 3 stages."""
import re

import pytest

from helpers import SM90_SHARED_BYTES, compile_for_sm90


# the window, compressed and selection kernels, forward and backward, select_blocks, decode, the
# selection backward's inverse index, the eager layer's mean pooling both ways; fp32 leaves the
# selection's shared passes out (kernels/selection.py, `_cuda_core_default`)
ROUTED = {"_bwd_dq_kernel", "_bwd_dkdv_kernel", "_dq_kernel", "_dkdv_kernel", "_select_kernel",
          "_fused_kernel", "_partials_kernel", "_dq_ds_kernel", "_delta_kernel", "_keys_kernel",
          "_bounds_kernel", "_chunk_base_kernel", "_entries_kernel", "_mean_pool_fwd_kernel",
          "_add_mean_pool_bwd_kernel"}


# 16-bit rows: the selection's shared passes (fp32 leaves them out)
SHARED_PASSES = {"_shared_dq_kernel", "_shared_fwd_kernel"}


@pytest.mark.parametrize("dtype,dk,dv,HQ,H,expected", [
    ("bfloat16", 256, 256, 32, 2, ROUTED | SHARED_PASSES),
    ("bfloat16", 192, 128, 64, 4, ROUTED | SHARED_PASSES),
    ("float32", 256, 256, 32, 2, ROUTED)], ids=["bf16-D256", "bf16-Dk192-Dv128", "fp32-D256"])
def test_routed_kernels_fit_sm90_shared_memory(dtype, dk, dv, HQ, H, expected):
    run = compile_for_sm90("routed", dtype, dk, dv, HQ, H)
    assert run.returncode == 0, run.stderr[-3000:]
    kernels = re.findall(r"compiled (\w+) (\{.*?\}) smem (\d+)", run.stdout)
    assert expected <= {name for name, _, _ in kernels}, run.stdout
    over = [(name, options, int(smem)) for name, options, smem in kernels
            if int(smem) > SM90_SHARED_BYTES]
    assert not over, over


# ptxas' spill stores a thread, at most, of a routed kernel at the spec's geometry (bf16, D = 128,
# HQ = 64, H = 4). The most today, Triton 3.9: the window dK dV kernel's pointer-load path (696
# bytes; sm90 reads its Q / dO through TMA). Mean pooling's forward at 4096 values a program
# spilled 9162 bytes, and its call took 20x the time it takes without (kernels/pooling.py).
SPEC_SPILL_BYTES = 1024
# decode's kernels run one query token: left out of the 2-byte access check (its fused kernel
# issues 6, its combine kernel 4, unexamined); its `_select_kernel` shares select_blocks' name,
# and both have none
DECODE = {"_fused_kernel", "_partials_kernel", "_combine_kernel"}


def _spill_stores(ptxas_log: str) -> list[tuple[str, str]]:
    """(kernel, its spill-store bytes) of each kernel in a compile_for_sm90(ptxas_log=True) run."""
    return re.findall(r"Compiling entry function '(\w+)'.*?(\d+) bytes spill stores", ptxas_log,
                      flags=re.S)


def test_routed_kernels_spill_little_and_access_wide_at_spec_geometry():
    """Spills within SPEC_SPILL_BYTES, and no 2-byte global load or store in a prefill kernel's
    SASS (dq from stored dS made 16 a tile, loading dS under a per-key mask: a fifth of its stall
    samples on an H200)."""
    run = compile_for_sm90("routed", "bfloat16", 128, 128, 64, 4, ptxas_log=True, sass=True)
    assert run.returncode == 0, run.stderr[-3000:]
    spills = _spill_stores(run.stdout)
    compiled = re.findall(r"^compiled (\w+)", run.stdout, flags=re.M)
    assert [name for name, _ in spills] == compiled, run.stdout[-3000:]
    assert ROUTED | SHARED_PASSES <= set(compiled), run.stdout
    over = [(name, int(spill)) for name, spill in spills if int(spill) > SPEC_SPILL_BYTES]
    assert not over, over
    narrow = re.findall(r"^sass (\w+) narrow (\d+)", run.stdout, flags=re.M)
    assert [name for name, _ in narrow] == compiled, run.stdout[-3000:]
    assert [(name, int(n)) for name, n in narrow if name not in DECODE and int(n)] == []


# ptxas' spill stores a thread, at most, of the shared passes' plan kernels at one query head per
# KV head and n = 19 (groups of 32 / 64 queries, 32 slots): 6064 / 6964 bytes at their
# `_plan_warps` (8 / 16), where one warp spilled 44744 in the forward's and ptxas took 56 s and
# over 5 minutes over the two, the layer's first call waiting on it (kernels/selection.py)
PLAN_SPILL_BYTES = 8192


def test_plan_kernels_spread_wide_groups_over_warps():
    run = compile_for_sm90("plans", 8, 8, 19, ptxas_log=True)
    assert run.returncode == 0, run.stderr[-3000:]
    spills = dict(_spill_stores(run.stdout))
    assert set(spills) == {"_shared_plan_kernel", "_dq_plan_kernel"}, run.stdout[-3000:]
    over = {name: int(b) for name, b in spills.items() if int(b) > PLAN_SPILL_BYTES}
    assert not over, over
