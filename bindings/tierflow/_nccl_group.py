"""tierflow's NCCL communicators beside torch.distributed: what they move,
how one is made for a group of its ranks, and how torch's streams are
ordered around its collectives (the ZeRO-3 engine's device collectives).

A :class:`DeviceCommunicator` takes the calls a GlooCommunicator takes, so
the engine issues both alike. Each collective is enqueued on the NCCL
communicator's own stream behind what torch's current stream has queued so
far (the copy of a shard into its slot, a gradient's production), and its
tensors are recorded on that stream, so torch's caching allocator does not
hand their memory out again before the collective has run.

Its :class:`DeviceWork`'s ``wait()`` is torch.distributed's NCCL Work's: torch's
current stream waits for the collective on the GPU and the host goes on, so
the kernels that read the result are queued while it still runs.
``host_wait()`` blocks the host until it has run, and raises NCCL's error
or the timeout's, naming the rank and the collective: what reads results
on the host (a gradient stepped on, a checkpoint) calls it first. A
collective only streams wait for still fails at its timeout: the
communicator's watchdog thread aborts NCCL then, which ends its kernels
(the waiting streams go on, behind a collective that did not complete),
and the next ``host_wait()`` or collective raises the error.
"""

from __future__ import annotations

import collections
import functools
from typing import Any

import torch

from tierflow import _gloo

__all__ = ["available", "moves", "connect", "host_wait", "DeviceCommunicator", "DeviceWork"]


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


def host_wait(work: Any) -> None:
    """Blocks until ``work`` has run: a :class:`DeviceWork`'s ``host_wait()``,
    any other Work's ``wait()`` (a host collective's, which blocks already)."""
    getattr(work, "host_wait", work.wait)()


class DeviceWork:
    """One collective of a :class:`DeviceCommunicator` (the module's docstring)."""

    __slots__ = ("_owner", "_work")

    def __init__(self, owner: "DeviceCommunicator", work: Any) -> None:
        self._owner, self._work = owner, work

    @property
    def done(self) -> bool:
        """Whether it has run on the GPU, or failed; never blocks."""
        return self._work.done

    def wait(self) -> None:
        """torch's current stream waits for the collective on the GPU; the
        host does not. Raises TierflowError where it has already failed."""
        owner = self._owner
        owner._comm.stream_wait(self._work, torch.cuda.current_stream(owner.device).cuda_stream)

    def host_wait(self) -> None:
        """Blocks until the collective has run on the GPU (the GIL released);
        raises TierflowError naming the rank, the collective and NCCL's words
        if it failed or passed the timeout."""
        self._work.wait()


class DeviceCommunicator:
    """An NCCL communicator (``tierflow._nccl.NcclCommunicator``) on this
    process's current CUDA device, its collectives ordered after torch's
    current stream; their :class:`DeviceWork` as the module's docstring says."""

    def __init__(self, comm: Any) -> None:
        self._comm = comm
        self.device = torch.device("cuda", comm.device)
        self.stream = torch.cuda.ExternalStream(comm.stream, device=self.device)
        # The collectives not yet seen done, oldest first (they finish in that
        # order): each holds its tensors until then, and a dropped NcclWork
        # would block the host until it is done.
        self._inflight: collections.deque[Any] = collections.deque()

    @property
    def rank(self) -> int:
        return self._comm.rank

    @property
    def size(self) -> int:
        return self._comm.size

    def _issue(self, op: Any, *tensors: torch.Tensor) -> DeviceWork:
        inflight = self._inflight
        while inflight and inflight[0].done:
            inflight.popleft()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for t in tensors:
            t.record_stream(self.stream)
        work = op()
        inflight.append(work)
        return DeviceWork(self, work)

    def all_gather(self, input: torch.Tensor, output: torch.Tensor, counts: list[int], *,
                   after: Any = None) -> DeviceWork:
        # ``after`` (a host read into a CPU slot) never fills device memory: waited for here.
        if after is not None:
            after.wait()
        return self._issue(lambda: self._comm.all_gather(input, output, counts), input, output)

    def all_gather_strided(self, input: torch.Tensor, output: torch.Tensor, stride: int, *,
                           after: Any = None) -> DeviceWork:
        if after is not None:
            after.wait()
        return self._issue(lambda: self._comm.all_gather_strided(input, output, stride), input, output)

    def reduce_scatter(self, input: torch.Tensor, output: torch.Tensor, counts: list[int],
                       op: str = "sum") -> DeviceWork:
        return self._issue(lambda: self._comm.reduce_scatter(input, output, counts, op), input, output)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> DeviceWork:
        return self._issue(lambda: self._comm.all_reduce(tensor, op), tensor)

    def broadcast(self, tensor: torch.Tensor, root: int) -> DeviceWork:
        return self._issue(lambda: self._comm.broadcast(tensor, root), tensor)

    def check(self) -> None:
        """Blocks until every collective issued so far has run on the GPU,
        raising the error of one that failed: they finish in issue order, and
        one that fails breaks the communicator, failing every later one (so
        the last one's host wait raises it too)."""
        if self._inflight:
            self._inflight[-1].wait()

    def close(self) -> None:
        """Waits for the collectives under way (the GIL released) and leaves the group."""
        self._comm.close()
        self._inflight.clear()


def connect(rank: int, size: int, store: Any, prefix: str, timeout: float) -> DeviceCommunicator:
    """A DeviceCommunicator for rank ``rank`` of ``size`` on the current CUDA
    device, meeting through ``store`` (torch.distributed's) under ``prefix``."""
    from tierflow import _nccl

    comm = _nccl.NcclCommunicator(rank, size, torch.cuda.current_device(), store=store, prefix=prefix,
                                  timeout=timeout)
    return DeviceCommunicator(comm)
