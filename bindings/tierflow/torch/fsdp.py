"""tierflow beneath FSDP2 (``torch.distributed.fsdp.fully_shard``).

tierflow's optimizers (:mod:`tierflow.torch.optim`) step a ``fully_shard``
model's DTensor parameters over their local shards as they are. This module
holds what FSDP2's own tools do not do for a sharded model whose shards live
in host memory:

* :func:`offload` with an :class:`OffloadPolicy`: each parameter's local
  shard homed on NVMe (by name pattern, by size) and brought into tierflow's
  host memory, within a budget, ahead of FSDP2's all-gather and the
  optimizer's step, in the order the first iteration used them.
* :func:`clip_grad_norm_`: ``torch.nn.utils.clip_grad_norm_`` over DTensor
  gradients without DTensor dispatch, its one reduction on the device of the
  mesh's process group. torch's own, under ``CPUOffloadPolicy``, reduces the
  CPU gradients' partial norms with the mesh's collective, which NCCL
  cannot run on CPU tensors (pytorch#148532).
"""

from __future__ import annotations

import collections
import contextlib
import fnmatch
import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import CPUOffloadPolicy

from tierflow import _core, _lifetime
from tierflow.torch import _fsdp2
from tierflow.torch._homed import Home, HomedTensor, Layout
from tierflow.torch.optim.adam import _DTensor, _local

__all__ = ["OffloadPolicy", "ShardOffload", "offload", "clip_grad_norm_"]

_PAGE = 4096
_MIN_HOST_MEMORY = 64 << 10


@dataclass
class OffloadPolicy(CPUOffloadPolicy):
    """Where each local shard of a ``fully_shard`` model lives: a
    ``CPUOffloadPolicy`` (give it to ``fully_shard(offload_policy=...)`` on a
    GPU, so the shards are in host memory, and to :func:`offload` after) that
    also homes shards on NVMe.

    A shard is homed on NVMe when its parameter's name (as
    ``model.named_parameters()`` gives it from the root) matches one of the
    ``fnmatch`` patterns ``nvme`` and its bytes are at least
    ``nvme_min_bytes``; every other shard stays where FSDP2 put it.

    Args:
        pin_memory: as ``CPUOffloadPolicy``'s (FSDP2 pins the host-homed
            shards; tierflow's host memory, which the NVMe-homed ones pass
            through, is pinned when a GPU is present).
        nvme_dir: the directory the shard files go in (``rank<r>/`` of it
            per rank); needed when any shard is homed on NVMe.
        host_memory: bytes (or a size such as ``"2G"``) of tierflow's host
            memory the NVMe-homed shards pass through: what one module's
            shards need while they are gathered, what the optimizer steps at
            once, and the reads ahead. None: a quarter of this rank's
            NVMe-homed shards, at least twice the largest and 64 KiB.
        nvme: name patterns; ``"*"`` (the default) every parameter.
        nvme_min_bytes: the smallest shard homed on NVMe.
        gradients: where the gradients of the NVMe-homed shards live between
            backward and the optimizer step: ``"host"`` (the default: where
            FSDP2 puts them, pinned host memory on a GPU) or ``"nvme"``
            (written to NVMe as each module's are reduced, read back for the
            step a budget at a time, as the shards).
        aio: the NVMe I/O engine's settings (``block_size``, ``queue_depth``,
            ``threads``, ``submit_batch``), as a DeepSpeed config's ``aio``.
    """

    nvme_dir: str | os.PathLike | None = None
    host_memory: int | str | None = None
    nvme: str | Sequence[str] = "*"
    nvme_min_bytes: int = 0
    gradients: str = "host"
    aio: dict[str, int] | None = field(default=None)

    def __post_init__(self) -> None:
        if self.nvme_dir is not None and not isinstance(self.nvme_dir, (str, os.PathLike)):
            raise ValueError(f"OffloadPolicy.nvme_dir: {self.nvme_dir!r} is not a path")
        patterns = [self.nvme] if isinstance(self.nvme, str) else list(self.nvme)
        if not all(isinstance(p, str) for p in patterns):
            raise ValueError(f"OffloadPolicy.nvme: {self.nvme!r} is not a name pattern or a list of them")
        if isinstance(self.nvme_min_bytes, bool) or not isinstance(self.nvme_min_bytes, int) \
                or self.nvme_min_bytes < 0:
            raise ValueError(f"OffloadPolicy.nvme_min_bytes: {self.nvme_min_bytes!r} is not a byte count")
        if isinstance(self.host_memory, str):
            self.host_memory = _core.parse_size(self.host_memory, "OffloadPolicy.host_memory")
        elif self.host_memory is not None and (isinstance(self.host_memory, bool)
                                               or not isinstance(self.host_memory, int)
                                               or self.host_memory < _MIN_HOST_MEMORY):
            raise ValueError(f"OffloadPolicy.host_memory: {self.host_memory!r} is not a byte count of at least "
                             f"{_MIN_HOST_MEMORY}")
        if self.gradients not in ("host", "nvme"):
            raise ValueError(f"OffloadPolicy.gradients: {self.gradients!r} is not 'host' or 'nvme'")
        if self.aio is not None and not isinstance(self.aio, dict):
            raise ValueError(f"OffloadPolicy.aio: {self.aio!r} is not a dict")

    def on_nvme(self, name: str, nbytes: int) -> bool:
        """Whether the shard of parameter ``name``, ``nbytes`` long, is homed on NVMe."""
        patterns = [self.nvme] if isinstance(self.nvme, str) else self.nvme
        return nbytes >= self.nvme_min_bytes and any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _pages(n: int) -> int:
    return max(_PAGE, -(-n // _PAGE) * _PAGE)


def _storage_of(lease: Any) -> torch.UntypedStorage:
    """The lease's bytes (host memory of the store) as a torch storage, no copy."""
    return torch.from_dlpack(lease.wait()).untyped_storage()


class _Homed:
    """One NVMe-homed shard: its block, the lease its views use now (None:
    hollow, ``away`` standing in for its local tensor), whether they use
    ordinary memory (after :meth:`materialize`), and its gradient's block
    once one was homed (under ``gradients="nvme"``)."""

    __slots__ = ("shard", "block", "lease", "materialized", "away", "grad_block", "grad_away", "grad_lease")

    def __init__(self, shard: _fsdp2.Shard, block: int) -> None:
        self.shard, self.block = shard, block
        self.lease: Any = None
        self.materialized = False
        self.away: HomedTensor | None = None
        self.grad_block: int | None = None
        self.grad_away: HomedTensor | None = None
        self.grad_lease: Any = None

    @property
    def room(self) -> int:
        return self.shard.room


class ShardOffload:
    """What :func:`offload` set up on a ``fully_shard`` model: the shards it
    homes on NVMe, the store and prefetcher that bring them in, and the hooks.

    Between their uses, an NVMe-homed shard's parameter keeps its shape over
    a storage of no bytes, as FSDP2 leaves its unsharded parameters outside
    forward and backward: read its values through ``model.state_dict()`` (or
    :meth:`materialize`), not through the parameter object. ``state_dict()``
    and ``load_state_dict()`` (``torch.distributed.checkpoint``'s too) bring
    the shards they cover into ordinary host memory, where they stay until the
    next forward writes them home. :meth:`close` (or the end of the
    interpreter) brings every shard back into ordinary memory for good and
    removes the files."""

    def __init__(self, model: nn.Module, policy: OffloadPolicy) -> None:
        _fsdp2.check()
        if not isinstance(policy, OffloadPolicy):
            raise ValueError(f"tierflow.torch.fsdp.offload: policy is a {type(policy).__name__}, not an OffloadPolicy")
        self.model, self.policy = model, policy
        shards = _fsdp2.shards(model)
        on_cuda = [s.name for s in shards if s.data.device.type != "cpu"]
        if on_cuda:
            raise ValueError(f"tierflow.torch.fsdp.offload: '{on_cuda[0]}''s shard is on {shards[0].data.device}; "
                             "give fully_shard offload_policy=OffloadPolicy(...) (or CPUOffloadPolicy()) so the "
                             "shards are in host memory")
        chosen = [s for s in shards if policy.on_nvme(s.name, s.nbytes)]
        self.nvme_bytes = sum(_pages(s.nbytes) for s in chosen)
        # FSDP2 gathers a group's parameters together: its shards are held at once.
        per_group: dict[int, int] = collections.defaultdict(int)
        parts: dict[int, list[str]] = {}
        for s in chosen:
            per_group[id(s.group)] += _pages(s.room)
            here = s.name.split(".")[:-1]
            common = parts.setdefault(id(s.group), here)
            while common[: len(here)] != here[: len(common)]:
                common.pop()
            del common[len(here):]
        names = {key: ".".join(common) or "the root" for key, common in parts.items()}
        largest = max(per_group, key=per_group.get, default=None)
        group_bytes = per_group[largest] if largest is not None else 0
        budget = policy.host_memory
        if budget is None:
            budget = max(_MIN_HOST_MEMORY, 2 * group_bytes, _pages(self.nvme_bytes // 4))
        self.host_memory = int(budget)
        if chosen and self.host_memory < group_bytes:
            raise ValueError(
                f"OffloadPolicy.host_memory: {self.host_memory} bytes cannot hold the NVMe-homed shards of "
                f"'{names[largest]}' ({group_bytes} bytes), which FSDP2 gathers together; give at least "
                f"{2 * group_bytes} (one module's gathered, the next one's read ahead)")
        if chosen and policy.gradients == "nvme":
            pair = max(chosen, key=lambda s: _pages(s.room) + _pages(s.nbytes))
            if self.host_memory < _pages(pair.room) + _pages(pair.nbytes):
                raise ValueError(f"OffloadPolicy.host_memory: {self.host_memory} bytes cannot hold '{pair.name}''s "
                                 f"shard and its gradient ({_pages(pair.room) + _pages(pair.nbytes)} bytes), which "
                                 "the optimizer step reads together")
        self._homed: list[_Homed] = []
        self._by_group: dict[int, list[_Homed]] = collections.defaultdict(list)
        self._by_param: dict[int, _Homed] = {}
        self._undo: list[Any] = []
        self._held: list[_Homed] = []  # leased for an all-gather under way
        self._retiring: collections.deque = collections.deque()  # (CUDA event, [homed]) on a GPU
        self._stashed: list[tuple[Tensor, Tensor]] = []  # gradients set aside while a step runs
        self._stepping: list[_Homed] = []  # leased for a step under way
        self._outgoing: collections.deque = collections.deque()  # (event, homed): gradients still being copied
        self._in_iteration = False
        # An iteration runs from a forward to the optimizer step (every
        # micro-batch of an accumulation), or to the next forward when no
        # backward came between (evaluation).
        self._stepped = self._in_backward = False
        self.closed = False
        self.store = self.scheduler = None
        self.nvme_dir: str | None = None
        if not chosen:
            return
        if policy.nvme_dir is None:
            raise ValueError("OffloadPolicy.nvme_dir: shards homed on NVMe need a directory")
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.nvme_dir = os.path.join(os.fspath(policy.nvme_dir), "tierflow-fsdp", f"rank{rank}")
        os.makedirs(self.nvme_dir, mode=0o700, exist_ok=True)
        self.store = _core.Store(self.host_memory, nvme_dir=self.nvme_dir, nvme_budget=1 << 60,
                                 single_holder=True, aio=policy.aio,
                                 file_size=min(256 << 20, _pages(self.nvme_bytes)))
        _lifetime.track(self)
        # Half the budget reads ahead; the rest holds what a gather or a step uses now.
        self.scheduler = _core.PrefetchScheduler(self.store, budget_share=0.5)
        for s in chosen:
            homed = _Homed(s, self.store.create_block(s.name, s.room, "nvme"))
            homed.away = HomedTensor(Home(f"'{s.name}''s shard (homed on NVMe by tierflow.torch.fsdp.offload)",
                                          Layout.of(s.real), self._opener(homed, grad=False)))
            self._write_home(homed)
            self._undo.append(_fsdp2.wrap_reset(s, lambda homed=homed: self._materialize(homed),
                                                lambda homed=homed: self._reset_done(homed)))
            self._homed.append(homed)
            self._by_group[id(s.group)].append(homed)
            self._by_param[id(s.parameter)] = homed
        self.store.flush()
        groups = {id(h.shard.group): h.shard.group for h in self._homed}
        for group in groups.values():
            self._undo.append(_fsdp2.wrap_unshard(group, self._before_gather, self._after_gather))
            if policy.gradients == "nvme":
                self._undo.append(_fsdp2.wrap_post_backward(group, self._after_reduce))
        self._undo.append(model.register_forward_pre_hook(self._root_pre_forward, prepend=True).remove)
        modules = {id(h.shard.module): h.shard.module for h in self._homed}
        for module in modules.values():
            self._undo.append(module.register_state_dict_pre_hook(self._materialize_hook).remove)
            self._undo.append(module.register_load_state_dict_pre_hook(self._materialize_hook).remove)
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self._undo.append(register_optimizer_step_pre_hook(self._step_pre_hook).remove)
        self._undo.append(register_optimizer_step_post_hook(self._step_post_hook).remove)

    # ---- the iteration ------------------------------------------------------------------------

    def _begin(self) -> None:
        if self._in_iteration:
            self.scheduler.end_iteration()
        self.scheduler.begin_iteration()
        self._in_iteration = True

    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        self._send_grads(wait=True)
        self._rehome()
        if self._stepped or not self._in_backward or not self._in_iteration:
            self._begin()
        self._stepped = self._in_backward = False

    def _acquire(self, block: int, mode: str, what: str) -> Any:
        """A granted lease of ``block``'s host copy: through the prefetcher
        (in the iteration's order) once an iteration has begun."""
        if self.closed:
            raise RuntimeError(f"tierflow.torch.fsdp.offload: {what} was homed on NVMe by an offload since closed")
        try:
            if self._in_iteration:
                return self.scheduler.acquire(block, "host", mode)
            lease = self.store.acquire(block, "host", mode)
            lease.wait()
            return lease
        except OSError as e:
            raise type(e)(e.errno, f"tierflow.torch.fsdp.offload: bringing {what} into host memory "
                                   f"({self.host_memory} bytes) failed: {e.strerror or e}") from e

    @contextlib.contextmanager
    def _open(self, block: int, layout: Layout, mode: str, what: str):
        """A tensor of ``layout`` over a lease of ``block`` for the ``with``
        block, the lease released dirty when written and left cleanly (and a
        copy written but left by an exception dropped: the home keeps what it
        had)."""
        lease = self._acquire(block, mode, what)
        written = mode != "read"
        clean = False
        try:
            yield layout.over(_storage_of(lease))
            clean = True
        finally:
            lease.release(dirty=written and clean)
            if written:
                self.store.evict(block, "host")

    def _opener(self, homed: _Homed, grad: bool) -> Any:
        """The ``open`` of a HomedTensor standing in for ``homed``'s shard or gradient."""
        def open_(write: bool):
            block, away = (homed.grad_block, homed.grad_away) if grad else (homed.block, homed.away)
            what = f"'{homed.shard.name}''s {'gradient' if grad else 'shard'}"
            return self._open(block, away._home.layout, "write" if write else "read", what)
        return open_

    def _lease(self, homed: _Homed, mode: str) -> None:
        """Brings ``homed`` in (through the prefetcher, in the iteration's
        order) and points its views at the copy."""
        if homed.lease is not None:
            raise RuntimeError(f"tierflow.torch.fsdp.offload: '{homed.shard.name}''s shard is leased twice")
        if not self._in_iteration:
            self._begin()
        homed.lease = self._acquire(homed.block, mode, f"'{homed.shard.name}''s shard")
        _fsdp2.point_at(homed.shard, _storage_of(homed.lease))

    def _unlease(self, homed: _Homed, dirty: bool) -> None:
        _fsdp2.hollow(homed.shard, homed.away)
        lease, homed.lease = homed.lease, None
        self.scheduler.release(lease, dirty=dirty)

    # ---- gradients on NVMe (gradients="nvme") ----------------------------------------------------------

    def _after_reduce(self, group: Any) -> None:
        """After FSDP2 reduced ``group``'s gradients: each new one (not
        accumulated into one already home) is written home, once the copy
        from the GPU FSDP2 may still run has finished; those are sent later."""
        self._send_grads(wait=False)
        for homed in self._by_group.get(id(group), ()):
            grad = homed.shard.parameter.grad
            if grad is None or isinstance(_local(grad), HomedTensor):
                continue
            event = _fsdp2.grad_offload_event(homed.shard)
            if event is not None and not event.query():
                self._outgoing.append((event, homed))
            else:
                self._send_grad(homed)

    def _send_grads(self, wait: bool) -> None:
        while self._outgoing and (wait or self._outgoing[0][0].query()):
            event, homed = self._outgoing.popleft()
            event.synchronize()
            self._send_grad(homed)

    def _send_grad(self, homed: _Homed) -> None:
        """Writes ``homed``'s gradient home and leaves a HomedTensor as its local tensor."""
        grad = homed.shard.parameter.grad
        if grad is None or isinstance(_local(grad), HomedTensor):
            return  # (set to None, or home, meanwhile)
        local = _local(grad)
        layout = Layout.contiguous(local.shape, local.dtype)
        name = homed.shard.name
        if homed.grad_block is None:
            homed.grad_block = self.store.create_block(f"{name}.grad", max(layout.room, 1), "nvme")
            homed.grad_away = HomedTensor(Home(f"'{name}''s gradient (homed on NVMe by tierflow.torch.fsdp.offload)",
                                               layout, self._opener(homed, grad=True)))
        elif homed.grad_away._home.layout != layout:
            raise RuntimeError(f"tierflow.torch.fsdp.offload: '{name}''s gradient is {tuple(local.shape)} "
                               f"{local.dtype}, not {homed.grad_away._home.layout.size} "
                               f"{homed.grad_away._home.layout.dtype} as before")
        with self._open(homed.grad_block, layout, "overwrite", f"'{name}''s gradient") as home:
            home.copy_(local)
        _fsdp2.set_local(grad, homed.grad_away)

    def _lease_grad(self, homed: _Homed) -> None:
        """Points a homed gradient's local tensor at a (read) lease of it, for a step."""
        grad = homed.shard.parameter.grad
        if grad is None or _local(grad) is not homed.grad_away:
            return
        homed.grad_lease = self._acquire(homed.grad_block, "read", f"'{homed.shard.name}''s gradient")
        _fsdp2.set_local(grad, homed.grad_away._home.layout.over(_storage_of(homed.grad_lease)))

    def _unlease_grad(self, homed: _Homed) -> None:
        if homed.grad_lease is None:
            return
        grad = homed.shard.parameter.grad
        if grad is not None:
            _fsdp2.set_local(grad, homed.grad_away)
        lease, homed.grad_lease = homed.grad_lease, None
        lease.release(dirty=False)

    def _need(self, homed: _Homed) -> int:
        """The host memory a step of ``homed`` holds: its shard's, and its gradient's when that is home."""
        grad = homed.shard.parameter.grad
        away = grad is not None and _local(grad) is homed.grad_away
        return _pages(homed.room) + (_pages(homed.grad_away._home.layout.room) if away else 0)

    def _reap(self, wait: bool = False) -> None:
        while self._retiring and (wait or self._retiring[0][0].query()):
            event, held = self._retiring.popleft()
            event.synchronize()
            for homed in held:
                self._unlease(homed, dirty=False)

    def _before_gather(self, group: Any) -> None:
        self._reap(wait=len(self._retiring) > 1)
        self._send_grads(wait=False)
        self._in_backward = self._in_backward or _fsdp2.in_backward(group)
        taken = []
        try:
            for homed in self._by_group.get(id(group), ()):
                if homed.lease is None and _fsdp2.reads_shard(homed.shard):
                    self._lease(homed, "read")
                    taken.append(homed)
        except BaseException:
            self._abandon(taken)  # the gather does not run: none of its shards stays leased
            raise
        self._held += taken

    def _after_gather(self, group: Any) -> None:
        done = [h for h in self._held if h.shard.group is group]
        if not done:
            return
        self._held = [h for h in self._held if h.shard.group is not group]
        if torch.cuda.is_available() and torch.cuda.is_initialized() and _fsdp2.device_of(group).type == "cuda":
            # The copies to the GPU are queued behind what the current stream
            # waits on: the shards go back once an event after them has passed.
            event = torch.cuda.Event()
            event.record()
            self._retiring.append((event, done))
            return
        for homed in done:
            self._unlease(homed, dirty=False)

    # ---- the optimizer step ---------------------------------------------------------------------

    def _steps(self, optimizer: torch.optim.Optimizer) -> list[_Homed]:
        """The NVMe-homed shards ``optimizer`` would step now (those with a
        gradient), but those in ordinary memory now, stepped there."""
        out = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                homed = self._by_param.get(id(p))
                if homed is not None and p.grad is not None and not homed.materialized:
                    out.append(homed)
        return out

    def _step_pre_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
        if not any(id(p) in self._by_param for group in optimizer.param_groups for p in group["params"]):
            return None
        # (``args`` holds the optimizer first.) A closure (Lightning's loop
        # passes one) makes the gradients: it runs here, once, before the
        # homed shards are stepped, and the step gets its loss back.
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        result = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

            def ran() -> Any:
                return loss

            result = ((args[0], ran, *args[2:]), kwargs) if len(args) > 1 else (args, {**kwargs, "closure": ran})
        homed = self._steps(optimizer)
        if homed:
            self._step_homed(optimizer, homed)
        return result

    def _step_homed(self, optimizer: torch.optim.Optimizer, homed: list[_Homed]) -> None:
        self._reap(wait=True)
        self._send_grads(wait=True)
        from tierflow.torch.optim import Adam, Muon

        if isinstance(optimizer, (Adam, Muon)):
            # tierflow's optimizers step the shards a budget at a time, and the
            # step itself the rest, their gradients set aside meanwhile.
            room, chunk, held = self.host_memory // 2, [], 0
            try:
                for h in homed:
                    need = self._need(h)
                    if chunk and held + need > room:
                        self._step_chunk(optimizer, chunk)
                        chunk, held = [], 0
                    chunk.append(h)
                    self._lease(h, "write")
                    self._lease_grad(h)
                    held += need
                self._step_chunk(optimizer, chunk)
            finally:
                self._abandon(chunk)  # (a chunk whose lease or step failed: its shards as they were)
            for h in homed:
                p = h.shard.parameter
                self._stashed.append((p, p.grad))
                p.grad = None
            return
        need = sum(self._need(h) for h in homed)
        if need > self.host_memory:
            raise ValueError(
                f"tierflow.torch.fsdp.offload: {type(optimizer).__name__} steps every parameter at once, so its "
                f"{len(homed)} NVMe-homed shards ({need} bytes) must fit OffloadPolicy.host_memory "
                f"({self.host_memory} bytes) together; give at least {need}, or step with "
                "tierflow.torch.optim's optimizers, which step them a budget at a time")
        try:
            for h in homed:
                self._stepping.append(h)
                self._lease(h, "write")
                self._lease_grad(h)
        except BaseException:
            self._abandon(self._stepping)
            self._stepping = []
            raise

    def _abandon(self, held: list[_Homed]) -> None:
        """Releases ``held`` unwritten: their homes keep the values before
        the gather or step that failed."""
        for h in held:
            if h.lease is not None:
                self._unlease(h, dirty=False)
            self._unlease_grad(h)

    def _step_chunk(self, optimizer: Any, chunk: list[_Homed]) -> None:
        params = [h.shard.parameter for h in chunk]
        try:
            optimizer.step_parameters(params)
        finally:
            forget = getattr(optimizer, "_forget_views", None)  # (Adam's views of the leases, which go now)
            if forget is not None:
                forget(params)
        for h in chunk:
            self._unlease(h, dirty=True)
            self._unlease_grad(h)

    def _step_post_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._stepped = True
        stepping, self._stepping = self._stepping, []
        for h in stepping:
            self._unlease(h, dirty=True)
            self._unlease_grad(h)
        stashed, self._stashed = self._stashed, []
        for p, grad in stashed:
            p.grad = grad

    # ---- values outside the iteration ------------------------------------------------------------

    def materialize(self, modules: Iterable[nn.Module] | None = None) -> None:
        """Brings the NVMe-homed shards of ``modules`` (None: all) into
        ordinary host memory, where their parameters can be read and written
        (and are stepped) until the next forward writes them home."""
        wanted = None if modules is None else {id(m) for m in modules}
        for homed in self._homed:
            if wanted is None or id(homed.shard.module) in wanted:
                self._materialize(homed)

    def _materialize(self, homed: _Homed) -> None:
        """One shard into ordinary host memory (none leased, or there already)."""
        if homed.materialized or homed.lease is not None:
            return
        pin = homed.shard.offloaded_to_cpu and self.policy.pin_memory and torch.cuda.is_available()
        target = torch.empty(homed.room, dtype=torch.uint8, pin_memory=pin)
        with self.store.acquire(homed.block, "host", "read") as lease:
            target.copy_(torch.from_dlpack(lease.wait())[: homed.room])
        _fsdp2.point_at(homed.shard, target.untyped_storage())
        homed.materialized = True

    def _reset_done(self, homed: _Homed) -> None:
        """After FSDP2 re-saved the shard's views (``module.to``): the same
        room, or the block no longer fits them."""
        block_bytes = self.store.describe(homed.block)["size_bytes"]
        if homed.shard.room > block_bytes:
            raise RuntimeError(f"tierflow.torch.fsdp.offload: '{homed.shard.name}''s shard grew to "
                               f"{homed.shard.room} bytes (a dtype changed after offload()); call offload() after "
                               "the model's last .to()")
        homed.away = HomedTensor(Home(homed.away._home.name, Layout.of(homed.shard.real),
                                      self._opener(homed, grad=False)))

    def _write_home(self, homed: _Homed) -> None:
        """Writes the values the shard's views hold into its block, on its
        way to NVMe, and leaves the views hollow."""
        with self.store.acquire(homed.block, "host", "overwrite") as lease:
            torch.from_dlpack(lease.wait())[: homed.room].copy_(_bytes_of(homed.shard))
            lease.release(dirty=True)
        self.store.evict(homed.block, "host")
        _fsdp2.hollow(homed.shard, homed.away)

    def _rehome(self) -> None:
        """Writes the materialized shards home."""
        for homed in self._homed:
            if homed.materialized:
                self._write_home(homed)
                homed.materialized = False

    def _materialize_hook(self, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        """state_dict's and load_state_dict's pre-hook: ``module``'s shards in ordinary memory."""
        self.materialize([module])

    # ---- telemetry and the end ------------------------------------------------------------------------

    def telemetry(self) -> dict[str, Any]:
        """The store's counters (bytes moved, loads, stall time per tier and
        link) and the prefetcher's (iterations, stalled accesses, stall
        seconds); {} when no shard is homed on NVMe."""
        if self.store is None:
            return {}
        return {"store": self.store.telemetry(), "prefetch": self.scheduler.stats}

    def close(self) -> None:
        """Brings every shard back into ordinary host memory, removes the
        hooks, the store and its files. Idempotent."""
        if self.closed:
            return
        self._reap(wait=True)
        self._drop_leases()
        if self.store is not None:
            self.materialize()
            self._bring_grads_back()
            for undo in reversed(self._undo):
                undo()
            self._undo.clear()
            if self._in_iteration:
                self.scheduler.end_iteration()
                self._in_iteration = False
            for homed in self._homed:
                homed.materialized = False
        self._release_native()

    def _drop_leases(self) -> None:
        """Releases what a gather, a step or a gradient's read left leased (a
        failure, or the interpreter's end mid-iteration), unwritten: their
        homes keep the last values written."""
        self._abandon(self._held + self._stepping + [h for h in self._homed if h.lease or h.grad_lease])
        self._held, self._stepping = [], []

    def _bring_grads_back(self) -> None:
        """Every gradient homed on NVMe (or still being copied there) into ordinary host memory."""
        for event, _ in self._outgoing:
            event.synchronize()
        self._outgoing.clear()
        for homed in self._homed:
            grad = homed.shard.parameter.grad
            if grad is not None and homed.grad_away is not None and _local(grad) is homed.grad_away:
                _fsdp2.set_local(grad, homed.grad_away.clone())

    def _release_native(self) -> None:
        if self.store is not None and not self.closed:
            self._drop_leases()
        self.closed = True
        if self.store is not None:
            store, self.store, self.scheduler = self.store, None, None
            store.close()
            del store  # (the last reference: its files go with it)
            for directory in (self.nvme_dir, os.path.dirname(self.nvme_dir)):
                try:
                    os.rmdir(directory)
                except OSError:  # not empty: another rank's, or the user's
                    break


def _bytes_of(shard: _fsdp2.Shard) -> Tensor:
    """The shard's storage bytes its views cover, from the start of the storage."""
    return torch.empty(0, dtype=torch.uint8).set_(shard.data.untyped_storage(), 0, (shard.room,), (1,))


def offload(model: nn.Module, policy: OffloadPolicy) -> ShardOffload:
    """Homes the local shards of the ``fully_shard`` model ``model`` (the
    root) that ``policy`` names on NVMe, and returns the :class:`ShardOffload`
    that runs them. Call it after ``fully_shard`` and before the first
    forward's parameters are used by anything but FSDP2 and an optimizer.

    Each NVMe-homed shard is written to a file of ``policy.nvme_dir`` and
    its memory freed. Before FSDP2 all-gathers a module's parameters, in
    forward and in backward, their shards are read into tierflow's host
    memory (ahead of time, in the order the first iteration used them, within
    ``policy.host_memory``), and go back once the gather has read them; the
    optimizer's step reads them (for writing) before it runs and writes them
    home after. tierflow's optimizers step them a budget at a time; another
    optimizer (``torch.optim.AdamW``) steps all parameters at once, so the
    shards it steps must fit the budget together. The gradients stay where
    FSDP2 puts them.

    Raises ValueError for a model that is not the root ``fully_shard``
    module, shards on a GPU (``fully_shard`` them with
    ``offload_policy=policy`` or ``CPUOffloadPolicy()``), a bad policy value
    or a shard larger than the budget, and RuntimeError for a torch whose
    FSDP2 internals differ from those this was built against."""
    return ShardOffload(model, policy)



def clip_grad_norm_(parameters: Tensor | Iterable[Tensor], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None) -> Tensor:
    """Clips the gradients of ``parameters`` by their total norm, as
    ``torch.nn.utils.clip_grad_norm_`` does, and returns that norm (a
    0-dim fp32 tensor on the CPU, the same on every rank).

    A DTensor gradient (FSDP2's, sharded over a mesh) counts by its local
    shard: each rank sums its shards' ``norm_type``-th powers (or takes their
    maximum for ``inf``), the sums are all-reduced once per mesh over each
    mesh dimension the gradient is sharded over (not a replicated one, as
    HSDP's), on the mesh's device (a CUDA mesh's NCCL gets a CUDA scalar even
    when the gradients are in host memory), and every local shard
    is scaled in place by ``max_norm / (total + 1e-6)`` when that is below 1.
    A plain tensor gradient counts once, as it is on every rank. ``foreach``
    is accepted as torch's (the norms are computed per tensor either way).
    Raises RuntimeError, as torch does, when ``error_if_nonfinite`` and the
    total norm is nan or inf."""
    if isinstance(parameters, Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    max_norm, norm_type = float(max_norm), float(norm_type)
    if not grads:
        return torch.tensor(0.0)
    inf = math.isinf(norm_type)
    # Per mesh and placements: the dimensions a gradient is sharded over are
    # the ones its norm is summed over (a replicated one, HSDP's, holds the
    # same shard on every rank and is not).
    local_by_mesh: dict[tuple, tuple[object, list[int], list[Tensor]]] = {}
    plain: list[Tensor] = []
    for g in grads:
        if _DTensor is not None and isinstance(g, _DTensor):
            dims = [d for d, placement in enumerate(g.placements) if placement.is_shard()]
            key = (id(g.device_mesh), tuple(dims))
            local_by_mesh.setdefault(key, (g.device_mesh, dims, []))[2].append(_local(g))
        else:
            plain.append(g)

    def part(tensors: list[Tensor]) -> Tensor:
        """Their max |g| (inf) or sum of |g|^p, fp32 on the CPU."""
        norms = [torch.linalg.vector_norm(t.detach(), norm_type, dtype=torch.float32).cpu() for t in tensors
                 if t.numel() > 0]
        if not norms:
            return torch.tensor(0.0)
        stacked = torch.stack(norms)
        return stacked.max() if inf else (stacked ** norm_type).sum()

    import torch.distributed as dist

    total = part(plain)
    for mesh, dims, locals_ in local_by_mesh.values():
        value = part(locals_)
        device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" \
            else torch.device(mesh.device_type)
        reduced = value.to(device)
        for dim in dims:
            dist.all_reduce(reduced, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM,
                            group=mesh.get_group(dim))
        value = reduced.cpu()
        total = torch.maximum(total, value) if inf else total + value
    total = total if inf else total ** (1.0 / norm_type)
    if error_if_nonfinite and not math.isfinite(total.item()):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
            "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g in grads:
            target = _local(g)
            target.mul_(coef.to(device=target.device, dtype=target.dtype))
    return total
