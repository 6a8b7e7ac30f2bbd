"""Stages 0–2's runtime: the parameters stay where the model keeps them.

tierflow's Adam/AdamW steps them (its state in host memory or on NVMe), or
ZenFlow: in place for an fp32 model, over fp32 masters for a bf16/fp16 one
(as at stage 3, :class:`~tierflow.zero.zenflow.PartitionedZenFlow` over
:class:`~tierflow.zero.zenflow.ResidentParams`).
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable

import torch

from tierflow.config import Config, MuonConfig
from tierflow.zero import copies
from tierflow.zero.runtime import (OptimizerSide, adam_class_and_options, muon_named, muon_optimizer,
                                   optimizer_nvme, zenflow_options)
from tierflow.zero.zenflow import PartitionedZenFlow, ResidentParams

__all__ = ["ResidentRuntime"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class ResidentRuntime:
    """The :class:`~tierflow.zero.runtime.Runtime` of stages 0–2: one
    process, the model cast to ``precision`` and its ``trainable``
    parameters (or param groups) stepped where they are."""

    partitioned = False
    plan = None

    def __init__(self, model: torch.nn.Module, config: Config, trainable: list, *, precision: str) -> None:
        self.module = model
        if isinstance(config.optimizer, MuonConfig):
            named = muon_named(model, trainable, lambda p: p)
            where = next((p.device for _, p in named if p.device.type != "cpu"), None)
            if where is not None:
                raise ValueError(f"optimizer.type: Muon at zero_optimization.stage {config.zero.stage} with the model on "
                                 f"{where}; Muon steps host matrices in place (give stage 3, whose step runs on "
                                 "host copies, or keep the model on the CPU)")
        if precision != "fp32":
            model.to(_DTYPES[precision])
        self.zenflow: PartitionedZenFlow | None = None
        self._hooks: list[Any] = []
        nvme = optimizer_nvme(config, 0, 1, None)
        zf = config.zero.zenflow
        if isinstance(config.optimizer, MuonConfig):
            self.optimizer = muon_optimizer(config, named, nvme)
            self.state = OptimizerSide(self.optimizer)
        elif zf is None:
            cls, kwargs = adam_class_and_options(config, nvme)
            self.optimizer = cls(trainable, **kwargs)
            self.state = OptimizerSide(self.optimizer)
        elif precision != "fp32":  # ZenFlow's engine steps fp32 parameters in place: masters, as at stage 3
            resident = ResidentParams(model, zf, nvme="nvme_dir" in nvme)
            self.zenflow = PartitionedZenFlow(resident, model, trainable, zenflow_options(config, nvme))
            self.optimizer = self.zenflow.optimizer
            self.state = OptimizerSide(self.optimizer, self.zenflow)
        else:
            from tierflow.torch.optim import ZenFlow

            self.optimizer = ZenFlow(trainable, **zenflow_options(config, nvme))
            self.state = OptimizerSide(self.optimizer, in_place=True)
            # The model's values lag the open window until finish(): a
            # state_dict() of the model reads them after it. A
            # load_state_dict() lands after it too, and the host side then
            # takes the loaded values, which its own copy would overwrite.
            self._hooks = [
                model.register_state_dict_pre_hook(lambda module, prefix, keep_vars: self.state.finish()),
                model.register_load_state_dict_pre_hook(lambda module, *args: self.state.finish()),
                model.register_load_state_dict_post_hook(lambda module, incompatible: self.optimizer.reload_values()),
            ]

    @property
    def device(self) -> torch.device:
        first = next(self.module.parameters(), None)
        return first.device if first is not None else torch.device("cpu")

    # ---- a training step ----------------------------------------------------------------------

    def forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        if not (module.training and torch.is_grad_enabled()):
            self.finish()  # an evaluation reads the newest values
        return module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool, need_norm: bool) -> None:
        loss.backward(retain_graph=retain_graph)

    def end_micro_batch(self) -> None:
        pass

    def _with_grads(self) -> list[torch.Tensor]:
        """The stepped parameters that have a gradient (under ZenFlow over
        masters, the model's: its masters' gradients are made from them)."""
        stepped = self.module.parameters() if self.zenflow is not None else \
            (p for g in self.optimizer.param_groups for p in g["params"])
        return [p for p in stepped if p.grad is not None]

    def grad_norm_sq(self) -> tuple[float, bool]:
        norm_sq = sum(copies.norm_sq(p.grad) for p in self._with_grads())
        return norm_sq, math.isfinite(norm_sq)

    def apply(self, factor: float | None) -> None:
        try:
            if factor is None:
                return
            if self.zenflow is not None:
                self.zenflow.step(factor)  # the model's gradients into the masters, scaled; the masters back
                return
            if factor != 1.0:
                with torch.no_grad():
                    for p in self._with_grads():
                        p.grad.mul_(factor)
            self.optimizer.step()
        finally:
            self.zero_grad(True)

    def zero_grad(self, set_to_none: bool) -> None:
        if self.zenflow is not None:  # the masters' gradients are ZenFlow's buffers, refilled each step
            self.module.zero_grad(set_to_none=set_to_none)
        else:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def check_no_sync(self) -> None:
        pass  # one process: nothing is reduced

    def finish(self) -> None:
        self.state.finish()

    # ---- reports ------------------------------------------------------------------------------

    def memory_stats(self, busy_seconds: float) -> dict[str, Any]:
        out: dict[str, Any] = {"tiers": {}, "bytes": {}, "stall_seconds": 0.0, "stall_fraction": 0.0}
        optimizer = self.state.memory_stats()
        if optimizer is not None:
            out["optimizer"] = optimizer
        return out

    def write_trace(self, path: str | os.PathLike) -> None:
        raise ValueError("write_trace: only stage 3 keeps parameters in the store")

    # ---- checkpoints --------------------------------------------------------------------------

    def entries(self) -> list[tuple[str, Any]]:
        seen, out = set(), []
        for name, p in self.module.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append((name, p))
        return out

    def read(self, item: torch.nn.Parameter) -> torch.Tensor:
        return item.detach().cpu()

    read_local = read

    def local_of(self, item: torch.nn.Parameter, values: torch.Tensor) -> torch.Tensor:
        return values

    def whole_of(self, item: torch.nn.Parameter, local: torch.Tensor) -> torch.Tensor:
        return local

    def master(self, item: torch.nn.Parameter, local: torch.Tensor) -> torch.Tensor | None:
        if self.zenflow is not None:
            return self.zenflow.master_of(item)
        return self.state.master_of_param(item)

    def write(self, item: torch.nn.Parameter, fill: Callable[[torch.Tensor], None]) -> None:
        target = torch.empty(item.shape, dtype=item.dtype)
        fill(target)
        with torch.no_grad():
            item.copy_(target)

    def flush(self) -> None:
        pass  # the model holds its values

    def local_numel(self) -> dict[int, int]:
        return {id(p): p.numel() for g in self.optimizer.param_groups for p in g["params"]}

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self.state.close()
