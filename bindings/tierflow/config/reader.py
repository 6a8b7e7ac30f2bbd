"""The DeepSpeed reader: :func:`from_deepspeed` walks a DeepSpeed config
section by section, as DeepSpeed reads it, into the dataclasses of
``schema.py``. Every key is taken by name, so none goes unseen: it acts, or
it is refused by name (a value that would change what DeepSpeed trains and
that tierflow does not do, or a key tierflow does not know), or it is
reported by name as not used (``known.py`` says which and why)."""

from __future__ import annotations

import copy

import dataclasses
import difflib
import json
import os
import types
import warnings
from typing import Any, Callable, Mapping

from tierflow import _core
from tierflow.config import known
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

_STRICT_HINT = "tierflow.strict_config: false reports these as a warning instead"


# ---- the reader -------------------------------------------------------------------------------

class _Run:
    """What one from_deepspeed() call gathers besides the values."""

    def __init__(self, model: ModelFacts | None, optimizer: dict[str, tuple[Any, str]] | None,
                 world_size: int) -> None:
        self.model = model
        self.optimizer = optimizer
        self.world_size = world_size
        self.strict_config = True  # tierflow.strict_config, read first
        self.sources: dict[str, str] = {}
        self.unresolved: list[str] = []
        self.not_used: list[UnusedKey] = []
        self.mismatches: list[str] = []
        # Refused unless tierflow.strict_config is false (then reported as not
        # used): unknown keys, and values that tierflow does otherwise but
        # whose difference changes nothing in what is trained.
        self.strict_refusals: list[tuple[UnusedKey, str]] = []  # (as reported, as refused)


class _Section:
    """One object of the config: hands out its keys by name and remembers
    which were taken, so that what is left over is named."""

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

    def refuse(self, name: str, agrees: Callable[[Any], bool], why: str) -> None:
        """Accepts ``name`` when its value is what tierflow does; any other
        value would change what is trained, so it is a ValueError saying why."""
        self.taken.add(name)
        if name in self.data and not agrees(self.data[name]):
            raise ValueError(f"{self.key(name)}: {_show(self.data[name])} is not supported: {why}")

    def refuse_enabled(self, name: str, why: str) -> None:
        """Accepts the section ``name`` quietly while its feature is off, as in
        tierflow; ``"enabled": true`` turns on what tierflow does not run: a
        ValueError saying why."""
        self.taken.add(name)
        if name not in self.data or self.data[name] is None:
            return
        if not isinstance(self.data[name], Mapping):
            raise ValueError(f"{self.key(name)}: {_show(self.data[name])} is not an object")
        if known.enabled(self.data[name]):
            raise ValueError(f"{self.key(name)}.enabled: true is not supported: {why}")

    def contradicts(self, name: str, convert: Callable[[str, Any], Any], agrees: Callable[[Any], bool],
                    what: str) -> None:
        """``name``'s value (checked by ``convert``) describes what tierflow
        does when ``agrees``; else it asks for another way of doing the same,
        which tierflow does not have (``what`` says what it does): refused,
        or reported with ``tierflow.strict_config`` false."""
        self.taken.add(name)
        if name not in self.data:
            return
        raw = self.data[name]
        if isinstance(raw, str) and raw.strip() == "auto" and self.auto_is_default:
            return  # DeepSpeed's default, which is what tierflow does
        if not agrees(convert(self.key(name), raw)):
            path = self.key(name)
            self.run.strict_refusals.append((UnusedKey(path, f"not used by tierflow: {what}"),
                                             f"{path}: {_show(self.data[name])} is not what tierflow does: {what}"))

    def finish(self, known_keys: Mapping[str, str] = types.MappingProxyType({}), *,
               unknown: str = "unknown key") -> None:
        """Names every key not taken: DeepSpeed's that tierflow leaves alone
        (``known_keys``, with the reason) as not used; any other as
        ``unknown``, with the nearest of this section's keys."""
        candidates = sorted(self.taken | set(known_keys))
        for name in self.data:
            if name in self.taken:
                continue
            self.taken.add(name)
            if name in known_keys:
                self.run.not_used.append(UnusedKey(self.key(name), known_keys[name]))
                continue
            path = self.key(name)
            close = _nearest(name, candidates)
            hint = f"; did you mean '{close}'?" if close else ""
            self.run.strict_refusals.append((UnusedKey(path, unknown), f"{path}: {unknown}{hint}"))


def _nearest(name: str, candidates: list[str]) -> str | None:
    """The known key ``name`` is most likely a misspelling of: the closest by
    difflib's ratio, else one it begins or ends (``topk`` for ``topk_ratio``)."""
    close = difflib.get_close_matches(name, candidates, n=1)
    if close:
        return close[0]
    partial = [c for c in candidates if len(name) >= 3 and (c.startswith(name) or c.endswith(name))]
    return min(partial, key=len) if partial else None


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



# ---- optimizer and scheduler -----------------------------------------------------------------

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
    p.refuse("fp32_optimizer_states", lambda v: v is True, "tierflow keeps the optimizer state in fp32")
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
    p.refuse("last_batch_iteration", lambda v: v == -1 and not isinstance(v, bool),
             "tierflow's schedule starts at the first step (-1); a run's schedule resumes with load_checkpoint")
    # DeepSpeed passes these as the schedule's arguments: another one's is refused there too.
    p.finish(unknown=f"not a {kind} parameter")
    s.finish()
    return SchedulerConfig(type=kind, **values)


# ---- zero_optimization ------------------------------------------------------------------------

_PINNED = ("it pins (page-locks) the host memory it copies to and from the device, where the system "
           "allows, as true says")


def _read_offload(run: _Run, z: _Section, name: str, stage: int, nvme_dir: str | None,
                  param: bool) -> OffloadOptimizerConfig | OffloadParamConfig | None:
    """The offload section ``name``, or None when it is absent (or null)."""
    cls = OffloadParamConfig if param else OffloadOptimizerConfig
    if z.data.get(name, None) is None:
        z.taken.add(name)
        return None
    s = z.section(name, auto_is_default=True)
    assert s is not None
    device = s.get("device", _choice("none", "cpu", "nvme"), "none")
    defaults = cls()
    values: dict[str, Any] = {"device": device}
    s.contradicts("pin_memory", _flag, lambda v: v is True, _PINNED)
    # The NVMe buffers size something only where NVMe is streamed through them.
    if device == "nvme" and (param or stage == 3):
        values["buffer_count"] = s.get("buffer_count", _whole(1), defaults.buffer_count)
    else:
        s.unused("buffer_count", f'not used: device is "{device}"' if device != "nvme" else
                 f"not used at stage {stage}: the optimizer's NVMe state streams through a host budget of its "
                 "own size, up to 256 MiB")
    if param:
        for key, convert in (("buffer_size", _whole(1)), ("max_in_cpu", _whole(0))):
            if device == "nvme":
                values[key] = s.get(key, convert, getattr(defaults, key))
            else:
                s.unused(key, f'not used: device is "{device}"')
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
    # Its keys go to the C++ parser; the unknown ones are named here, as everywhere.
    s = _Section(run, "zero_optimization.zenflow", section, auto_is_default=True)
    s.taken.update((*_ZENFLOW_KEYS, "offload"))
    s.finish()
    # DeepSpeed drops "auto" values from its pydantic sections: the default,
    # which for the intervals and the strategy is "auto" itself.
    given = {k: v for k, v in _json_numbers(section).items()
             if k in s.taken and k in (*_ZENFLOW_KEYS, "offload") and not (isinstance(v, str) and v == "auto")}
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


# A ZeRO stage 1-3 config without an offload section reads as "cpu", what
# tierflow does; "none" (DeepSpeed's default: kept on the accelerator) is refused.
_OPTIMIZER_HOME = ("tierflow steps the optimizer on the CPU, so its state lives in host memory or on NVMe, never "
                   'on the device; give "cpu" or "nvme"')
_PARAM_HOME = ("tierflow's stage 3 homes every parameter in host memory or on NVMe and fetches it to the device "
               'for its module; give "cpu" or "nvme"')


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

    def offload(name: str, param: bool, legacy: str) -> Any:
        """The offload section at a stage that reads it: "cpu" when absent,
        "none" refused (after what else depends on it was checked)."""
        cls = OffloadParamConfig if param else OffloadOptimizerConfig
        section = _read_offload(run, z, name, stage, nvme_dir, param=param)
        if legacy_cpu[name]:
            run.sources[f"{zp}.{name}.device"] = f"{zp}.{legacy} (deprecated)"
            return cls(device="cpu")
        if section is None:
            run.sources[f"{zp}.{name}.device"] = ('default: "cpu", where tierflow keeps it (DeepSpeed\'s '
                                                 'default, "none", keeps it on the accelerator)')
            return cls(device="cpu")
        return section

    values: dict[str, Any] = {"stage": stage}
    refused_none: list[str] = []
    if stage >= 1:
        optimizer_offload = offload("offload_optimizer", False, "cpu_offload")
        zenflow = _read_zenflow(run, z)
        if zenflow is not None and optimizer_offload.device == "none":
            raise ValueError(f'{zp}.zenflow: needs {zp}.offload_optimizer.device "cpu" or "nvme" '
                             "(ZenFlow steps the less important columns on the CPU)")
        if optimizer_offload.device == "none":
            refused_none.append(f'{zp}.offload_optimizer.device: "none" (the state on the accelerator) is not '
                                f"supported: {_OPTIMIZER_HOME}")
        values["offload_optimizer"] = optimizer_offload
        values["zenflow"] = zenflow
    else:
        for name in ("offload_optimizer", "zenflow", "cpu_offload"):
            z.unless(name, _no_offload, "not used at stage 0 (ZeRO is off)")
    if stage == 3:
        param_offload = offload("offload_param", True, "cpu_offload_param")
        if param_offload.device == "none":
            refused_none.append(f'{zp}.offload_param.device: "none" (the parameters on the accelerator) is not '
                                f"supported: {_PARAM_HOME}")
        values["offload_param"] = param_offload
    else:
        for name in ("offload_param", "cpu_offload_param"):
            z.unless(name, _no_offload, f"not used at stage {stage} (parameter offload is ZeRO-3's)")
    z.taken.update(("cpu_offload", "cpu_offload_param"))
    if refused_none:
        _raise_strict_refusals(run)  # a misspelt device is the likelier cause: name it first
        raise ValueError("; ".join(refused_none))

    # How DeepSpeed moves the gradients: at stage 3 tierflow reduces each one
    # (in fp32, over the ranks) and adds it into its own host block as it is
    # produced, during the backward; at stages 0-2 one process keeps them where
    # autograd leaves them until the optimizer's step reads them.
    if stage == 3:
        z.contradicts("overlap_comm", lambda k, v: v if v is None else _flag(k, v), lambda v: v in (None, True),
                      "its stage 3 reduces and moves each gradient during the backward, as it is produced, "
                      "as true says")
        z.contradicts("contiguous_gradients", _flag, lambda v: v is True,
                      "its stage 3 copies each gradient into a contiguous host block of its own as it is "
                      "produced, as true says")
    else:
        for name in ("overlap_comm", "contiguous_gradients"):
            z.unused(name, f"not used at stage {stage}: one process, whose gradients stay where autograd leaves "
                           "them until the optimizer's step reads them")
    elements = _whole(0)
    if stage == 3:
        values["sub_group_size"] = z.get("sub_group_size", _whole(1), 1_000_000_000)
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
        for name in ("sub_group_size", *_STAGE3_KEYS, *_STAGE3_ALIASES.values(),
                     "stage3_gather_fp16_weights_on_model_save"):
            z.unused(name, reason)
    for name, (agrees, why) in known.ZERO_REFUSED.items():
        z.refuse(name, agrees, why)
    z.finish(known.ZERO_UNUSED)
    return ZeroConfig(**values)


# ---- aio, precision, the tierflow section, the batch ------------------------------------------

_AIO_DEFAULTS = {"block_size": 1_048_576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
                 "overlap_events": True}


def _read_aio(run: _Run, top: _Section) -> AioConfig | None:
    """The aio section, with DeepSpeed's defaults for the keys it leaves out;
    None without one (DeepSpeed takes "aio": null as none), so that the store
    keeps tierflow's own I/O engine defaults."""
    top.taken.add("aio")
    if top.data.get("aio", None) is None:
        return None
    s = top.section("aio", auto_is_default=False)
    assert s is not None
    data: Mapping[str, Any] = s.data
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
        min_loss_scale=f.get("min_loss_scale", positive_when_dynamic, 1),
    )
    if "consecutive_hysteresis" in f:
        _flag(f.key("consecutive_hysteresis"), f.data["consecutive_hysteresis"])
    for key, (agrees, why) in known.FP16_REFUSED.items():
        f.refuse(key, agrees, why)
    f.finish(known.FP16_UNUSED)
    # DeepSpeed reads the older name bfloat16 only when bf16 is absent.
    name = "bfloat16" if "bfloat16" in top and "bf16" not in top else "bf16"
    if name == "bf16":
        top.unused("bfloat16", "not used: bf16 is given, and DeepSpeed reads bfloat16 only without it")
    b = top.section(name, auto_is_default=True) or _Section(run, name, {}, auto_is_default=True)
    bf16 = Bf16Config(enabled=b.get("enabled", _flag, False, auto=unresolved),
                      check_grad_overflow=b.get("check_grad_overflow", _flag, True,
                                                default_note="default (DeepSpeed's since 0.19.3)"))
    for key, (agrees, why) in known.BF16_REFUSED.items():
        b.refuse(key, agrees, why)
    b.finish(known.BF16_UNUSED)
    if name == "bfloat16":
        for key in ("enabled", "check_grad_overflow"):
            source = run.sources.pop(f"bfloat16.{key}", None)
            run.sources[f"bf16.{key}"] = f"bfloat16.{key}, DeepSpeed's older name" + (f", {source}" if source else "")
    if fp16.enabled is True and bf16.enabled is True:
        raise ValueError(f"fp16.enabled and {name}.enabled: both true; a run trains in one of fp16 and bf16")
    return fp16, bf16


def _read_data_types(run: _Run, top: _Section) -> None:
    """``data_types``: the dtypes DeepSpeed accumulates gradients, holds
    parameters and buffers in; tierflow's are fixed (fp32 gradients, the
    training precision's parameters), so only those are accepted."""
    if top.data.get("data_types", None) is None:
        top.taken.add("data_types")
        return
    s = top.section("data_types", auto_is_default=False)
    assert s is not None
    s.refuse("grad_accum_dtype", lambda v: v is None or v in known.FP32_NAMES,
             "tierflow accumulates the gradients in fp32")
    s.refuse("param_dtype", lambda v: v is None, "tierflow computes in the training precision (bf16, fp16 or fp32)")
    s.refuse("buffer_dtype", lambda v: v is None, "tierflow leaves the model's buffers in their own dtype")
    s.refuse("keep_in_fp32_modules", lambda v: v == [],
             "tierflow keeps no module in fp32 under bf16/fp16 training")
    s.finish()


def _chunk(path: str, raw: Any) -> int:
    """``tierflow.gather_chunk``: 0 (whole parameters), or a size in whole 4 KiB pages."""
    if raw == 0:
        return 0
    size = _size(path, raw)
    if size % 4096:
        raise ValueError(f"{path}: {size} bytes is not a whole number of 4 KiB pages (or 0: whole parameters)")
    return size


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
        strict_config=s.get("strict_config", _flag, True),
        collectives=s.get("collectives", _choice("tierflow", "torch"), "tierflow"),
        collectives_timeout=s.get("collectives_timeout", _real(0.0, low_open=True), 600.0),
        gather_chunk=s.get("gather_chunk", _chunk, 16 << 20),
    )
    # tierflow's own section has no foreign keys to carry over: a typo is an
    # error, whatever strict_config says.
    for name in s.data:
        if name not in s.taken:
            close = _nearest(name, sorted(s.taken))
            hint = f"did you mean '{close}'?" if close else "the keys are " + ", ".join(
                f.name for f in dataclasses.fields(TierflowOptions))
            raise ValueError(f"tierflow.{name}: unknown key; {hint}")
    return options


def _report_tierflow_stage(run: _Run, top: _Section, options: TierflowOptions, zero: ZeroConfig) -> None:
    """Names the tierflow section's keys that nothing reads at this stage."""
    given = top.data.get("tierflow") or {}
    if zero.stage != 3:
        for name in ("device_memory", "host_memory", "trace", "overlap_step", "collectives", "collectives_timeout",
                     "gather_chunk"):
            if name in given:
                run.not_used.append(UnusedKey(f"tierflow.{name}", f"not used at stage {zero.stage}: the store, its "
                                                                   "budgets, its trace, the overlapped step and "
                                                                   "the collectives are stage 3's"))
    nvme = zero.offload_optimizer.device == "nvme" or (zero.stage == 3 and zero.offload_param.device == "nvme")
    if "nvme_dir" in given and not nvme:
        run.not_used.append(UnusedKey("tierflow.nvme_dir", "not used: nothing is offloaded to NVMe"))


def _raise_strict_refusals(run: _Run) -> None:
    """Raises the unknown keys and the contradicting settings found so far,
    in one ValueError, unless tierflow.strict_config is false."""
    if run.strict_refusals and run.strict_config:
        raise ValueError("; ".join(refused for _, refused in run.strict_refusals) + f" ({_STRICT_HINT})")


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
    DeepSpeed users write it, into a :class:`Config`. It only reads: nothing
    is made or changed, so a refused config leaves nothing behind.

    * ``model`` (a torch module) resolves the ``"auto"`` sizes as Hugging
      Face's Trainer does from its hidden size ``h``:
      stage3_prefetch_bucket_size ``0.9·h²`` (rounded down) and
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

    Every key acts, or is named:

    * a ValueError for a bad value, naming its dotted key and value; for a
      value that would change what DeepSpeed trains and that tierflow does
      not do (``prescale_gradients: true``, ``fp16_master_weights_and_grads:
      true``, an offload device "none"...), saying why; and, unless
      ``tierflow.strict_config`` is false, for a key tierflow does not know
      (with the nearest known key: ``...offload_optimizer.devcie: unknown key;
      did you mean 'device'?``) or a setting it does otherwise with the same
      result (``overlap_comm: false``);
    * one :class:`TierflowConfigWarning` listing the keys DeepSpeed has that
      tierflow leaves alone (monitoring, profilers, collective tuning, a
      stage's settings at another stage), each with the reason, and with
      ``strict_config`` false those refused above by it; all also in
      ``Config.not_used``. ``strict=True`` makes it a ValueError.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size: {world_size!r} is not a whole number ≥ 1")
    data = _load(path_or_dict)
    run = _Run(model_facts(model) if model is not None else None,
               optimizer_facts(optimizer) if optimizer is not None else None, world_size)
    top = _Section(run, "", data, auto_is_default=False)
    options = _read_tierflow(run, top)
    run.strict_config = options.strict_config
    batch, micro, steps = _read_batch(run, top)
    clipping = top.get("gradient_clipping", _real(0.0), 1.0, auto=unresolved,
                       default_note="default (DeepSpeed's since 0.19.3)")
    top.unless("wall_clock_breakdown", lambda v: v is False, "not used by tierflow: DeepSpeed's timing printout "
                                                             "(tierflow's is Engine.telemetry() and its trace)")
    optimizer_config = _read_optimizer(run, top)
    scheduler = _read_scheduler(run, top, optimizer_config)
    zero = _read_zero(run, top, options.nvme_dir)
    _report_tierflow_stage(run, top, options, zero)
    aio = _read_aio(run, top)
    fp16, bf16 = _read_precision(run, top)
    _read_data_types(run, top)
    for name, (agrees, why) in known.TOP_REFUSED.items():
        top.refuse(name, agrees, why)
    for name, why in known.ENABLED_REFUSED.items():
        top.refuse_enabled(name, why)
    top.finish(known.TOP_UNUSED)
    if run.mismatches:
        raise ValueError("the optimizer given disagrees with the config: " + "; ".join(run.mismatches) +
                         ' (write "auto" to take the optimizer\'s value)')
    _raise_strict_refusals(run)
    run.not_used.extend(reported for reported, _ in run.strict_refusals)
    if run.not_used:
        listed = "; ".join(map(str, run.not_used))
        message = f"{len(run.not_used)} key(s) of the DeepSpeed config not acted on: {listed}"
        if strict:
            raise ValueError(message)
        warnings.warn(message, TierflowConfigWarning, stacklevel=2)
    return Config(
        train_batch_size=batch, train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=steps,
        world_size=world_size, gradient_clipping=clipping, optimizer=optimizer_config, scheduler=scheduler,
        zero=zero, aio=aio, fp16=fp16, bf16=bf16, tierflow=options, model=run.model,
        unresolved=tuple(run.unresolved), not_used=tuple(run.not_used), sources=dict(run.sources),
        deepspeed=copy.deepcopy(dict(data)),
    )
