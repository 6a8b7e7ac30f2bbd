"""The ``scheduler`` section: DeepSpeed's WarmupLR, WarmupDecayLR and
WarmupCosineLR as :class:`SchedulerConfig`, and the ``LambdaLR`` that sets
their learning rates step for step."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Literal

from tierflow.config.schema import _Auto, _refuse_auto

@dataclass(frozen=True)
class SchedulerConfig:
    """``scheduler``: DeepSpeed's WarmupLR, WarmupDecayLR or WarmupCosineLR
    with its parameters and defaults. :meth:`build` makes the
    ``torch.optim.lr_scheduler.LambdaLR`` that sets the same learning rates,
    step for step, as DeepSpeed's class would.

    With ``w = max(2, warmup_num_steps)`` and DeepSpeed's iteration ``i``
    (``-1`` before the first ``step()``, then 0, 1, ...), the warm-up fraction
    is ``g(i) = log(i + 1) / log(w)`` ("log") or ``i / w`` ("linear") while
    ``i < w``:

    * WarmupLR: ``lr = min + (max - min) * g(i)``, then ``max``;
    * WarmupDecayLR: the same warm-up, then
      ``max(0, (total - i) / max(1, total - w))`` in place of ``g``;
    * WarmupCosineLR: ``lr = base * r``, ``r = m + (1 - m) * g(i)`` during
      warm-up (``m`` = warmup_min_ratio), then
      ``r = max(0, c + (1 - c) * (1 + cos(pi * min(1, (i - w + 1) / max(1, total - w)))) / 2)``
      (``c`` = cos_min_ratio); ``base`` is the group's lr when built.

    Before the first step the lr is ``min`` (``0`` for WarmupCosineLR).
    ``warmup_max_lr`` None (WarmupLR's default) takes each param group's lr.
    """

    type: Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    warmup_num_steps: int | _Auto = 1000
    warmup_type: Literal["log", "linear"] = "log"
    warmup_min_lr: float | tuple[float, ...] | None = None
    warmup_max_lr: float | tuple[float, ...] | _Auto | None = None
    total_num_steps: int | _Auto | None = None
    warmup_min_ratio: float | None = None
    cos_min_ratio: float | None = None

    @property
    def param_names(self) -> tuple[str, ...]:
        """The parameters of this schedule, in DeepSpeed's names."""
        return _SCHEDULER_PARAMS[self.type]

    def _warmup(self, iteration: int) -> float:
        w = max(2, self.warmup_num_steps)  # type: ignore[arg-type]
        if self.warmup_type == "log":
            return (1.0 / math.log(w)) * math.log(iteration + 1)  # DeepSpeed's order of operations
        return iteration / w

    def _gamma(self, iteration: int) -> float:
        """WarmupLR's and WarmupDecayLR's share of (max - min) at iteration >= 0."""
        w = max(2, self.warmup_num_steps)  # type: ignore[arg-type]
        if iteration < w:
            return self._warmup(iteration)
        if self.type == "WarmupLR":
            return 1.0
        total = self.total_num_steps
        return max(0.0, float(total - iteration) / float(max(1.0, total - w)))  # type: ignore[operator]

    def _cosine_ratio(self, iteration: int) -> float:
        if iteration < 0:
            return 0.0
        w = max(2, self.warmup_num_steps)  # type: ignore[arg-type]
        if iteration < w:
            m = self.warmup_min_ratio
            return m + self._warmup(iteration) * (1.0 - m)  # type: ignore[operator]
        progress = min(1.0, (iteration - w + 1) / max(1, self.total_num_steps - w))  # type: ignore[operator]
        c = self.cos_min_ratio
        return max(0.0, c + (1.0 - c) * (1 + math.cos(math.pi * progress)) / 2)  # type: ignore[operator]

    def build(self, optimizer: Any) -> Any:
        """The ``LambdaLR`` over ``optimizer`` that sets DeepSpeed's learning
        rates: after ``k`` calls of its ``step()``, each group's lr is what
        DeepSpeed's scheduler gives after ``k`` calls of its own.

        For WarmupLR and WarmupDecayLR each group's ``lr`` (and
        ``initial_lr``) is set to its ``warmup_max_lr`` first, the rate the
        LambdaLR scales; WarmupCosineLR scales each group's own lr. A list of
        rates must have one per param group. An unresolved ``"auto"`` raises
        ValueError naming it."""
        from torch.optim.lr_scheduler import LambdaLR

        for name in ("warmup_num_steps", "warmup_max_lr", "total_num_steps"):
            _refuse_auto(f"scheduler.params.{name}", getattr(self, name))
        groups = optimizer.param_groups
        if self.type == "WarmupCosineLR":
            for group in groups:
                group["initial_lr"] = group["lr"]
            return LambdaLR(optimizer, lambda epoch: self._cosine_ratio(epoch - 1))

        def per_group(value: Any, name: str) -> list[float]:
            if isinstance(value, tuple):
                if len(value) != len(groups):
                    raise ValueError(f"scheduler.params.{name}: {len(value)} values for {len(groups)} param groups")
                return list(value)
            return [value] * len(groups)

        highs = per_group(self.warmup_max_lr, "warmup_max_lr") if self.warmup_max_lr is not None else [
            float(g["lr"]) for g in groups]
        lows = per_group(self.warmup_min_lr, "warmup_min_lr")
        for i, high in enumerate(highs):
            if not high > 0:
                raise ValueError(f"scheduler.params.warmup_max_lr: param group {i}'s lr {high} is not > 0, "
                                 "the rate the schedule scales")

        def factor(low: float, high: float) -> Callable[[int], float]:
            # LambdaLR's epoch e is DeepSpeed's iteration e - 1 (DeepSpeed sets
            # min at construction, iteration -1; LambdaLR computes epoch 0 there).
            return lambda epoch: (low if epoch == 0 else low + (high - low) * self._gamma(epoch - 1)) / high

        for group, high in zip(groups, highs):
            group["lr"] = high
            group["initial_lr"] = high
        return LambdaLR(optimizer, [factor(low, high) for low, high in zip(lows, highs)])


# The parameters of each schedule, in DeepSpeed's names.
_SCHEDULER_PARAMS: dict[str, tuple[str, ...]] = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"),
    "WarmupDecayLR": ("total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"),
    "WarmupCosineLR": ("total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type"),
}
