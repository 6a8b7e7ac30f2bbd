"""The collectives a data-parallel ZeRO-3 run needs.

With several processes (launched with ``torchrun``, the process group made
with ``torch.distributed.init_process_group`` before the engine), each rank's
store holds one shard of every parameter: ``ceil(numel / world_size)``
elements, the last rank's padded with zeros. A parameter's full values are
the rank-ordered concatenation of the shards (:meth:`Group.gather`, or
:meth:`Group.gather_in_place` for a buffer whose rank slot is filled); a
gradient becomes each rank's shard of the mean over the ranks
(:meth:`Group.reduce_scatter_mean`). The reductions run in fp32 whatever the
compute dtype, so a gradient averaged over two ranks differs from one
process's only by the order of the additions.

Who runs them (``tierflow.collectives``): ``"tierflow"`` (the default) runs
the parameters' and gradients' collectives on tierflow's own communicators
where it has one for the buffers' memory — Gloo for host memory; NCCL for
device memory when the process group runs NCCL and tierflow was built with
it (``tierflow._nccl``, on the NCCL torch brings); each meeting through the
process group's store — and on ``torch.distributed`` otherwise
(:attr:`Group.counts` counts each); ``"torch"`` runs them all
on ``torch.distributed``. The handful of scalar sums and
barriers a step needs (the gradient norm, an agreement on an error) are fp64
and always ``torch.distributed``'s. tierflow's collectives are asynchronous:
the engine issues a gather ahead of its use and reduce-scatters a gradient
while the backward goes on; both complete in issue order, and every rank
issues them in the same order. On a GPU a collective's wait orders torch's
current stream after it and lets the host go on (as torch.distributed's NCCL
Work's wait); whatever reads a result on the host waits for it there first
(:meth:`Pending.host_wait`), so a collective that failed asynchronously
raises there instead of handing over what it left.

With no process group (or a group of one) every collective is the identity,
and the engine runs exactly as a single process does. All ranks must call the
collectives in the same order: they run the same model on the same code path,
so the forward, the backward and the step do.

This module is the only one in the engine that calls ``torch.distributed``
or a communicator.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from tierflow import _gloo, _nccl_group

__all__ = ["Chunks", "Group", "Pending", "current_group", "COLLECTIVES"]

#: ``tierflow.collectives``'s values.
COLLECTIVES = ("tierflow", "torch")

# Communicators made in this process, in order: every rank makes its groups'
# in the same order, so the n-th one's keys in the store are the same on each.
_made = itertools.count(1)


class Pending:
    """A collective issued and not yet waited for. :meth:`wait` makes its
    output ready for what runs next — on the host (Gloo, torch.distributed's
    gloo) it blocks until the collective is done; on a GPU torch's current
    stream waits for it (the host goes on) — raises its error where it
    failed, and returns the output. :meth:`host_wait` (or ``synchronize()``,
    the name a CUDA event's wait has, so a gradient's readiness can be
    either) blocks the host until it is done in both cases. ``then(output)``
    runs after a successful wait (on a GPU, its kernels queued behind the
    collective); ``finally_()`` after every wait, failed or not (the end of
    what the collective read from: a lease, say), once."""

    def __init__(self, work: Any, out: torch.Tensor, then: Any = None, finally_: Any = None) -> None:
        self._work, self._out, self._then, self._finally = work, out, then, finally_
        self._waited: Any = None  # the work once waited for: host_wait() may still block on it

    @property
    def done(self) -> bool:
        """Whether it has finished (never blocks)."""
        work = self._work
        if work is None:
            return True
        done = getattr(work, "done", None)  # tierflow's Work; torch.distributed's has is_completed()
        return done if isinstance(done, bool) else work.is_completed()

    @property
    def output(self) -> torch.Tensor:
        """The tensor the collective writes: its values only after :meth:`wait`."""
        return self._out

    def wait(self) -> torch.Tensor:
        try:
            if self._work is not None:
                work, self._work = self._work, None
                self._waited = work
                work.wait()
                if self._then is not None:
                    self._then(self._out)
        finally:
            if self._finally is not None:
                end, self._finally = self._finally, None
                end()
        return self._out

    def host_wait(self) -> torch.Tensor:
        """:meth:`wait`, then the host blocks until the collective has run
        (raising its error: a device collective's, seen only now, included)."""
        out = self.wait()
        if self._waited is not None:
            _nccl_group.host_wait(self._waited)
        return out

    synchronize = host_wait


class Chunks:
    """The collectives of one tensor's chunks, issued in order, as one
    :class:`Pending`'s work: :meth:`wait` waits for every one (the first
    error raised after all are waited for: each holds its buffers until then)."""

    def __init__(self, pending: list[Pending]) -> None:
        self._pending = pending

    @property
    def done(self) -> bool:
        return all(p.done for p in self._pending)

    def wait(self) -> None:
        self._each(Pending.wait)

    def host_wait(self) -> None:
        self._each(Pending.host_wait)

    def _each(self, wait: Any) -> None:
        error = None
        for p in self._pending:
            try:
                wait(p)
            except BaseException as e:  # noqa: BLE001 - every one waited for, the first error raised
                error = error or e
        if error is not None:
            raise error


class Group:
    """The ranks of one data-parallel run (``world_size`` 1 without a process
    group). ``collectives``: who runs the parameters' and gradients'
    collectives (the module's docstring); ``timeout``: seconds one of
    tierflow's may take before it fails, and the communicator with it."""

    def __init__(self, process_group: Any = None, *, collectives: str = "tierflow", timeout: float = 600.0) -> None:
        import torch.distributed as dist

        if collectives not in COLLECTIVES:
            raise ValueError(f"tierflow.collectives: {collectives!r} is not \"tierflow\" or \"torch\"")
        if not timeout > 0:
            raise ValueError(f"tierflow.collectives_timeout: {timeout} s is not positive")
        self._dist = dist
        self.active = dist.is_available() and dist.is_initialized()
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group) if self.active else 1
        self.rank = dist.get_rank(process_group) if self.active else 0
        if self.world_size == 1:
            self.active = False
        self.collectives = collectives
        self.timeout = float(timeout)
        self._comm: Any = None  # tierflow's communicator over host memory, made at its first use
        self._device_comm: Any = None  # and over device memory (NCCL)
        # Device memory on tierflow's NCCL where it was built with one and the
        # process group runs NCCL (each rank on a GPU of its own); else torch.distributed's.
        self._device_collectives = (self.active and collectives == "tierflow"
                                    and dist.get_backend(process_group) == "nccl" and _nccl_group.available())
        # Collectives run by tierflow's communicators and by torch.distributed.
        self.counts = {"tierflow": 0, "torch": 0}
        # NCCL moves device memory only: host tensors (a checkpoint's values,
        # a parameter being adopted) go through a device copy.
        self._staging = (torch.device("cuda", torch.cuda.current_device())
                         if self.active and dist.get_backend(process_group) == "nccl" else None)

    @classmethod
    def from_options(cls, options: Any = None, process_group: Any = None) -> "Group":
        """The group of ``process_group`` run as ``options`` (a config's
        :class:`~tierflow.config.TierflowOptions`) say."""
        if options is None:
            return cls(process_group)
        return cls(process_group, collectives=options.collectives, timeout=options.collectives_timeout)

    # ---- who runs a collective ----------------------------------------------------------------

    def _ours(self, *tensors: torch.Tensor) -> Any:
        """tierflow's communicator when it runs a collective over ``tensors``,
        else None (torch.distributed's)."""
        if not self.active or self.collectives == "torch":
            return None
        if all(_gloo.moves(t) for t in tensors):
            if self._comm is None:
                self._comm = self._connect(_gloo.connect)
            self.counts["tierflow"] += 1
            return self._comm
        if self._device_collectives and all(_nccl_group.moves(t) for t in tensors):
            if self._device_comm is None:
                self._device_comm = self._connect(_nccl_group.connect)
            self.counts["tierflow"] += 1
            return self._device_comm
        return None

    def _connect(self, connect: Any) -> Any:
        """One of tierflow's communicators (``connect``: Gloo's or NCCL's)
        over this group's ranks, meeting through the process group's store."""
        dist = self._dist
        ranks = dist.get_process_group_ranks(self.process_group) if self.process_group is not None \
            else range(self.world_size)
        prefix = f"tierflow/zero/{next(_made)}/" + ",".join(map(str, ranks))
        return connect(self.rank, self.world_size, dist.distributed_c10d._get_default_store(), prefix, self.timeout)

    def close(self) -> None:
        """Leaves tierflow's communicators (each waits for what is under
        way); a later collective makes new ones."""
        for name in ("_comm", "_device_comm"):
            comm = getattr(self, name)
            setattr(self, name, None)
            if comm is not None:
                comm.close()

    def check(self) -> None:
        """Blocks until tierflow's device collectives issued so far have run,
        raising the error of one that failed asynchronously (their waits only
        order torch's stream after them). Host collectives need none: each
        is waited for on the host as it is used."""
        if self._device_comm is not None:
            self._device_comm.check()

    def _run(self, op: Any, tensor: torch.Tensor, *others: torch.Tensor) -> None:
        """``op(tensor, *others)`` on torch.distributed's backend's device:
        ``tensor`` (the output) gets the result in place."""
        self.counts["torch"] += 1
        if self._staging is None or tensor.device.type != "cpu":
            op(tensor, *others)
            return
        staged = tensor.to(self._staging)
        op(staged, *(o.to(self._staging) for o in others))
        tensor.copy_(staged)

    # ---- shards -------------------------------------------------------------------------------

    def shard_numel(self, numel: int) -> int:
        """Elements of one rank's shard of a tensor of ``numel``."""
        return max(1, -(-numel // self.world_size))

    def shard_of(self, flat: torch.Tensor, shard: int) -> torch.Tensor:
        """This rank's ``shard`` elements of ``flat`` (a 1-D tensor of the full
        values), padded with zeros past the end."""
        begin = self.rank * shard
        piece = flat[begin:begin + shard]
        if piece.numel() == shard:
            return piece
        out = torch.zeros(shard, dtype=flat.dtype, device=flat.device)
        out[:piece.numel()] = piece
        return out

    def slot(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slot of ``full`` (``world_size`` equal shards, flat)."""
        shard = full.numel() // self.world_size
        return full[self.rank * shard:(self.rank + 1) * shard]

    # ---- collectives --------------------------------------------------------------------------

    def gather(self, shard: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Every rank's ``shard`` (1-D, the same size on each), concatenated in
        rank order into ``out`` (``world_size × shard`` elements) or a new tensor."""
        if out is None:
            out = torch.empty(shard.numel() * self.world_size, dtype=shard.dtype, device=shard.device)
        if not self.active:
            out.copy_(shard)
            return out
        self.slot(out).copy_(shard)
        return self.gather_in_place(out).host_wait()

    def gather_in_place(self, full: torch.Tensor, *, after: Any = None, finally_: Any = None) -> Pending:
        """Starts gathering into ``full`` (1-D, ``world_size`` equal shards)
        every rank's shard from its slot of its ``full``, where this rank has
        put its own (:meth:`slot`): no copy in. Wait for the result before
        reading ``full``, or writing its slot.

        ``after``: a Work still filling the slot (``Lease.copy_into``'s read
        from NVMe), which tierflow's communicator waits for on its own
        thread, so the gather is issued now, in its place in the order (on
        torch.distributed, it is waited for here first). ``finally_``: as
        :class:`Pending`'s; it also runs when issuing fails."""
        try:
            return self._gather_in_place(full, after, finally_)
        except BaseException:
            if finally_ is not None:
                finally_()
            raise

    def _gather_in_place(self, full: torch.Tensor, after: Any, finally_: Any) -> Pending:
        comm = self._ours(full) if self.active else None
        if comm is None and after is not None:
            after.wait()
        if not self.active:
            return Pending(None, full, finally_=finally_)
        counts = [full.numel() // self.world_size] * self.world_size
        if comm is not None:
            return Pending(comm.all_gather(self.slot(full), full, counts, after=after), full, finally_=finally_)
        # torch.distributed's gloo copies its input into the slot: give it a copy.
        mine = self.slot(full).clone()
        if self._staging is None:
            self.counts["torch"] += 1
            work = self._dist.all_gather_into_tensor(full, mine, group=self.process_group, async_op=True)
            return Pending(work, full, finally_=finally_)
        self._run(lambda o, s: self._dist.all_gather_into_tensor(o, s, group=self.process_group), full, mine)
        return Pending(None, full, finally_=finally_)

    def gathers_chunks(self, full: torch.Tensor) -> bool:
        """Whether :meth:`gather_chunk` runs on tierflow's communicator for
        ``full``'s memory (torch.distributed has no all-gather into strided
        places: a parameter is gathered whole there)."""
        if not self.active or self.collectives == "torch":
            return False
        return _gloo.moves(full) or (self._device_collectives and _nccl_group.moves(full))

    def gather_chunk(self, full: torch.Tensor, begin: int, count: int, *, after: Any = None) -> Pending:
        """Starts gathering elements ``begin`` to ``begin + count`` of every
        rank's shard, from its slot of its ``full``, into their places in
        ``full`` (1-D, ``world_size`` equal shards): a chunk of the parameter,
        the rest of ``full`` left alone, so its first chunks are gathered while
        the later ones are still being read. Only where :meth:`gathers_chunks`;
        ``after`` as :meth:`gather_in_place`'s."""
        shard = full.numel() // self.world_size
        comm = self._ours(full)
        if comm is None:
            raise RuntimeError(f"gather_chunk: no tierflow communicator moves {full.dtype} on {full.device}")
        mine = full[self.rank * shard + begin:][:count]
        work = comm.all_gather_strided(mine, full[begin:], shard, after=after)
        return Pending(work, full)

    def reduce_scatter_mean(self, flat: torch.Tensor, shard: int) -> Pending:
        """Starts reducing this rank's ``shard`` elements of the mean over the
        ranks of ``flat`` (1-D, each rank's full gradient), in fp32: the
        result is :meth:`Pending.wait`'s."""
        full = torch.zeros(shard * self.world_size, dtype=torch.float32, device=flat.device)
        full[:flat.numel()] = flat
        if not self.active:
            return Pending(None, full)
        out = torch.empty(shard, dtype=torch.float32, device=flat.device)
        world = self.world_size
        comm = self._ours(full)
        if comm is not None:
            # ``full`` stays referenced by the Work until it is done.
            return Pending(comm.reduce_scatter(full, out, [shard] * world), out, lambda o: o.div_(world))
        self._run(lambda o, f: self._dist.reduce_scatter_tensor(o, f, group=self.process_group), out, full)
        return Pending(None, out.div_(world))

    def sum(self, *values: float) -> list[float]:
        """Each of ``values`` summed over the ranks (fp64, torch.distributed's)."""
        if not self.active:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        self._run(lambda x: self._dist.all_reduce(x, group=self.process_group), t)
        return t.tolist()

    def gather_ints(self, *values: int) -> list[tuple[int, ...]]:
        """Every rank's ``values`` (int64, as many on each), in rank order
        (torch.distributed's)."""
        if not self.active:
            return [tuple(values)]
        mine = torch.tensor(values, dtype=torch.int64)
        out = torch.empty(len(values) * self.world_size, dtype=torch.int64)
        self._run(lambda o, m: self._dist.all_gather_into_tensor(o, m, group=self.process_group), out, mine)
        return [tuple(row) for row in out.view(self.world_size, -1).tolist()]

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``tensor`` replaced in place by rank ``src``'s values."""
        if self.active:
            staged = tensor if tensor.is_contiguous() else tensor.contiguous()
            comm = self._ours(staged)
            if comm is not None:
                _nccl_group.host_wait(comm.broadcast(staged.view(-1), src))
            else:
                self._run(lambda x: self._dist.broadcast(x, src=src, group=self.process_group), staged)
            if staged is not tensor:
                tensor.copy_(staged)
        return tensor

    def barrier(self) -> None:
        if self.active:
            self._dist.barrier(group=self.process_group)

    def agree(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank (one all-reduce)."""
        if not self.active:
            return ok
        return self.sum(0.0 if ok else 1.0)[0] == 0.0

    def __repr__(self) -> str:
        return f"Group(rank={self.rank}, world_size={self.world_size}, collectives={self.collectives!r})"


def current_group(options: Any = None) -> Group:
    """The default process group's ranks (world_size 1 without one), its
    collectives run as ``options`` (a config's TierflowOptions) say."""
    return Group.from_options(options)
