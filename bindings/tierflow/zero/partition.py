"""The parameters of a ZeRO-3 run, kept in tierflow's block store.

Each parameter's compute copy is one block, homed in host memory or on NVMe;
its fp32 gradient is another. Between uses the parameter's ``.data`` is a
placeholder that holds nothing (``numel()`` 0, as DeepSpeed's; the real shape
is ``ds_shape``, the element count ``ds_numel``), and the parameter is a
:class:`StoredParameter`, which refuses any computation with its values while
they are away, naming the parameter and the way to gather it: a use the hooks
missed fails loudly instead of computing with wrong values. :meth:`fetch`
leases the block into the device tier and points ``.data`` at the lease's
memory — a torch tensor over the tier's bytes, no copy — and :meth:`release`
ends the lease and puts the placeholder back (on a GPU, once the kernels
queued on the compute stream that read it have finished).

During a training iteration (the micro-batches up to an optimizer step) every
lease goes through the core's prefetch scheduler, so the order of the first
iteration is recorded and the next ones load each block ahead of its use
within the tiers' budgets; an iteration that departs from the recorded order
is served on demand and re-recorded, never an error. Outside one (eval, a
forward under ``no_grad``, a checkpoint) leases go to the store directly.

With several data-parallel ranks (comm.py) each rank's blocks hold its
shard of every parameter and gradient. A parameter is gathered in one
pipeline: its shard is leased in host memory (read from NVMe ahead of use by
the scheduler, as any block), copied straight into this rank's slot of the
gather buffer on the device (on a copy stream of its own on a GPU), the lease
ended, and the buffer all-gathered in place, asynchronously; a shard larger
than ``tierflow.gather_chunk`` (:attr:`Plan.gather_chunk_bytes`) a chunk at a
time, each chunk's gather behind its own read or copy. During an
iteration the store gathers ahead: as one parameter is fetched, the gathers
of those the last iteration fetched after it (ahead.py) are issued too, in
that order, while the parameters on their way hold less than DeepSpeed's
``stage3_prefetch_bucket_size`` (:attr:`Plan.gather_ahead_bytes`; 0: none
ahead) and within the budget, so each gather runs while the layers before it
compute, and each read from NVMe runs ahead of its gather. A gradient is
reduce-scattered to the rank's shard of the mean, also asynchronously (the
add into its block waits for it), before it is accumulated; and the
optimizer steps each rank's shards (a flat parameter per partition,
:attr:`Partition.step_param`). The gathered buffers, those in use
and those on their way, are bounded by the device budget (less a page for
the device tier, which holds nothing then), so a rank's device never holds
more than ``tierflow.device_memory``. Whole-parameter reads (a checkpoint,
``state_dict``) gather too: every rank makes them, in the same order.

The hooks that decide *when* to fetch and release live in hooks.py; this
module owns the store and the bookkeeping, and is the only one that touches
leases.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import math
import os
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from tierflow import _core, _lifetime
from tierflow.errors import TierflowError
from tierflow.zero.ahead import FetchOrder
from tierflow.zero.buffers import GatherBuffers
from tierflow.zero.comm import Chunks, Group, Pending
from tierflow.zero.copies import copy_into, norm_sq
from tierflow.zero.plan import PAGE, Plan, format_bytes, pages
from tierflow.zero.sharing import ranks_sharing, share_of

__all__ = ["ParamStore", "Partition", "StoredParameter", "NotGatheredError"]


class NotGatheredError(RuntimeError):
    """A computation read a parameter whose values are in tierflow's store,
    not in the parameter (outside its module's forward, a
    :class:`~tierflow.zero.GatheredParameters` block or ``zero.Init``)."""


# What may be asked of a parameter whose values are away: its metadata, its
# hooks and the detach state_dict() makes (its hook puts the values in).
# Anything else computes with the values, and is refused.
_METADATA_METHODS = frozenset((
    "size", "dim", "ndimension", "numel", "nelement", "element_size", "is_floating_point", "is_complex",
    "detach", "requires_grad_", "register_hook", "register_post_accumulate_grad_hook", "__repr__",
    "__format__", "__hash__", "untyped_storage", "storage_offset", "stride", "data_ptr", "is_contiguous",
    "get_device", "type", "_is_view", "__torch_function__", "share_memory_", "is_shared", "is_pinned",
))


def _values_needed(func: object) -> bool:
    """Whether calling ``func`` on a tensor reads or writes its values."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):  # a property: metadata, .data, .grad
        return False
    return name not in _METADATA_METHODS


class StoredParameter(torch.nn.Parameter):
    """A parameter whose values live in tierflow's store (the class a plain
    ``nn.Parameter`` takes when the store adopts it). While its values are
    away, a computation with it raises :class:`NotGatheredError` naming it;
    its shape is ``ds_shape``. Results of operations on it are plain tensors,
    as they are for ``nn.Parameter``."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if _values_needed(func):
            for a in tensors_in(args, kwargs):
                if type(a) is StoredParameter:
                    ref = a.__dict__.get("_tierflow_part")
                    part = ref() if ref is not None else None
                    if part is None:
                        raise NotGatheredError(
                            f"parameter {a.__dict__.get('ds_name', '')!r}: its values went with the tierflow store "
                            "that was closed (the engine's close()); read the model before closing it")
                    if not part.available and part.numel:
                        raise NotGatheredError(
                            f"parameter '{part.name}' ({list(part.shape)}) is not gathered: tierflow keeps its "
                            f"values in the store outside its module's forward. Read or write it inside "
                            f"`with tierflow.zero.GatheredParameters(param)`, or, if a module's forward uses it "
                            f"without owning it, call `tierflow.zero.register_external_parameter(module, param)`")
        return torch._C._disabled_torch_function_impl(func, types, args, kwargs or {})


def tensors_in(args: tuple, kwargs: dict | None) -> Iterator[torch.Tensor]:
    """The tensors among a torch call's arguments, and in its lists and
    tuples (where torch functions take tensors): a plain loop, since every
    call with a stored parameter, and every call of a forward, asks."""
    for group in (args, (kwargs or {}).values()):
        for a in group:
            if isinstance(a, torch.Tensor):
                yield a
            elif isinstance(a, (list, tuple)):
                for b in a:
                    if isinstance(b, torch.Tensor):
                        yield b


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread right now."""
    return torch._C._current_graph_task_id() != -1


def data_of(param: torch.Tensor) -> torch.Tensor:
    """``param.data``, past every torch function mode."""
    with torch._C.DisableTorchFunction():
        return param.data


def set_data(param: torch.Tensor, value: torch.Tensor) -> None:
    """``param.data = value``, past every torch function mode and
    :class:`StoredParameter`'s check (the store's own moves)."""
    with torch._C.DisableTorchFunction():
        param.data = value


class Partition:
    """One parameter in the store: its blocks, its shape and where it is now."""

    __slots__ = ("param", "name", "index", "shape", "dtype", "numel", "nbytes", "block", "grad_block",
                 "persistent", "lease", "gathered", "grad_empty", "placeholder", "requires_grad",
                 "shard_numel", "sharded", "step_param", "step_placeholder", "standin", "held", "__weakref__")

    def __init__(self, param: torch.nn.Parameter, name: str, index: int, persistent: bool,
                 shard_numel: int | None = None) -> None:
        self.param = param
        self.name = name
        self.index = index
        self.shape = tuple(param.shape)
        self.dtype = param.dtype
        self.numel = param.numel()
        self.nbytes = self.numel * param.element_size()
        self.persistent = persistent
        self.requires_grad = param.requires_grad
        self.block = -1
        self.grad_block = -1
        self.lease: Any = None      # the device lease while resident (one rank)
        self.gathered: torch.Tensor | None = None  # the full values while resident (several ranks)
        self.grad_empty = True      # no gradient accumulated since the last step
        self.held = 0               # host views given as .data now (GatheredParameters, zero.Init's writes)
        self.placeholder = _placeholder(param)
        # Elements of this rank's blocks: the whole parameter with one rank;
        # with several, its shard (flat).
        self.sharded = shard_numel is not None
        self.shard_numel = shard_numel if self.sharded else self.numel
        # What the optimizer steps: a parameter of its own over the host copy
        # (of the shard's shape), never the model's, which autograd and the
        # hooks touch meanwhile when the step overlaps the backward.
        one = torch.zeros(1, dtype=param.dtype, device=param.device)
        # The parameter's shape over one element (ParamStore._away).
        self.standin = one.expand(param.shape) if param.dim() else one.reshape(())
        self.step_placeholder = one.expand(shard_numel) if self.sharded else self.standin
        self.step_param = torch.nn.Parameter(self.step_placeholder, requires_grad=param.requires_grad)

    @property
    def shard_bytes(self) -> int:
        return self.shard_numel * (self.nbytes // max(1, self.numel)) if self.sharded else self.nbytes

    @property
    def resident(self) -> bool:
        """Whether its values are on the device as ``.data``."""
        return self.lease is not None or self.gathered is not None

    @property
    def available(self) -> bool:
        """Whether ``.data`` holds its values now (on the device, or a host view)."""
        return self.lease is not None or self.gathered is not None or self.held > 0

    def __repr__(self) -> str:
        return f"Partition({self.name!r}, {list(self.shape)}, {self.dtype}, resident={self.resident})"


def _norm_sq(t: torch.Tensor) -> tuple[float, bool]:
    """``t``'s squared L2 norm (accumulated in fp64) and whether it is finite."""
    sq = norm_sq(t)
    return sq, math.isfinite(sq)


def _no_room(error: BaseException) -> bool:
    """Whether ``error`` is the single-holder store's refusal of a wait that
    only the release of a lease held here could end (EDEADLK)."""
    return isinstance(error, TierflowError) and error.errno == errno.EDEADLK


def _placeholder(param: torch.Tensor) -> torch.Tensor:
    """What ``.data`` is while the parameter lives in the store: an empty
    tensor of its dtype (a storage of its own, so that a view of it names
    the parameter)."""
    return torch.empty(0, dtype=param.dtype, device=param.device)


@dataclass
class _Gathered:
    """A whole-parameter access with several ranks (ParamStore.host_view)."""

    part: Partition
    values: torch.Tensor
    mode: str


@dataclass
class _Saved:
    """A tensor autograd saved that views a parameter's memory, kept as the
    parameter and the view's geometry instead (hooks.py's pack hook): the
    memory goes back to the tier after the forward, and the backward fetches
    it again."""

    part: Partition
    offset: int
    size: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype


class ParamStore:
    """The block store of one ZeRO-3 run and the partitions in it.

    ``plan`` gives the tiers' budgets and the blocks' homes; ``device_backend``
    "auto" uses the CUDA pool when a GPU is present and the host stand-in (a
    budgeted region of host memory) otherwise; ``trace`` records every
    transfer and wait for :meth:`write_trace`.
    """

    def __init__(self, plan: Plan, *, device_backend: str = "auto", trace: bool = False,
                 group: Group | None = None) -> None:
        self.plan = plan
        self.group = group or Group()
        world = self.group.world_size
        needs_nvme = "nvme" in (plan.param_home, plan.grad_home)
        if needs_nvme and not plan.nvme_dir:
            raise ValueError("zero_optimization.offload_param.nvme_path: parameters or gradients on NVMe "
                             "need a directory (or tierflow.nvme_dir)")
        nvme_dir = None
        if needs_nvme:
            nvme_dir = os.path.join(os.fspath(plan.nvme_dir), "tierflow-zero3")
            if world > 1:
                nvme_dir = os.path.join(nvme_dir, f"rank{self.group.rank}")
            os.makedirs(nvme_dir, mode=0o700, exist_ok=True)
        nvme_bytes = (plan.param_bytes if plan.param_home == "nvme" else 0) + \
                     (plan.grad_bytes if plan.grad_home == "nvme" else 0)
        # A file no larger than the blocks need; a block larger than one gets a file of its own.
        files = {"file_size": max(PAGE, min(256 << 20, pages(nvme_bytes)))} if needs_nvme else {}
        # One rank: the device tier holds the parameters themselves. Several:
        # the shards go from host memory straight into their gather buffers,
        # which take the whole budget but the device tier's one page.
        tier_budget = plan.device_budget if world == 1 else PAGE
        self.gather_budget = plan.device_budget if world == 1 else plan.device_budget - tier_budget
        # Ranks with their files on one device split its queue depth (sharing.py).
        self.nvme_sharing = ranks_sharing(self.group, nvme_dir) if needs_nvme and world > 1 else 1
        # Hooks run one at a time, so no lease ends while one is waited on: fail such waits, never hang.
        self.store = _core.Store(plan.host_budget, nvme_dir=nvme_dir,
                                 nvme_budget=(1 << 60) if needs_nvme else 0,
                                 device_budget=tier_budget, device_backend=device_backend,
                                 trace=trace, single_holder=True,
                                 aio=share_of(plan.aio, self.nvme_sharing) if needs_nvme else None, **files)
        self.nvme_dir = nvme_dir
        self.scheduler = _core.PrefetchScheduler(self.store, budget_share=plan.prefetch_share,
                                                 evict_distance=plan.evict_distance,
                                                 staging_share=plan.staging_share)
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.store.device_is_cuda \
            else torch.device("cpu")
        # Several ranks in host memory: the gather buffers, kept for the next gathers.
        self._buffers = GatherBuffers(self.gather_budget) if world > 1 and self.device.type == "cpu" else None
        self.parts: list[Partition] = []
        self._by_id: dict[int, Partition] = {}
        self._resident: dict[int, Partition] = {}  # data pointer of the device view -> partition
        self._resident_bytes = 0
        self.gathered_high_water = 0  # bytes of gathered parameters held at once, at most
        self._scheduled: set = set()  # leases taken through the scheduler (released through it)
        self._retiring: collections.deque = collections.deque()  # (event, lease) released on a GPU
        # Several ranks: the gathers issued ahead of their fetch (partition
        # index -> Pending), in issue order, and the gather buffers' bytes.
        self._order = FetchOrder()
        self._ahead: dict[int, Pending] = {}
        self._ahead_bytes = 0
        self._copy_stream: Any = None  # a GPU's stream for the shards' copies into their slots
        self.gathered_ahead = 0   # gathers issued ahead of their fetch
        self.gathers_dropped = 0  # of those, dropped unused (an order departed from, room needed)
        self.shards_read_into_slots = 0  # shards read from NVMe straight into their gather slot
        self.gather_chunks = 0  # gathers of a chunk of a parameter (tierflow.gather_chunk)
        self.in_iteration = False
        self.closed = False
        _lifetime.track(self)

    # ---- registration -------------------------------------------------------------------------

    def part_of(self, param: Any) -> Partition | None:
        return self._by_id.get(id(param))

    def adopt(self, param: torch.nn.Parameter, name: str, *, persistent: bool) -> Partition:
        """Moves ``param`` into the store: its blocks are made at their homes,
        its values written there, and ``.data`` becomes the placeholder."""
        if id(param) in self._by_id:
            return self._by_id[id(param)]
        if param.dtype != self.plan.compute_dtype and param.is_floating_point():
            with torch.no_grad():
                param.data = param.data.to(self.plan.compute_dtype)
        g = self.group
        part = Partition(param, name, len(self.parts), persistent,
                         shard_numel=g.shard_numel(param.numel()) if g.world_size > 1 else None)
        safe = name.replace("/", "_")
        part.block = self.store.create_block(f"{safe}.param", max(part.shard_bytes, 1), self.plan.param_home)
        if part.requires_grad:
            part.grad_block = self.store.create_block(f"{safe}.grad", max(part.shard_numel * 4, 1),
                                                      self.plan.grad_home)
        values = param.data.reshape(part.shape)
        if part.sharded:  # every rank starts from rank 0's values, as DeepSpeed broadcasts them
            values = g.shard_of(g.broadcast(values.detach().clone()).reshape(-1), part.shard_numel)
        lease = self.store.acquire(part.block, "host", "overwrite")
        try:
            copy_into(self._local(lease, part), values)
        finally:
            lease.release(dirty=True)
        self.parts.append(part)
        self._by_id[id(param)] = part
        set_data(param, part.placeholder)
        if type(param) is torch.nn.Parameter:  # a subclass of the user's keeps its class, and the hooks alone
            param.__class__ = StoredParameter
        # DeepSpeed's names for what the placeholder no longer tells.
        param.__dict__.update(ds_shape=torch.Size(part.shape), ds_numel=part.numel, ds_id=part.index,
                              ds_name=name, _tierflow_part=weakref.ref(part))
        return part

    def keep_only(self, param_ids: set[int]) -> None:
        """Forgets the partitions whose parameter is not among ``param_ids``
        (a tied head's own weight that zero.Init stored before the model tied
        it): they are neither stepped, saved nor fetched. Their blocks keep
        their room in the store, which removes no block before it closes."""
        orphans = [part for part in self.parts if id(part.param) not in param_ids]
        if not orphans:
            return
        for part in orphans:
            self.release(part)
            self._by_id.pop(id(part.param), None)
            part.param.__dict__.pop("_tierflow_store", None)
        self.parts = [part for part in self.parts if id(part.param) in param_ids]
        for index, part in enumerate(self.parts):
            part.index = index
            part.param.__dict__["ds_id"] = index

    # ---- views --------------------------------------------------------------------------------

    def _bytes(self, lease: Any) -> torch.Tensor:
        return torch.from_dlpack(lease.wait())

    def _view(self, lease: Any, part: Partition) -> torch.Tensor:
        """The lease's bytes as the parameter: its dtype and shape, no copy."""
        raw = self._bytes(lease)[: part.nbytes]
        return raw.view(part.dtype).view(part.shape)

    def _grad_view(self, lease: Any, part: Partition) -> torch.Tensor:
        return self._bytes(lease)[: part.numel * 4].view(torch.float32).view(part.shape)

    def _local(self, lease: Any, part: Partition) -> torch.Tensor:
        """The block's values as this rank holds them: the parameter (one
        rank), or its flat shard (several)."""
        if not part.sharded:
            return self._view(lease, part)
        return self._bytes(lease)[: part.shard_bytes].view(part.dtype)

    def _grad_local(self, lease: Any, part: Partition) -> torch.Tensor:
        if not part.sharded:
            return self._grad_view(lease, part)
        return self._bytes(lease)[: part.shard_numel * 4].view(torch.float32)

    def _full(self, part: Partition, shard: torch.Tensor) -> torch.Tensor:
        """``part``'s full values, gathered from every rank's ``shard``."""
        return self.group.gather(shard)[: part.numel].view(part.shape)

    # ---- residency on the device --------------------------------------------------------------

    def fetch(self, part: Partition) -> None:
        """Makes ``part`` resident in the device tier (a no-op when it is)."""
        if part.resident:
            return
        if part.sharded:
            self._fetch_gathered(part)
            return
        need = pages(part.nbytes)
        self._check_room(part, need)
        self._reap(wait=False)
        try:
            lease = self._lease(part.block, "device", "read")
        except TierflowError as e:
            # The copies this step holds left no piece large enough: release
            # those nothing uses now and try once more (a copy in use cannot move).
            if not _no_room(e):
                raise
            idle = self._release_idle()
            if not idle and not self._retiring:
                raise
            self._reap(wait=True)
            lease = self._lease(part.block, "device", "read")
        view = self._view(lease, part)
        part.lease = lease
        self._install(part, view, need)

    def _check_room(self, part: Partition, need: int) -> None:
        """Raises unless the device budget holds ``need`` more bytes of
        ``part`` beside what this step holds (the gathered parameters' share:
        all but the device tier's, with several ranks)."""
        if self._resident_bytes + need <= self.gather_budget:
            return
        held = ", ".join(p.name for p in self._resident.values())
        least = self._resident_bytes + need + (self.plan.device_budget - self.gather_budget)
        raise RuntimeError(
            f"tierflow.device_memory: {format_bytes(self.plan.device_budget)} cannot hold '{part.name}' "
            f"({format_bytes(need)}) beside what this step holds at once ({format_bytes(self._resident_bytes)}: "
            f"{held}); give at least {least} bytes")

    def _install(self, part: Partition, view: torch.Tensor, need: int) -> None:
        set_data(part.param, view)
        self._resident[view.untyped_storage().data_ptr()] = part
        self._resident_bytes += need
        self.gathered_high_water = max(self.gathered_high_water, self._resident_bytes + self._ahead_bytes)

    # ---- gathers (several ranks) --------------------------------------------------------------

    def _fetch_gathered(self, part: Partition) -> None:
        """:meth:`fetch` of a sharded parameter: its gather issued ahead, or
        issued now; then the next ones ahead; then the wait for its own."""
        need = pages(part.nbytes)
        pending = self._ahead.pop(part.index, None)
        if pending is not None:
            self._ahead_bytes -= need
        else:
            if self._resident_bytes + self._ahead_bytes + need > self.gather_budget:
                self._drain_ahead()  # the gathers on their way give their room back to this one
            self._check_room(part, need)
            self._reap(wait=False)
            pending = self._start_gather(part)
        if self.in_iteration:
            self._order.fetched(part.index)
            self._gather_ahead(need)
        full = pending.wait()
        if full.is_cuda:  # made on the copy stream, read on the compute stream
            full.record_stream(torch.cuda.current_stream(full.device))
        part.gathered = full
        self._install(part, full[: part.numel].view(part.shape), need)

    def _start_gather(self, part: Partition, *, ahead: bool = False) -> Pending:
        """Issues ``part``'s gather: its shard put into this rank's slot of a
        gather buffer, which is then all-gathered in place (:meth:`_fill_slot`)."""
        world = self.group.world_size
        if self._buffers is None:
            full = torch.empty(part.shard_numel * world, dtype=part.dtype, device=self.device)
        else:
            full = self._buffers.take(part.shard_numel * world, part.dtype)
        if self._reads_into_slot(part):
            return self._read_into_slot(part, full, ahead)
        return self._copy_into_slot(part, full)

    def _reads_into_slot(self, part: Partition) -> bool:
        """Whether ``part``'s shard is read from NVMe straight into its slot:
        a host buffer (page-aligned), a shard of whole pages (so is its slot,
        and nothing past it is written), homed on NVMe, and its home file
        current (a newer copy in the host tier is copied from instead)."""
        return (self._buffers is not None and part.shard_bytes % PAGE == 0 and self.plan.param_home == "nvme"
                and self.store.state(part.block, "nvme") == "valid")

    def _chunks(self, part: Partition, full: torch.Tensor) -> list[tuple[int, int]] | None:
        """The pieces of ``part``'s shard gathered one after another, as
        (first element, elements), each ``plan.gather_chunk_bytes`` but the
        last; None: the shard is gathered whole (no larger than one piece, or
        no tierflow communicator for ``full``'s memory)."""
        per = self.plan.gather_chunk_bytes // full.element_size()
        if per <= 0 or part.shard_numel <= per or not self.group.gathers_chunks(full):
            return None
        return [(begin, min(per, part.shard_numel - begin)) for begin in range(0, part.shard_numel, per)]

    def _chunk_gathers(self, full: torch.Tensor, pending: list[Pending], finally_: Any = None) -> Pending:
        """The gathers of ``full``'s chunks, issued in order, as one Pending (counted)."""
        self.gather_chunks += len(pending)
        return Pending(Chunks(pending), full, finally_=finally_)

    def _read_into_slot(self, part: Partition, full: torch.Tensor, ahead: bool) -> Pending:
        """The shard read from its home file into the slot, the gather issued
        behind the read (the communicator waits for it), the home lease ended
        once the gather has been waited for. A shard larger than a chunk is
        read and gathered chunk by chunk, each gather behind its own read."""
        lease = self.store.acquire(part.block, "nvme", "read")
        chunks = self._chunks(part, full)
        reads: list[Any] = []
        try:
            lease.wait()  # at once, unless a newer copy is still being written home
            slot = self.group.slot(full).view(torch.uint8)
            traffic = "prefetch" if ahead else "demand"
            if chunks is None:
                reads.append(lease.copy_into(slot, traffic))
            else:
                element = full.element_size()
                for begin, count in chunks:
                    piece = slot[begin * element:(begin + count) * element]
                    reads.append(lease.copy_into(piece, traffic, offset=begin * element))
        except BaseException:
            lease.release()  # (waits for the reads already started)
            raise
        self.shards_read_into_slots += 1

        def end() -> None:
            # The reads' Works are held until here: dropped unfinished, they
            # would wait for the reads on this thread.
            reads.clear()
            lease.release()
        if chunks is None:
            return self.group.gather_in_place(full, after=reads[0], finally_=end)
        try:
            pending = [self.group.gather_chunk(full, begin, count, after=read)
                       for (begin, count), read in zip(chunks, reads)]
        except BaseException:
            end()
            raise
        return self._chunk_gathers(full, pending, finally_=end)

    def _copy_into_slot(self, part: Partition, full: torch.Tensor) -> Pending:
        """The shard leased in host memory (the prefetch scheduler reads it
        ahead), copied into the slot, the lease ended (on a GPU once the copy
        is done), and the buffer all-gathered in place. A shard larger than a
        chunk is copied and gathered chunk by chunk: each chunk's gather
        runs while the next is copied."""
        cuda = self.device.type == "cuda"
        if cuda and self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        stream = contextlib.nullcontext() if not cuda else torch.cuda.stream(self._copy_stream)
        lease = self._lease(part.block, "host", "read")
        try:
            with stream:
                slot, local = self.group.slot(full), self._local(lease, part)
                chunks = self._chunks(part, full)
                pending = []
                # The collectives start after their copy: on a GPU, on the
                # copy stream (torch.distributed's orders itself after it).
                for begin, count in chunks or [(0, part.shard_numel)]:
                    slot[begin:begin + count].copy_(local[begin:begin + count], non_blocking=cuda)
                    if chunks is not None:
                        pending.append(self.group.gather_chunk(full, begin, count))
                if cuda:
                    copied = torch.cuda.Event()
                    copied.record(self._copy_stream)
                    self._retiring.append((copied, lease))  # ended once the copy is done (_reap)
                    lease = None
                if chunks is None:
                    return self.group.gather_in_place(full)
                return self._chunk_gathers(full, pending)
        finally:
            if lease is not None:
                self._unlease(lease, dirty=False)

    def _gather_ahead(self, current_bytes: int) -> None:
        """Issues the gathers of the fetches the last iteration made after
        this point, in order, while those on their way hold less than the
        prefetch window (as DeepSpeed's prefetch bucket: the last one may
        pass it) and within the gather budget beside ``current_bytes``, the
        parameter being fetched (not resident yet). A later fetch of that
        one (a backward's, after a release) is gathered ahead too."""
        window = self.plan.gather_ahead_bytes
        for index in self._order.upcoming():
            if self._ahead_bytes >= window:
                return
            if index in self._ahead or index >= len(self.parts):
                continue
            part = self.parts[index]
            need = pages(part.nbytes)
            if part.resident or not part.sharded:
                continue
            if self._resident_bytes + current_bytes + self._ahead_bytes + need > self.gather_budget:
                return
            self._ahead[index] = self._start_gather(part, ahead=True)
            self._ahead_bytes += need
            self.gathered_ahead += 1
            self.gathered_high_water = max(self.gathered_high_water, self._resident_bytes + self._ahead_bytes)

    def _drain_ahead(self, *, quiet: bool = False) -> None:
        """Waits for the gathers issued ahead and drops them (their parameter
        is gathered again when fetched): their room goes back to the budget.
        Raises the first one's error, after waiting for them all (unless
        ``quiet``: closing after a failure the caller has seen)."""
        ahead, self._ahead, self._ahead_bytes = self._ahead, {}, 0
        error = None
        for pending in ahead.values():
            try:
                pending.wait()
            except BaseException as e:  # noqa: BLE001 - every one waited for, the first error raised
                error = error or e
            self.gathers_dropped += 1
        if error is not None and not quiet:
            raise error

    def release(self, part: Partition) -> None:
        """Ends ``part``'s residency: ``.data`` is the placeholder again. On a
        GPU the device copy goes back to the store only once the kernels
        queued so far on the compute stream — those that read it — have
        finished (an event recorded now; :meth:`_reap`)."""
        if not part.resident:
            return
        lease = part.lease
        self._resident.pop(data_of(part.param).untyped_storage().data_ptr(), None)
        set_data(part.param, self._away(part))
        part.lease = None
        full, part.gathered = part.gathered, None  # on a GPU, torch's caching allocator orders its reuse
        if self._buffers is not None and full is not None:
            self._buffers.give(full)
        del full
        self._resident_bytes -= pages(part.nbytes)
        if lease is None:
            return
        if self.device.type == "cuda":
            # The store's copies and frees run on their own streams, and its
            # release requires the kernels that used the memory to be done.
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._retiring.append((event, lease))
            self._reap(wait=False)
        else:  # the host stand-in: every computation on it has returned
            self._unlease(lease, dirty=False)

    @staticmethod
    def _away(part: Partition) -> torch.Tensor:
        """What ``.data`` becomes as ``part`` goes back to the store. When a
        backward may follow (grad mode on, or inside one), a trainable
        parameter's gradient is still to come, and torch's AccumulateGrad lays
        a new gradient out by the parameter's sizes and strides: it gets a
        stand-in of its shape that holds one element (its values are never
        read — what autograd saved is fetched again — and any computation
        with the parameter is still refused while it is away), until
        :meth:`settle` after the backward. Otherwise the empty placeholder."""
        if part.requires_grad and (torch.is_grad_enabled() or in_backward()):
            return part.standin
        return part.placeholder

    def settle(self) -> None:
        """After a backward: every parameter away in the store holds the empty
        placeholder again (see :meth:`_away`)."""
        for part in self.parts:
            if not part.available:
                set_data(part.param, part.placeholder)

    def _reap(self, *, wait: bool) -> None:
        """Ends the device leases :meth:`release` left to the kernels still
        reading them: those whose kernels are done, or (``wait``) all of them,
        waiting for their kernels first."""
        while self._retiring and (wait or self._retiring[0][0].query()):
            event, lease = self._retiring.popleft()
            event.synchronize()
            self._unlease(lease, dirty=False)

    def _release_idle(self) -> bool:
        """Releases every resident parameter whose device memory no tensor
        but the parameter's own views (what fetch made) references: one held
        since an earlier use (a tied weight until its gradient hook, a
        persistent one) that nothing is reading now. A later use fetches it
        again (the hooks and ParameterAccess fetch what is not resident).
        Whether any was released; none where torch cannot count a storage's
        users."""
        count = getattr(torch._C, "_storage_Use_Count", None)
        if count is None:
            return False
        idle = []
        for part in self._resident.values():
            # The parameter's own tensor, the gathered buffer (several ranks)
            # and the storage object made to ask: nothing else holds it.
            own = 2 + (part.gathered is not None)
            if count(part.param.untyped_storage()._cdata) <= own:
                idle.append(part)
        for part in idle:
            self.release(part)
        return bool(idle)

    def release_all(self, *, keep_persistent: bool) -> None:
        for part in list(self._resident.values()):
            if not (keep_persistent and part.persistent):
                self.release(part)
        if not keep_persistent:
            try:
                self._drain_ahead()
            finally:
                self._reap(wait=True)

    @property
    def gathered_bytes(self) -> int:
        """Bytes of parameters resident on the device now (gathered, with several ranks)."""
        return self._resident_bytes

    def resident_part(self, tensor: torch.Tensor) -> Partition | None:
        """The partition whose device memory ``tensor`` views, if any."""
        if not self._resident:
            return None
        try:
            return self._resident.get(tensor.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # a tensor without storage (meta, sparse...)
            return None

    # Leases through the scheduler during an iteration, else the store.
    def _lease(self, block: int, tier: str, mode: str) -> Any:
        if self.in_iteration:
            lease = self.scheduler.acquire(block, tier, mode)
            self._scheduled.add(lease)
            return lease
        lease = self.store.acquire(block, tier, mode)
        lease.wait()
        return lease

    def _unlease(self, lease: Any, dirty: bool) -> None:
        if lease in self._scheduled:
            self._scheduled.discard(lease)
            self.scheduler.release(lease, dirty)
        else:
            lease.release(dirty)

    # ---- iterations ---------------------------------------------------------------------------

    def begin_iteration(self) -> None:
        if not self.in_iteration:
            self._scheduled = set()
            self.scheduler.begin_iteration()
            self._order.begin()
            self.in_iteration = True

    def end_iteration(self) -> None:
        if self.in_iteration:
            try:
                self.release_all(keep_persistent=False)
            finally:
                self._order.end()
                self.scheduler.end_iteration()
                self.in_iteration = False

    # ---- gradients ----------------------------------------------------------------------------

    def lease_for_accumulate(self, part: Partition, grad: torch.Tensor) -> "GradLease":
        """``part``'s fp32 gradient block leased for adding ``grad`` into it
        (the first micro-batch since a step overwrites it), the add itself
        left to :meth:`GradLease.add`, which may run on another thread: a GPU
        gradient comes down on the store's gradient stream into pinned
        memory, so nothing here waits for its bytes. End it with
        :meth:`end_accumulate`."""
        grad, ready = self._own_gradient(part, grad)
        fresh = part.grad_empty
        lease = self._lease(part.grad_block, "host", "overwrite" if fresh else "write")
        part.grad_empty = False
        return GradLease(part, lease, self._grad_local(lease, part), grad, fresh, ready)

    def end_accumulate(self, lease: "GradLease", ok: bool) -> None:
        """Ends :meth:`lease_for_accumulate`'s lease; a failed add leaves the
        block as the store had it (and, when it held nothing, empty)."""
        self._unlease(lease.lease, dirty=ok)
        if not ok and lease.fresh:
            lease.part.grad_empty = True

    def grad_norm_sq(self, part: Partition) -> tuple[float, bool]:
        """The squared L2 norm of ``part``'s accumulated gradient (one read of
        its block; this rank's shard) and whether it is finite."""
        lease = self._lease(part.grad_block, "host", "read")
        try:
            return _norm_sq(self._grad_local(lease, part))
        finally:
            self._unlease(lease, dirty=False)

    @contextlib.contextmanager
    def gradients(self, parts: list[Partition], buffers: list[torch.Tensor],
                  scale: float) -> Iterator[list[torch.Tensor]]:
        """For a reader that takes every gradient at once (ZenFlow's step):
        the accumulated gradient of each of ``parts`` times ``scale`` (fp32,
        the parameter's shape) as a view of its block, scaled in place and
        held for the ``with`` block; a part with no gradient since the last
        step gives its ``buffers`` entry, zeroed. The gradients must be homed
        in host memory (ZenFlow's plan homes them there), where holding them
        all takes no room."""
        if self.plan.grad_home != "host":
            raise RuntimeError("ParamStore.gradients: the gradients are not homed in host memory")
        if self.group.world_size > 1:
            yield self._gathered_gradients(parts, buffers, scale)
            return
        written = scale != 1.0
        leases, out = [], []
        try:
            for part, buffer in zip(parts, buffers):
                if part.grad_empty:
                    out.append(buffer.zero_())
                    continue
                lease = self._lease(part.grad_block, "host", "write" if written else "read")
                leases.append(lease)
                view = self._grad_view(lease, part)
                if written:
                    copy_into(view, view, scale)
                out.append(view)
            yield out
        finally:
            for lease in leases:
                self._unlease(lease, dirty=written)

    def _gathered_gradients(self, parts: list[Partition], buffers: list[torch.Tensor],
                            scale: float) -> list[torch.Tensor]:
        """:meth:`gradients` over several ranks: each gradient whole in its
        ``buffers`` entry, gathered from every rank's shard of the mean (every
        rank calls it with the same ``parts``, in the same order). A part
        with no gradient on any rank is zeroed without a collective; one with
        a gradient on some ranks only gathers zeros from the others."""
        empty = self.group.sum(*(1.0 if part.grad_empty else 0.0 for part in parts))
        for part, buffer, none in zip(parts, buffers, empty):
            if none == self.group.world_size:
                buffer.zero_()
                continue
            if part.grad_empty:
                local = torch.zeros(part.shard_numel, dtype=torch.float32)
            else:
                lease = self._lease(part.grad_block, "host", "read")
                try:
                    local = self._grad_local(lease, part).clone()
                finally:
                    self._unlease(lease, dirty=False)
            whole = self.group.gather(local)
            copy_into(buffer.reshape(-1), whole[: part.numel], scale)
        return buffers

    def clear_grads(self) -> None:
        for part in self.parts:
            part.grad_empty = True

    # ---- the optimizer's pass -----------------------------------------------------------------

    def step_parts(self) -> Iterator[Partition]:
        """The parameters with a gradient, in order (see :meth:`stepping`)."""
        for part in self.parts:
            if part.grad_block >= 0 and not part.grad_empty:
                yield part

    def lease_for_step(self, part: Partition, grad: torch.Tensor) -> "StepLease":
        """At the accumulation boundary, for a step that overlaps the rest of
        the backward: ``part``'s host copy leased for writing, and what makes
        its final gradient — ``grad`` (this micro-batch's; reduce-scattered
        with several ranks) added to what its block holds, or ``grad`` itself
        when the block holds nothing, which then never goes to the store.
        Nothing here waits for the gradient's bytes: a GPU gradient comes down
        on a copy stream of its own into pinned memory, and the stepping
        thread adds and waits (:meth:`StepLease.gradient`). End it with
        :meth:`end_step`."""
        self.release(part)
        grad, ready = self._own_gradient(part, grad)
        grad_lease = None
        try:
            into = None
            if not part.grad_empty:
                grad_lease = self._lease(part.grad_block, "host", "write")
                into = self._grad_local(grad_lease, part)
            param_lease = self._lease(part.block, "host", "write")
        except BaseException:
            if grad_lease is not None:
                self._unlease(grad_lease, dirty=False)
            raise
        part.grad_empty = True  # consumed by this step
        return StepLease(part, param_lease, grad_lease, self._local(param_lease, part), grad, into, ready)

    def _own_gradient(self, part: Partition, grad: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """This rank's share of ``grad`` (with several ranks, its shard of the
        mean over them) on its way to host memory: :meth:`_download`."""
        if part.sharded:
            pending = self.group.reduce_scatter_mean(grad.detach().reshape(-1), part.shard_numel)
            if not pending.output.is_cuda:  # in host memory already: the add waits for the reduction
                return pending.output, pending
            # The copy down queued behind the reduction; the add waits for both.
            host, copied = self._download(pending.wait())
            return host, _Downloaded(pending, copied)
        return self._download(grad.detach())

    def _download(self, grad: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """``grad`` in host memory, and the event its copy completes with
        (None when it is there already). A device gradient is copied on the
        store's gradient stream, ordered after the kernels that made it, into
        pinned memory; the caching allocator keeps its device memory until
        the copy is done (record_stream)."""
        if not grad.is_cuda:
            return grad, None
        if getattr(self, "_grad_stream", None) is None:
            self._grad_stream = torch.cuda.Stream(grad.device)
        stream = self._grad_stream
        stream.wait_stream(torch.cuda.current_stream(grad.device))
        host = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=True)
        with torch.cuda.stream(stream):
            host.copy_(grad, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(stream)
        grad.record_stream(stream)
        return host, ready

    def end_step(self, lease: "StepLease", ok: bool) -> None:
        """Ends :meth:`lease_for_step`'s leases: the host copy is the newest
        (dirty) when the step went through."""
        self._unlease(lease.param_lease, dirty=ok)
        if lease.grad_lease is not None:
            self._unlease(lease.grad_lease, dirty=False)

    def stepping(self, parts: list[Partition], grad_scale: float) -> "_Stepping":
        """A context in which the first parameters of ``parts`` — as many as
        half the host tier holds with their gradients, at least one — have
        their host copies as ``.data`` (written back when it ends) and their
        gradients, multiplied by ``grad_scale``, as ``.grad``; it gives the
        list of those it took. One optimizer step over several parameters
        streams their state back to back.

        Copies in use cannot move, so the ones a batch holds may leave the
        tier's free room in pieces too small for the next parameter even
        within half the budget: the store then refuses that lease (EDEADLK,
        a single-holder store) and the batch ends before it. The first
        parameter always finds room, with nothing else held (the plan's host
        budget is twice the largest pair)."""
        return _Stepping(self, parts, grad_scale, self.plan.host_budget // 2)

    # ---- whole-parameter access (checkpoints, GatheredParameters, state_dict) ------------------

    def read_local(self, part: Partition) -> torch.Tensor:
        """A CPU copy of this rank's values of ``part`` (all of them with one rank)."""
        lease = self._lease(part.block, "host", "read")
        try:
            return self._local(lease, part).clone()
        finally:
            self._unlease(lease, dirty=False)

    def read(self, part: Partition) -> torch.Tensor:
        """A CPU copy of ``part``'s full values (gathered from every rank:
        each calls it, in the same order)."""
        local = self.read_local(part)
        return self._full(part, local) if part.sharded else local

    def host_view(self, part: Partition, mode: str) -> tuple[Any, torch.Tensor]:
        """``part``'s full values in host memory and a token to end the access
        with :meth:`end_host`. One rank: a host lease of the block, no copy.
        Several: a gathered copy ("overwrite": not gathered, every rank taken
        to write the same values) whose ending writes this rank's shard back —
        after a "write", the values of :meth:`end_host`'s ``source`` rank,
        broadcast."""
        if not part.sharded:
            lease = self._lease(part.block, "host", mode)
            return lease, self._view(lease, part)
        full = torch.empty(part.shape, dtype=part.dtype) if mode == "overwrite" else self.read(part)
        return _Gathered(part, full, mode), full

    def hold(self, part: Partition, view: torch.Tensor) -> None:
        """Makes ``view`` (a :meth:`host_view`) ``part``'s ``.data`` until :meth:`unhold`."""
        part.held += 1
        set_data(part.param, view)

    def unhold(self, part: Partition) -> None:
        """Ends :meth:`hold`: the placeholder is ``.data`` again."""
        part.held -= 1
        set_data(part.param, part.placeholder)

    def end_host(self, lease: Any, dirty: bool, source: int = 0) -> None:
        """Ends :meth:`host_view`'s access; ``dirty``: its values are kept —
        with several ranks, after a "write", rank ``source``'s (every rank
        calls it, with the same ``source``)."""
        if not isinstance(lease, _Gathered):
            self._unlease(lease, dirty)
            return
        if dirty:
            values = lease.values
            if lease.mode == "write":
                values = self.group.broadcast(values.detach().clone(), src=source)
            self.write(lease.part, values)

    def write(self, part: Partition, values: torch.Tensor) -> None:
        """Replaces ``part``'s values (the device copy, if resident, first);
        with several ranks each keeps its shard of ``values``."""
        self.release(part)
        if part.sharded:
            values = self.group.shard_of(values.reshape(-1), part.shard_numel)
        lease = self._lease(part.block, "host", "overwrite")
        try:
            copy_into(self._local(lease, part), values.reshape(self._local_shape(part)))
        except BaseException:
            self._unlease(lease, dirty=False)
            raise
        self._unlease(lease, dirty=True)

    @staticmethod
    def _local_shape(part: Partition) -> tuple[int, ...]:
        return (part.shard_numel,) if part.sharded else part.shape

    # ---- reporting ----------------------------------------------------------------------------

    def telemetry(self) -> dict:
        return self.store.telemetry()

    def write_trace(self, path: str | os.PathLike) -> None:
        self.store.write_trace(os.fspath(path))

    def flush(self) -> None:
        self.store.flush()

    def restore_all(self) -> None:
        """Gives every parameter its values back as a plain tensor (a run
        that could not start leaves the model as it found it)."""
        self.release_all(keep_persistent=False)
        for part in self.parts:
            set_data(part.param, self.read(part))
            if type(part.param) is StoredParameter:
                part.param.__class__ = torch.nn.Parameter
            for key in ("ds_shape", "ds_numel", "ds_id", "ds_name", "_tierflow_part"):
                part.param.__dict__.pop(key, None)

    def _release_native(self) -> None:
        self.close()  # at interpreter exit (tierflow._lifetime)

    def close(self) -> None:
        """Ends every lease and closes the store (its files are removed). The
        parameters keep their placeholders; the store is no longer theirs."""
        if self.closed:
            return
        try:
            self._drain_ahead(quiet=True)  # a failed gather was raised where it was waited for
            self.end_iteration()
            self.release_all(keep_persistent=False)
        finally:
            self.group.close()
        if self._buffers is not None:
            self._buffers.clear()
        self.store.close()
        self.closed = True
        for part in self.parts:  # no cycle keeps the store alive past its engine
            part.param.__dict__.pop("_tierflow_store", None)
        self._by_id.clear()
        self.scheduler = None
        self.store = None


class _Downloaded:
    """A reduced device gradient's way to host memory: ``synchronize()``
    waits on the host for the reduction — so one that failed asynchronously
    (a peer gone, the timeout) raises here instead of its buffer being added —
    then for the copy down (a CUDA event)."""

    __slots__ = ("_reduced", "_copied")

    def __init__(self, reduced: Pending, copied: Any) -> None:
        self._reduced, self._copied = reduced, copied

    def synchronize(self) -> None:
        self._reduced.host_wait()
        if self._copied is not None:
            self._copied.synchronize()


@dataclass
class StepLease:
    """A parameter's host copy, leased for one optimizer step, and what makes
    its final gradient (:meth:`gradient`)."""

    part: Partition
    param_lease: Any
    grad_lease: Any
    value: torch.Tensor
    grad: torch.Tensor                 # this micro-batch's gradient, in host memory once ``ready``
    into: torch.Tensor | None = None   # the block holding the earlier micro-batches' sum, if any
    ready: Any = None                  # what ends the gradient's copy from the device (synchronize())

    def gradient(self) -> torch.Tensor:
        """The final gradient, of the parameter's dtype (as _Stepping gives
        it): waits for its copy, adds it to the earlier ones. Runs on the
        stepping thread, off the autograd thread."""
        if self.ready is not None:
            self.ready.synchronize()
        grad = self.grad
        if self.into is not None:
            with torch.no_grad():
                self.into.add_(grad.to(torch.float32).reshape(self.into.shape))
            grad = self.into
        return grad.to(dtype=self.part.dtype).reshape(self.value.shape)


@dataclass
class GradLease:
    """A gradient block leased for one micro-batch's gradient to be added
    into it (:meth:`add`)."""

    part: Partition
    lease: Any
    view: torch.Tensor     # this rank's fp32 gradient, in the block
    grad: torch.Tensor     # the gradient to add, in host memory once ``ready``
    fresh: bool            # the block held nothing: the add overwrites it
    ready: Any = None      # what ends the gradient's copy from the device (synchronize())

    def add(self, norm: bool) -> tuple[float, bool]:
        """Waits for the gradient's copy and adds it into the block (the copy
        takes the norm in the same pass when the block held nothing); with
        ``norm`` returns the block's squared L2 norm and whether it is finite
        (else 0.0, True)."""
        if self.ready is not None:
            self.ready.synchronize()
        if self.fresh:
            sq = copy_into(self.view, self.grad, norm=norm)
        else:
            with torch.no_grad():
                self.view.add_(self.grad.to(torch.float32).reshape(self.view.shape))
            sq = norm_sq(self.view) if norm else 0.0
        return sq, math.isfinite(sq)


class _Stepping:
    def __init__(self, owner: ParamStore, parts: list[Partition], grad_scale: float, cap: int) -> None:
        self.owner, self.parts, self.grad_scale, self.cap = owner, parts, grad_scale, cap
        self.batch: list[Partition] = []
        self.leases: list[tuple[Any, Any]] = []

    def _take(self, part: Partition) -> tuple[Any, Any] | None:
        """``part``'s host copy and gradient leased, or None when the batch
        must end before it (the store refused the room for it)."""
        o = self.owner
        pl = None
        try:
            pl = o._lease(part.block, "host", "write")
            return pl, o._lease(part.grad_block, "host", "write")
        except BaseException as e:
            if pl is not None:
                o._unlease(pl, dirty=False)
            if self.batch and _no_room(e):
                return None
            raise

    def __enter__(self) -> list[Partition]:
        o = self.owner
        held = 0
        try:
            for part in self.parts:
                need = pages(part.shard_bytes) + pages(part.shard_numel * 4)
                if self.batch and held + need > self.cap:
                    break
                o.release(part)
                taken = self._take(part)
                if taken is None:
                    break
                pl, gl = taken
                held += need
                self.batch.append(part)
                self.leases.append((pl, gl))
                p = part.step_param
                p.data = o._local(pl, part)
                grad = o._grad_local(gl, part)
                if self.grad_scale != 1.0:
                    grad.mul_(self.grad_scale)
                # torch wants a gradient of the parameter's dtype: a bf16/fp16
                # parameter steps its fp32 master from the accumulated fp32
                # gradient rounded once, as torch's own bf16 training does.
                p.grad = grad if part.dtype == torch.float32 else grad.to(part.dtype)
        except BaseException as e:
            self.__exit__(type(e), e, None)  # nothing was stepped: no copy is newer
            raise
        return self.batch

    def __exit__(self, exc_type, exc, tb) -> None:
        o = self.owner
        for part, (pl, gl) in zip(self.batch, self.leases):
            p = part.step_param
            p.grad = None
            p.data = part.step_placeholder
            # The updated parameter is the newest copy (dirty) unless the step
            # failed; the consumed gradient is overwritten by the next micro-batch.
            o._unlease(pl, dirty=exc_type is None)
            o._unlease(gl, dirty=False)
        self.leases.clear()
