"""The typed description of a run that :func:`~tierflow.config.from_deepspeed`
returns: one frozen dataclass per section of a DeepSpeed config, the
:data:`AUTO` placeholder of an unresolved ``"auto"``, and how what was not
acted on is named (:class:`UnusedKey`, :class:`TierflowConfigWarning`).

The optimizer's and the scheduler's sections are in ``optimizers.py`` and
``schedules.py``, with what builds them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Mapping, NamedTuple

if TYPE_CHECKING:
    from tierflow.config.optimizers import AdamConfig, MuonConfig
    from tierflow.config.schedules import SchedulerConfig


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


def _show(value: Any) -> str:
    """A value as the user wrote it in JSON (strings quoted), for messages."""
    if value is AUTO:
        return '"auto"'
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _refuse_auto(path: str, value: Any) -> None:
    if value is AUTO:
        raise ValueError(f'{path}: "auto" is unresolved; give a value, or the model/optimizer it comes from '
                         "to from_deepspeed()")


def _shown(value: Any) -> str:
    """A value for the printout."""
    return "auto (unresolved)" if value is AUTO else _show(_to_json(value))


def _to_json(value: Any) -> Any:
    if value is AUTO:
        return "auto"
    if isinstance(value, tuple):
        return [_to_json(v) for v in value]
    return value


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


# ---- the sections ----------------------------------------------------------------------

@dataclass(frozen=True)
class OffloadOptimizerConfig:
    """``zero_optimization.offload_optimizer``: where the optimizer state
    lives — "cpu": host memory; "nvme": files in nvme_path, streamed through
    ``buffer_count`` sub-groups of host memory at stage 3. tierflow steps the
    optimizer on the CPU, so at stages 1-3 the state is never on the device:
    :func:`from_deepspeed` refuses "none" there, and a config without the
    section reads as "cpu". "none" is left only at stage 0 (ZeRO off)."""

    device: Literal["none", "cpu", "nvme"] = "none"
    nvme_path: str | None = None
    buffer_count: int = 4


@dataclass(frozen=True)
class OffloadParamConfig:
    """``zero_optimization.offload_param`` (ZeRO-3): where parameters live
    between uses ("cpu": host memory; "nvme": files in nvme_path), the NVMe
    staging buffers (buffer_count of buffer_size elements) and how many
    parameter elements stay in host memory with nvme (max_in_cpu). tierflow's
    stage 3 homes every parameter in host memory or on NVMe and fetches it to
    the device for its module: :func:`from_deepspeed` refuses "none" at stage
    3, and a config without the section reads as "cpu"."""

    device: Literal["none", "cpu", "nvme"] = "none"
    nvme_path: str | None = None
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
    ZenFlow, and the stage-3 sizes (in elements) with DeepSpeed's defaults.
    ``sub_group_size``, the ``stage3_*`` values and ``offload_param`` matter
    at stage 3 only. ``stage3_gather_16bit_weights_on_model_save`` is kept
    for what reads it beside the engine (Hugging Face's Accelerate decides by
    it whether a stage-3 save asks the engine for the 16-bit weights);
    tierflow's own ``save_16bit_model`` streams them at any stage."""

    stage: int = 0
    offload_optimizer: OffloadOptimizerConfig = field(default_factory=OffloadOptimizerConfig)
    offload_param: OffloadParamConfig = field(default_factory=OffloadParamConfig)
    zenflow: ZenflowConfig | None = None
    sub_group_size: int = 1_000_000_000
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
    on its own (``single_submit``), with DeepSpeed's defaults for the keys a
    given section leaves out. It configures the I/O engine of the ZeRO-3
    store's NVMe tier (:meth:`engine_options`); a config without an ``aio``
    section has ``Config.aio`` None, and the store keeps tierflow's own
    engine defaults (``tierflow tune io`` measures better ones)."""

    block_size: int = 1_048_576
    queue_depth: int = 8
    intra_op_parallelism: int = 1
    single_submit: bool = False

    def engine_options(self) -> dict[str, int]:
        """The I/O engine's settings, as ``_core.Store(aio=...)`` takes them:
        ``block_size``, ``queue_depth``, ``threads`` and, with
        ``single_submit``, ``submit_batch`` 1 (each request handed to the
        kernel on its own; else the engine's own batching)."""
        out = {"block_size": self.block_size, "queue_depth": self.queue_depth, "threads": self.intra_op_parallelism}
        if self.single_submit:
            out["submit_batch"] = 1
        return out


@dataclass(frozen=True)
class Fp16Config:
    """``fp16``: mixed precision with loss scaling; ``loss_scale`` 0 is
    dynamic, starting at 2**initial_scale_power."""

    enabled: bool | _Auto = False
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
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
    """``bf16`` (or DeepSpeed's older ``bfloat16``). ``check_grad_overflow``
    (DeepSpeed's default true since 0.19.3): a step whose gradients are not
    all finite is skipped, as fp16 skips an overflow."""

    enabled: bool | _Auto = False
    check_grad_overflow: bool = True


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
    tierflow decides. ``strict_config`` (default true) refuses a key
    tierflow does not know and a setting it does otherwise, whose value
    changes nothing in what is trained (``overlap_comm: false``...); false
    reports them in one warning instead. With several ranks,
    ``collectives`` says who runs the parameters' gathers and the gradients'
    reduce-scatters: ``"tierflow"`` (default) tierflow's communicators where
    it has one for the memory (Gloo for host memory) and torch.distributed's
    elsewhere, ``"torch"`` torch.distributed's; ``collectives_timeout`` (seconds, default 600) is how
    long one of tierflow's may take before it fails the step; ``gather_chunk`` (bytes of a rank's
    shard, whole 4 KiB pages, default 16 MiB; 0: whole parameters) is the piece of a parameter
    gathered at once on tierflow's communicators, so its first pieces are gathered while the rest
    is still read or copied up."""

    device_memory: int | None = None
    host_memory: int | None = None
    nvme_dir: str | None = None
    threads: int | None = None
    trace: bool = False
    overlap_step: bool = True
    strict_config: bool = True
    collectives: str = "tierflow"
    collectives_timeout: float = 600.0
    gather_chunk: int = 16 << 20


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
    optimizer: AdamConfig | MuonConfig | None = None
    scheduler: SchedulerConfig | None = None
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    aio: AioConfig | None = None
    fp16: Fp16Config = field(default_factory=Fp16Config)
    bf16: Bf16Config = field(default_factory=Bf16Config)
    tierflow: TierflowOptions = field(default_factory=TierflowOptions)
    model: ModelFacts | None = field(default=None, compare=False)
    unresolved: tuple[str, ...] = field(default=(), compare=False)
    not_used: tuple[UnusedKey, ...] = field(default=(), compare=False)
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)
    deepspeed: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # DeepSpeed's engine.config is the config dict itself, and trainers read
    # it so (Hugging Face's Trainer: engine.config.get("zero_optimization")):
    # the keys as the config gave them, "auto" and all.
    def get(self, key: str, default: Any = None) -> Any:
        """The DeepSpeed config's own value of top-level ``key`` (as given), or ``default``."""
        return self.deepspeed.get(key, default)

    def __getitem__(self, key: str) -> Any:
        return self.deepspeed[key]

    def __contains__(self, key: object) -> bool:
        return key in self.deepspeed

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
        if self.aio is None:
            lines.append("  aio: none given, so the NVMe tier keeps tierflow's own I/O engine defaults")
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
        if section == "optimizer" and o is not None:
            return o.heading()
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
        if self.optimizer is not None:
            e.append(("optimizer.type", self.optimizer.type))
            names = [f.name for f in dataclasses.fields(self.optimizer) if f.name != "type"]
            e += [(f"optimizer.params.{n}", getattr(self.optimizer, n)) for n in names
                  if getattr(self.optimizer, n) is not None]
        if self.scheduler is not None:
            s = self.scheduler
            e.append(("scheduler.type", s.type))
            for name in s.param_names:
                value = getattr(s, name)
                if value is not None:
                    e.append((f"scheduler.params.{name}", value))
        z = self.zero
        zp = "zero_optimization"
        e.append((f"{zp}.stage", z.stage))
        if z.stage >= 1:
            o = z.offload_optimizer
            # The NVMe buffers are read only where they size something: stage 3's NVMe stream.
            e += [(f"{zp}.offload_optimizer.{name}", getattr(o, name))
                  for name in ("device", "nvme_path", "buffer_count")
                  if name == "device" or (o.device == "nvme" and (name == "nvme_path" or z.stage == 3))]
        if z.stage == 3:
            p = z.offload_param
            e += [(f"{zp}.offload_param.{f.name}", getattr(p, f.name)) for f in dataclasses.fields(p)
                  if f.name == "device" or p.device == "nvme"]
        if z.zenflow is not None:
            e += [(f"{zp}.zenflow.{name}", getattr(z.zenflow, name)) for name in _ZENFLOW_KEYS
                  if name != "steps_per_epoch" or z.zenflow.steps_per_epoch is not None]
        if z.stage == 3:
            e.append((f"{zp}.sub_group_size", z.sub_group_size))
            e += [(f"{zp}.{name}", getattr(z, name)) for name in _STAGE3_KEYS]
        if self.aio is not None:
            e += [(f"aio.{f.name}", getattr(self.aio, f.name)) for f in dataclasses.fields(self.aio)]
        e += [(f"fp16.{f.name}", getattr(self.fp16, f.name)) for f in dataclasses.fields(self.fp16)]
        e += [(f"bf16.{f.name}", getattr(self.bf16, f.name)) for f in dataclasses.fields(self.bf16)]
        # The tierflow section's values that differ from its defaults.
        defaults = TierflowOptions()
        e += [(f"tierflow.{f.name}", getattr(self.tierflow, f.name)) for f in dataclasses.fields(self.tierflow)
              if getattr(self.tierflow, f.name) != getattr(defaults, f.name)]
        return e
