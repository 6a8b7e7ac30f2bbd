"""ZenFlow over fp32 masters: :class:`PartitionedZenFlow`, at ZeRO stage 3
and, through :class:`ResidentParams`, for a bf16/fp16 model at stages 1–2.

At stage 3 a parameter's compute copy is a block in the store, leased where it
is used, so ZenFlow's engine — which keeps views of the parameters it steps
and writes them between steps — cannot step it where it lies. As DeepSpeed's
ZenFlow does, the optimizer's state lives in host memory instead
(``offload_optimizer.device`` "cpu"): an fp32 master of every trainable
parameter, whole, and a :class:`~tierflow.torch.optim.ZenFlow` over the
masters. With "nvme" (beyond DeepSpeed's ZenFlow, which refuses it) the
windowed side's own masters and moments are files, streamed a weight at a
time by each of its steps (``ZenFlow(offload="nvme")``); the masters here
stay in host memory. At each accumulation boundary every parameter's accumulated
gradient is its master's ``.grad`` for the step (a view of its block, scaled
in place, when the gradients are homed in host memory, as with ZenFlow they
are: ZenFlow reads each into buffers of its own), ZenFlow steps, and
every master is written back into its compute block (rounded to the compute
dtype) through the store, from where the next forward leases it.

Over several data-parallel ranks each rank keeps the whole model's masters
and ZenFlow state, as one process does, and steps all of it: its column
selection ranks a matrix's columns by their gradient mass, and its "auto"
window ends when a fraction of all the weights agree, so both need whole
gradients of every weight. Each boundary gathers every gradient whole from
the ranks' shards of the mean (:meth:`ParamStore.gradients`); every rank then
runs the same step on the same values, so the masters stay equal to the bit
across ranks, and each writes its own shard back. The host memory and the
CPU step are one process's on every rank, not divided by the ranks.

The write-back right after :meth:`ZenFlow.step` reads masters nothing else
writes at that moment: under ``overlap_step`` the window's CPU step runs on
the engine's own thread over the windowed side's own copy of the masters and
its staging buffers (bindings/src/zenflow.cpp, core/src/zenflow/cpu_device.cpp);
its result reaches the masters only when the window is applied, on the
caller's thread, inside a later ``step()`` or ``finish()``. So after either
returns the masters are whole and still. The columns the windowed side owns
lag a window in the store as they do in the masters; :meth:`finish` (called
before an evaluation, a ``state_dict()`` and a save) applies the window in
flight and the open one, and writes the result back.

The masters are made from the store's values when the engine starts, and
again whenever the model's values are replaced from outside the optimizer:
``load_state_dict()`` of the model and ``load_checkpoint`` (a bf16/fp16 run's
checkpoint carries its masters). Values written into a parameter any other way
(``GatheredParameters`` with ``modifier_rank``) are overwritten at the next
step by its master, as DeepSpeed's fp32 partitions would.

At stages 1–2 the parameters stay where the model has them, and ZenFlow's
engine steps fp32 parameters in place; a bf16/fp16 model is stepped the same
way as at stage 3, through :class:`ResidentParams`, which gives its
parameters the store's shape: each gradient is read from ``.grad`` and each
master written back into the parameter (rounded to its dtype).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from tierflow.torch.optim.adam import _save_file
from tierflow.zero.copies import copy_into
from tierflow.zero.partition import ParamStore, Partition

__all__ = ["PartitionedZenFlow", "ResidentParams"]


class _ResidentPart:
    """A resident parameter as :class:`PartitionedZenFlow` sees a partition."""

    __slots__ = ("param", "name", "shape", "requires_grad", "grad_block")

    def __init__(self, param: torch.nn.Parameter, name: str) -> None:
        self.param, self.name = param, name
        self.shape = tuple(param.shape)
        self.requires_grad = param.requires_grad
        self.grad_block = 0  # its gradient is .grad

    @property
    def grad_empty(self) -> bool:
        return self.param.grad is None


@dataclass(frozen=True)
class _ResidentPlan:
    compute_dtype: torch.dtype
    zenflow_bytes: tuple[int, int, int]


class ResidentParams:
    """A model's parameters where the model keeps them (stages 1–2), read and
    written as :class:`PartitionedZenFlow` reads and writes a store's: the
    gradient from ``.grad``, the values from and into the parameter (any
    device). ``zenflow`` is the config's ZenFlow section and ``nvme``
    whether the windowed side's state is on NVMe (for the host memory its
    state takes)."""

    def __init__(self, model: torch.nn.Module, zenflow: Any, *, nvme: bool = False) -> None:
        from tierflow.zero.plan import zenflow_host_bytes

        self._parts: dict[int, _ResidentPart] = {}
        for name, p in model.named_parameters():
            self._parts.setdefault(id(p), _ResidentPart(p, name))
        trainable = [tuple(x.param.shape) for x in self._parts.values() if x.requires_grad]
        dtype = next(iter(self._parts.values())).param.dtype if self._parts else torch.float32
        self.plan = _ResidentPlan(dtype, zenflow_host_bytes(trainable, zenflow.topk_ratio, zenflow.overlap_step,
                                                            nvme=nvme))

    def part_of(self, p: Any) -> _ResidentPart | None:
        return self._parts.get(id(p))

    @contextlib.contextmanager
    def gradients(self, parts: list[_ResidentPart], buffers: list[torch.Tensor],
                  scale: float) -> Iterator[list[torch.Tensor]]:
        """:meth:`ParamStore.gradients`: each ``.grad`` times ``scale`` copied
        into its fp32 buffer (zeroed without one)."""
        for part, buffer in zip(parts, buffers):
            if part.grad_empty:
                buffer.zero_()
            else:
                copy_into(buffer, part.param.grad, scale)
        yield buffers

    def read(self, part: _ResidentPart) -> torch.Tensor:
        return part.param.detach()

    def write(self, part: _ResidentPart, value: torch.Tensor) -> None:
        copy_into(part.param.data, value)


class PartitionedZenFlow:
    """The fp32 masters of ``params``' trainable parameters and the ZenFlow
    optimizer over them (:attr:`optimizer`, what the engine's ``optimizer``
    and LR scheduler see: its ``param_groups`` are the model's groups, over the
    masters).

    ``trainable`` is the engine's: the model's parameters (in ``params``), or
    torch-style groups of them. ``options`` are ZenFlow's keyword arguments
    (AdamW's hyper-parameters, ``zenflow``, ``threads``). ``model`` gets a
    ``state_dict`` pre-hook that calls :meth:`finish` and a
    ``load_state_dict`` post-hook that makes the masters again (until
    :meth:`close`)."""

    def __init__(self, params: ParamStore | ResidentParams, model: torch.nn.Module, trainable: list,
                 options: dict[str, Any]) -> None:
        from tierflow.torch.optim import ZenFlow

        self.params = params
        groups = trainable if trainable and isinstance(trainable[0], dict) else [{"params": trainable}]
        self.parts: list[Partition] = []
        self.masters: list[torch.Tensor] = []
        master_groups = []
        for g, group in enumerate(groups):
            masters, names = [], []
            for i, p in enumerate(group["params"]):
                part = params.part_of(p)
                if part is None:
                    raise ValueError(f"model_parameters[{g}]['params'][{i}]: not a parameter of the model "
                                     "(stage 3 steps the parameters in its store)")
                if not part.requires_grad or part.grad_block < 0:
                    continue
                master = torch.empty(part.shape, dtype=torch.float32, requires_grad=True)
                # The gradient lives beside its master for the run: one buffer,
                # refilled at each step, so ZenFlow never makes one of its own.
                master.grad = torch.zeros_like(master)
                self.parts.append(part)
                self.masters.append(master)
                masters.append(master)
                names.append(part.name)
            master_groups.append({**{k: v for k, v in group.items() if k != "params"},
                                  "params": masters, "param_names": names})
        self._own_grads = [m.grad for m in self.masters]
        self._read_masters()
        self.optimizer = ZenFlow(master_groups, **options)
        self._overlap = bool(self.optimizer.schedule["overlap_step"])
        self._topk = float(self.optimizer.zenflow_config.get("topk_ratio", 0.1))
        self._nvme = self.optimizer.offload == "nvme"
        # Whether ZenFlow may hold updates the store has not seen (a window
        # open or in flight): set by a step, cleared by finish().
        self._unfinished = False
        # held_bytes() before and after the first selection: the sizes are
        # fixed, so each step reads a figure rather than recounting it.
        self._held = tuple(self._count_held(selected) for selected in (False, True))
        self._selected = False  # known to have a selection (it stays, once made)
        self.high_water = self.held_bytes()
        self._handles = [
            model.register_state_dict_pre_hook(lambda module, prefix, keep_vars: self.finish()),
            model.register_load_state_dict_post_hook(lambda module, incompatible: self.reload()),
        ]

    # ---- stepping -------------------------------------------------------------------------------

    def step(self, grad_scale: float) -> None:
        """One ZenFlow step from the accumulated gradients, each multiplied by
        ``grad_scale`` (the engine's unscale and clip factor), and every
        master written back to its compute block. A parameter without a
        gradient since the last step steps with a zero one (ZenFlow steps
        every parameter it holds)."""
        # ZenFlow reads each gradient into buffers of its own within its
        # step: it reads them where the store keeps them when it can.
        with self.params.gradients(self.parts, self._own_grads, grad_scale) as grads:
            for master, grad in zip(self.masters, grads):
                master.grad = grad
            try:
                self.optimizer.step()
            finally:
                for master, own in zip(self.masters, self._own_grads):
                    master.grad = own
        self._unfinished = True
        self._write_back()
        self.high_water = max(self.high_water, self.held_bytes())

    def finish(self) -> None:
        """Applies the window in flight and the open one (ZenFlow's
        ``finish``) and writes the masters back, so the store holds the newest
        values: before an evaluation, a ``state_dict()``, a save. A no-op when
        nothing has stepped since the last call."""
        if not self._unfinished:
            return
        self.optimizer.finish()
        self._write_back()
        self._unfinished = False

    def reload(self) -> None:
        """Makes the masters again from the store's values (the model's were
        replaced) and gives them to ZenFlow's host side
        (:meth:`ZenFlow.reload_values`: with its state on NVMe a weight at a
        time through its host budget), every moment and the selection kept."""
        self.optimizer.finish()
        self._read_masters()
        self.optimizer.reload_values()

    # ---- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """ZenFlow's state_dict (``"optimizer"``, after its ``finish``) and,
        when the compute copies are bf16/fp16, the fp32 masters by parameter
        name (``"masters"``): the compute copies alone would lose their low
        bits. fp32 masters are the compute copies, written back."""
        self.finish()
        sd = self.optimizer.state_dict()
        out: dict[str, Any] = {"optimizer": sd}
        if self.params.plan.compute_dtype != torch.float32:
            out["masters"] = {part.name: master.detach().clone() for part, master in zip(self.parts, self.masters)}
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Loads :meth:`state_dict`'s output after the model's values were
        loaded: the masters are the saved ones (bf16/fp16) or the store's
        values (fp32), and ZenFlow resumes from the saved state."""
        if not isinstance(state, dict) or "optimizer" not in state:
            raise ValueError("load_checkpoint: the optimizer's state is not a stage-3 ZenFlow state "
                             "(saved without zero_optimization.zenflow?)")
        self.optimizer.finish()
        self._load_masters(state.get("masters"))
        # The store already holds these values: the save wrote them back before the model's file.
        self._restart_engine(state["optimizer"])

    def save_state(self, directory: str) -> None:
        """With the windowed state on NVMe: ZenFlow's own streamed save into
        ``directory`` (:meth:`ZenFlow.save_state`, the state never whole in
        RAM) and, when the compute copies are bf16/fp16, the fp32 masters
        (``masters.pt``), written from where they lie."""
        self.finish()
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self.optimizer.save_state(directory)
        if self.params.plan.compute_dtype != torch.float32:
            _save_file({part.name: master.detach() for part, master in zip(self.parts, self.masters)},
                       os.path.join(directory, "masters.pt"))

    def load_state(self, directory: str) -> None:
        """Loads :meth:`save_state`'s directory after the model's values were
        loaded: the masters are the saved ones (bf16/fp16) or the store's
        values (fp32), and ZenFlow resumes from its streamed checkpoint, bit
        for bit."""
        self.optimizer.finish()
        saved = None
        if self.params.plan.compute_dtype != torch.float32:
            path = os.path.join(directory, "masters.pt")
            if not os.path.exists(path):
                raise ValueError(f"load_checkpoint: {directory} has no masters.pt, which a "
                                 f"{self.params.plan.compute_dtype} run's checkpoint holds")
            saved = torch.load(path, weights_only=True, mmap=True)  # read as they are copied, not all at once
        self._load_masters(saved)
        self.optimizer.load_state(directory)
        self._selected = False  # the loaded state's step count tells again

    def _load_masters(self, saved: dict[str, torch.Tensor] | None) -> None:
        """The masters again from the store, then ``saved``'s (by parameter
        name) over them when given; a missing or misshapen one is named."""
        self._read_masters()
        if saved is None:
            return
        missing = [part.name for part in self.parts if part.name not in saved]
        if missing:
            raise ValueError(f"load_checkpoint: the saved masters have no '{missing[0]}'")
        with torch.no_grad():
            for part, master in zip(self.parts, self.masters):
                value = saved[part.name]
                if tuple(value.shape) != part.shape:
                    raise ValueError(f"load_checkpoint: the saved master of '{part.name}' is "
                                     f"{list(value.shape)}, the parameter {list(part.shape)}")
                master.copy_(value)

    def master_of(self, part: Any) -> torch.Tensor | None:
        """A copy of ``part``'s fp32 master after :meth:`finish` (None for a
        parameter not trained); ``part`` a partition, or a resident parameter."""
        self.finish()
        if isinstance(self.params, ResidentParams):
            part = self.params.part_of(part) or part
        for p, master in zip(self.parts, self.masters):
            if p is part:
                return master.detach().clone()
        return None

    # ---- reports -------------------------------------------------------------------------------

    def held_bytes(self) -> int:
        """The host memory ZenFlow's state holds now, beside a refresh's
        columns changing sides: the masters and their gradients (their
        tensors' sizes) and the C++ engine's state as
        :func:`~tierflow.zero.plan.zenflow_host_bytes` counts it (the
        selection's, once the first step made one). The plan's budget adds the
        hand-over's."""
        if not self._selected:
            self._selected = self.optimizer.zenflow_stats().get("steps", 0) > 0
        return self._held[self._selected]

    def _count_held(self, selected: bool) -> int:
        from tierflow.zero.plan import zenflow_host_bytes

        ours = sum(2 * m.untyped_storage().nbytes() for m in self.masters)  # a master and its gradient
        counted = zenflow_host_bytes([tuple(m.shape) for m in self.masters], self._topk, self._overlap,
                                     selected=selected, hand_over=False, nvme=self._nvme)
        return ours + sum(counted) - 8 * sum(m.numel() for m in self.masters)

    def memory_stats(self) -> dict[str, Any]:
        """The engine's ``memory_stats()["optimizer"]``: ZenFlow's host memory,
        its budget the plan's; with its state on NVMe, the stream's host tier
        (``tiers["stream"]``), its files (``tiers["nvme"]``) and the bytes
        moved each way (``bytes``)."""
        budget = sum(self.params.plan.zenflow_bytes or (0,))
        from tierflow.zero.plan import links_of, tiers_of

        tiers: dict[str, Any] = {"host": {"budget": budget, "used": self.held_bytes(), "high_water": self.high_water}}
        moved: dict[str, int] = {}
        t = self.optimizer.telemetry()
        if t is not None:
            streamed = tiers_of(t)
            tiers["stream"] = streamed.pop("host")
            tiers.update(streamed)
            moved = links_of(t)
        return {"tiers": tiers, "bytes": moved, "zenflow": self.optimizer.zenflow_stats()}

    def close(self) -> None:
        """Takes the model's hooks off (idempotent)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ---- internals -----------------------------------------------------------------------------

    def _read_masters(self) -> None:
        with torch.no_grad():
            for part, master in zip(self.parts, self.masters):
                master.copy_(self.params.read(part))
        self._unfinished = False

    def _restart_engine(self, state: dict[str, Any]) -> None:
        # ZenFlow's engine keeps its own copy of the masters under
        # overlap_step and reads them when it is made: a load drops it, and
        # the next step makes it again from the masters as they are now.
        self.optimizer.load_state_dict(state)
        self._selected = False  # the loaded state's step count tells again

    def _write_back(self) -> None:
        # Last to first: the parameters the next forward needs first are
        # written last, so the store still holds them in host memory when it
        # starts (the scheduler keeps a written copy whose next use is near).
        for part, master in zip(reversed(self.parts), reversed(self.masters)):
            self.params.write(part, master.detach())
