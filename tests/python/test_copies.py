"""The host copies of a training step (tierflow.zero.copies over
_core.convert / _core.sum_of_squares): torch's values bit for bit, the
norm as torch's fp64 one, and bad arguments named."""

import math

import pytest
import torch

from tierflow import _core
from tierflow.zero.copies import copy_into, norm_sq

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def awkward_values(n: int) -> torch.Tensor:
    """Normal values across many magnitudes, with the edge cases of narrowing."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 20, (n,), generator=g).float())
    edge = torch.tensor([0.0, -0.0, 1.0, 1e-40, -1e-39, 65504.0, 65520.0, 3e38, 1.00390625, 1.00048828125])
    x[: edge.numel()] = edge[: min(n, edge.numel())]
    return x


@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("dst_dtype", DTYPES)
@pytest.mark.parametrize("scale", [1.0, 0.3712])
def test_convert_is_torch_bit_for_bit(src_dtype, dst_dtype, scale):
    ex = _core.Executor(2)
    src = awkward_values(3 * 16384 + 5).to(src_dtype)
    want = (src.float() * scale).to(dst_dtype)
    dst = torch.full_like(want, -7.0)
    assert _core.convert(ex, src, dst, scale) is None
    assert torch.equal(dst.view(torch.int16 if dst.element_size() == 2 else torch.int32),
                       want.view(torch.int16 if want.element_size() == 2 else torch.int32))


def test_the_fused_norm_is_that_of_what_was_written():
    ex = _core.Executor(3)
    src = torch.randn(100_003, dtype=torch.float32)
    dst = torch.empty(100_003, dtype=torch.bfloat16)
    sq = _core.convert(ex, src, dst, 0.5, sum_squares=True)
    assert sq == _core.sum_of_squares(ex, dst)
    torch_sq = float(torch.linalg.vector_norm(dst, dtype=torch.float64)) ** 2
    assert sq == pytest.approx(torch_sq, rel=1e-12)


def test_sum_of_squares_has_the_same_bits_on_any_thread_count():
    x = torch.randn(70_001) * 1e-3
    sums = {_core.sum_of_squares(_core.Executor(t), x) for t in (1, 2, 3)}
    assert len(sums) == 1
    x[12_345] = math.inf
    assert not math.isfinite(_core.sum_of_squares(_core.Executor(2), x))
    x[12_345] = math.nan
    assert math.isnan(_core.sum_of_squares(_core.Executor(2), x))


def test_bad_arguments_are_named():
    ex = _core.Executor(1)
    with pytest.raises(ValueError, match="dst: 3 elements where src has 4"):
        _core.convert(ex, torch.zeros(4), torch.zeros(3))
    buf = torch.zeros(8)
    with pytest.raises(ValueError, match="dst: overlaps src"):
        _core.convert(ex, buf[:4], buf[2:6])
    with pytest.raises(ValueError, match="src: float32, bfloat16 or float16 expected"):
        _core.convert(ex, torch.zeros(4, dtype=torch.int32), torch.zeros(4))
    with pytest.raises(ValueError, match="data: float32, bfloat16 or float16 expected"):
        _core.sum_of_squares(ex, torch.zeros(4, dtype=torch.float64))
    with pytest.raises(TypeError):  # not C-contiguous: refused, never copied
        _core.convert(ex, torch.zeros(4, 4).t(), torch.zeros(4, 4))
    # A buffer converted onto itself, one dtype, is allowed.
    x = torch.arange(6, dtype=torch.float32)
    _core.convert(ex, x, x, 2.0)
    assert x.tolist() == [0, 2, 4, 6, 8, 10]


def test_copy_into_gives_the_same_values_by_either_path():
    src = torch.randn(64, 48)
    kernel = torch.empty(64, 48, dtype=torch.bfloat16)
    sq = copy_into(kernel, src, 0.25, norm=True)
    # A strided source goes through torch; the values and the norm agree.
    strided = torch.empty(48, 64).t()
    strided.copy_(src)
    by_torch = torch.empty(64, 48, dtype=torch.bfloat16)
    sq_torch = copy_into(by_torch, strided, 0.25, norm=True)
    assert torch.equal(kernel, by_torch)
    assert sq == pytest.approx(sq_torch, rel=1e-12)
    assert norm_sq(kernel) == sq
    assert copy_into(kernel, src) == 0.0  # no norm asked, none made


def test_copy_into_scales_a_buffer_in_place_and_refuses_a_partial_overlap_to_the_kernel():
    x = torch.randn(40_000)
    want = x * 0.125
    copy_into(x, x, 0.125)
    assert torch.equal(x, want)
    # Overlapping but not the same elements: torch makes the copy, correctly.
    buf = torch.arange(10, dtype=torch.float32)
    copy_into(buf[2:6], buf[:4].clone())
    assert buf[2:6].tolist() == [0, 1, 2, 3]
