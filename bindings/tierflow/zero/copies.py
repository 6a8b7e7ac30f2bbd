"""The host copies a training step makes, in tierflow's kernels.

Each gradient goes from the backward into its fp32 block (and, with clipping
on, its squared norm is taken), and at each step it goes into ZenFlow's
masters, scaled, and every master back into its compute block, rounded to
bf16/fp16. On the CPU torch makes those copies one thread at a time and
narrows fp32 without SIMD, and takes an fp64 norm by converting every element
first; here each is one pass over both buffers, spread over the threads the
model's compute uses (idle while a hook or a step runs), the norm fused into
the copy that writes the gradient. Tensors elsewhere (a CUDA gradient, a
strided view) are copied by torch.
"""

from __future__ import annotations

import threading

import torch

from tierflow import _core, _lifetime

__all__ = ["copy_into", "norm_sq"]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_lock = threading.Lock()
_executor: _core.Executor | None = None


class _SharedExecutor:
    """Lets go of the shared executor at interpreter exit (tierflow._lifetime)."""

    def _release_native(self) -> None:
        global _executor
        with _lock:
            _executor = None


_releaser = _SharedExecutor()
_lifetime.track(_releaser)


def _shared_executor() -> _core.Executor:
    """One executor for the process, with torch's intra-op thread count when
    first used."""
    global _executor
    with _lock:
        if _executor is None:
            _executor = _core.Executor(max(1, torch.get_num_threads()))
        return _executor


def _kernel_can_take(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype in _KERNEL_DTYPES and t.is_contiguous()


def _apart_or_same(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether the kernel may take the pair: different storages, or one
    buffer converted onto itself (the same elements, of one dtype)."""
    if dst.untyped_storage().data_ptr() != src.untyped_storage().data_ptr():
        return True
    return dst.data_ptr() == src.data_ptr() and dst.dtype == src.dtype


def copy_into(dst: torch.Tensor, src: torch.Tensor, scale: float = 1.0, *, norm: bool = False) -> float:
    """``dst`` ← ``src`` × ``scale``, converted to ``dst``'s dtype (rounded to
    nearest even, as torch rounds). With ``norm``, returns the squared L2
    norm of what was written (fp64; inf or nan when an element is not
    finite), else 0.0. ``dst`` and ``src`` have one number of elements;
    ``dst`` may be ``src`` itself (scaled in place)."""
    if _kernel_can_take(dst) and _kernel_can_take(src) and dst.numel() == src.numel() and _apart_or_same(dst, src):
        sq = _core.convert(_shared_executor(), src.detach(), dst.detach(), scale, sum_squares=norm)
        return float(sq) if norm else 0.0
    with torch.no_grad():
        dst.copy_(src.reshape(dst.shape))
        if scale != 1.0:
            dst.mul_(scale)
    return norm_sq(dst) if norm else 0.0


def norm_sq(t: torch.Tensor) -> float:
    """``t``'s squared L2 norm, each square and the sum in fp64 (inf or nan
    when an element is not finite); on the CPU the same bits whatever the
    thread count."""
    if _kernel_can_take(t):
        return float(_core.sum_of_squares(_shared_executor(), t.detach()))
    return float(torch.linalg.vector_norm(t.detach(), dtype=torch.float64)) ** 2
