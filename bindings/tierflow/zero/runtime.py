"""The seam between the engine and where a model's parameters live.

:class:`~tierflow.zero.engine.Engine` is DeepSpeed's engine as a user and
Hugging Face's Trainer see it: the config, the counters, the fp16 loss
scale, the accumulation boundary and the clipping rule. Everything that
depends on where the parameters are kept belongs to a :class:`Runtime`:

- :class:`~tierflow.zero.partitioned.PartitionedRuntime` (stage 3): every
  parameter in tierflow's store, fetched module by module; the optimizer
  steps host copies (or ZenFlow fp32 masters), overlapped with the backward
  where nothing global must be known first;
- :class:`~tierflow.zero.resident.ResidentRuntime` (stages 0–2): the
  parameters where the model keeps them, stepped by tierflow's Adam/AdamW
  (state in host memory or on NVMe) or by ZenFlow.

Each runtime owns its optimizer and ZenFlow state, through an
:class:`OptimizerSide`; checkpoint.py reads and writes a run through this
protocol alone.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Protocol

import torch

from tierflow.config import AUTO, AdamConfig, Config, MuonConfig
from tierflow.zero.plan import Plan, links_of, tiers_of

__all__ = ["Runtime", "OptimizerSide", "check_optimizer", "zenflow_options", "adam_class_and_options",
           "muon_optimizer", "muon_named"]


class Runtime(Protocol):
    """What the engine asks of the parameters' owner.

    A checkpoint *item* is what :meth:`entries` lists: a partition at stage
    3, the parameter itself at stages 0–2; either has ``shape``, ``dtype``
    and ``requires_grad``.
    """

    optimizer: torch.optim.Optimizer
    state: "OptimizerSide"
    plan: Plan | None      # stage 3's plan, else None
    partitioned: bool      # whether each rank holds shards (stage 3's checkpoint files)

    @property
    def device(self) -> torch.device: ...

    # ---- a training step -----------------------------------------------------------------------

    def forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        """``module(*args, **kwargs)``, the values it reads the newest."""

    def backward(self, loss: torch.Tensor, retain_graph: bool, need_norm: bool) -> None:
        """Backward of ``loss`` (already scaled); with ``need_norm`` the
        gradients' squared norm is counted as they are made."""

    def end_micro_batch(self) -> None:
        """A ``step()`` call ended a micro-batch."""

    def grad_norm_sq(self) -> tuple[float, bool]:
        """The accumulated gradients' global squared L2 norm (over every
        rank) and whether every gradient is finite."""

    def apply(self, factor: float | None) -> None:
        """The boundary's update with the gradients times ``factor`` (None:
        a skipped step); the gradients are dropped either way."""

    def zero_grad(self, set_to_none: bool) -> None: ...

    def check_no_sync(self) -> None:
        """Raises when gradients cannot wait unreduced."""

    def finish(self) -> None:
        """Lands every update still in flight, so the model holds the newest values."""

    # ---- reports -------------------------------------------------------------------------------

    def memory_stats(self, busy_seconds: float) -> dict[str, Any]: ...

    def write_trace(self, path: str | os.PathLike) -> None: ...

    # ---- checkpoints ---------------------------------------------------------------------------

    def entries(self) -> list[tuple[str, Any]]:
        """(name, item) for every distinct parameter in the model's order (a tied one under its first name)."""

    def read(self, item: Any) -> torch.Tensor:
        """``item``'s whole compute values, in host memory (every rank calls it when sharded)."""

    def read_local(self, item: Any) -> torch.Tensor:
        """This rank's compute values of ``item``: the whole, or its flat shard."""

    def local_of(self, item: Any, values: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``item``'s whole ``values``."""

    def whole_of(self, item: Any, local: torch.Tensor) -> torch.Tensor:
        """``item``'s whole values from every rank's ``local`` part."""

    def master(self, item: Any, local: torch.Tensor) -> torch.Tensor | None:
        """This rank's fp32 master of a trainable low-precision ``item``
        (``local``: its compute values), or None when none is kept yet."""

    def write(self, item: Any, fill: Callable[[torch.Tensor], None]) -> None:
        """Overwrites ``item``'s values with what ``fill`` writes into a
        host tensor of its shape and dtype."""

    def flush(self) -> None:
        """Every value written so far where a checkpoint reads it."""

    def local_numel(self) -> dict[int, int]:
        """Elements of the optimizer's view of each parameter, by id of what it steps."""

    def close(self) -> None: ...


def check_optimizer(config: Config) -> None:
    """Refuses, by key, an optimizer section the engine cannot step."""
    opt = config.optimizer
    if opt is None:
        raise ValueError("optimizer: missing; the engine steps the optimizer the config names "
                         "(type Adam, AdamW or Muon, with its params)")
    if config.zero.zenflow is not None and not isinstance(opt, AdamConfig):
        raise ValueError(f"optimizer.type: {opt.type} with zenflow; ZenFlow steps Adam or AdamW")
    if isinstance(opt, MuonConfig):
        values = [("lr", opt.muon_group_lr), ("lr", opt.adam_group_lr), ("betas", opt.betas), ("eps", opt.eps),
                  ("weight_decay", opt.weight_decay)]
    else:
        values = [(name, getattr(opt, name)) for name in ("lr", "betas", "eps", "weight_decay")]
    for name, value in values:
        if value is AUTO:
            raise ValueError(f'optimizer.params.{name}: "auto" is unresolved; give a value')


def optimizer_nvme(config: Config, rank: int, world_size: int, plan: Plan | None) -> dict[str, Any]:
    """The optimizer's placement keywords with ``offload_optimizer.device``
    "nvme" (its directory made, this rank's own; the plan's stream budget
    at stage 3; the aio section's I/O engine for its files), else none."""
    z = config.zero
    if z.offload_optimizer.device != "nvme":
        return {}
    root = z.offload_optimizer.nvme_path or config.tierflow.nvme_dir
    rank_dir = f"rank{rank}" if world_size > 1 else ""
    out: dict[str, Any] = {"offload": "nvme", "nvme_dir": os.path.join(root, "tierflow-optimizer", rank_dir)}
    os.makedirs(out["nvme_dir"], mode=0o700, exist_ok=True)
    if plan is not None and plan.optimizer_host_budget is not None:
        out["host_memory"] = plan.optimizer_host_budget
    if config.aio is not None:
        out["aio"] = config.aio.engine_options()
    return out


def zenflow_options(config: Config, nvme: dict[str, Any]) -> dict[str, Any]:
    """``tierflow.torch.optim.ZenFlow``'s keywords under ``config``'s
    optimizer and ZenFlow sections, placed by ``nvme`` (:func:`optimizer_nvme`)."""
    opt, zf = config.optimizer, config.zero.zenflow
    options = {k: getattr(zf, k) for k in ("topk_ratio", "select_strategy", "select_interval", "update_interval",
                                            "overlap_step", "auto_ratio", "full_warm_up_rounds",
                                            "pt_reserved_cores_perc", "importance_norm")}
    if zf.steps_per_epoch is not None:
        options["steps_per_epoch"] = zf.steps_per_epoch
    return dict(lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay,
                decoupled_weight_decay=opt.decoupled_weight_decay, zenflow=options,
                threads=config.tierflow.threads, **nvme)


def adam_class_and_options(config: Config, nvme: dict[str, Any]) -> tuple[type, dict[str, Any]]:
    """tierflow's Adam or AdamW class and keywords under ``config``'s optimizer section."""
    from tierflow.torch.optim import Adam, AdamW

    opt = config.optimizer
    kwargs: dict[str, Any] = dict(lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay,
                                  amsgrad=opt.amsgrad, threads=config.tierflow.threads, **nvme)
    return (AdamW if opt.decoupled_weight_decay else Adam), kwargs


def muon_optimizer(config: Config, named: list[tuple[str, torch.Tensor]], nvme: dict[str, Any],
                   stepped: Callable[[torch.Tensor], torch.Tensor] = lambda t: t, group: Any = None) -> Any:
    """The engine's optimizer under an ``optimizer.type: Muon`` section:
    :class:`~tierflow.zero.muon.MuonWithAuxAdam` over tierflow's Muon for
    the hidden matrices of ``named`` ((name, a tensor of the parameter's
    shape) pairs, every name of a tied parameter; ``stepped`` maps each to
    what the optimizer steps) and AdamW for the rest, split by
    :func:`~tierflow.torch.optim.muon_param_groups`' rule, placed by
    ``nvme`` (:func:`optimizer_nvme`): with the state on NVMe, each part's
    files in a directory of its own and the host budget shared by the
    parts' state sizes (each at least the store's minimum). Over the
    several ranks of ``group`` (stage 3's flat shards) Muon's part is
    :class:`~tierflow.zero.muon.ShardedMuon`."""
    from tierflow.torch.optim import AdamW, Muon, muon_param_groups
    from tierflow.zero.muon import PART_NAMES, MuonWithAuxAdam, ShardedMuon

    opt = config.optimizer
    shapes, rest = muon_param_groups(named)
    hidden = [stepped(t) for t in shapes]
    rest = [stepped(t) for t in rest]
    placement: dict[bool, dict[str, Any]] = {True: {}, False: {}}
    if nvme:
        state_bytes = {True: sum(p.numel() * 4 for p in hidden), False: sum(p.numel() * 8 for p in rest)}
        for use_muon in (True, False):
            # (OffloadedMuon takes no aio options: Muon's files use the default I/O engine.)
            part = {k: v for k, v in nvme.items() if k != "host_memory" and (k != "aio" or not use_muon)}
            part["nvme_dir"] = os.path.join(nvme["nvme_dir"], PART_NAMES[use_muon])
            os.makedirs(part["nvme_dir"], mode=0o700, exist_ok=True)
            placement[use_muon] = part
        if "host_memory" in nvme and hidden and rest:
            total, least = int(nvme["host_memory"]), _MIN_STORE_HOST
            share = total * state_bytes[True] // max(1, state_bytes[True] + state_bytes[False])
            share = min(max(least, share // 4096 * 4096), max(least, total - least))
            placement[True]["host_memory"], placement[False]["host_memory"] = share, max(least, total - share)
        elif "host_memory" in nvme:
            placement[bool(hidden)]["host_memory"] = nvme["host_memory"]
    threads = config.tierflow.threads
    if not hidden:
        muon = None
    elif group is not None and group.world_size > 1:
        muon = ShardedMuon(hidden, {id(p): tuple(t.shape) for p, t in zip(hidden, shapes)}, group, threads=threads,
                           **opt.muon_options(), **placement[True])
    else:
        muon = Muon(hidden, threads=threads, **opt.muon_options(), **placement[True])
    try:
        adamw = AdamW(rest, threads=threads, **opt.adamw_options(), **placement[False]) if rest else None
    except BaseException:
        if muon is not None:
            muon.close()
        raise
    return MuonWithAuxAdam(muon, adamw)


def muon_named(model: torch.nn.Module, trainable: list, stepped: Callable[[torch.nn.Parameter], Any]
               ) -> list[tuple[str, Any]]:
    """(name, ``stepped(p)``) for each name of each ``trainable`` parameter
    of ``model`` (a tied one under every name, so muon_param_groups sees
    its head's name), for :func:`~tierflow.zero.runtime.muon_optimizer`.
    Param groups are refused: the engine makes Muon's and AdamW's itself."""
    if any(isinstance(g, dict) for g in trainable):
        raise ValueError("model_parameters: param groups with optimizer.type Muon; the engine makes Muon's group "
                         "(the hidden matrices) and AdamW's (the rest) itself: give parameters, or none")
    chosen = {id(p) for p in trainable}
    return [(name, stepped(p)) for name, p in model.named_parameters(remove_duplicate=False) if id(p) in chosen]


_MIN_STORE_HOST = 64 << 10  # an NVMe state store's least host budget (plan.py's _MIN_OPTIMIZER_HOST)


class OptimizerSide:
    """A runtime's optimizer as a checkpoint sees it: ``optimizer`` (what
    steps, and what the LR scheduler sees) and, when ZenFlow steps fp32
    masters of the model (:class:`~tierflow.zero.zenflow.PartitionedZenFlow`),
    ``zenflow``, which then owns the state. ``in_place`` marks ZenFlow
    stepping an fp32 model's own parameters, whose values lag its open
    window until :meth:`finish`."""

    def __init__(self, optimizer: torch.optim.Optimizer, zenflow: Any = None, *, in_place: bool = False) -> None:
        self.optimizer = optimizer
        self.zenflow = zenflow
        self.in_place = in_place

    @property
    def owner(self) -> Any:
        """What saves and loads the state: ZenFlow over masters, else the optimizer."""
        return self.zenflow if self.zenflow is not None else self.optimizer

    @property
    def on_nvme(self) -> bool:
        """Whether the state is saved as its NVMe store's own checkpoint."""
        return getattr(self.optimizer, "offload", "cpu") == "nvme" and hasattr(self.optimizer, "save_state")

    def finish(self) -> None:
        if self.zenflow is not None:
            self.zenflow.finish()
        elif self.in_place:
            self.optimizer.finish()

    def check_saved(self, saved: Any, path: str, numel: dict[int, int]) -> None:
        """Checks a state saved in memory form (``torch.load``'s result)
        against this optimizer; ``numel``: :meth:`Runtime.local_numel`."""
        from tierflow.torch.optim import Adam
        from tierflow.zero.muon import MuonWithAuxAdam

        if self.zenflow is not None:
            if not isinstance(saved, dict) or "optimizer" not in saved:
                raise ValueError(f"load_checkpoint: {path} is not a ZenFlow state over fp32 masters (saved without "
                                 "zero_optimization.zenflow?)")
            _check_groups(saved["optimizer"]["param_groups"], self.optimizer.param_groups, path)
            masters = saved.get("masters")
            if masters is not None:
                for part in self.zenflow.parts:
                    value = masters.get(part.name)
                    if value is None or tuple(value.shape) != part.shape:
                        raise ValueError(f"load_checkpoint: {path} has no fp32 master of '{part.name}' of its shape "
                                         f"{list(part.shape)}")
            return
        if isinstance(saved, dict) and "optimizer" in saved and "param_groups" not in saved:
            raise ValueError(f"load_checkpoint: {path} holds a ZenFlow state over fp32 masters; this run's "
                             "optimizer is not (zero_optimization.zenflow, bf16/fp16)")
        if not isinstance(saved, dict) or "param_groups" not in saved or "state" not in saved:
            raise ValueError(f"load_checkpoint: {path} is not an optimizer state_dict")
        _check_groups(saved["param_groups"], self.optimizer.param_groups, path)
        if isinstance(self.optimizer, (Adam, MuonWithAuxAdam)):
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            ids = [i for g in saved["param_groups"] for i in g["params"]]
            for index, (i, p) in enumerate(zip(ids, params)):
                for key, value in saved["state"].get(i, {}).items():
                    if key != "step" and torch.is_tensor(value) and value.numel() != numel[id(p)]:
                        raise ValueError(f"load_checkpoint: {path} holds '{key}' of {value.numel()} elements for "
                                         f"parameter {index} of the optimizer, which has {numel[id(p)]}")

    def check_directory(self, meta: dict[str, Any], directory: str, precision: str) -> None:
        """Checks the optimizer's own NVMe checkpoint in ``directory``
        (``meta``: its optimizer.pt) is for parameters grouped as this run's
        and holds what this run needs."""
        import errno

        _check_groups(meta["param_groups"], self.optimizer.param_groups, directory)
        if self.zenflow is not None and precision != "fp32":
            masters = os.path.join(directory, "masters.pt")
            if not os.path.isfile(masters):
                raise FileNotFoundError(errno.ENOENT, f"load_checkpoint: {masters} is missing (the fp32 masters of "
                                                      f"a {precision} run)", masters)

    def load(self, saved: Any) -> None:
        """Loads a state :meth:`check_saved` passed."""
        from tierflow.torch.optim import Adam
        from tierflow.zero.muon import MuonWithAuxAdam, set_masters

        if self.zenflow is not None:
            self.zenflow.load_state_dict(saved)
        elif isinstance(self.optimizer, Adam):
            _load_adam(self.optimizer, saved)
        elif isinstance(self.optimizer, MuonWithAuxAdam):
            for part, share in self.optimizer.split_state_dict(saved):
                if isinstance(part, Adam):
                    _load_adam(part, share)
                else:  # Muon: the same rule for its masters
                    part.load_state_dict(share)
                    set_masters(part, share)
            self.optimizer.rejoin()
        else:
            self.optimizer.load_state_dict(saved)

    def refresh(self) -> None:
        """The fp32 masters follow the model's loaded values (its state was
        not loaded): DeepSpeed's ``refresh_fp32_params``."""
        if self.zenflow is not None:
            self.zenflow.reload()
            return
        if self.in_place:  # ZenFlow's host side keeps its own copy of its columns
            self.optimizer.reload_values()
            return
        refresh = getattr(self.optimizer, "refresh_masters", None)
        if callable(refresh):
            refresh()

    def master_of_param(self, p: torch.Tensor) -> torch.Tensor | None:
        """A copy of the fp32 master the optimizer keeps of ``p`` (a parameter it steps), or None."""
        from tierflow.torch.optim.adam import MASTER_KEY

        master_of = getattr(self.optimizer, "master_of", None)  # (MuonWithAuxAdam: its parts know)
        if callable(master_of):
            try:
                return master_of(p)
            except KeyError:
                return None  # one it does not step
        read = getattr(self.optimizer, "_read_state", None)
        if getattr(self.optimizer, "offload", "cpu") == "nvme" and callable(read):
            group = next((g for g in self.optimizer.param_groups if any(q is p for q in g["params"])), None)
            return None if group is None else read(p, group).get(MASTER_KEY)  # (None: one it does not step)
        value = self.optimizer.state.get(p, {}).get(MASTER_KEY)
        return None if value is None else value.detach().cpu().clone()

    def memory_stats(self) -> dict[str, Any] | None:
        """The optimizer's tiers and links (its state's NVMe store), or None."""
        if self.zenflow is not None:
            return self.zenflow.memory_stats()
        telemetries = getattr(self.optimizer, "telemetries", None)  # (MuonWithAuxAdam: a store per part)
        if callable(telemetries):
            return _joint_stats(telemetries())
        telemetry = getattr(self.optimizer, "telemetry", None)
        t = telemetry() if callable(telemetry) else None
        return None if t is None else {"tiers": tiers_of(t), "bytes": links_of(t)}

    def close(self) -> None:
        if self.zenflow is not None:
            self.zenflow.close()
        close = getattr(self.optimizer, "close", None)
        if callable(close):
            close()


def _check_groups(saved_groups: list, groups: list, path: str) -> None:
    saved = [len(g["params"]) for g in saved_groups]
    ours = [len(g["params"]) for g in groups]
    if saved != ours:
        raise ValueError(f"load_checkpoint: {path} holds the state of param groups of {saved} parameters, this "
                         f"optimizer has {ours} (load_optimizer_states=False loads the model alone)")


def _load_adam(optimizer: Any, saved: dict[str, Any]) -> None:
    """tierflow Adam's load of ``saved`` (into RAM or, a state saved in host
    memory, into its NVMe store) with the saved fp32 masters set as they
    are: its own load would remake a master that does not round to its
    parameter's value, which a parameter in the store (a placeholder) never
    does."""
    from tierflow.torch.optim import MASTER_KEY

    masters, state = {}, {}
    for i, entry in saved["state"].items():
        if MASTER_KEY in entry:
            masters[i] = entry[MASTER_KEY]
            entry = {k: v for k, v in entry.items() if k != MASTER_KEY}
        state[i] = entry
    optimizer.load_state_dict({**saved, "state": state})
    params = [p for g in optimizer.param_groups for p in g["params"]]
    ids = [i for g in saved["param_groups"] for i in g["params"]]
    for i, p in zip(ids, params):
        if i in masters:
            optimizer._set_master(p, masters[i])


def _joint_stats(telemetries: list[dict]) -> dict[str, Any] | None:
    """The tiers and links of several NVMe stores as one's: each tier's
    budget, use and high-water mark and each link's bytes summed (a high
    water summed is an upper bound of the stores' joint one)."""
    if not telemetries:
        return None
    tiers: dict[str, dict[str, int | None]] = {}
    links: dict[str, int] = {}
    for t in telemetries:
        for kind, tier in tiers_of(t).items():
            into = tiers.setdefault(kind, {"budget": 0, "used": 0, "high_water": 0})
            into["budget"] = None if into["budget"] is None or tier["budget"] is None else into["budget"] + tier["budget"]
            into["used"] += tier["used"]
            into["high_water"] += tier["high_water"]
        for name, moved in links_of(t).items():
            links[name] = links.get(name, 0) + moved
    return {"tiers": tiers, "bytes": links}
