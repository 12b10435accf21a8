"""The selection backward's inverse index (nsa_ops.kernels.index) against its torch oracle,
`reference.selection_index`: the four tensors must match bit for bit, since the dK dV kernel reads
them as they are (entry order, repeats, chunk bounds and order). CPU cases run under
TRITON_INTERPRET with torch.empty poisoned, so an entry the kernels leave unwritten shows."""

import pytest
import torch

from nsa_ops import reference as ref
from nsa_ops.kernels import index as index_kernels
from nsa_ops.kernels.index import selection_index


def _block_idx(B, T, H, n, num_blocks, seed):
    """Random rows over num_blocks blocks, with -1, repeats inside a row and blocks past the
    query (num_blocks above the causal limit): every entry kind the index sorts."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-1, num_blocks, (B, T, H, n), generator=gen, dtype=torch.int32)


def _compare(bidx, sel_block, Tk, cu_q=None, cu_k=None, chunk=3, token_major=True,
             with_slots=True):
    want = ref.selection_index(bidx, sel_block, Tk, cu_q, cu_k, chunk, token_major, with_slots)
    got = selection_index(bidx, sel_block, Tk, cu_q, cu_k, chunk, token_major, with_slots)
    for name, g, w in zip(("ent_tok", "ent_pos", "ent_slot", "chunks"), got, want):
        if w is None:
            assert g is None, name
            continue
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(g, w), f"{name}: {(g != w).sum().item()} of {w.numel()} differ"
    return want


@pytest.mark.parametrize("B,T,Tk,H,n,sel_block,chunk", [
    (1, 37, 37, 1, 4, 8, 1),
    (2, 70, 70, 3, 5, 16, 3),  # H * n = 15: a padded column tile
    (1, 40, 103, 2, 4, 8, 4),  # queries at an offset
    (2, 33, 33, 2, 16, 4, 64),
    (1, 6, 6, 64, 128, 1, 8),  # 8192 entries a token: one token a `_keys_kernel` program
])
@pytest.mark.parametrize("token_major,with_slots", [(True, True), (False, False), (True, False)])
def test_index_fixed_length(B, T, Tk, H, n, sel_block, chunk, token_major, with_slots,
                            poisoned_empty):
    bidx = _block_idx(B, T, H, n, -(-Tk // sel_block) + 2, seed=T + n)
    want = _compare(bidx, sel_block, Tk, chunk=chunk, token_major=token_major,
                    with_slots=with_slots)
    assert (want[3][:, 1] > want[3][:, 0]).any()  # the inputs give chunks


def test_index_wide_chunk_ranks(monkeypatch, poisoned_empty):
    """Sort keys and chunk ranks past int32 sort as int64 (forced here by lowering the bound)."""
    monkeypatch.setattr(index_kernels, "_SORT32_MAX", 30)
    bidx = _block_idx(2, 70, 3, 5, -(-70 // 16) + 2, seed=5)
    _compare(bidx, 16, 70, chunk=3, token_major=True, with_slots=True)


@pytest.mark.parametrize("lengths_q,lengths_k", [
    ([13, 0, 40, 7], None),  # an empty sequence
    ([5, 20, 1], [30, 20, 9]),  # each sequence's queries at the end of longer keys
    ([3, 9, 0, 0, 14, 1, 6, 0, 11], [3, 17, 0, 5, 14, 8, 6, 0, 30]),  # a deeper search
])
@pytest.mark.parametrize("token_major", [True, False])
def test_index_packed(lengths_q, lengths_k, token_major, poisoned_empty):
    cu_q = torch.tensor([0] + lengths_q).cumsum(0).to(torch.int32)
    cu_k = None if lengths_k is None else torch.tensor([0] + lengths_k).cumsum(0).to(torch.int32)
    Tk = int((cu_q if cu_k is None else cu_k)[-1])
    bidx = _block_idx(1, int(cu_q[-1]), 2, 6, 6, seed=len(lengths_q))
    _compare(bidx, 8, Tk, cu_q, cu_k, chunk=2, token_major=token_major)


def test_index_window_of_rows(poisoned_empty):
    """A window of query rows of a batch of two (the stored-dS backward's windows): a view whose
    batch stride is the whole block_idx's."""
    bidx = _block_idx(2, 50, 2, 4, 8, seed=5)
    rows = slice(20, 35)
    _compare(bidx[:, rows], 8, 35, chunk=2)


def test_index_no_queries():
    """No query rows (a window of none over 16 keys): no entries, one empty chunk."""
    bidx = torch.zeros(1, 0, 2, 4, dtype=torch.int32)
    _compare(bidx, 8, 16)


def test_index_refuses_other_layouts():
    bidx = _block_idx(1, 10, 2, 4, 2, seed=0)
    with pytest.raises(ValueError, match="block_idx"):
        selection_index(bidx.to(torch.int64), 8, 10, None, None, 2, True, True)
    with pytest.raises(ValueError, match="block_idx"):
        selection_index(bidx.transpose(2, 3).contiguous().transpose(2, 3), 8, 10, None, None,
                        2, True, True)


@pytest.mark.gpu
@pytest.mark.parametrize("T,packed", [(8192, False), (16384, True)])
def test_index_gpu(T, packed):
    """Spec geometry (4 KV heads, 16 blocks of 64 a row) on the GPU, bit for bit."""
    H, n, sel_block = 4, 16, 64
    bidx = _block_idx(1, T, H, n, T // sel_block + 1, seed=T).cuda()
    cu_q = torch.tensor([0, 1000, 1000, 9000, T], dtype=torch.int32, device="cuda") \
        if packed else None
    for token_major in (True, False):
        _compare(bidx, sel_block, T, cu_q, chunk=128, token_major=token_major)
