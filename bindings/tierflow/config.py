"""A DeepSpeed config, read as DeepSpeed reads it, as tierflow's one typed
description of a run.

:func:`from_deepspeed` takes the JSON a DeepSpeed user already has (a path or
a dict) and returns a :class:`Config`: frozen dataclasses, one per section
(``optimizer``, ``scheduler``, ``zero``, ``aio``, ``fp16``, ``bf16``,
``tierflow``), every value checked and every default DeepSpeed's own. What
it does not act on is said by name: keys tierflow does not know, and keys
DeepSpeed has that tierflow leaves alone on purpose (monitoring, profilers,
collective tuning), each with its dotted path, in one
:class:`TierflowConfigWarning` (or one ValueError with ``strict=True``).

``"auto"`` values, the placeholders Hugging Face's Trainer fills in, are
resolved by the Trainer's rules from the ``model`` (its hidden size) and the
``optimizer`` (its lr, betas, eps, weight_decay) given; those neither can
resolve keep the value :data:`AUTO` and are listed in ``Config.unresolved``.

ZenFlow's section and the aio section are read by tierflow's C++ parsers (the
same the engine and the CLI use), so their keys are checked in one place.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import types
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, NamedTuple, Union

from tierflow import _core

__all__ = [
    "from_deepspeed",
    "Config",
    "AdamConfig",
    "MuonConfig",
    "SchedulerConfig",
    "ZeroConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "ZenflowConfig",
    "AioConfig",
    "Fp16Config",
    "Bf16Config",
    "TierflowOptions",
    "ModelFacts",
    "UnusedKey",
    "TierflowConfigWarning",
    "AUTO",
]


class TierflowConfigWarning(UserWarning):
    """Keys of a DeepSpeed config that tierflow did not act on, each named by
    its dotted path (``from_deepspeed(..., strict=True)`` raises instead)."""


class _Auto:
    """The type of :data:`AUTO`."""

    _instance: _Auto | None = None

    def __new__(cls) -> _Auto:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "AUTO"

    def __reduce__(self) -> str:
        return "AUTO"


#: The value of a key written ``"auto"`` that neither the model nor the
#: optimizer given could resolve; its dotted path is in ``Config.unresolved``.
AUTO = _Auto()


class UnusedKey(NamedTuple):
    """A key of the config that tierflow did not act on, and why."""

    key: str  # the dotted path, e.g. "zero_optimization.foo"
    reason: str  # "unknown key", or "not used by tierflow: ..."

    def __str__(self) -> str:
        return f"{self.key} ({self.reason})"


# ---- values -----------------------------------------------------------------------------

def _show(value: Any) -> str:
    """A value as the user wrote it in JSON (strings quoted), for messages."""
    if value is AUTO:
        return '"auto"'
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _number(path: str, raw: Any) -> int | float:
    """A JSON number, or a string holding one ("1e-4"), as DeepSpeed's configs
    carry them; bools, non-finite values and anything else are refused."""
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        raise ValueError(f"{path}: {_show(raw)} is not a number")
    value: int | float
    if isinstance(raw, str):
        text = raw.strip()
        try:
            value = int(text)
        except ValueError:
            try:
                value = float(text)
            except ValueError:
                raise ValueError(f"{path}: {_show(raw)} is not a number") from None
    else:
        value = raw
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{path}: {_show(raw)} is not a finite number")
    return value


def _whole(minimum: int = 0, maximum: int | None = None) -> Callable[[str, Any], int]:
    """A whole number in [minimum, maximum]; 5e8 and "5e8" are 500000000."""

    def convert(path: str, raw: Any) -> int:
        value = _number(path, raw)
        if isinstance(value, float):
            if not value.is_integer():
                raise ValueError(f"{path}: {_show(raw)} is not a whole number")
            value = int(value)
        if value < minimum or (maximum is not None and value > maximum):
            upper = "" if maximum is None else f" and ≤ {maximum}"
            raise ValueError(f"{path}: {_show(raw)} is not a whole number ≥ {minimum}{upper}")
        return value

    return convert


def _real(low: float | None = None, high: float | None = None, *, low_open: bool = False,
          high_open: bool = False) -> Callable[[str, Any], float]:
    """A finite number in the interval given (open or closed at each end)."""

    def convert(path: str, raw: Any) -> float:
        value = float(_number(path, raw))
        below = low is not None and (value <= low if low_open else value < low)
        above = high is not None and (value >= high if high_open else value > high)
        if below or above:
            left = "(" if low_open else "["
            right = ")" if high_open else "]"
            lo = "-inf" if low is None else f"{low:g}"
            hi = "inf" if high is None else f"{high:g}"
            raise ValueError(f"{path}: {_show(raw)} is outside {left}{lo}, {hi}{right}")
        return value

    return convert


def _flag(path: str, raw: Any) -> bool:
    if not isinstance(raw, bool):
        raise ValueError(f"{path}: {_show(raw)} is not true or false")
    return raw


def _choice(*options: str) -> Callable[[str, Any], str]:
    def convert(path: str, raw: Any) -> str:
        if not isinstance(raw, str) or raw not in options:
            listed = ", ".join(f'"{o}"' for o in options[:-1]) + f' or "{options[-1]}"'
            raise ValueError(f"{path}: {_show(raw)} is not {listed}")
        return raw

    return convert


def _text(path: str, raw: Any) -> str:
    if isinstance(raw, os.PathLike):
        raw = os.fspath(raw)
    if not isinstance(raw, str) or not raw:
        raise ValueError(f"{path}: {_show(raw)} is not a path")
    return raw


def _stage(path: str, raw: Any) -> int:
    value = _number(path, raw)
    if value not in (0, 1, 2, 3):
        raise ValueError(f"{path}: {_show(raw)} is not a ZeRO stage (0, 1, 2 or 3)")
    return int(value)


def _betas(path: str, raw: Any) -> tuple[float, float]:
    if not isinstance(raw, (list, tuple)) or len(raw) != 2:
        raise ValueError(f"{path}: {_show(raw)} is not a pair of numbers [beta1, beta2]")
    unit = _real(0.0, 1.0, high_open=True)
    return (unit(f"{path}[0]", raw[0]), unit(f"{path}[1]", raw[1]))


def _lr_or_lrs(positive: bool) -> Callable[[str, Any], float | tuple[float, ...]]:
    """A learning rate, or one per param group (DeepSpeed's schedulers take both)."""
    one = _real(0.0, low_open=positive)

    def convert(path: str, raw: Any) -> float | tuple[float, ...]:
        if isinstance(raw, (list, tuple)):
            if not raw:
                raise ValueError(f"{path}: [] has no learning rate")
            return tuple(one(f"{path}[{i}]", v) for i, v in enumerate(raw))
        return one(path, raw)

    return convert


def _size(path: str, raw: Any) -> int:
    """Bytes: an int (5e8 too) or a size string "8G", "512M" as the CLI's flags take."""
    if isinstance(raw, str):
        try:
            return _whole(1)(path, raw)
        except ValueError:
            return _core.parse_size(raw, path)
    return _whole(1)(path, raw)


def _json_numbers(section: Mapping[str, Any]) -> dict[str, Any]:
    """A section for a C++ parser: numbers written as strings ("1e6") or as
    floats with a whole value (1e6) become JSON numbers of the kind a whole
    number is, so the C++ type checks see what DeepSpeed's JSON would hold."""
    out: dict[str, Any] = {}
    for key, value in section.items():
        if isinstance(value, str) and value.strip() not in ("", "auto"):
            try:
                value = _number(key, value)
            except ValueError:
                pass
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        out[key] = value
    return out


# ---- the sections ----------------------------------------------------------------------

@dataclass(frozen=True)
class AdamConfig:
    """``optimizer`` with type Adam or AdamW (DeepSpeed accepts any case).

    As in DeepSpeed, ``"Adam"`` with ``adam_w_mode`` true (its default) is
    AdamW, decoupled weight decay; ``"Adam"`` with ``adam_w_mode`` false is
    Adam with L2 decay; ``"AdamW"`` is AdamW whatever ``adam_w_mode`` says.
    ``torch_adam`` picks torch's implementation in DeepSpeed, whose defaults
    differ (torch.optim.AdamW decays by 0.01 by default, DeepSpeed's fused and
    CPU Adam by 0); tierflow takes the defaults it implies and always steps in
    its own kernel, whose results are torch's.
    """

    type: Literal["Adam", "AdamW"] = "AdamW"
    lr: float | _Auto = 1e-3
    betas: tuple[float, float] | _Auto = (0.9, 0.999)
    eps: float | _Auto = 1e-8
    weight_decay: float | _Auto = 0.0
    amsgrad: bool = False
    adam_w_mode: bool = True
    torch_adam: bool = False

    @property
    def decoupled_weight_decay(self) -> bool:
        """True when the step is AdamW's (DeepSpeed's rule: type AdamW, or adam_w_mode)."""
        return self.type == "AdamW" or self.adam_w_mode

    def build(self, params: Any, *, threads: int | None = None) -> Any:
        """tierflow's :class:`~tierflow.torch.optim.AdamW` (or
        :class:`~tierflow.torch.optim.Adam` with L2 decay) over ``params`` with
        these values. An unresolved ``"auto"`` raises ValueError naming it."""
        from tierflow.torch.optim import Adam, AdamW

        for name in ("lr", "betas", "eps", "weight_decay"):
            _refuse_auto(f"optimizer.params.{name}", getattr(self, name))
        cls = AdamW if self.decoupled_weight_decay else Adam
        return cls(params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay,
                   amsgrad=self.amsgrad, threads=threads)


@dataclass(frozen=True)
class MuonConfig:
    """``optimizer`` with type Muon: DeepSpeed's MuonWithAuxAdam, Muon for the
    hidden matrices and AdamW for the rest. ``lr`` sets both groups' rate
    unless ``muon_lr`` / ``adam_lr`` override it; with none, DeepSpeed's
    defaults: 0.02 for Muon, 3e-4 for AdamW (:attr:`muon_group_lr`,
    :attr:`adam_group_lr` are the rates in effect). Both groups decay by
    ``weight_decay`` (default 0); the AdamW group has DeepSpeed's betas
    (0.9, 0.95) and eps 1e-10. The update is torch's Muon with Nesterov
    momentum, 5 Newton–Schulz steps and the lr scaled by
    sqrt(max(1, rows/cols)), as DeepSpeed's."""

    type: Literal["Muon"] = "Muon"
    lr: float | _Auto | None = None
    muon_lr: float | None = None
    adam_lr: float | None = None
    momentum: float = 0.95
    weight_decay: float | _Auto = 0.0
    betas: tuple[float, float] | _Auto = (0.9, 0.95)
    eps: float | _Auto = 1e-10

    @property
    def muon_group_lr(self) -> float | _Auto:
        return self.muon_lr if self.muon_lr is not None else (0.02 if self.lr is None else self.lr)

    @property
    def adam_group_lr(self) -> float | _Auto:
        return self.adam_lr if self.adam_lr is not None else (3e-4 if self.lr is None else self.lr)

    def build(self, model: Any, *, threads: int | None = None) -> tuple[Any, Any]:
        """``(Muon, AdamW)``: tierflow's optimizers over ``model``'s parameters
        split by :func:`~tierflow.torch.optim.muon_param_groups` (either is
        None when its share is empty). An unresolved ``"auto"`` raises
        ValueError naming it."""
        from tierflow.torch.optim import AdamW, Muon, muon_param_groups

        _refuse_auto("optimizer.params.lr", self.muon_group_lr)
        _refuse_auto("optimizer.params.lr", self.adam_group_lr)
        for name in ("weight_decay", "betas", "eps"):
            _refuse_auto(f"optimizer.params.{name}", getattr(self, name))
        hidden, rest = muon_param_groups(model)
        muon = Muon(hidden, lr=self.muon_group_lr, momentum=self.momentum, weight_decay=self.weight_decay,
                    nesterov=True, ns_steps=5, threads=threads) if hidden else None
        adamw = AdamW(rest, lr=self.adam_group_lr, betas=self.betas, eps=self.eps,
                      weight_decay=self.weight_decay, threads=threads) if rest else None
        return muon, adamw


def _refuse_auto(path: str, value: Any) -> None:
    if value is AUTO:
        raise ValueError(f'{path}: "auto" is unresolved; give a value, or the model/optimizer it comes from '
                         "to from_deepspeed()")


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


@dataclass(frozen=True)
class OffloadOptimizerConfig:
    """``zero_optimization.offload_optimizer``: where the optimizer state
    lives ("none": on the device; "cpu": pinned host memory when pin_memory;
    "nvme": files in nvme_path) and the NVMe staging buffers."""

    device: Literal["none", "cpu", "nvme"] = "none"
    nvme_path: str | None = None
    pin_memory: bool = True
    buffer_count: int = 4


@dataclass(frozen=True)
class OffloadParamConfig:
    """``zero_optimization.offload_param`` (ZeRO-3): where parameters live
    between uses, the NVMe staging buffers (buffer_count of buffer_size
    elements) and how many parameter elements stay in host memory with nvme
    (max_in_cpu)."""

    device: Literal["none", "cpu", "nvme"] = "none"
    nvme_path: str | None = None
    pin_memory: bool = True
    buffer_count: int = 5
    buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000


@dataclass(frozen=True)
class ZenflowConfig:
    """``zero_optimization.zenflow``, as the C++ engine reads it, with the
    schedule it resolves to (``warm_up_steps``, ``select_every`` steps and how
    that was decided)."""

    topk_ratio: float = 0.1
    select_strategy: Literal["auto", "step", "epoch"] = "auto"
    select_interval: int | Literal["auto"] = "auto"
    update_interval: int | Literal["auto"] = "auto"
    overlap_step: bool = False
    auto_ratio: float = 0.99
    full_warm_up_rounds: int = 0
    pt_reserved_cores_perc: float = 0.5
    importance_norm: Literal["l1", "l2"] = "l1"
    steps_per_epoch: int | None = None
    warm_up_steps: int = 0
    select_every: int = 100
    select_every_source: str = ""


@dataclass(frozen=True)
class ZeroConfig:
    """``zero_optimization``: the ZeRO stage (0-3), where state is offloaded,
    ZenFlow, and the bucket and residency sizes (in elements) with
    DeepSpeed's defaults. ``overlap_comm`` defaults to true at stage 3 only,
    as in DeepSpeed. The ``stage3_*`` values and ``offload_param`` matter at
    stage 3 only."""

    stage: int = 0
    offload_optimizer: OffloadOptimizerConfig = field(default_factory=OffloadOptimizerConfig)
    offload_param: OffloadParamConfig = field(default_factory=OffloadParamConfig)
    zenflow: ZenflowConfig | None = None
    sub_group_size: int = 1_000_000_000
    reduce_bucket_size: int | _Auto = 500_000_000
    contiguous_gradients: bool = True
    overlap_comm: bool = False
    stage3_prefetch_bucket_size: int | _Auto = 50_000_000
    stage3_param_persistence_threshold: int | _Auto = 100_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    stage3_gather_16bit_weights_on_model_save: bool = False


@dataclass(frozen=True)
class AioConfig:
    """``aio``, as tierflow's I/O engine reads it: chunk size in bytes,
    requests in flight per worker, worker threads (``intra_op_parallelism``,
    or its older name ``thread_count``) and whether each request is submitted
    on its own (``single_submit``). DeepSpeed's defaults."""

    block_size: int = 1_048_576
    queue_depth: int = 8
    intra_op_parallelism: int = 1
    single_submit: bool = False


@dataclass(frozen=True)
class Fp16Config:
    """``fp16``: mixed precision with loss scaling; ``loss_scale`` 0 is
    dynamic, starting at 2**initial_scale_power."""

    enabled: bool | _Auto = False
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: int = 1

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == 0

    @property
    def initial_scale(self) -> float:
        """The first loss scale: 2**initial_scale_power when dynamic, else loss_scale."""
        return float(2 ** self.initial_scale_power) if self.dynamic else self.loss_scale


@dataclass(frozen=True)
class Bf16Config:
    """``bf16`` (or DeepSpeed's older ``bfloat16``)."""

    enabled: bool | _Auto = False


@dataclass(frozen=True)
class TierflowOptions:
    """The optional ``tierflow`` section, for what DeepSpeed has no key for:
    the device and host memory budgets in bytes (ints, or sizes such as
    "8G"), the directory of the NVMe tier's files (used where an NVMe
    offload names no nvme_path), the CPU threads of the optimizer step,
    whether the ZeRO-3 engine records a trace of its transfers and waits
    (``trace``, default false) and whether it steps each parameter during
    the backward as soon as its gradient is final, when no clipping or fp16
    loss scale needs every gradient first (``overlap_step``, default true;
    false steps them all after the backward, with the same result). None:
    tierflow decides."""

    device_memory: int | None = None
    host_memory: int | None = None
    nvme_dir: str | None = None
    threads: int | None = None
    trace: bool = False
    overlap_step: bool = True


@dataclass(frozen=True)
class ModelFacts:
    """What from_deepspeed() read off the model given: its parameter count
    and hidden size, and where the hidden size came from."""

    parameters: int
    hidden_size: int | None
    hidden_size_source: str


@dataclass(frozen=True)
class Config:
    """A run's configuration, read from a DeepSpeed config by
    :func:`from_deepspeed`. Sections are frozen dataclasses; a value written
    ``"auto"`` that could not be resolved is :data:`AUTO`, its path in
    ``unresolved``. ``not_used`` lists the keys not acted on, ``sources`` says
    where each value not taken from the config came from (a default, an
    ``"auto"`` rule, a derivation). ``str(config)`` prints it all."""

    train_batch_size: int | _Auto
    train_micro_batch_size_per_gpu: int | _Auto
    gradient_accumulation_steps: int | _Auto
    world_size: int = 1
    gradient_clipping: float | _Auto = 1.0
    steps_per_print: int | None = None
    wall_clock_breakdown: bool = False
    optimizer: AdamConfig | MuonConfig | None = None
    scheduler: SchedulerConfig | None = None
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    aio: AioConfig = field(default_factory=AioConfig)
    fp16: Fp16Config = field(default_factory=Fp16Config)
    bf16: Bf16Config = field(default_factory=Bf16Config)
    tierflow: TierflowOptions = field(default_factory=TierflowOptions)
    model: ModelFacts | None = field(default=None, compare=False)
    unresolved: tuple[str, ...] = field(default=(), compare=False)
    not_used: tuple[UnusedKey, ...] = field(default=(), compare=False)
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    @property
    def precision(self) -> Literal["bf16", "fp16", "fp32"] | _Auto:
        """The training precision: "bf16", "fp16" or "fp32" (AUTO while an enabled flag is)."""
        if self.bf16.enabled is True:
            return "bf16"
        if self.fp16.enabled is True:
            return "fp16"
        if self.bf16.enabled is AUTO or self.fp16.enabled is AUTO:
            return AUTO
        return "fp32"

    def source(self, key: str) -> str:
        """Where the value at dotted ``key`` came from: "config", "default",
        "auto: <rule>", "auto: unresolved" or "derived: <rule>"."""
        return self.sources.get(key, "config")

    def to_dict(self) -> dict[str, Any]:
        """The effective config in DeepSpeed's shape (unresolved values as
        "auto", the tierflow section when set): from_deepspeed() reads it back
        to an equal Config."""
        out: dict[str, Any] = {}
        for key, value in self._entries():
            node = out
            *parents, last = key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[last] = _to_json(value)
        return out

    def describe(self) -> str:
        """The effective config, readably: one line per value with its dotted
        key and, where it did not come from the config, its source; then the
        unresolved keys and the keys not acted on."""
        lines = ["tierflow config (read from a DeepSpeed config)"]
        if self.model is not None:
            hidden = "unknown" if self.model.hidden_size is None else str(self.model.hidden_size)
            lines.append(f"  model: {self.model.parameters} parameters, hidden size {hidden} "
                         f"({self.model.hidden_size_source})")
        entries = self._entries()
        width = max(len(key) for key, _ in entries) + 2
        heading = None
        for key, value in entries:
            section = key.split(".")[0] if "." in key else "batch and steps"
            if section != heading:
                heading = section
                lines.append(f"  {section}" + self._heading_note(section))
            shown = _shown(value)
            source = self.source(key)
            note = "" if source == "config" or value is AUTO else f"  [{source}]"
            lines.append(f"    {key:<{width}}{shown}{note}")
            if key == "zero_optimization.zenflow.importance_norm" and self.zero.zenflow is not None:
                z = self.zero.zenflow
                lines.append(f"    {'':<{width}}schedule: {z.warm_up_steps} full warm-up steps, selection "
                             f"refreshed every {z.select_every} steps ({z.select_every_source})")
        lines.append("  unresolved: " + (", ".join(self.unresolved) if self.unresolved else "none"))
        if self.not_used:
            lines.append(f"  not acted on ({len(self.not_used)}):")
            lines.extend(f"    {item}" for item in self.not_used)
        else:
            lines.append("  not acted on: none")
        return "\n".join(lines)

    __str__ = describe

    def _heading_note(self, section: str) -> str:
        o = self.optimizer
        if section == "batch and steps":
            return f": world size {self.world_size}"
        if section == "optimizer" and isinstance(o, AdamConfig):
            if o.type == "AdamW":
                return ": AdamW, decoupled weight decay"
            return ": Adam with adam_w_mode, so AdamW (decoupled weight decay)" if o.adam_w_mode else (
                ": Adam with L2 weight decay (adam_w_mode false)")
        if section == "optimizer" and isinstance(o, MuonConfig):
            return (f": Muon for the hidden matrices at lr {_shown(o.muon_group_lr)}, AdamW for the rest at lr "
                    f"{_shown(o.adam_group_lr)}")
        if section == "zero_optimization" and self.zero.stage == 0:
            return ": stage 0, ZeRO off (no offload, no ZenFlow, no stage-3 settings)"
        if section == "zero_optimization" and self.zero.stage < 3:
            return f": stage {self.zero.stage} (offload_param and the stage-3 settings are ZeRO-3's)"
        if section == "fp16":
            return ": training precision " + ("auto (unresolved)" if self.precision is AUTO else self.precision)
        return ""

    def _entries(self) -> list[tuple[str, Any]]:
        """(dotted key, value) of every effective setting, in DeepSpeed's names."""
        e: list[tuple[str, Any]] = [
            ("train_batch_size", self.train_batch_size),
            ("train_micro_batch_size_per_gpu", self.train_micro_batch_size_per_gpu),
            ("gradient_accumulation_steps", self.gradient_accumulation_steps),
            ("gradient_clipping", self.gradient_clipping),
        ]
        if self.steps_per_print is not None:
            e.append(("steps_per_print", self.steps_per_print))
        e.append(("wall_clock_breakdown", self.wall_clock_breakdown))
        if self.optimizer is not None:
            e.append(("optimizer.type", self.optimizer.type))
            names = [f.name for f in dataclasses.fields(self.optimizer) if f.name != "type"]
            e += [(f"optimizer.params.{n}", getattr(self.optimizer, n)) for n in names
                  if getattr(self.optimizer, n) is not None]
        if self.scheduler is not None:
            s = self.scheduler
            e.append(("scheduler.type", s.type))
            for name in _SCHEDULER_PARAMS[s.type]:
                value = getattr(s, name)
                if value is not None:
                    e.append((f"scheduler.params.{name}", value))
        z = self.zero
        zp = "zero_optimization"
        e.append((f"{zp}.stage", z.stage))
        if z.stage >= 1:
            e += [(f"{zp}.offload_optimizer.{f.name}", getattr(z.offload_optimizer, f.name))
                  for f in dataclasses.fields(z.offload_optimizer)
                  if f.name != "nvme_path" or z.offload_optimizer.nvme_path is not None]
        if z.stage == 3:
            e += [(f"{zp}.offload_param.{f.name}", getattr(z.offload_param, f.name))
                  for f in dataclasses.fields(z.offload_param)
                  if f.name != "nvme_path" or z.offload_param.nvme_path is not None]
        if z.zenflow is not None:
            e += [(f"{zp}.zenflow.{name}", getattr(z.zenflow, name)) for name in _ZENFLOW_KEYS
                  if name != "steps_per_epoch" or z.zenflow.steps_per_epoch is not None]
        e += [(f"{zp}.{name}", getattr(z, name)) for name in
              ("sub_group_size", "reduce_bucket_size", "contiguous_gradients", "overlap_comm")]
        if z.stage == 3:
            e += [(f"{zp}.{name}", getattr(z, name)) for name in _STAGE3_KEYS]
        e += [(f"aio.{f.name}", getattr(self.aio, f.name)) for f in dataclasses.fields(self.aio)]
        e += [(f"fp16.{f.name}", getattr(self.fp16, f.name)) for f in dataclasses.fields(self.fp16)]
        e.append(("bf16.enabled", self.bf16.enabled))
        e += [(f"tierflow.{f.name}", getattr(self.tierflow, f.name)) for f in dataclasses.fields(self.tierflow)
              if getattr(self.tierflow, f.name) not in (None, False)]
        return e


def _shown(value: Any) -> str:
    """A value for the printout."""
    return "auto (unresolved)" if value is AUTO else _show(_to_json(value))


def _to_json(value: Any) -> Any:
    if value is AUTO:
        return "auto"
    if isinstance(value, tuple):
        return [_to_json(v) for v in value]
    return value


_SCHEDULER_PARAMS: dict[str, tuple[str, ...]] = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"),
    "WarmupDecayLR": ("total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"),
    "WarmupCosineLR": ("total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type"),
}

_ZENFLOW_KEYS = ("topk_ratio", "select_strategy", "select_interval", "update_interval", "overlap_step",
                 "auto_ratio", "full_warm_up_rounds", "pt_reserved_cores_perc", "importance_norm",
                 "steps_per_epoch")

# The stage-3 keys, as DeepSpeed's docs spell them, and the names without the
# prefix that DeepSpeed also accepts for them.
_STAGE3_KEYS = ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                "stage3_max_live_parameters", "stage3_max_reuse_distance",
                "stage3_gather_16bit_weights_on_model_save")
_STAGE3_ALIASES = {
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "stage3_max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save": "gather_16bit_weights_on_model_save",
}

# ---- what tierflow knows of DeepSpeed and leaves alone ----------------------------------------

_MONITORING = "not used by tierflow: DeepSpeed's monitoring and logging"
_PROFILING = "not used by tierflow: DeepSpeed's profilers (tierflow reports its own telemetry and traces)"
_COLLECTIVES = "not used by tierflow: a tuning of DeepSpeed's collectives"
_ZERO_PLUS = "not used by tierflow: a ZeRO++/MiCS feature of DeepSpeed"
_INTERNALS = "not used by tierflow: a switch of DeepSpeed's own engine"
_TRAINING = "not used by tierflow: a DeepSpeed training feature tierflow does not run"

_UNUSED_TOP: dict[str, str] = {
    **{k: _MONITORING for k in ("comms_logger", "tensorboard", "wandb", "csv_monitor", "comet", "timers",
                                "memory_breakdown", "dump_state", "log_level")},
    **{k: _PROFILING for k in ("flops_profiler", "autotuning", "eigenvalue")},
    **{k: _COLLECTIVES for k in ("communication_data_type", "seq_parallel_communication_data_type",
                                 "prescale_gradients", "gradient_predivide_factor", "gradient_allreduce_op",
                                 "disable_allgather", "sparse_gradients")},
    **{k: _TRAINING for k in ("activation_checkpointing", "sparse_attention", "data_efficiency",
                              "curriculum_learning", "progressive_layer_drop", "compression_training",
                              "weight_quantization", "elasticity", "pipeline", "hybrid_engine",
                              "tensor_parallel", "expert_parallel", "sequence_parallel_size", "compile",
                              "amp", "torch_autocast", "graph_harvesting", "vocabulary_size",
                              "dataloader_drop_last")},
    **{k: "not used by tierflow: DeepSpeed's checkpointing" for k in ("checkpoint", "nebula", "datastates_ckpt",
                                                                       "data_types")},
    "zero_allow_untested_optimizer": "not used by tierflow: it runs its own optimizers",
    "zero_force_ds_cpu_optimizer": "not used by tierflow: it runs its own optimizers",
    "managed_gradient_accumulation": _INTERNALS,
}

_UNUSED_ZERO: dict[str, str] = {
    **{k: _COLLECTIVES for k in ("allgather_partitions", "allgather_bucket_size", "reduce_scatter",
                                 "use_multi_rank_bucket_allreduce", "round_robin_gradients",
                                 "stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params",
                                 "stage3_allgather_sequential", "allgather_sequential")},
    **{k: _ZERO_PLUS for k in ("zero_hpz_partition_size", "zero_quantized_weights",
                               "zero_quantized_nontrainable_weights", "zero_quantized_gradients",
                               "zeropp_loco_param", "mics_shard_size", "mics_hierarchical_params_gather")},
    **{k: _INTERNALS for k in ("load_from_fp32_weights", "elastic_checkpoint", "ignore_unused_parameters",
                               "legacy_stage1", "memory_efficient_linear", "pipeline_loading_checkpoint",
                               "override_module_apply", "log_trace_cache_warnings", "enable_sanity_checks",
                               "leaf_module", "stage3_module_granularity_threshold",
                               "module_granularity_threshold", "stage3_model_persistence_threshold",
                               "model_persistence_threshold")},
    "save_muon_momentum_buffer_in_memory":
        "not used by tierflow: it places the Muon momentum by the tier budgets",
    "cpu_offload_use_pin_memory": "not used by tierflow: deprecated, and ignored by DeepSpeed too "
                                  "(use offload_optimizer.pin_memory / offload_param.pin_memory)",
}

_UNUSED_PRECISION: dict[str, str] = {
    "auto_cast": "not used by tierflow: casting inputs is the model's business",
    "fp16_master_weights_and_grads": "not used by tierflow: it keeps fp32 masters and gradients",
    "bf16_master_weights_and_grads": "not used by tierflow: it keeps fp32 masters and gradients",
    "bf16_optimizer_states": "not used by tierflow: it keeps the optimizer state in fp32",
    "immediate_grad_update": "not used by tierflow: its gradients go to the host as they are produced",
    "check_grad_overflow": "not used by tierflow: bf16 training skips no step",
}


# ---- the reader -------------------------------------------------------------------------------

class _Run:
    """What one from_deepspeed() call gathers besides the values."""

    def __init__(self, model: ModelFacts | None, optimizer: dict[str, tuple[Any, str]] | None,
                 world_size: int) -> None:
        self.model = model
        self.optimizer = optimizer
        self.world_size = world_size
        self.sources: dict[str, str] = {}
        self.unresolved: list[str] = []
        self.not_used: list[UnusedKey] = []
        self.mismatches: list[str] = []


_Resolver = Callable[[], Union[tuple[Any, str], None]]


class _Section:
    """One object of the config: hands out its keys by name and remembers
    which were taken, so that what is left over is reported by name."""

    def __init__(self, run: _Run, path: str, data: Any, *, auto_is_default: bool) -> None:
        if not isinstance(data, Mapping):
            raise ValueError(f"{path}: {_show(data)} is not an object")
        for key in data:
            if not isinstance(key, str):
                raise ValueError(f"{path}: key {key!r} is not a string")
        self.run = run
        self.path = path
        self.data = data
        self.taken: set[str] = set()
        # DeepSpeed's pydantic sections drop "auto" values, so they take the
        # default; elsewhere "auto" means something only for the keys Hugging
        # Face's Trainer fills in.
        self.auto_is_default = auto_is_default

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def __contains__(self, name: str) -> bool:
        return name in self.data

    def get(self, name: str, convert: Callable[[str, Any], Any], default: Any, *,
            auto: _Resolver | None = None, default_note: str = "default") -> Any:
        """The value of ``name`` checked by ``convert``, or ``default`` when
        absent. "auto" is resolved by ``auto`` (None from it: unresolved, the
        value AUTO), else is the default where DeepSpeed drops it, else refused."""
        path = self.key(name)
        self.taken.add(name)
        if name not in self.data:
            self.run.sources[path] = default_note
            return default
        raw = self.data[name]
        if isinstance(raw, str) and raw.strip() == "auto":
            if auto is not None:
                resolved = auto()
                if resolved is None:
                    self.run.unresolved.append(path)
                    self.run.sources[path] = "auto: unresolved"
                    return AUTO
                value, how = resolved
                self.run.sources[path] = f"auto: {how}"
                return convert(path, value)
            if self.auto_is_default:
                self.run.sources[path] = f"auto: DeepSpeed's default ({default_note})"
                return default
            raise ValueError(f'{path}: "auto" is not resolved for this key (DeepSpeed and Hugging Face\'s '
                             "Trainer fill it nowhere); give a value")
        return convert(path, raw)

    def raw(self, name: str) -> Any:
        self.taken.add(name)
        return self.data[name]

    def section(self, name: str, *, auto_is_default: bool) -> _Section | None:
        if name not in self.data:
            self.taken.add(name)
            return None
        return _Section(self.run, self.key(name), self.raw(name), auto_is_default=auto_is_default)

    def unused(self, name: str, reason: str) -> None:
        """Reports ``name``, when present, as not acted on."""
        self.taken.add(name)
        if name in self.data:
            self.run.not_used.append(UnusedKey(self.key(name), reason))

    def unless(self, name: str, agrees: Callable[[Any], bool], reason: str) -> None:
        """Accepts ``name`` quietly when its value is what tierflow does anyway,
        else reports it as not acted on."""
        self.taken.add(name)
        if name in self.data and not agrees(self.data[name]):
            self.run.not_used.append(UnusedKey(self.key(name), reason))

    def finish(self, known: Mapping[str, str] = types.MappingProxyType({}), *,
               unknown: str = "unknown key") -> None:
        """Reports every key not taken: DeepSpeed's with the reason in ``known``,
        any other as ``unknown``."""
        for name in self.data:
            if name not in self.taken:
                self.taken.add(name)
                self.run.not_used.append(UnusedKey(self.key(name), known.get(name, unknown)))


def _load(path_or_dict: Any) -> Mapping[str, Any]:
    if isinstance(path_or_dict, Mapping):
        return path_or_dict
    if not isinstance(path_or_dict, (str, os.PathLike)):
        raise TypeError("from_deepspeed: expected a path to a JSON file or a dict, got "
                        f"{type(path_or_dict).__name__}")
    path = os.fspath(path_or_dict)

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise ValueError(f"{path}: key {json.dumps(key)} appears twice in one object")
            out[key] = value
        return out

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ValueError(f"{path}: no such DeepSpeed config file") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror})") from None
    try:
        data = json.loads(text, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a DeepSpeed config is a JSON object, not {type(data).__name__}")
    return data


def _model_facts(model: Any) -> ModelFacts:
    if not (hasattr(model, "named_parameters") and callable(model.named_parameters)):
        raise TypeError(f"from_deepspeed: model= expects a torch.nn.Module, got {type(model).__name__}")
    unique = {id(p): p for _, p in model.named_parameters()}
    parameters = sum(int(p.numel()) for p in unique.values())
    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None) if config is not None else None
    if isinstance(hidden, int) and hidden > 0:
        return ModelFacts(parameters, hidden, "model.config.hidden_size")
    sizes = getattr(config, "hidden_sizes", None) if config is not None else None
    if sizes and all(isinstance(s, int) and s > 0 for s in sizes):
        return ModelFacts(parameters, max(sizes), "the largest of model.config.hidden_sizes")
    # A plain torch module: the width most of its matrices share is its hidden
    # size (a transformer's attention and MLP weights all have d_model on one side).
    dims: Counter[int] = Counter()
    matrices = [p for p in unique.values() if p.dim() == 2]
    for p in matrices:
        dims.update(int(d) for d in p.shape)
    if not dims:
        return ModelFacts(parameters, None, "no model.config.hidden_size and no 2-D weight to read it from")
    hidden = max(dims, key=lambda d: (dims[d], d))
    return ModelFacts(parameters, hidden,
                      f"the dimension most common among its {len(matrices)} 2-D weights; "
                      "no model.config.hidden_size")


def _optimizer_facts(optimizer: Any) -> dict[str, tuple[Any, str]]:
    """lr, betas, eps and weight_decay of a torch optimizer, as HF's Trainer
    would fill them: the value all param groups share, else the largest group's."""
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list) or not groups or not all(isinstance(g, dict) for g in groups):
        raise TypeError(f"from_deepspeed: optimizer= expects a torch.optim.Optimizer, got {type(optimizer).__name__}")

    def plain(value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return tuple(plain(v) for v in value)
        return float(value.item()) if hasattr(value, "item") else value

    sizes = [sum(int(p.numel()) for p in g.get("params", [])) for g in groups]
    facts: dict[str, tuple[Any, str]] = {}
    for name in ("lr", "betas", "eps", "weight_decay"):
        values = [plain(g[name]) if name in g else None for g in groups]
        if all(v is None for v in values):
            continue
        if len(set(map(repr, values))) == 1:
            facts[name] = (values[0], f"the optimizer's {name}")
        else:
            i = max(range(len(groups)), key=lambda k: (values[k] is not None, sizes[k]))
            facts[name] = (values[i], f"the optimizer's {name} in param group {i}, its largest (the groups differ)")
    return facts


def _from_optimizer(run: _Run, name: str) -> _Resolver:
    def resolve() -> tuple[Any, str] | None:
        if run.optimizer is None or name not in run.optimizer:
            return None
        return run.optimizer[name]

    return resolve


def _check_match(run: _Run, section: _Section, name: str, convert: Callable[[str, Any], Any],
                 facts_key: str) -> None:
    """HF's Trainer refuses a config value that disagrees with its own; so
    does this reader with the optimizer given."""
    if run.optimizer is None or facts_key not in run.optimizer or name not in section:
        return
    raw = section.data[name]
    if isinstance(raw, str) and raw.strip() == "auto":
        return
    ours = _to_json(convert(section.key(name), raw))
    theirs = _to_json(run.optimizer[facts_key][0])
    if ours != theirs:
        run.mismatches.append(f"{section.key(name)} is {_show(ours)} in the config but {_show(theirs)} in the "
                              "optimizer given")


def _read_optimizer(run: _Run, top: _Section) -> AdamConfig | MuonConfig | None:
    s = top.section("optimizer", auto_is_default=False)
    if s is None:
        return None
    if "type" not in s:
        raise ValueError('optimizer.type: missing (DeepSpeed needs "Adam", "AdamW" or "Muon" here)')
    written = s.raw("type")
    kind = written.lower() if isinstance(written, str) else None
    if kind not in ("adam", "adamw", "muon"):
        raise ValueError(f'optimizer.type: {_show(written)} is not an optimizer tierflow runs ("Adam", "AdamW" '
                         'or "Muon", in any case)')
    s.unused("legacy_fusion", "not used by tierflow: DeepSpeed's fused-kernel switch")
    p = s.section("params", auto_is_default=False) or _Section(run, "optimizer.params", {}, auto_is_default=False)
    if "max_grad_norm" in p:
        raise ValueError("optimizer.params.max_grad_norm: not an optimizer parameter in DeepSpeed; "
                         "use the top-level gradient_clipping")
    nonneg = _real(0.0)
    if kind == "muon":
        checks = {"lr": nonneg, "weight_decay": nonneg, "betas": _betas, "eps": nonneg}
        optional_lr = lambda k, v: None if v is None else nonneg(k, v)  # noqa: E731
        result = MuonConfig(
            lr=p.get("lr", optional_lr, None, auto=_from_optimizer(run, "lr"),
                     default_note="default: DeepSpeed's 0.02 for Muon, 3e-4 for AdamW"),
            muon_lr=p.get("muon_lr", optional_lr, None),
            adam_lr=p.get("adam_lr", optional_lr, None),
            momentum=p.get("momentum", _real(0.0, 1.0, high_open=True), 0.95),
            weight_decay=p.get("weight_decay", nonneg, 0.0, auto=_from_optimizer(run, "weight_decay")),
            betas=p.get("betas", _betas, (0.9, 0.95), auto=_from_optimizer(run, "betas")),
            eps=p.get("eps", nonneg, 1e-10, auto=_from_optimizer(run, "eps")),
        )
        p.unused("ns_method", "not used by tierflow: its kernel runs the standard Newton–Schulz iteration "
                              '("gram" computes the same iteration in another order)')
        p.finish(unknown="unknown key for Muon")
        s.finish()
        for name, convert in checks.items():
            _check_match(run, p, name, convert, name)
        return result

    torch_adam = p.get("torch_adam", _flag, False)
    adam_w_mode = p.get("adam_w_mode", _flag, True)
    decoupled = kind == "adamw" or adam_w_mode
    if kind == "adamw" and not adam_w_mode:
        run.not_used.append(UnusedKey("optimizer.params.adam_w_mode", 'not used: type "AdamW" always decouples '
                                                                      "the weight decay, as in DeepSpeed"))
        adam_w_mode = True
    # torch.optim.AdamW decays by 0.01 by default; DeepSpeed's own Adam by 0.
    decay_default = 0.01 if torch_adam and decoupled else 0.0
    decay_note = ("default (torch.optim.AdamW's, with torch_adam)" if decay_default
                  else "default (DeepSpeed's Adam)")
    result = AdamConfig(
        type="AdamW" if kind == "adamw" else "Adam",
        lr=p.get("lr", nonneg, 1e-3, auto=_from_optimizer(run, "lr")),
        betas=p.get("betas", _betas, (0.9, 0.999), auto=_from_optimizer(run, "betas")),
        eps=p.get("eps", nonneg, 1e-8, auto=_from_optimizer(run, "eps")),
        weight_decay=p.get("weight_decay", nonneg, decay_default, auto=_from_optimizer(run, "weight_decay"),
                           default_note=decay_note),
        amsgrad=p.get("amsgrad", _flag, False),
        adam_w_mode=adam_w_mode,
        torch_adam=torch_adam,
    )
    if p.get("bias_correction", _flag, True) is False:
        raise ValueError("optimizer.params.bias_correction: false is not supported: tierflow's Adam always "
                         "corrects the moments' bias")
    p.unless("fp32_optimizer_states", lambda v: v is True,
             "not used by tierflow: it keeps the optimizer state in fp32")
    p.finish(unknown=f"unknown key for {result.type}")
    s.finish()
    for name, convert in (("lr", nonneg), ("betas", _betas), ("eps", nonneg), ("weight_decay", nonneg)):
        _check_match(run, p, name, convert, name)
    return result


def _read_scheduler(run: _Run, top: _Section, optimizer: AdamConfig | MuonConfig | None) -> SchedulerConfig | None:
    s = top.section("scheduler", auto_is_default=False)
    if s is None:
        return None
    kind = s.raw("type") if "type" in s else None
    if kind not in _SCHEDULER_PARAMS:
        raise ValueError(f"scheduler.type: {_show(kind)} is not a schedule tierflow builds "
                         '("WarmupLR", "WarmupDecayLR" or "WarmupCosineLR")')
    p = s.section("params", auto_is_default=False) or _Section(run, "scheduler.params", {}, auto_is_default=False)
    steps = _whole(1)

    def max_lr() -> tuple[Any, str] | None:
        resolved = _from_optimizer(run, "lr")()
        if resolved is not None:
            return resolved
        if optimizer is not None and not isinstance(optimizer.lr, _Auto):
            return optimizer.lr, "optimizer.params.lr"
        return None

    values: dict[str, Any] = {
        "warmup_num_steps": p.get("warmup_num_steps", steps, 1000, auto=lambda: None),
        "warmup_type": p.get("warmup_type", _choice("log", "linear"), "log"),
    }
    if kind in ("WarmupLR", "WarmupDecayLR"):
        values["warmup_min_lr"] = p.get("warmup_min_lr", _lr_or_lrs(positive=False), 0.0,
                                        auto=lambda: (0.0, "0, as Hugging Face's Trainer fills it"))
        max_default = None if kind == "WarmupLR" else 0.001
        values["warmup_max_lr"] = p.get("warmup_max_lr", _lr_or_lrs(positive=True), max_default, auto=max_lr,
                                        default_note="default: each param group's lr" if kind == "WarmupLR"
                                        else "default")
        if not isinstance(values["warmup_max_lr"], tuple):
            _check_match(run, p, "warmup_max_lr", _lr_or_lrs(positive=True), "lr")
    if kind in ("WarmupDecayLR", "WarmupCosineLR"):
        if "total_num_steps" not in p:
            raise ValueError(f"scheduler.params.total_num_steps: missing; {kind} needs the number of training steps")
        values["total_num_steps"] = p.get("total_num_steps", steps, None, auto=lambda: None)
    if kind == "WarmupCosineLR":
        values["warmup_min_ratio"] = p.get("warmup_min_ratio", _real(0.0, 1.0), 0.0)
        values["cos_min_ratio"] = p.get("cos_min_ratio", _real(0.0, 1.0), 0.0001)
    p.unused("last_batch_iteration", "not used by tierflow: resume a schedule from its state_dict")
    others = {name: f"not a {kind} parameter" for names in _SCHEDULER_PARAMS.values() for name in names}
    p.finish(others)
    s.finish()
    return SchedulerConfig(type=kind, **values)


def _read_offload(run: _Run, z: _Section, name: str, nvme_dir: str | None,
                  param: bool) -> OffloadOptimizerConfig | OffloadParamConfig:
    cls = OffloadParamConfig if param else OffloadOptimizerConfig
    s = z.section(name, auto_is_default=True)
    if s is None:
        prefix = f"{z.key(name)}."
        for f in dataclasses.fields(cls):
            run.sources[prefix + f.name] = "default"
        return cls()
    device = s.get("device", _choice("none", "cpu", "nvme"), "none")
    defaults = cls()
    values: dict[str, Any] = {
        "device": device,
        "pin_memory": s.get("pin_memory", _flag, True),
        "buffer_count": s.get("buffer_count", _whole(1), defaults.buffer_count),
    }
    if param:
        values["buffer_size"] = s.get("buffer_size", _whole(1), defaults.buffer_size)  # type: ignore[attr-defined]
        values["max_in_cpu"] = s.get("max_in_cpu", _whole(0), defaults.max_in_cpu)  # type: ignore[attr-defined]
    path = s.key("nvme_path")
    if device == "nvme":
        given = s.get("nvme_path", lambda k, v: v if v is None else _text(k, v), None)
        if given is None and nvme_dir is None:
            raise ValueError(f'{path}: missing; device "nvme" needs a directory on the NVMe drive '
                             "(or tierflow.nvme_dir)")
        if given is None:
            run.sources[path] = "tierflow.nvme_dir"
        values["nvme_path"] = given if given is not None else nvme_dir
    else:
        s.unless("nvme_path", lambda v: v is None, f'not used: device is "{device}"')
    if not param:
        s.unless("pipeline_read", lambda v: v is True,
                 "not used by tierflow: its optimizer step always overlaps reading the next sub-group")
        s.unless("pipeline_write", lambda v: v is True,
                 "not used by tierflow: its optimizer step always overlaps writing the last sub-group")
        s.unless("fast_init", lambda v: v is False, "not used by tierflow: DeepSpeed's NVMe initialisation shortcut")
        s.unless("ratio", lambda v: not isinstance(v, bool) and v in (1, 1.0),
                 "not used by tierflow: it places the optimizer state by the tier budgets "
                 "(tierflow.device_memory), not by a fixed share")
        s.unless("super_offload", lambda v: v is False, "not used by tierflow: DeepSpeed's Superchip path")
        s.unused("cpuadam_cores_perc", "not used by tierflow: the step's threads are tierflow.threads")
    s.finish()
    return cls(**values)


def _read_zenflow(run: _Run, z: _Section) -> ZenflowConfig | None:
    if "zenflow" not in z:
        z.taken.add("zenflow")
        return None
    section = z.raw("zenflow")
    if section is None:
        return None
    if not isinstance(section, Mapping):
        raise ValueError(f"zero_optimization.zenflow: {_show(section)} is not an object")
    # DeepSpeed drops "auto" values from its pydantic sections: the default,
    # which for the intervals and the strategy is "auto" itself.
    given = {k: v for k, v in _json_numbers(section).items() if not (isinstance(v, str) and v == "auto")}
    try:
        read = _core.zenflow_config(given)
    except ValueError as e:
        raise ValueError(f"zero_optimization.{e}") from None
    schedule = read.pop("schedule")
    for name in _ZENFLOW_KEYS:
        if name not in section:
            run.sources[f"zero_optimization.zenflow.{name}"] = "default"
    return ZenflowConfig(**read, warm_up_steps=schedule["warm_up_steps"], select_every=schedule["select_interval"],
                         select_every_source=schedule["select_interval_source"])


def _no_offload(value: Any) -> bool:
    """True for a section or flag that asks for no offload (null, false, device "none")."""
    return value is None or value is False or (isinstance(value, Mapping) and value.get("device") == "none")


def _read_zero(run: _Run, top: _Section, nvme_dir: str | None) -> ZeroConfig:
    zp = "zero_optimization"
    if zp in top and isinstance(top.data[zp], bool):
        # DeepSpeed's first format: true is stage 1.
        stage = 1 if top.raw(zp) else 0
        run.sources[f"{zp}.stage"] = f"{zp}: {json.dumps(top.data[zp])} (DeepSpeed's deprecated form)"
        z = _Section(run, zp, {}, auto_is_default=True)
    else:
        z = top.section(zp, auto_is_default=True) or _Section(run, zp, {}, auto_is_default=True)
        stage = z.get("stage", _stage, 0)
    hidden = run.model.hidden_size if run.model is not None else None

    def from_hidden(rule: Callable[[int], int], text: str) -> _Resolver:
        def resolve() -> tuple[int, str] | None:
            if hidden is None:
                return None
            return rule(hidden), f"{text}, the model's hidden size {hidden}"
        return resolve

    def aliased(name: str, convert: Callable[[str, Any], Any], default: Any,
                auto: _Resolver | None = None) -> Any:
        """A stage-3 key, given by its documented name or the one without the
        prefix (DeepSpeed takes both); its source is kept under the documented one."""
        alias = _STAGE3_ALIASES[name]
        if name in z and alias in z:
            raise ValueError(f"{zp}.{name} and {zp}.{alias}: both given; they are one setting")
        z.taken.update((name, alias))
        if alias not in z:
            return z.get(name, convert, default, auto=auto)
        value = z.get(alias, convert, default, auto=auto)
        source = run.sources.pop(f"{zp}.{alias}", None)
        run.sources[f"{zp}.{name}"] = f"{zp}.{alias}" + (f", {source}" if source else "")
        return value

    # Deprecated booleans DeepSpeed maps onto the offload sections.
    for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if old in z and z.raw(old) is not None:
            flag = _flag(f"{zp}.{old}", z.data[old])
            if flag and new in z:
                raise ValueError(f"{zp}.{old} and {zp}.{new}: both given; {old} is the deprecated form of {new}")
    legacy_cpu = {new: bool(z.data.get(old)) for old, new in (("cpu_offload", "offload_optimizer"),
                                                             ("cpu_offload_param", "offload_param"))}

    values: dict[str, Any] = {"stage": stage}
    if stage >= 1:
        offload = _read_offload(run, z, "offload_optimizer", nvme_dir, param=False)
        if legacy_cpu["offload_optimizer"]:
            offload = OffloadOptimizerConfig(device="cpu")
            run.sources[f"{zp}.offload_optimizer.device"] = f"{zp}.cpu_offload (deprecated)"
        values["offload_optimizer"] = offload
        zenflow = _read_zenflow(run, z)
        if zenflow is not None and offload.device == "none":
            raise ValueError(f'{zp}.zenflow: needs {zp}.offload_optimizer.device "cpu" or "nvme" '
                             "(ZenFlow steps the less important columns on the CPU)")
        values["zenflow"] = zenflow
    else:
        for name in ("offload_optimizer", "zenflow", "cpu_offload"):
            z.unless(name, _no_offload, "not used at stage 0 (ZeRO is off)")
    if stage == 3:
        offload_param = _read_offload(run, z, "offload_param", nvme_dir, param=True)
        if legacy_cpu["offload_param"]:
            offload_param = OffloadParamConfig(device="cpu")
            run.sources[f"{zp}.offload_param.device"] = f"{zp}.cpu_offload_param (deprecated)"
        values["offload_param"] = offload_param
    else:
        for name in ("offload_param", "cpu_offload_param"):
            z.unless(name, _no_offload, f"not used at stage {stage} (parameter offload is ZeRO-3's)")
    z.taken.update(("cpu_offload", "cpu_offload_param"))

    elements = _whole(0)
    values["sub_group_size"] = z.get("sub_group_size", _whole(1), 1_000_000_000)
    values["reduce_bucket_size"] = z.get("reduce_bucket_size", elements, 500_000_000,
                                         auto=from_hidden(lambda h: h * h, "h²"))
    values["contiguous_gradients"] = z.get("contiguous_gradients", _flag, True)
    values["overlap_comm"] = z.get("overlap_comm", lambda k, v: v if v is None else _flag(k, v), None)
    if values["overlap_comm"] is None:
        values["overlap_comm"] = stage == 3
        run.sources[f"{zp}.overlap_comm"] = f"default: {json.dumps(stage == 3)} at stage {stage}"
    if stage == 3:
        values["stage3_prefetch_bucket_size"] = aliased(
            "stage3_prefetch_bucket_size", elements, 50_000_000,
            from_hidden(lambda h: int(0.9 * h * h), "0.9·h² rounded down"))
        values["stage3_param_persistence_threshold"] = aliased(
            "stage3_param_persistence_threshold", elements, 100_000,
            from_hidden(lambda h: 10 * h, "10·h"))
        values["stage3_max_live_parameters"] = aliased("stage3_max_live_parameters", elements, 1_000_000_000)
        values["stage3_max_reuse_distance"] = aliased("stage3_max_reuse_distance", elements, 1_000_000_000)
        old = "stage3_gather_fp16_weights_on_model_save"
        if old in z:
            if "stage3_gather_16bit_weights_on_model_save" in z or "gather_16bit_weights_on_model_save" in z:
                raise ValueError(f"{zp}.{old}: given with its new name stage3_gather_16bit_weights_on_model_save")
            values["stage3_gather_16bit_weights_on_model_save"] = z.get(old, _flag, False)
            run.sources[f"{zp}.stage3_gather_16bit_weights_on_model_save"] = f"{zp}.{old} (its deprecated name)"
            z.taken.add("stage3_gather_16bit_weights_on_model_save")
            z.taken.add("gather_16bit_weights_on_model_save")
        else:
            values["stage3_gather_16bit_weights_on_model_save"] = aliased(
                "stage3_gather_16bit_weights_on_model_save", _flag, False)
    else:
        reason = f"not used at stage {stage} (a ZeRO-3 setting)"
        for name in (*_STAGE3_KEYS, *_STAGE3_ALIASES.values(), "stage3_gather_fp16_weights_on_model_save"):
            z.unused(name, reason)
    z.finish(_UNUSED_ZERO)
    return ZeroConfig(**values)


_AIO_DEFAULTS = {"block_size": 1_048_576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
                 "overlap_events": True}


def _read_aio(run: _Run, top: _Section) -> AioConfig:
    # DeepSpeed takes "aio": null as no section.
    s = None if top.data.get("aio", {}) is None else top.section("aio", auto_is_default=False)
    top.taken.add("aio")
    data: Mapping[str, Any] = {} if s is None else s.data
    if s is not None:
        for name, value in data.items():
            if isinstance(value, str) and value.strip() == "auto":
                raise ValueError(f'aio.{name}: "auto" is not resolved for this key; give a value')
        if "thread_count" in data and "intra_op_parallelism" in data:
            a, b = _json_numbers({"a": data["thread_count"], "b": data["intra_op_parallelism"]}).values()
            if a != b:
                raise ValueError(f"aio.thread_count {_show(data['thread_count'])} and aio.intra_op_parallelism "
                                 f"{_show(data['intra_op_parallelism'])} disagree (one setting, two names)")
    given = {k: data[k] for k in (*_AIO_DEFAULTS, "thread_count") if k in data}
    section = {**{k: v for k, v in _AIO_DEFAULTS.items() if k not in given}, **given}
    if "thread_count" in given:
        section.pop("intra_op_parallelism", None)
    read = _core.aio_config(_json_numbers(section))
    for name in _AIO_DEFAULTS:
        if name not in data and not (name == "intra_op_parallelism" and "thread_count" in data):
            run.sources[f"aio.{name}"] = "default"
    if "thread_count" in data and "intra_op_parallelism" not in data:
        run.sources["aio.intra_op_parallelism"] = "aio.thread_count"
    if s is not None:
        s.taken.update((*_AIO_DEFAULTS, "thread_count"))
        s.unless("use_gds", lambda v: v is False,
                 "not used by tierflow: it reads NVMe through pinned host memory, not GPUDirect Storage")
        s.finish()
    return AioConfig(block_size=read["block_size"], queue_depth=read["queue_depth"],
                     intra_op_parallelism=read["threads"], single_submit=section["single_submit"])


def _read_precision(run: _Run, top: _Section) -> tuple[Fp16Config, Bf16Config]:
    unresolved = lambda: None  # noqa: E731 - fp16/bf16 "enabled" come from the Trainer's arguments
    f = top.section("fp16", auto_is_default=True) or _Section(run, "fp16", {}, auto_is_default=True)
    enabled = f.get("enabled", _flag, False, auto=unresolved)
    loss_scale = f.get("loss_scale", _real(0.0), 0.0)
    dynamic = enabled is not False and loss_scale == 0
    positive_when_dynamic = _whole(1) if dynamic else _whole(0)
    fp16 = Fp16Config(
        enabled=enabled,
        loss_scale=loss_scale,
        initial_scale_power=f.get("initial_scale_power", _whole(0, 1023), 16),
        loss_scale_window=f.get("loss_scale_window", positive_when_dynamic, 1000),
        hysteresis=f.get("hysteresis", _whole(1), 2),
        consecutive_hysteresis=f.get("consecutive_hysteresis", _flag, False),
        min_loss_scale=f.get("min_loss_scale", positive_when_dynamic, 1),
    )
    f.finish(_UNUSED_PRECISION)
    # DeepSpeed reads the older name bfloat16 only when bf16 is absent.
    name = "bfloat16" if "bfloat16" in top and "bf16" not in top else "bf16"
    if name == "bf16":
        top.unused("bfloat16", "not used: bf16 is given, and DeepSpeed reads bfloat16 only without it")
    b = top.section(name, auto_is_default=True) or _Section(run, name, {}, auto_is_default=True)
    bf16 = Bf16Config(enabled=b.get("enabled", _flag, False, auto=unresolved))
    b.finish(_UNUSED_PRECISION)
    if name == "bfloat16":
        source = run.sources.pop("bfloat16.enabled", None)
        run.sources["bf16.enabled"] = "bfloat16.enabled, DeepSpeed's older name" + (f", {source}" if source else "")
    if fp16.enabled is True and bf16.enabled is True:
        raise ValueError(f"fp16.enabled and {name}.enabled: both true; a run trains in one of fp16 and bf16")
    return fp16, bf16


def _read_tierflow(run: _Run, top: _Section) -> TierflowOptions:
    s = top.section("tierflow", auto_is_default=False)
    if s is None:
        return TierflowOptions()
    optional = lambda convert: lambda k, v: None if v is None else convert(k, v)  # noqa: E731
    options = TierflowOptions(
        device_memory=s.get("device_memory", optional(_size), None),
        host_memory=s.get("host_memory", optional(_size), None),
        nvme_dir=s.get("nvme_dir", optional(_text), None),
        threads=s.get("threads", optional(_whole(1, 4096)), None),
        trace=s.get("trace", _flag, False),
        overlap_step=s.get("overlap_step", _flag, True),
    )
    # tierflow's own section has no foreign keys to carry over: a typo is an error.
    for name in s.data:
        if name not in s.taken:
            raise ValueError(f"tierflow.{name}: unknown key (device_memory, host_memory, nvme_dir, threads, trace, "
                             "overlap_step)")
    return options


def _read_batch(run: _Run, top: _Section) -> tuple[Any, Any, Any]:
    """DeepSpeed's batch rule: train_batch_size = micro batch × accumulation
    steps × world size; the one missing is derived (with DeepSpeed's floor
    divisions), one alone makes accumulation 1, and the three must agree."""
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    # "auto" here is filled from the Trainer's arguments: unresolved.
    batch, micro, steps = [top.get(key, _whole(1), None, auto=lambda: None) for key in keys]
    for key in keys:
        if run.sources.get(key) == "default":
            del run.sources[key]  # absent: derived below, or an error
    world = run.world_size
    if AUTO in (batch, micro, steps):
        # What is absent follows from what is unresolved.
        values = []
        for key, value in zip(keys, (batch, micro, steps)):
            if value is None:
                run.unresolved.append(key)
                run.sources[key] = "derived: from unresolved values"
                value = AUTO
            values.append(value)
        return tuple(values)  # type: ignore[return-value]
    rule = "derived: DeepSpeed's train_batch_size = micro × accumulation × world size"
    if batch is not None and micro is not None and steps is None:
        steps = batch // micro // world
        run.sources["gradient_accumulation_steps"] = f"{rule} ({batch} // {micro} // {world})"
    elif batch is not None and steps is not None and micro is None:
        micro = batch // world // steps
        run.sources["train_micro_batch_size_per_gpu"] = f"{rule} ({batch} // {world} // {steps})"
    elif micro is not None and steps is not None and batch is None:
        batch = micro * steps * world
        run.sources["train_batch_size"] = f"{rule} ({micro} × {steps} × {world})"
    elif batch is not None and micro is None and steps is None:
        steps, micro = 1, batch // world
        run.sources["gradient_accumulation_steps"] = "derived: 1, as DeepSpeed takes it with train_batch_size alone"
        run.sources["train_micro_batch_size_per_gpu"] = f"{rule} ({batch} // {world})"
    elif micro is not None and batch is None and steps is None:
        steps, batch = 1, micro * world
        run.sources["gradient_accumulation_steps"] = ("derived: 1, as DeepSpeed takes it with "
                                                      "train_micro_batch_size_per_gpu alone")
        run.sources["train_batch_size"] = f"{rule} ({micro} × 1 × {world})"
    elif batch is None or micro is None:
        raise ValueError("train_batch_size, train_micro_batch_size_per_gpu: neither is given; DeepSpeed needs "
                         "one of them")
    if micro < 1 or steps < 1 or batch != micro * steps * world:
        raise ValueError(f"train_batch_size: {batch} is not train_micro_batch_size_per_gpu × "
                         f"gradient_accumulation_steps × world size = {micro} × {steps} × {world}")
    return batch, micro, steps


def from_deepspeed(path_or_dict: str | os.PathLike[str] | Mapping[str, Any], *, model: Any = None,
                   optimizer: Any = None, strict: bool = False, world_size: int = 1) -> Config:
    """Reads a DeepSpeed config, a JSON file's path or a dict, exactly as
    DeepSpeed users write it, into a :class:`Config`.

    * ``model`` (a torch module) resolves the ``"auto"`` sizes as Hugging
      Face's Trainer does from its hidden size ``h``: reduce_bucket_size
      ``h²``, stage3_prefetch_bucket_size ``0.9·h²`` (rounded down) and
      stage3_param_persistence_threshold ``10·h`` at stage 3. ``h`` is
      ``model.config.hidden_size`` (or the largest of ``hidden_sizes``), or for
      a plain module the dimension most common among its 2-D weights.
    * ``optimizer`` (a torch optimizer) resolves ``optimizer.params`` lr,
      betas, eps and weight_decay and ``scheduler.params.warmup_max_lr``
      from its param groups; a value given in the config that disagrees with
      it is a ValueError, as in the Trainer. ``warmup_min_lr`` "auto" is 0.
    * ``world_size``: the data-parallel ranks in DeepSpeed's batch rule.

    Other ``"auto"`` values (batch sizes, gradient_clipping, fp16/bf16
    enabled, the scheduler's step counts) come from the Trainer's arguments:
    they stay :data:`AUTO`, listed in ``Config.unresolved``. Numbers may be
    written as strings ("1e-4") and whole numbers as floats (5e8).

    Keys not acted on (unknown ones, and DeepSpeed's that tierflow leaves
    alone, each with the reason) are listed in one
    :class:`TierflowConfigWarning`, or with ``strict=True`` in one
    ValueError. A bad value is a ValueError naming its dotted key and value.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size: {world_size!r} is not a whole number ≥ 1")
    data = _load(path_or_dict)
    run = _Run(_model_facts(model) if model is not None else None,
               _optimizer_facts(optimizer) if optimizer is not None else None, world_size)
    top = _Section(run, "", data, auto_is_default=False)
    options = _read_tierflow(run, top)
    batch, micro, steps = _read_batch(run, top)
    clipping = top.get("gradient_clipping", _real(0.0), 1.0, auto=lambda: None)
    steps_per_print = top.get("steps_per_print", lambda k, v: None if v is None else _whole(1)(k, v), None)
    wall_clock = top.get("wall_clock_breakdown", _flag, False)
    optimizer_config = _read_optimizer(run, top)
    scheduler = _read_scheduler(run, top, optimizer_config)
    zero = _read_zero(run, top, options.nvme_dir)
    aio = _read_aio(run, top)
    fp16, bf16 = _read_precision(run, top)
    top.finish(_UNUSED_TOP)
    if run.mismatches:
        raise ValueError("the optimizer given disagrees with the config: " + "; ".join(run.mismatches) +
                         ' (write "auto" to take the optimizer\'s value)')
    if run.not_used:
        listed = "; ".join(map(str, run.not_used))
        message = f"{len(run.not_used)} key(s) of the DeepSpeed config not acted on: {listed}"
        if strict:
            raise ValueError(message)
        warnings.warn(message, TierflowConfigWarning, stacklevel=2)
    return Config(
        train_batch_size=batch, train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=steps,
        world_size=world_size, gradient_clipping=clipping, steps_per_print=steps_per_print,
        wall_clock_breakdown=wall_clock, optimizer=optimizer_config, scheduler=scheduler, zero=zero, aio=aio,
        fp16=fp16, bf16=bf16, tierflow=options, model=run.model, unresolved=tuple(run.unresolved),
        not_used=tuple(run.not_used), sources=dict(run.sources),
    )
