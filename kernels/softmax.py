"""The online softmax's key-tile step, shared by the window, compressed and selection forward
kernels, and their finish.

Their key tiles leave the scores unscaled: the scale (to log2 units) goes into the tile's max
here and into the exponent's one fused multiply-add, exp2(s * qk_scale - m), where a scaled copy
of the scores cost a multiply per score. That takes a positive scale, as the ops check
(`validation.check_scale`): the unscaled max then scales to the scaled scores' max, and a masked
-inf stays -inf. H200, bf16, spec geometry, three interleaved rounds against the kernels before,
forward alone: window 64k 2.93 -> 2.87 ms (8k 0.376 -> 0.368), Triton compressed 64k 10.06 ->
9.51 (8k 0.257 -> 0.258), selection 64k 13.44 -> 13.43.

Moving the max lazily, as FlashAttention-4 does (only when some row would outgrow it by more
than 8 in log2 units, so that most tiles skip the rescale of l and acc), measured slower in all
three (window 64k 3.23, compressed 11.27, selection 13.54): the program-wide test and its branch
cost more than the multiplies they save.

`attend_tile` is the whole step, so the compressed forward now loads a tile's V beside its K, not
after the exponentials: its sm_90 code at the spec geometry changes (the window and selection
kernels' does not), its o and lse stay bitwise the same, and its time holds (H200, three
interleaved rounds against the kernel before: 8k 0.257-0.258 -> 0.254-0.255 ms, 16k 0.865-0.870
-> 0.864-0.871, 64k 9.51-9.67 -> 9.61-9.67).
"""
import math

import triton
import triton.language as tl

# kernels work in base 2 (exp2 / log2): a scale enters as scale * LOG2E.value (launch arguments
# are plain floats, kernel globals constexprs), lse leaves in natural-log units through LN2
LOG2E = tl.constexpr(math.log2(math.e))
LN2 = tl.constexpr(math.log(2.0))


@triton.jit
def running_max(m, tile_max, l, acc):
    """(m, l, acc) moved to max(m, tile_max), the sum l and output acc rescaled with it, for a
    key tile whose rows' max scores are tile_max (log2 units, -inf for a row the tile masks
    whole). m must start finite, e.g. -1e30: a row that has seen nothing then gets alpha = 1 and
    p = exp2(-inf - m) = 0, never the NaN of -inf - -inf."""
    m_new = tl.maximum(m, tile_max)
    alpha = tl.exp2(m - m_new)
    return m_new, l * alpha, acc * alpha[:, None]


@triton.jit
def attend_tile(s, v, m, l, acc, qk_scale, PREC: tl.constexpr):
    """(m, l, acc) after a key tile with unscaled scores s [rows, keys] (-inf where masked) and
    values v [keys, Dv]: `running_max`, then the tile's exp2(s * qk_scale - m) into the sum and
    the output."""
    m, l, acc = running_max(m, tl.max(s, 1) * qk_scale, l, acc)
    p = tl.exp2(s * qk_scale - m[:, None])
    return m, l + tl.sum(p, 1), acc + tl.dot(p.to(v.dtype), v, input_precision=PREC)


@triton.jit
def finish(m, l, acc):
    """(o, lse) of rows whose softmax is done: o = acc / l, lse = m + log2(l) in natural-log
    units. A row that saw no key (l = 0) gets o = 0 and lse = -inf, the empty row's mark; a NaN
    row (a NaN input made l NaN) keeps o and lse NaN, so `l != 0`, not `l > 0`."""
    seen = l != 0
    l_safe = tl.where(seen, l, 1.0)
    lse = tl.where(seen, (m + tl.log2(l_safe)) * LN2, float("-inf"))
    return acc / l_safe[:, None], lse
