"""In-order accumulation across programs: the deterministic mode of the backward kernels.

Under `torch.use_deterministic_algorithms(True)` the dk/dv kernels whose programs share an output
tile (selection: chunks of the queries of one block; compressed: query-range splits of one key
tile) add their partial sums in a fixed order instead of with fp32 atomics, so a backward run twice
on the same inputs gives bitwise equal gradients. Each program takes a ticket (an atomic counter,
as CUB's decoupled look-back does for its tile ids), so every lower ticket has already been
scheduled: waiting on one cannot deadlock. A program computes its partial sum, waits until its
predecessor's flag is set, adds its partial into the output with a plain read-modify-write and
sets its own flag.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def sync_buffer(programs: int, device) -> torch.Tensor:
    """int32 [1 + programs], zeroed: the ticket counter, then one flag per program."""
    return torch.zeros(1 + programs, dtype=torch.int32, device=device)


@triton.jit
def take_ticket(sync):
    """This program's position in the order (scheduling order, not program_id order)."""
    return tl.atomic_add(sync, 1)


@triton.jit
def wait_for(sync, ticket):
    """Spin until the program holding `ticket` has passed its turn."""
    while tl.atomic_add(sync + 1 + ticket, 0, sem="acquire") == 0:
        pass


@triton.jit
def pass_turn(sync, ticket):
    """Publish this program's writes to the one waiting on `ticket`."""
    tl.debug_barrier()  # every thread's stores come before the release
    tl.atomic_xchg(sync + 1 + ticket, 1, sem="release")
