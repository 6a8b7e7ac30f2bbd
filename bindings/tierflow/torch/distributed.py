"""tierflow's communicators beneath ``torch.distributed`` and FSDP2.

Importing this module registers the ``torch.distributed`` backend
``"tierflow"``, whose collectives run on tierflow's communicators: Gloo for
host memory (float32, bfloat16 and float16 tensors on the CPU) and, where
tierflow was built with NCCL and a GPU is present, NCCL for CUDA tensors of
those dtypes (``tierflow._nccl``: one GPU a rank, the current device; each
collective runs after torch's current stream, and its wait, as with torch's
NCCL backend, makes torch's current stream wait for it and lets the host go
on)::

    import tierflow.torch.distributed  # registers the backend
    torch.distributed.init_process_group("tierflow")        # CPU tensors (and CUDA ones on NCCL)
    torch.distributed.init_process_group("cpu:tierflow,cuda:nccl")

Everything built on ``torch.distributed`` then runs on it — FSDP2's
all-gathers and reduce-scatters, DTensor's redistributions, DDP's gradient
all-reduces — each asynchronous where the caller asks (``async_op=True``),
completing in issue order, failing with the communicator's error (naming the
rank and the collective) when a peer dies or ``timeout`` passes, after which
every later collective of that group fails too. Collectives the
communicator has no counterpart for (integers, ``alltoall``, point-to-point,
``PREMUL_SUM``) raise ``NotImplementedError`` naming them; give such tensors
another backend in the device map, or another group.

:class:`AllGather` and :class:`ReduceScatter` serve one FSDP2 module instead,
beside whatever its process group is, through FSDP2's
``set_custom_all_gather`` / ``set_custom_reduce_scatter``::

    model.set_custom_all_gather(tierflow.torch.distributed.AllGather())
    model.set_custom_reduce_scatter(tierflow.torch.distributed.ReduceScatter())
"""

from __future__ import annotations

import contextlib
import datetime
import threading
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from tierflow import _gloo, _nccl_group

__all__ = ["BACKEND", "ProcessGroupTierflow", "AllGather", "ReduceScatter"]

#: The backend's name for ``torch.distributed.init_process_group``.
BACKEND = "tierflow"

_OPS = {dist.ReduceOp.RedOpType.SUM: "sum", dist.ReduceOp.RedOpType.AVG: "sum",
        dist.ReduceOp.RedOpType.MAX: "max", dist.ReduceOp.RedOpType.MIN: "min"}


def _op(op: Any, collective: str) -> tuple[str, bool]:
    """The communicator's reduction for torch's ``op``, and whether the
    result is divided by the group's size after it (AVG)."""
    kind = getattr(op, "op", op)
    if kind not in _OPS:
        raise NotImplementedError(f"tierflow backend: {collective} with {kind} (it reduces with SUM, AVG, MAX or MIN)")
    return _OPS[kind], kind == dist.ReduceOp.RedOpType.AVG


def _on_device(tensors: Sequence[torch.Tensor], collective: str, hint: str = "") -> bool:
    """Whether ``collective`` (its words in an error: "tierflow backend:
    all_reduce") over ``tensors`` runs on tierflow's NCCL (CUDA tensors,
    tierflow built with NCCL) rather than its Gloo (CPU tensors); raises
    NotImplementedError for any other tensors, ending with ``hint``."""
    if all(_gloo.moves(t) for t in tensors):
        return False
    if _nccl_group.available() and all(_nccl_group.moves(t) for t in tensors):
        return True
    t = next(t for t in tensors if not _gloo.moves(t))
    device = " and contiguous CUDA ones (on NCCL)" if _nccl_group.available() else ""
    raise NotImplementedError(f"{collective} of a {t.dtype} tensor on {t.device} (it moves float32, "
                              f"bfloat16 and float16 CPU tensors{device}, all of one kind{hint})")


#: What the backend's refusals end with.
_BACKEND_HINT = "; give this device another backend, e.g. \"cpu:tierflow,cuda:nccl\""


class _Work(dist.Work):
    """The completion of collectives on the communicator (their Works, in
    issue order), then ``then()`` — copies out, a division — once they are
    done. ``result()`` is the tensors torch's API returns.

    As torch's NCCL Work: ``wait()`` of CUDA collectives makes torch's
    current stream wait for them (``then()``'s kernels queued behind them)
    and lets the host go on; ``is_completed()`` says whether they have run
    on the GPU; the future of :meth:`get_future` completes once they have,
    ``then()``'s copies included."""

    def __init__(self, works: list, then: Callable[[], None] | None = None,
                 result: list[torch.Tensor] | None = None) -> None:
        super().__init__()
        self._works, self._then, self._result = works, then, result or []
        self._issued = list(works)  # kept for is_completed() and host_wait()
        self._lock = threading.Lock()
        self._done = not works
        self._error: BaseException | None = None
        if self._done and then is not None:
            then()

    def _finish(self) -> None:
        with self._lock:
            if self._done:
                if self._error is not None:
                    raise self._error
                return
            try:
                for work in self._works:
                    work.wait()
                if self._then is not None:
                    self._then()
            except BaseException as e:  # noqa: BLE001 - kept for every later wait, then raised
                self._error = e
                raise
            finally:
                self._done = True
                self._works = []

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:  # noqa: B008 - torch's signature
        self._finish()
        return True

    def host_wait(self) -> None:
        """:meth:`wait`, then the host blocks until every collective has run
        (raising a CUDA collective's error, seen only now)."""
        self._finish()
        for work in self._issued:
            _nccl_group.host_wait(work)

    def is_completed(self) -> bool:
        return all(work.done for work in self._issued)

    @property
    def done(self) -> bool:
        return self.is_completed()

    def is_success(self) -> bool:
        if not self.is_completed():
            raise RuntimeError("tierflow backend: is_success() of a collective not yet completed")
        try:
            self._finish()
        except BaseException:  # noqa: BLE001
            return False
        return True

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> list[torch.Tensor]:
        self._finish()
        return self._result

    def get_future(self) -> torch.futures.Future:
        """A future completed with :meth:`result` (or its error) once the
        collectives are done, by a thread that waits for them."""
        future: torch.futures.Future = torch.futures.Future()
        # The caller's stream, where then()'s copies run (as under wait()),
        # waited for before the future completes.
        cuda = next((t.device for t in self._result if t.is_cuda), None)
        stream = torch.cuda.current_stream(cuda) if cuda is not None else None

        def complete() -> None:
            try:
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    self.host_wait()
                if stream is not None:
                    stream.synchronize()
            except BaseException as e:  # noqa: BLE001 - handed to the future
                future.set_exception(e)
            else:
                future.set_result(self._result)

        threading.Thread(target=complete, name="tierflow-work", daemon=True).start()
        return future


class ProcessGroupTierflow(dist.ProcessGroup):
    """The ``"tierflow"`` backend's group: its ranks' collectives on one
    :class:`~tierflow.GlooCommunicator` for CPU tensors and, where tierflow
    was built with NCCL, one NCCL communicator for CUDA tensors (made at the
    group's first CUDA collective, on the current device); both meet
    through the group's store (torch.distributed's, prefixed for the group)."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
        self.comm = _gloo.connect(rank, size, store, BACKEND, seconds)
        self._store, self._seconds = store, seconds
        self.device_comm: Any = None

    def _comm(self, tensors: Sequence[torch.Tensor], collective: str) -> Any:
        """The communicator that moves ``tensors`` (raises for what neither does)."""
        if not _on_device(tensors, f"tierflow backend: {collective}", _BACKEND_HINT):
            return self.comm
        if self.device_comm is None:
            self.device_comm = _nccl_group.connect(self.rank(), self.size(), self._store, BACKEND + "-nccl",
                                                   self._seconds)
        return self.device_comm

    # The names torch.distributed gives the group (its pybind trampoline
    # asks these of a Python group).
    _name = ""
    _desc = ""

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    def _set_group_name(self, name: str) -> None:
        self._name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._name

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._desc


    # ---- the collectives torch's API lowers to ------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        comm = self._comm(tensors, "all_reduce")
        op, average = _op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, "all_reduce")
        flat = [t if t.is_contiguous() else t.contiguous() for t in tensors]
        works = [comm.all_reduce(f.view(-1), op=op) for f in flat]

        def then() -> None:
            for t, f in zip(tensors, flat):
                if average:
                    f.div_(self.size())
                if f is not t:
                    t.copy_(f)
        return _Work(works, then, tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return self.allreduce(tensors, opts)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        return _all_gather(self._comm((output, input), "all_gather_into_tensor"), output, input, self.size())

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        return self._allgather_base(output, input, opts)

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> dist.Work:
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                  opts: Any = None) -> dist.Work:
        works, copies = [], []
        for outputs, input in zip(output_lists, inputs):
            comm = self._comm([input, *outputs], "all_gather")
            if len({o.numel() for o in outputs} | {input.numel()}) != 1:
                raise ValueError("tierflow backend: all_gather of tensors of unequal sizes")
            full = torch.empty(input.numel() * self.size(), dtype=input.dtype, device=input.device)
            works.append(comm.all_gather(input.contiguous().view(-1), full, [input.numel()] * self.size()))
            copies.append((full, outputs))

        def then() -> None:
            for full, outputs in copies:
                for o, piece in zip(outputs, full.chunk(self.size())):
                    o.copy_(piece.view(o.shape))
        return _Work(works, then, [o for outputs in output_lists for o in outputs])

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> dist.Work:
        works = [self._allgather_base(o, i, opts) for o, i in zip(outputs, inputs)]
        return _Work(works, None, outputs)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        comm = self._comm((output, input), "reduce_scatter_tensor")
        return _reduce_scatter(comm, output, input, opts.reduceOp if opts is not None else dist.ReduceOp.SUM,
                               self.size())

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        return self._reduce_scatter_base(output, input, opts)

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> dist.Work:
        return self.reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
                       opts: Any = None) -> dist.Work:
        works = []
        for output, inputs in zip(outputs, input_lists):
            whole = torch.cat([t.reshape(-1) for t in inputs])
            works.append(self._reduce_scatter_base(output, whole, opts))
        return _Work(works, None, outputs)

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> dist.Work:
        works = [self._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs)]
        return _Work(works, None, outputs)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        comm = self._comm(tensors, "broadcast")
        root = opts.rootRank if opts is not None else 0
        flat = [t if t.is_contiguous() else t.contiguous() for t in tensors]
        works = [comm.broadcast(f.view(-1), root) for f in flat]

        def then() -> None:
            for t, f in zip(tensors, flat):
                if f is not t:
                    t.copy_(f)
        return _Work(works, then, tensors)

    def barrier(self, opts: Any = None) -> dist.Work:
        return _Work([self.comm.all_reduce(torch.zeros(1), op="sum")])

    def shutdown(self) -> None:
        """Leaves the communicators (destroy_process_group calls it); a
        collective after it raises."""
        for name in ("comm", "device_comm"):
            comm = getattr(self, name)
            setattr(self, name, None)
            if comm is not None:
                comm.close()


def _all_gather(comm: Any, output: torch.Tensor, input: torch.Tensor, size: int) -> _Work:
    """``output`` (``size`` × ``input``'s elements, contiguous) becomes every
    rank's ``input`` in rank order; in place when ``input`` is this rank's
    slot of it."""
    if output.numel() != input.numel() * size:
        raise ValueError(f"tierflow backend: all_gather_into_tensor into {output.numel()} elements of "
                         f"{size} × {input.numel()}")
    out = output if output.is_contiguous() else torch.empty_like(output, memory_format=torch.contiguous_format)
    work = comm.all_gather(input.contiguous().view(-1), out.view(-1), [input.numel()] * size)
    return _Work([work], None if out is output else (lambda: output.copy_(out)), [output])


def _reduce_scatter(comm: Any, output: torch.Tensor, input: torch.Tensor, op: Any,
                    size: int) -> _Work:
    """``output`` becomes this rank's slice of the reduction of every rank's
    ``input`` (``size`` × ``output``'s elements)."""
    if input.numel() != output.numel() * size:
        raise ValueError(f"tierflow backend: reduce_scatter_tensor of {input.numel()} elements into "
                         f"{size} × {output.numel()}")
    name, average = _op(op, "reduce_scatter_tensor")
    out = output if output.is_contiguous() else torch.empty_like(output, memory_format=torch.contiguous_format)
    src = input.contiguous()  # kept by the Work until it is done
    work = comm.reduce_scatter(src.view(-1), out.view(-1), [output.numel()] * size, op=name)

    def then() -> None:
        if average:
            out.div_(size)
        if out is not output:
            output.copy_(out)
    return _Work([work], then, [output])


def _create(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> ProcessGroupTierflow:
    return ProcessGroupTierflow(store, rank, size, timeout)


def _register() -> None:
    if BACKEND.upper() not in dist.Backend._plugins:
        devices = ["cpu", "cuda"] if _nccl_group.available() else ["cpu"]
        dist.Backend.register_backend(BACKEND, _create, devices=devices)


_register()


# ---- FSDP2's custom collectives ------------------------------------------------------------------

_communicators: dict[tuple[str, bool], Any] = {}
_communicators_lock = threading.Lock()


def _communicator_of(group: dist.ProcessGroup, timeout: float, device: bool = False) -> Any:
    """The communicator of ``group`` for host memory (Gloo: its own under the
    ``"tierflow"`` backend) or, with ``device``, for CUDA memory (NCCL, on
    the current device); else one made for it at its first use, meeting
    through the default group's store under the group's name."""
    if isinstance(group, ProcessGroupTierflow) and not device:
        return group.comm
    name = group.group_name
    with _communicators_lock:
        comm = _communicators.get((name, device))
        if comm is None:
            store = dist.distributed_c10d._get_default_store()
            if device:
                comm = _nccl_group.connect(group.rank(), group.size(), store, f"tierflow-fsdp-nccl/{name}", timeout)
            else:
                comm = _gloo.connect(group.rank(), group.size(), store, f"tierflow-fsdp/{name}", timeout)
            _communicators[(name, device)] = comm
        return comm


try:
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as _AllGatherBase
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatterBase
except ImportError:  # a torch without FSDP2's custom collectives
    _AllGatherBase = _ReduceScatterBase = object  # type: ignore[assignment,misc]


class AllGather(_AllGatherBase):  # type: ignore[misc,valid-type]
    """FSDP2's all-gather (``FSDPModule.set_custom_all_gather``) on tierflow's
    communicators for the module's group, whatever backend the group has:
    Gloo for CPU shards (FSDP2 with ``CPUOffloadPolicy``, or a CPU mesh),
    NCCL for CUDA ones where tierflow was built with it (after FSDP2's
    all-gather stream's work; the wait returns once it has run on the GPU).
    ``timeout``: seconds a collective may take before it fails."""

    def __init__(self, timeout: float = 600.0) -> None:
        self.timeout = float(timeout)

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        device = _on_device((output_tensor, input_tensor), "tierflow: FSDP2's all-gather")
        work = _all_gather(_communicator_of(group, self.timeout, device), output_tensor, input_tensor, group.size())
        if async_op:
            return work
        work.wait()
        return None


class ReduceScatter(_ReduceScatterBase):  # type: ignore[misc,valid-type]
    """FSDP2's reduce-scatter (``FSDPModule.set_custom_reduce_scatter``) on
    tierflow's communicators for the module's group; see :class:`AllGather`."""

    def __init__(self, timeout: float = 600.0) -> None:
        self.timeout = float(timeout)

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any = dist.ReduceOp.SUM, async_op: bool = False) -> dist.Work | None:
        device = _on_device((output_tensor, input_tensor), "tierflow: FSDP2's reduce-scatter")
        work = _reduce_scatter(_communicator_of(group, self.timeout, device), output_tensor, input_tensor, op,
                               group.size())
        if async_op:
            return work
        work.wait()
        return None
