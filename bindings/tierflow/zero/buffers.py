"""The gather buffers of a multi-rank ZeRO-3 run in host memory, kept for the
next gathers of the same size.

Each gather of a sharded parameter fills a buffer of ``world_size`` shards
(:meth:`~tierflow.zero.partition.ParamStore.fetch`). In host memory a fresh
one for every gather costs more than the gather's own copies: the pages of a
new allocation are faulted in as the collective writes them. So a released
buffer goes back here, and the next gather of that size takes it.

Every buffer starts on a page boundary, so a shard whose size is whole pages
has its slot on one too: the store reads it from NVMe straight into the slot
(``Lease.copy_into``, O_DIRECT). The buffers kept unused are bounded by a
byte budget (the gather budget: the buffers in use and those kept never
exceed what the gathers may hold at once), the oldest given up first.

On a GPU the buffers are torch's caching allocator's, which already does
this; the store uses none of this there.
"""

from __future__ import annotations

import collections
import mmap

import torch

__all__ = ["GatherBuffers"]


def _sole_owner(buffer: torch.Tensor) -> bool:
    """Whether nothing but ``buffer`` refers to its memory (no view of it
    left: a tensor autograd saved, a parameter's ``.data``). The count
    includes the storage object made to ask."""
    return torch._C._storage_Use_Count(buffer.untyped_storage()._cdata) <= 2


class GatherBuffers:
    """Page-aligned flat host buffers by (elements, dtype), ``budget`` bytes
    of them kept unused at most."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._kept: collections.OrderedDict[int, tuple[tuple, torch.Tensor]] = collections.OrderedDict()
        self._kept_bytes = 0
        self.made = 0    # buffers allocated
        self.reused = 0  # gathers that took a kept one

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat buffer of ``numel`` elements of ``dtype``, its first byte on
        a page boundary; its values are unspecified."""
        key = (numel, dtype)
        for handle, (k, buffer) in self._kept.items():
            if k == key:
                del self._kept[handle]
                self._kept_bytes -= buffer.numel() * buffer.element_size()
                self.reused += 1
                return buffer
        self.made += 1
        # Anonymous pages of their own, so the storage itself starts on a
        # page boundary (a view into a larger allocation would have a
        # storage offset, which the saved-tensor hooks rebuild views from).
        return torch.frombuffer(mmap.mmap(-1, numel * dtype.itemsize), dtype=dtype, count=numel)

    def give(self, buffer: torch.Tensor) -> None:
        """Keeps ``buffer`` (from :meth:`take`) for a later gather of its size,
        unless something still refers to its memory or it is larger than the
        budget; older ones are given up to stay within it."""
        nbytes = buffer.numel() * buffer.element_size()
        if nbytes > self.budget or not _sole_owner(buffer):
            return
        while self._kept and self._kept_bytes + nbytes > self.budget:
            _, (_, old) = self._kept.popitem(last=False)
            self._kept_bytes -= old.numel() * old.element_size()
        self._kept[id(buffer)] = ((buffer.numel(), buffer.dtype), buffer)
        self._kept_bytes += nbytes

    def clear(self) -> None:
        """Gives up every buffer kept."""
        self._kept.clear()
        self._kept_bytes = 0
