"""kernels/pooling.py against reference.compress_mean_backward (and the in-place add before it):
the same roundings in the same order. Under the Triton interpreter (which truncates float32 to
bfloat16 where a GPU rounds to nearest: bfloat16 on the GPU only) bitwise equal where 1 / l is
exact (l a power of two); the CPU reference divides where the kernel multiplies by 1 / l as
torch's CUDA division does, so l = 48 agrees to an ulp there and bitwise on the GPU."""
import pytest
import torch

from nsa_ops import reference
from nsa_ops.kernels.pooling import add_mean_pool_backward


@pytest.mark.parametrize("block_len,block_stride", [(32, 16), (64, 16), (16, 16), (64, 64),
                                                    (48, 16)])
@pytest.mark.parametrize("T", [1, 15, 100, 257])
@pytest.mark.parametrize("dtype,grad_dtype", [(torch.float32, torch.float32),
                                              (torch.float16, torch.float32),
                                              (torch.float16, torch.float16),
                                              (torch.float64, torch.float64),
                                              (torch.float32, torch.float64)], ids=str)
@pytest.mark.parametrize("with_other", [False, True])
def test_add_mean_pool_backward_matches_reference(block_len, block_stride, T, dtype, grad_dtype,
                                                  with_other, device="cpu"):
    g = torch.Generator().manual_seed(T * block_len)
    B, H, D = 2, 3, 8
    rows = -(-T // block_stride) + 2  # the compressed rows past the tokens' are padding
    dx = torch.randn(B, T, H, D, generator=g).to(dtype)
    other = torch.randn(B, T, H, D, generator=g).to(dtype) if with_other else None
    grad = torch.randn(B, rows, H, D, generator=g).to(grad_dtype)
    dx, grad = dx.to(device), grad.to(device)
    other = other.to(device) if with_other else None
    expected = dx.clone()
    if with_other:
        expected += other
    reference.compress_mean_backward(grad, T, block_len, block_stride, out=expected)
    ours = add_mean_pool_backward(dx.clone(), grad, block_len, block_stride, other)
    if block_len & (block_len - 1) and device == "cpu":
        # an ulp of 1 / l per row, more where the sum cancels: the dtype's default tolerances
        torch.testing.assert_close(ours, expected)
    else:
        assert torch.equal(ours, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("block_len,block_stride", [(32, 16), (48, 16), (64, 64)])
@pytest.mark.parametrize("dtype,grad_dtype", [(torch.bfloat16, torch.bfloat16),
                                              (torch.bfloat16, torch.float32),
                                              (torch.float32, torch.float32),
                                              (torch.float64, torch.float64)], ids=str)
@pytest.mark.parametrize("with_other", [False, True])
def test_gpu_add_mean_pool_backward_matches_reference(block_len, block_stride, dtype, grad_dtype,
                                                      with_other):
    """On CUDA, against the reference's torch ops on CUDA: bitwise, bfloat16, float64 and l = 48
    too."""
    for T in (257, 8192):
        test_add_mean_pool_backward_matches_reference(block_len, block_stride, T, dtype,
                                                      grad_dtype, with_other, device="cuda")


def test_add_mean_pool_backward_strided_views():
    """dx and grad with batch and token strides of their own (views of larger tensors)."""
    g = torch.Generator().manual_seed(0)
    big = torch.randn(3, 40, 2, 16, generator=g)
    dx = big[1:, 5:37]  # [2, 32, 2, 16], token stride 32
    grad = torch.randn(2, 9, 2, 16, generator=g)[:, ::2][:, :3]  # 2 * 32 rows apart
    expected = dx.clone()
    reference.compress_mean_backward(grad, 32, 32, 16, out=expected)
    add_mean_pool_backward(dx, grad, 32, 16)
    assert torch.equal(dx, expected)


def test_add_mean_pool_backward_head_major():
    """Head-major dx, other and grad (H before T in memory): any strides."""
    g = torch.Generator().manual_seed(1)
    dx = torch.randn(2, 3, 40, 8, generator=g).transpose(1, 2)  # [2, 40, 3, 8]
    other = torch.randn(2, 8, 40, 3, generator=g).permute(0, 2, 3, 1)
    grad = torch.randn(2, 3, 8, 5, generator=g).permute(0, 3, 1, 2)  # [2, 5, 3, 8]
    expected = dx + other
    reference.compress_mean_backward(grad, 40, 16, 8, out=expected)
    add_mean_pool_backward(dx, grad, 16, 8, other)
    assert torch.equal(dx, expected)


@pytest.mark.parametrize("case", ["stride not dividing", "grad rows", "other's shape"])
def test_add_mean_pool_backward_refuses(case):
    dx = torch.zeros(1, 32, 2, 8)
    grad = torch.zeros(1, 2, 2, 8)
    with pytest.raises(ValueError, match={"stride not dividing": "block_stride",
                                          "grad rows": "grad", "other's shape": "other"}[case]):
        if case == "stride not dividing":
            add_mean_pool_backward(dx, grad, 32, 12)
        elif case == "grad rows":
            add_mean_pool_backward(dx, grad[:, :1], 32, 16)
        else:
            add_mean_pool_backward(dx, grad, 32, 16, dx[:, :16])
