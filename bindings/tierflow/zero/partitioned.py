"""Stage 3's runtime: every parameter in tierflow's store.

Each parameter is fetched around its module's forward and backward
(hooks.py) and its gradient goes to the store as it is made. The optimizer
steps the parameters batch by batch in host memory, each batch's compute
copies and gradients leased there while its state streams from where it
lives; with ``zero_optimization.zenflow`` ZenFlow steps fp32 masters in host
memory instead (zenflow.py). With nothing global to know first, each
parameter steps during the backward (overlap.py).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable

import torch

from tierflow.config import Config, MuonConfig
from tierflow.zero.comm import Group, current_group
from tierflow.zero.hooks import ModuleHooks
from tierflow.zero.init import mark
from tierflow.zero.overlap import OverlappedStep, overlappable
from tierflow.zero.partition import ParamStore, Partition
from tierflow.zero.plan import Plan, format_bytes, links_of, make_plan, parameters_of, tiers_of
from tierflow.zero.runtime import (OptimizerSide, adam_class_and_options, muon_named, muon_optimizer,
                                   optimizer_nvme, zenflow_options)
from tierflow.zero.zenflow import PartitionedZenFlow

__all__ = ["PartitionedRuntime"]


class PartitionedRuntime:
    """The :class:`~tierflow.zero.runtime.Runtime` of stage 3.

    ``store``: the store the model was built into under
    :class:`~tierflow.zero.init.Init`, else None (one is made).
    ``is_boundary`` tells whether the micro-batch under way ends an
    accumulation; ``needs_norm`` whether a step needs the gradients' global
    norm (clipping, an overflow check), which keeps the step out of the
    backward. The optimizer's parameters are the partitions' step
    parameters: one per model parameter (its shape, or this rank's flat
    shard with several ranks), over host copies leased only while it steps.
    """

    partitioned = True

    def __init__(self, model: torch.nn.Module, config: Config, trainable: list, *, group: Group,
                 store: ParamStore | None, is_boundary: Callable[[], bool], needs_norm: bool) -> None:
        self.module = model
        self.config = config
        self.group = group
        self._is_boundary = is_boundary
        self._need_norm = False
        self._norm_sq = 0.0
        self._finite = True
        self._norm_counted: set[int] = set()
        self.plan, self.params = self._store(model, config, store)
        self.hooks = ModuleHooks(model, self.params, self._on_grad, self._model_forward)
        self.zenflow: PartitionedZenFlow | None = None
        try:
            nvme = optimizer_nvme(config, group.rank, group.world_size, self.plan)
            if config.zero.zenflow is not None:  # ZenFlow steps fp32 masters in host memory
                self.zenflow = PartitionedZenFlow(self.params, model, trainable, zenflow_options(config, nvme))
                self.optimizer = self.zenflow.optimizer
            elif isinstance(config.optimizer, MuonConfig):  # split by the parameters' shapes, not their shards'
                standins = {}
                for p in trainable:
                    part = self.params.part_of(p)
                    if part is not None:
                        standins[id(part.standin)] = part.step_param
                self.optimizer = muon_optimizer(config, muon_named(model, trainable, self._standin), nvme,
                                                stepped=lambda t: standins.get(id(t), t), group=group)
            else:
                cls, kwargs = adam_class_and_options(config, nvme)
                self.optimizer = cls(self._stepped(trainable), **kwargs)
        except BaseException:  # the model gets its values back, the store its files
            self.hooks.remove()
            self.params.restore_all()
            self.params.close()
            raise
        self.state = OptimizerSide(self.optimizer, self.zenflow)
        self._overlap = OverlappedStep(self.params, self.optimizer,
                                       steps=overlappable(config, needs_norm, group.world_size),
                                       on_norm=self._count_norm)

    # ---- construction -------------------------------------------------------------------------

    def _store(self, model: torch.nn.Module, config: Config, params: ParamStore | None) -> tuple[Plan, ParamStore]:
        group = self.group
        if params is not None and group.world_size != current_group().world_size:
            raise ValueError(f"tierflow.zero.Init: the model was built for {group.world_size} ranks, the process "
                             f"group now has {current_group().world_size}; build it under the same group")
        plan = make_plan(model, config, world_size=group.world_size)
        if params is None:
            params = ParamStore(plan, trace=bool(getattr(config.tierflow, "trace", False)), group=group)
        else:
            plan = _fit_store(plan, params.plan, config)
            params.plan = plan
        for info, (name, _, p) in zip(plan.params, parameters_of(model)):
            part = params.part_of(p)
            if part is None:
                params.adopt(p, name, persistent=info.persistent)
                mark(p, params)
            else:
                part.name, part.persistent = name, info.persistent
        # A parameter zero.Init stored that the model no longer has (a tied
        # head's own weight, replaced by the embedding's): not trained, saved
        # or counted.
        params.keep_only({id(p) for _, _, p in parameters_of(model)})
        if params.device.type == "cuda":  # the model's buffers (norm statistics, position ids) beside it
            for module in model.modules():
                for key, buffer in module._buffers.items():
                    if buffer is not None and buffer.device != params.device:
                        module._buffers[key] = buffer.to(params.device)
        return plan, params

    def _stepped(self, trainable: list) -> list:
        """What the optimizer steps for ``trainable`` (parameters, or param
        groups): each partition's :attr:`~Partition.step_param` — a
        parameter of the model's shape over its host copy with one rank, over
        this rank's flat shard with several (as DeepSpeed's stage-3
        optimizer holds flat partitions)."""

        own = self._own
        return [{**g, "params": [own(p) for p in g["params"]]} if isinstance(g, dict) else own(g)
                for g in trainable]

    def _standin(self, p: Any) -> Any:
        """A tensor of the model's parameter ``p``'s shape (its partition's stand-in)."""
        part = self.params.part_of(p)
        return part.standin if part is not None else p

    def _own(self, p: Any) -> Any:
        """What the optimizer steps for the model's parameter ``p``."""
        part = self.params.part_of(p)
        return part.step_param if part is not None else p

    @property
    def device(self) -> torch.device:
        return self.params.device

    # ---- a training step ----------------------------------------------------------------------

    def forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        return module(*args, **kwargs)  # the hooks' _model_forward brackets it

    def _model_forward(self, starting: bool) -> None:
        """A forward of the whole model starts or ends, through the engine or
        the model called directly (``engine.module(x)``, ``generate()``): a
        training forward opens the scheduler's iteration, an evaluation reads
        the newest values and gives the device back."""
        training = self.module.training and torch.is_grad_enabled()
        if starting:
            self._overlap.wait()  # a forward before step(): the work of a backward ends first
            if training:
                self.params.begin_iteration()
            else:
                self.finish()
        else:
            # What the forward gathered on a GPU was only waited for by its
            # streams: the output is read next, so a gather that failed
            # since raises now, not after its garbage went into a loss.
            self.group.check()
            if not training:
                self.params.release_all(keep_persistent=self.params.in_iteration)

    def backward(self, loss: torch.Tensor, retain_graph: bool, need_norm: bool) -> None:
        self._need_norm = need_norm
        try:
            loss.backward(retain_graph=retain_graph)
            self._overlap.wait()  # the last gradient's add, or step: its error is the backward's
        finally:
            self.params.release_all(keep_persistent=True)
            self.params.settle()

    def _on_grad(self, part: Partition, grad: torch.Tensor) -> None:
        if self._overlap.take(part, grad, self._is_boundary()):
            return  # its last gradient of the boundary: stepped now, while the backward goes on
        self._overlap.accumulate(part, grad, self._need_norm)  # into the store, off this thread

    def _count_norm(self, part: Partition, sq: float, finite: bool) -> None:
        self._norm_sq += sq
        self._finite = self._finite and finite
        self._norm_counted.add(part.index)

    def end_micro_batch(self) -> None:
        self._overlap.end_micro_batch()

    def grad_norm_sq(self) -> tuple[float, bool]:
        self._overlap.wait()
        norm_sq, finite = self._norm_sq, self._finite
        for part in self.params.parts:  # gradients the last micro-batch did not touch
            if not part.grad_empty and part.index not in self._norm_counted:
                sq, ok = self.params.grad_norm_sq(part)
                norm_sq, finite = norm_sq + sq, finite and ok
        # Each rank holds its shards' share of the global norm (and may alone overflow).
        norm_sq, bad = self.group.sum(norm_sq if finite else 0.0, 0.0 if finite else 1.0)
        return norm_sq, bad == 0 and math.isfinite(norm_sq)

    def apply(self, factor: float | None) -> None:
        params = self.params
        self._forget_norm()
        try:
            self._overlap.wait()  # the backward's last parameter
            if factor is None:
                return
            params.release_all(keep_persistent=False)
            if self.zenflow is not None:
                self.zenflow.step(factor)
                return
            # A batch of parameters at a time (ParamStore.stepping); the
            # scheduler loads the next ones' blocks meanwhile. With the step
            # overlapped, these are the parameters the boundary's backward
            # did not reach (a module skipped then).
            parts = list(params.step_parts())
            while parts:
                with params.stepping(parts, factor) as batch:
                    self.optimizer.step_parameters([part.step_param for part in batch])
                parts = parts[len(batch):]
            # Once a step: the optimizer's own step hooks and counters (no
            # gradient is left, so it updates nothing).
            self.optimizer.step()
        finally:
            params.clear_grads()
            params.end_iteration()

    def zero_grad(self, set_to_none: bool) -> None:
        try:
            self._overlap.wait()  # a gradient on its way to the store lands before it goes
        finally:
            self._forget_norm()
            self.params.clear_grads()

    def _forget_norm(self) -> None:
        self._norm_sq, self._finite = 0.0, True
        self._norm_counted.clear()

    def check_no_sync(self) -> None:
        if self.group.world_size > 1:
            raise RuntimeError("no_sync: incompatible with ZeRO stage 3 over several ranks (each keeps only its "
                               "shard of a gradient, reduced as it is made)")

    def finish(self) -> None:
        self.state.finish()

    # ---- reports ------------------------------------------------------------------------------

    def memory_stats(self, busy_seconds: float) -> dict[str, Any]:
        t = self.params.telemetry()
        out: dict[str, Any] = {"tiers": tiers_of(t), "bytes": links_of(t), "stall_seconds": t["stall_seconds"],
                               "stall_fraction": t["stall_seconds"] / busy_seconds if busy_seconds > 0 else 0.0}
        if self.group.world_size > 1:  # the parameters gathered from every rank's shards
            out["tiers"]["gathered"] = {"budget": self.params.gather_budget, "used": self.params.gathered_bytes,
                                        "high_water": self.params.gathered_high_water}
            # Who ran the collectives, and the gathers issued ahead of their use.
            out["collectives"] = {"by": self.group.collectives, "tierflow": self.group.counts["tierflow"],
                                  "torch": self.group.counts["torch"],
                                  "gathered_ahead": self.params.gathered_ahead,
                                  "ahead_dropped": self.params.gathers_dropped,
                                  "shards_read_into_slots": self.params.shards_read_into_slots,
                                  "gather_chunks": self.params.gather_chunks}
        out["scheduler"] = self.params.scheduler.stats
        optimizer = self.state.memory_stats()
        if optimizer is not None:
            out["optimizer"] = optimizer
        return out

    def write_trace(self, path: str | os.PathLike) -> None:
        self.params.write_trace(path)

    # ---- checkpoints --------------------------------------------------------------------------

    def entries(self) -> list[tuple[str, Any]]:
        return [(part.name, part) for part in self.params.parts]

    def read(self, item: Partition) -> torch.Tensor:
        return self.params.read(item)

    def read_local(self, item: Partition) -> torch.Tensor:
        return self.params.read_local(item)

    def local_of(self, item: Partition, values: torch.Tensor) -> torch.Tensor:
        return self.group.shard_of(values.reshape(-1), item.shard_numel) if item.sharded else values

    def whole_of(self, item: Partition, local: torch.Tensor) -> torch.Tensor:
        return self.group.gather(local.reshape(-1))[: item.numel].view(item.shape) if item.sharded else local

    def master(self, item: Partition, local: torch.Tensor) -> torch.Tensor | None:
        if self.zenflow is not None:
            kept = self.zenflow.master_of(item)
            return self.local_of(item, kept) if kept is not None else None
        # The optimizer steps this rank's values (the parameter, or its
        # shard), and reads one it never stepped from them.
        p = item.step_param
        p.data = local
        try:
            return self.state.master_of_param(p)
        finally:
            p.data = item.step_placeholder

    def write(self, item: Partition, fill: Callable[[torch.Tensor], None]) -> None:
        self.params.release(item)  # a resident copy would be stale once this lands
        lease, view = self.params.host_view(item, "overwrite")
        try:
            fill(view)
        except BaseException:
            self.params.end_host(lease, dirty=False)
            raise
        self.params.end_host(lease, dirty=True)

    def flush(self) -> None:
        self.params.flush()

    def local_numel(self) -> dict[int, int]:
        return {id(part.step_param): part.shard_numel for part in self.params.parts}

    def close(self) -> None:
        self.hooks.remove()
        try:
            self._overlap.close()
        finally:
            self.state.close()
            self.params.close()


def _fit_store(plan: Plan, given: Plan, config: Config) -> Plan:
    """``plan`` (the model's) with the budgets of the store zero.Init built
    it into (``given``), which must hold the model's working set."""
    if given.device_budget < plan.minimum_device:
        raise ValueError(f"tierflow.device_memory: {format_bytes(given.device_budget)} cannot hold "
                         f"{plan.minimum_device_reason}; give at least {plan.minimum_device} bytes")
    if given.host_budget < plan.minimum_host:
        raise ValueError(f"tierflow.host_memory: {format_bytes(given.host_budget)} cannot hold "
                         f"{plan.minimum_host_reason}; give at least {plan.minimum_host} bytes")
    total = config.tierflow.host_memory
    zenflow_host = sum(plan.zenflow_bytes) + (plan.optimizer_host_budget or 0) \
        if plan.zenflow_bytes is not None else 0
    if zenflow_host and total is not None and given.host_budget + zenflow_host > int(total):
        # zero.Init sized its store before the model (and so ZenFlow's state) was known.
        raise ValueError(
            f"tierflow.host_memory: {format_bytes(int(total))} cannot hold ZenFlow's state "
            f"({format_bytes(zenflow_host)}) beside the {format_bytes(given.host_budget)} "
            "the store of tierflow.zero.Init took; ZenFlow keeps fp32 masters of the whole model in host "
            "memory, so build the model without zero.Init, or give tierflow.host_memory at least "
            f"{given.host_budget + zenflow_host} bytes")
    return dataclasses.replace(plan, device_budget=given.device_budget, host_budget=given.host_budget,
                               param_home=given.param_home, grad_home=given.grad_home, nvme_dir=given.nvme_dir)
