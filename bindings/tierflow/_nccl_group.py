"""tierflow's NCCL communicators beside torch.distributed: what they move,
how one is made for a group of its ranks, and how torch's streams are
ordered around its collectives (the ZeRO-3 engine's device collectives).

A :class:`DeviceCommunicator` takes the calls a GlooCommunicator takes, so
the engine issues both alike. Each collective is enqueued on the NCCL
communicator's own stream behind what torch's current stream has queued so
far (the copy of a shard into its slot, a gradient's production), and its
tensors are recorded on that stream, so torch's caching allocator does not
hand their memory out again before the collective has run. Its Work's
``wait()`` blocks until it has run on the GPU (and raises NCCL's error, or
the timeout's, naming the rank and the collective), after which torch's
streams may read the result.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from tierflow import _gloo

__all__ = ["available", "moves", "connect", "DeviceCommunicator"]


@functools.cache
def available() -> bool:
    """Whether tierflow was built with NCCL (``tierflow._nccl``) and a CUDA
    device is present to run it on (asked once: every collective asks)."""
    try:
        from tierflow import _nccl
    except ImportError:  # the wheel's libnccl.so.2 missing, say
        return False
    return bool(_nccl.available) and torch.cuda.is_available()


def moves(tensor: torch.Tensor) -> bool:
    """Whether an NCCL communicator moves ``tensor``: a contiguous CUDA
    tensor of a dtype tierflow's collectives take."""
    return tensor.device.type == "cuda" and tensor.dtype in _gloo.DTYPES and tensor.is_contiguous()


class DeviceCommunicator:
    """An NCCL communicator (``tierflow._nccl.NcclCommunicator``) on this
    process's current CUDA device, its collectives ordered after torch's
    current stream."""

    def __init__(self, comm: Any) -> None:
        self._comm = comm
        self.device = torch.device("cuda", comm.device)
        self.stream = torch.cuda.ExternalStream(comm.stream, device=self.device)

    @property
    def rank(self) -> int:
        return self._comm.rank

    @property
    def size(self) -> int:
        return self._comm.size

    def _issue(self, op: Any, *tensors: torch.Tensor) -> Any:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for t in tensors:
            t.record_stream(self.stream)
        return op()

    def all_gather(self, input: torch.Tensor, output: torch.Tensor, counts: list[int], *,
                   after: Any = None) -> Any:
        # ``after`` (a host read into a CPU slot) never fills device memory: waited for here.
        if after is not None:
            after.wait()
        return self._issue(lambda: self._comm.all_gather(input, output, counts), input, output)

    def all_gather_strided(self, input: torch.Tensor, output: torch.Tensor, stride: int, *,
                           after: Any = None) -> Any:
        if after is not None:
            after.wait()
        return self._issue(lambda: self._comm.all_gather_strided(input, output, stride), input, output)

    def reduce_scatter(self, input: torch.Tensor, output: torch.Tensor, counts: list[int], op: str = "sum") -> Any:
        return self._issue(lambda: self._comm.reduce_scatter(input, output, counts, op), input, output)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> Any:
        return self._issue(lambda: self._comm.all_reduce(tensor, op), tensor)

    def broadcast(self, tensor: torch.Tensor, root: int) -> Any:
        return self._issue(lambda: self._comm.broadcast(tensor, root), tensor)

    def close(self) -> None:
        self._comm.close()


def connect(rank: int, size: int, store: Any, prefix: str, timeout: float) -> DeviceCommunicator:
    """A DeviceCommunicator for rank ``rank`` of ``size`` on the current CUDA
    device, meeting through ``store`` (torch.distributed's) under ``prefix``."""
    from tierflow import _nccl

    comm = _nccl.NcclCommunicator(rank, size, torch.cuda.current_device(), store=store, prefix=prefix,
                                  timeout=timeout)
    return DeviceCommunicator(comm)
