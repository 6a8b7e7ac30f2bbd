"""The DeepSpeed reader: :func:`from_deepspeed` walks a DeepSpeed config
section by section, as DeepSpeed reads it, into the dataclasses of
``schema.py``; every key is taken by name, so what is left over is reported
by name (the tables below say why DeepSpeed keys tierflow knows are not
acted on)."""

from __future__ import annotations

import dataclasses
import json
import os
import types
import warnings
from typing import Any, Callable, Mapping

from tierflow import _core
from tierflow.config.auto import (BATCH_KEYS, Resolver, derive_batch, from_hidden, from_optimizer, model_facts,
                                  optimizer_facts, unresolved)
from tierflow.config.optimizers import AdamConfig, MuonConfig
from tierflow.config.schedules import _SCHEDULER_PARAMS, SchedulerConfig
from tierflow.config.schema import (_STAGE3_ALIASES, _STAGE3_KEYS, _ZENFLOW_KEYS, AUTO, AioConfig, Bf16Config,
                                    Config, Fp16Config, ModelFacts, OffloadOptimizerConfig, OffloadParamConfig,
                                    TierflowConfigWarning, TierflowOptions, UnusedKey, ZenflowConfig, ZeroConfig,
                                    _Auto, _show, _to_json)
from tierflow.config.values import (_betas, _choice, _flag, _json_numbers, _lr_or_lrs, _real, _size, _stage,
                                    _text, _whole)

__all__ = ["from_deepspeed"]


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
            auto: Resolver | None = None, default_note: str = "default") -> Any:
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
            lr=p.get("lr", optional_lr, None, auto=from_optimizer(run.optimizer, "lr"),
                     default_note="default: DeepSpeed's 0.02 for Muon, 3e-4 for AdamW"),
            muon_lr=p.get("muon_lr", optional_lr, None),
            adam_lr=p.get("adam_lr", optional_lr, None),
            momentum=p.get("momentum", _real(0.0, 1.0, high_open=True), 0.95),
            weight_decay=p.get("weight_decay", nonneg, 0.0, auto=from_optimizer(run.optimizer, "weight_decay")),
            betas=p.get("betas", _betas, (0.9, 0.95), auto=from_optimizer(run.optimizer, "betas")),
            eps=p.get("eps", nonneg, 1e-10, auto=from_optimizer(run.optimizer, "eps")),
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
        lr=p.get("lr", nonneg, 1e-3, auto=from_optimizer(run.optimizer, "lr")),
        betas=p.get("betas", _betas, (0.9, 0.999), auto=from_optimizer(run.optimizer, "betas")),
        eps=p.get("eps", nonneg, 1e-8, auto=from_optimizer(run.optimizer, "eps")),
        weight_decay=p.get("weight_decay", nonneg, decay_default, auto=from_optimizer(run.optimizer, "weight_decay"),
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
        resolved = from_optimizer(run.optimizer, "lr")()
        if resolved is not None:
            return resolved
        if optimizer is not None and not isinstance(optimizer.lr, _Auto):
            return optimizer.lr, "optimizer.params.lr"
        return None

    values: dict[str, Any] = {
        "warmup_num_steps": p.get("warmup_num_steps", steps, 1000, auto=unresolved),
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
        values["total_num_steps"] = p.get("total_num_steps", steps, None, auto=unresolved)
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
    def hidden(rule: Callable[[int], int], text: str) -> Resolver:
        return from_hidden(run.model, rule, text)

    def aliased(name: str, convert: Callable[[str, Any], Any], default: Any,
                auto: Resolver | None = None) -> Any:
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
                                         auto=hidden(lambda h: h * h, "h²"))
    values["contiguous_gradients"] = z.get("contiguous_gradients", _flag, True)
    values["overlap_comm"] = z.get("overlap_comm", lambda k, v: v if v is None else _flag(k, v), None)
    if values["overlap_comm"] is None:
        values["overlap_comm"] = stage == 3
        run.sources[f"{zp}.overlap_comm"] = f"default: {json.dumps(stage == 3)} at stage {stage}"
    if stage == 3:
        values["stage3_prefetch_bucket_size"] = aliased(
            "stage3_prefetch_bucket_size", elements, 50_000_000,
            hidden(lambda h: int(0.9 * h * h), "0.9·h² rounded down"))
        values["stage3_param_persistence_threshold"] = aliased(
            "stage3_param_persistence_threshold", elements, 100_000,
            hidden(lambda h: 10 * h, "10·h"))
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
    # fp16/bf16 "enabled" come from the Trainer's arguments: unresolved.
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
    # "auto" here is filled from the Trainer's arguments: unresolved.
    batch, micro, steps = [top.get(key, _whole(1), None, auto=unresolved) for key in BATCH_KEYS]
    for key in BATCH_KEYS:
        if run.sources.get(key) == "default":
            del run.sources[key]  # absent: derived, or an error
    return derive_batch(batch, micro, steps, run.world_size, run.sources, run.unresolved)


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
    run = _Run(model_facts(model) if model is not None else None,
               optimizer_facts(optimizer) if optimizer is not None else None, world_size)
    top = _Section(run, "", data, auto_is_default=False)
    options = _read_tierflow(run, top)
    batch, micro, steps = _read_batch(run, top)
    clipping = top.get("gradient_clipping", _real(0.0), 1.0, auto=unresolved)
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
