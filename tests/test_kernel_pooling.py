"""kernels/pooling.py against reference.compress_mean (mean_pool: torch CUDA's summation order,
`_cuda_mean_order`) and reference.compress_mean_backward with the in-place add before it
(add_mean_pool_backward): the same roundings in the same order. Under the Triton interpreter
(which truncates float32 to bfloat16 where a GPU rounds to nearest: bfloat16 on the GPU only)
the backward is bitwise equal where 1 / l is exact (l a power of two); the CPU reference divides
where the kernel multiplies by 1 / l as torch's CUDA division does, so l = 48 agrees to an ulp
there and bitwise on the GPU."""
import pytest
import torch

from nsa_ops import reference
from nsa_ops.kernels import pooling
from nsa_ops.kernels.pooling import add_mean_pool_backward, mean_pool


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


def _cuda_mean_order(x: torch.Tensor, block_len: int, block_stride: int) -> torch.Tensor:
    """reference.compress_mean as torch's CUDA reduction orders its sums where it gives each
    output one thread (inputs into four accumulators by index mod 4, then ((a0 + a1) + a2) + a3,
    times outputs / inputs in the accumulator's dtype), on the CPU one torch op at a time."""
    acc = torch.promote_types(x.dtype, torch.float32)
    blocks = reference.gather_blocks(x, block_len, block_stride).to(acc)  # [B, N, H, l, D]
    parts = [blocks[..., j::4, :].unbind(-2) for j in range(4)]
    sums = []
    for tokens in parts:
        s = torch.zeros_like(blocks[..., 0, :])
        for t in tokens:
            s = s + t
        sums.append(s)
    total = ((sums[0] + sums[1]) + sums[2]) + sums[3]
    outputs = total.numel()
    factor = torch.tensor(outputs, dtype=acc) / torch.tensor(outputs * block_len, dtype=acc)
    return (total * factor).to(x.dtype)


def _assert_within_rounding(ours: torch.Tensor, x: torch.Tensor, block_len: int,
                            block_stride: int) -> None:
    """ours within the bound of l sums' float rounding and one output rounding of the float64
    mean (the output's subnormal spacing included)."""
    exact = reference.compress_mean(x.double(), block_len, block_stride)
    magnitude = reference.compress_mean(x.double().abs(), block_len, block_stride)
    acc, out = torch.finfo(torch.promote_types(x.dtype, torch.float32)), torch.finfo(x.dtype)
    bound = block_len * acc.eps * magnitude + out.eps * (exact.abs() + out.smallest_normal)
    assert ((ours.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("block_len,block_stride", [(32, 16), (64, 16), (16, 16), (48, 16),
                                                    (30, 10), (7, 3)])
@pytest.mark.parametrize("T", [1, 15, 100, 257])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64], ids=str)
def test_mean_pool_matches_reference(block_len, block_stride, T, dtype, device="cpu"):
    """On the CPU (whose sums run in another order): bitwise `_cuda_mean_order`, within rounding
    of the float64 mean. On CUDA: bitwise reference.compress_mean's torch ops where l < 64 (torch
    sums each output in one thread there; from l = 64 on this shape it splits the sum across
    warps: within rounding). Values spread over 2^-12..2^12, so that the order shows."""
    g = torch.Generator().manual_seed(T * block_len + block_stride)
    B, H, D = 2, 3, 8
    spread = torch.exp2(torch.randint(-12, 13, (B, T, H, D), generator=g).float())
    x = (torch.randn(B, T, H, D, generator=g) * spread).to(dtype).to(device)
    ours = mean_pool(x, block_len, block_stride)
    expected = reference.compress_mean(x, block_len, block_stride)
    assert ours.shape == expected.shape and ours.is_contiguous()
    if device == "cpu":
        assert torch.equal(ours, _cuda_mean_order(x, block_len, block_stride))
    elif block_len < 64:
        assert torch.equal(ours, expected)
    _assert_within_rounding(ours, x, block_len, block_stride)


@pytest.mark.gpu
@pytest.mark.parametrize("block_len,block_stride", [(32, 16), (48, 16), (64, 64), (30, 10)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64],
                         ids=str)
def test_gpu_mean_pool_matches_reference(block_len, block_stride, dtype):
    """On CUDA, against the reference's torch ops on CUDA."""
    for T in (257, 8192):
        test_mean_pool_matches_reference(block_len, block_stride, T, dtype, device="cuda")


def test_mean_pool_head_major_and_strided():
    """Head-major x and a token-strided view of a larger tensor: any strides."""
    g = torch.Generator().manual_seed(2)
    for x in (torch.randn(2, 3, 40, 8, generator=g).transpose(1, 2),
              torch.randn(3, 90, 2, 16, generator=g)[1:, 3:83:2]):
        assert torch.equal(mean_pool(x, 16, 8), _cuda_mean_order(x, 16, 8))


def test_mean_pool_column_tiles():
    """Rows wider than a program's columns (`_fwd_tiles`), the last tile part padding."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 70, 4, 48, generator=g, dtype=torch.float64)
    block_c, _ = pooling._fwd_tiles(4, 48, 64, x.element_size())
    assert 4 * 48 % block_c and 4 * 48 > block_c
    assert torch.equal(mean_pool(x, 64, 16), _cuda_mean_order(x, 64, 16))


def test_mean_pool_refuses_other_ranks():
    with pytest.raises(ValueError, match="x must be"):
        mean_pool(torch.zeros(32, 2, 8), 32, 16)
