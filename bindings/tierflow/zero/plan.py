"""Where a ZeRO-3 run keeps what, and how much memory each tier may use.

A :class:`Plan` is made from a model's parameters and a :class:`~tierflow.config.Config`
before any byte moves, so a run that cannot fit is refused at once with the
budget it would need, and :func:`estimate_memory` can print the same figures
for a model that was never trained.

What lives where (ZeRO-3):

* each parameter's compute copy (its dtype: fp32, or bf16/fp16 under
  ``bf16``/``fp16``) is one block homed in host memory
  (``offload_param.device`` "cpu" or "none") or on NVMe ("nvme"), leased into
  the device tier around its module's forward and backward;
* each parameter's gradient, accumulated in fp32 across micro-batches, is one
  block homed in host memory (``offload_optimizer.device`` "cpu"/"none") or
  on NVMe ("nvme"; not with ZenFlow, which reads every gradient into its own
  host buffers at every step, so a gradient on NVMe would only cost its
  bytes' trip there and back);
* the optimizer's state (Adam's moments, and the fp32 master of a bf16/fp16
  parameter; an fp32 parameter's compute copy *is* its master) belongs to the
  optimizer: host memory, or NVMe streamed through its own host budget.

The budgets, without a ``tierflow`` section, follow DeepSpeed's own keys so a
DeepSpeed config places as much in host memory under tierflow as under
DeepSpeed: the parameter store's host tier holds ``offload_param.buffer_count ×
buffer_size`` elements plus ``max_in_cpu`` with parameters on NVMe, and the
gradients' ``offload_optimizer.buffer_count × sub_group_size`` elements with
gradients on NVMe; the optimizer's stream gets ``offload_optimizer.buffer_count
× sub_group_size`` fp32 elements. Every budget is capped at what it could ever
hold. ``tierflow.device_memory`` is the device tier's budget (default: the
parameters DeepSpeed keeps live, ``stage3_max_live_parameters`` plus
``stage3_prefetch_bucket_size`` elements, capped at all of them);
``tierflow.host_memory`` is the whole host budget of the run, a quarter of it
(at most) for the optimizer's stream and the rest for the parameter store.
With ``zero_optimization.zenflow`` the optimizer's state is ZenFlow's
(:func:`zenflow_host_bytes`): in host memory with ``offload_optimizer.device``
"cpu"; with "nvme" the windowed side's masters and moments of every matrix
are files (:func:`zenflow_nvme_bytes`) streamed a weight at a time through the
optimizer's host budget, and the rest (the fp32 masters the store's compute
copies are written from, the gradients, the selected columns' state) stays in
host memory. The parameter store gets what is left of ``tierflow.host_memory``
after them.

Each tier is one region and a copy in use cannot move, so the minimums are
twice the working set: the largest module's parameters (and the persistent
ones) on the device, the largest parameter and its gradient on the host —
beside the blocks homed in host memory, which stay in its tier for the run
(gradients under ``offload_optimizer.device`` "cpu").
Under activation checkpointing a checkpointed segment's re-forward holds all
of the segment's parameters until their gradients land: give the device twice
that. (Copies in use can still split a tier's free room into pieces too
small for the next copy: the engine's store is single-holder, so it refuses
such a wait at once (EDEADLK) rather than hang, and the engine answers by
releasing the device copies nothing is using — ParamStore.fetch — or ending
a step's batch early — ParamStore.stepping.)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from tierflow.config import AUTO, Config, MuonConfig

__all__ = ["Plan", "ParamInfo", "make_plan", "estimate_memory", "format_bytes", "zenflow_host_bytes",
           "zenflow_nvme_bytes"]

PAGE = 4096
_MIN_OPTIMIZER_HOST = 64 << 10  # OffloadedAdam's minimum: four sub-groups of a page per buffer
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def pages(nbytes: int) -> int:
    """``nbytes`` rounded up to whole 4 KiB pages, as the store allocates."""
    return -(-nbytes // PAGE) * PAGE


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class ParamInfo:
    """One parameter as the plan sees it: its name (the first module path that
    holds it), element count, the module that owns it and whether it stays
    resident on the device for the whole step (at most
    ``stage3_param_persistence_threshold`` elements)."""

    name: str
    numel: int
    module: str
    persistent: bool


@dataclass(frozen=True)
class Plan:
    """The tiers' budgets (bytes) and homes of a ZeRO-3 run; see the module's docstring."""

    compute_dtype: torch.dtype
    param_home: str         # "host" or "nvme"
    grad_home: str          # "host" or "nvme"
    optimizer_offload: str  # "cpu" or "nvme"
    nvme_dir: str | None
    device_budget: int
    host_budget: int        # the parameter store's host tier
    optimizer_host_budget: int | None  # the optimizer's stream (nvme), else None
    params: tuple[ParamInfo, ...]
    param_bytes: int        # compute copies, page-aligned
    grad_bytes: int         # fp32 gradients, page-aligned
    state_bytes: int        # the optimizer's fp32 state (ZenFlow's: zenflow_bytes and zenflow_nvme_bytes)
    minimum_device: int     # the most the device must hold at once
    minimum_device_reason: str
    minimum_host: int
    minimum_host_reason: str
    sources: dict[str, str] = dataclasses.field(default_factory=dict)
    # The scheduler's: the share of the device budget prefetches may fill
    # (stage3_prefetch_bucket_size, at most stage3_max_live_parameters) and the
    # accesses within which a released parameter stays (stage3_max_reuse_distance).
    prefetch_share: float = 0.75
    evict_distance: int = 0
    # Several ranks: the bytes of parameters whose gathers are issued ahead
    # of their fetch, at most (the same window, of the gathered parameters).
    gather_ahead_bytes: int = 100_000_000
    # Several ranks: the bytes of a rank's shard gathered at once on
    # tierflow's communicators (tierflow.gather_chunk; 0: whole parameters).
    gather_chunk_bytes: int = 16 << 20
    # The share of the host tier's room (beside the blocks homed there: the
    # gradients, with DeepSpeed's keys) that stages parameters homed on NVMe
    # ahead of use — offload_param's buffers, used for what they are for,
    # whatever the prefetch bucket (which bounds prefetch into the device).
    staging_share: float = 0.75
    world_size: int = 1     # data-parallel ranks: the byte figures are one rank's shards
    # ZenFlow's host memory (zero/zenflow.py), (masters, moments, gradients)
    # bytes; None without zero_optimization.zenflow.
    zenflow_bytes: tuple[int, int, int] | None = None
    # ZenFlow's state on NVMe (offload_optimizer.device "nvme"), else None.
    zenflow_nvme_bytes: int | None = None
    # The NVMe tier's I/O engine (the config's aio section), None: its own defaults.
    aio: dict[str, int] | None = None

    def rows(self) -> list[tuple[str, str, str, str]]:
        """(what, where, bytes, note) for the table :func:`estimate_memory` prints."""
        dt = str(self.compute_dtype).removeprefix("torch.")
        state_where = "host memory" if self.optimizer_offload == "cpu" else "nvme"
        rows = [
            (f"parameters ({dt})", self.param_home, format_bytes(self.param_bytes),
             f"{len(self.params)} tensors; leased into the device tier around each module"),
            ("gradients (fp32)", self.grad_home, format_bytes(self.grad_bytes), "accumulated across micro-batches"),
        ]
        if self.zenflow_bytes is not None:
            master, moments, grads = self.zenflow_bytes
            on_nvme = self.zenflow_nvme_bytes is not None
            rows += [
                ("ZenFlow masters (fp32)", "host memory", format_bytes(master),
                 "every trainable parameter, written back to its compute copy after each step"),
                ("ZenFlow moments (fp32)", "host memory", format_bytes(moments),
                 ("the selected columns' and 1-D weights'" if on_nvme else "exp_avg and exp_avg_sq of both sides,")
                 + " and the columns changing sides"),
                ("ZenFlow gradients (fp32)", "host memory", format_bytes(grads),
                 "each step's gradient and the window's sums"),
            ]
            if on_nvme:
                rows.append(("ZenFlow windowed state (fp32)", "nvme", format_bytes(self.zenflow_nvme_bytes),
                             "each matrix's master and moments, streamed a weight at a time"))
            return rows
        return rows + [
            ("optimizer state (fp32)", state_where, format_bytes(self.state_bytes),
             "moments" + (" and master" if self.compute_dtype != torch.float32 else "; the fp32 parameter is its master")),
        ]

    def describe(self) -> str:
        lines = ["tierflow ZeRO-3 memory plan" + (f" (one of {self.world_size} ranks: its shards)"
                                                  if self.world_size > 1 else "")]
        width = max(len(r[0]) for r in self.rows())
        for what, where, size, note in self.rows():
            lines.append(f"  {what:<{width}}  {where:<11} {size:>10}  {note}")
        lines.append("  budgets:")
        lines.append(f"    device tier         {format_bytes(self.device_budget):>10}  "
                     f"(needs at least {format_bytes(self.minimum_device)}: {self.minimum_device_reason}) "
                     f"[{self.sources.get('device', '')}]")
        lines.append(f"    host tier (params)  {format_bytes(self.host_budget):>10}  "
                     f"(needs at least {format_bytes(self.minimum_host)}: {self.minimum_host_reason}) "
                     f"[{self.sources.get('host', '')}]")
        if self.optimizer_host_budget is not None:
            lines.append(f"    host (optimizer)    {format_bytes(self.optimizer_host_budget):>10}  "
                         f"the NVMe state streams through it [{self.sources.get('optimizer', '')}]")
        if self.zenflow_bytes is not None:
            lines.append(f"    host (ZenFlow)      {format_bytes(sum(self.zenflow_bytes)):>10}  "
                         f"ZenFlow's state, beside the parameter store [{self.sources.get('optimizer', '')}]")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()


def _named_params(model: torch.nn.Module) -> list[tuple[str, str, torch.nn.Parameter]]:
    """(name, owning module's path, parameter) for every distinct parameter,
    the first path that holds it (as ``named_parameters`` dedups)."""
    out, seen = [], set()
    for module_name, module in model.named_modules():
        for local, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            name = f"{module_name}.{local}" if module_name else local
            out.append((name, module_name, p))
    return out


def numel_of(p: torch.Tensor) -> int:
    """A parameter's element count, also when it is in a store (its ``.data``
    then holds nothing; ``ds_numel`` tells)."""
    return int(p.__dict__.get("ds_numel", p.numel()))


def shape_of(p: torch.Tensor) -> tuple[int, ...]:
    """A parameter's shape, also when it is in a store (``ds_shape``)."""
    return tuple(p.__dict__.get("ds_shape", p.shape))


def _module_working_sets(model: torch.nn.Module, persistent: set[int], element_bytes: int) -> tuple[int, str]:
    """The largest set of (non-persistent) parameters one module holds
    directly, in aligned bytes, and that module's name."""
    best, where = 0, "no module has parameters"
    for module_name, module in model.named_modules():
        size = sum(pages(numel_of(p) * element_bytes) for p in module.parameters(recurse=False)
                   if id(p) not in persistent)
        if size > best:
            best, where = size, f"module '{module_name or '<root>'}'"
    return best, where


def _resolved(value: Any, default: int) -> int:
    return default if value is AUTO else int(value)


@dataclass(frozen=True)
class Homes:
    """Where a stage-3 run keeps its blocks, from the config alone: the
    parameters and gradients ("host" or "nvme"), the optimizer's state
    ("cpu" or "nvme"), and the one directory of the store's NVMe files (or
    None)."""

    param_home: str
    grad_home: str
    optimizer_offload: str
    nvme_dir: str | None


def homes_of(config: Config) -> Homes:
    """:class:`Homes` under ``config``. Gradients go to NVMe with the
    optimizer's state, except under ZenFlow, which reads them all in host
    memory at once. One store has one NVMe tier: its files go to the
    parameters' directory, else the optimizer's, else ``tierflow.nvme_dir``."""
    z = config.zero
    param_home = "nvme" if z.offload_param.device == "nvme" else "host"
    grad_home = "nvme" if z.offload_optimizer.device == "nvme" and z.zenflow is None else "host"
    optimizer_offload = "nvme" if z.offload_optimizer.device == "nvme" else "cpu"
    nvme_dir = (z.offload_param.nvme_path if param_home == "nvme" else None) or \
        (z.offload_optimizer.nvme_path if grad_home == "nvme" else None)
    if nvme_dir is None and "nvme" in (param_home, grad_home, optimizer_offload):
        nvme_dir = config.tierflow.nvme_dir
    return Homes(param_home, grad_home, optimizer_offload, nvme_dir)


def available_memory() -> int:
    """The host memory available now (``MemAvailable``), in bytes; 8 GiB when it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def make_plan(model: torch.nn.Module | None, config: Config, *, sizes: dict[str, int] | None = None,
              world_size: int = 1) -> Plan:
    """The plan of ``model`` under ``config`` (stage 3) for one of
    ``world_size`` data-parallel ranks: each rank's host tier, NVMe files and
    optimizer state hold its shard of every parameter (``ceil(numel /
    world_size)`` elements), its device the gathered parameters of the module
    at work. ``sizes`` gives the element count of parameters whose
    ``numel()`` does not tell it (none normally: a parameter partitioned by
    tierflow keeps its shape). Raises ValueError naming the key when a budget
    cannot hold the working set, with the minimum that would do.

    ``model`` None plans a model not built yet (:class:`~tierflow.zero.init.Init`
    builds it into the store this plan sizes): its sizes are unknown, so
    each budget the ``tierflow`` section does not give comes from DeepSpeed's
    buffer keys as for a model, with the model's own sizes replaced by a
    quarter of the memory available now; the engine later checks the model
    fits them."""
    if config.zero.stage != 3:
        what = "tierflow.zero.Init builds a model for stage 3" if model is None else "a ZeRO-3 plan needs stage 3"
        raise ValueError(f"zero_optimization.stage: {config.zero.stage}; {what}")
    precision = config.precision
    if precision is AUTO:
        raise ValueError('bf16.enabled / fp16.enabled: "auto" is unresolved; give true or false')
    dtype = _DTYPES[precision]
    element = torch.empty((), dtype=dtype).element_size()
    z = config.zero
    homes = homes_of(config)
    param_home, grad_home = homes.param_home, homes.grad_home
    optimizer_offload, nvme_dir = homes.optimizer_offload, homes.nvme_dir

    threshold = _resolved(z.stage3_param_persistence_threshold, 100_000)
    known = model is not None
    named = _named_params(model) if known else []
    # What the budgets may grow to for each size of the model: its own, or
    # (not built yet) a quarter of the memory available.
    cap = None if known else available_memory() // 4
    sizes = sizes or {}
    infos = []
    for name, module_name, p in named:
        n = sizes.get(name, numel_of(p))
        infos.append(ParamInfo(name, n, module_name, n <= threshold))
    persistent = {id(p) for (_, _, p), info in zip(named, infos) if info.persistent}

    def shard(n: int) -> int:  # this rank's elements of a parameter of n
        return n if world_size == 1 else max(1, -(-n // world_size))

    param_bytes = sum(pages(shard(i.numel) * element) for i in infos)
    grad_bytes = sum(pages(shard(i.numel) * 4) for i in infos)
    low_precision = dtype != torch.float32
    amsgrad = bool(getattr(config.optimizer, "amsgrad", False))
    state_bytes = sum(shard(i.numel) * 4 * (2 + int(amsgrad) + int(low_precision)) for i in infos)
    zenflow_bytes = zenflow_nvme = None
    zenflow_least = 0  # the optimizer's stream budget's minimum: the largest matrix's windowed state
    zf = z.zenflow if known else None  # (a model not built yet: its matrices are unknown)
    if zf is not None:
        # Every rank keeps the whole model's masters and ZenFlow state, as
        # one process does: see zenflow.py's PartitionedZenFlow.
        shapes = [shape_of(p) for _, _, p in named if p.requires_grad]
        zenflow_bytes = zenflow_host_bytes(shapes, zf.topk_ratio, zf.overlap_step, nvme=optimizer_offload == "nvme")
        state_bytes = sum(zenflow_bytes)
        if optimizer_offload == "nvme":
            zenflow_nvme, zenflow_least = zenflow_nvme_bytes(shapes)
            state_bytes += zenflow_nvme

    # Each tier is one region its copies are carved from, and a copy in use
    # cannot move: the budgets hold twice what is in use at once, so the copies
    # held can never split the free room into pieces too small for the next.
    persistent_bytes = sum(pages(i.numel * element) for i in infos if i.persistent)
    module_set, module_name = _module_working_sets(model, persistent, element) if known else (0, "")
    minimum_device = 2 * (module_set + persistent_bytes)
    device_reason = f"twice {module_name}'s parameters" + (
        f" and the {sum(i.persistent for i in infos)} persistent ones" if persistent_bytes else "")
    largest = max(infos, key=lambda i: i.numel, default=None)
    # A block homed in host memory stays in the host tier for the run; the
    # others are leased into it for each use, twice the largest at most.
    resident = (param_bytes if param_home == "host" else 0) + (grad_bytes if grad_home == "host" else 0)
    if largest is None:
        minimum_host, host_reason = PAGE, "no parameters" if known else "the model, not built yet"
    else:
        lease_bytes, leased = 0, []
        its = " (its shard)" if world_size > 1 else ""
        if param_home != "host":
            lease_bytes += pages(shard(largest.numel) * element)
            leased.append(f"'{largest.name}'{its}")
        if grad_home != "host":
            lease_bytes += pages(shard(largest.numel) * 4)
            leased.append("its gradient" if leased else f"the gradient of '{largest.name}'{its}")
        minimum_host = max(PAGE, resident + 2 * lease_bytes)
        homed = " and ".join(kind for kind, home in (("parameters", param_home), ("gradients", grad_home))
                             if home == "host")
        reasons = [f"the {homed} homed there"] if homed else []
        if leased:
            reasons.append("twice " + " and ".join(leased) + (", stepped together" if len(leased) == 2 else ""))
        host_reason = " beside ".join(reasons)

    sources: dict[str, str] = {}
    t = config.tierflow
    if t.device_memory is not None:
        device_budget, sources["device"] = int(t.device_memory), "tierflow.device_memory"
        if device_budget < minimum_device:
            raise ValueError(f"tierflow.device_memory: {format_bytes(device_budget)} cannot hold {device_reason}; "
                             f"give at least {format_bytes(minimum_device)} ({minimum_device} bytes)")
    else:
        live = (z.stage3_max_live_parameters + _resolved(z.stage3_prefetch_bucket_size, 50_000_000)) * element
        # every parameter whole, on one rank's device
        gathered = sum(pages(i.numel * element) for i in infos) if known else cap
        device_budget = max(minimum_device, min(gathered, pages(live)))
        sources["device"] = ("all parameters" if device_budget == gathered and known
                             else "a quarter of the memory available" if device_budget == gathered
                             else "stage3_max_live_parameters + stage3_prefetch_bucket_size")
    # The model's sizes where the budgets follow them.
    param_size, grad_size, state_size = (param_bytes, grad_bytes, state_bytes) if known else (cap, cap, cap)

    optimizer_host: int | None = None
    zenflow_host = sum(zenflow_bytes) if zenflow_bytes is not None else 0
    # Muon's engine optimizer streams two stores (Muon's and AdamW's), each at least the minimum.
    least_optimizer = _MIN_OPTIMIZER_HOST * (2 if isinstance(config.optimizer, MuonConfig) else 1)
    if t.host_memory is not None:
        total = int(t.host_memory)
        if zenflow_nvme is not None:  # four of the largest matrix let its stream overlap; more buys nothing
            optimizer_host = max(zenflow_least, min(total // 4, 4 * zenflow_least, zenflow_nvme))
        elif optimizer_offload == "nvme":
            optimizer_host = max(least_optimizer, min(total // 4, pages(state_size if known else total)))
        host_budget = total - (optimizer_host or 0) - zenflow_host
        sources["host"] = sources["optimizer"] = "tierflow.host_memory"
        if host_budget < minimum_host:
            need = minimum_host + (optimizer_host or 0) + zenflow_host
            raise ValueError(f"tierflow.host_memory: {format_bytes(total)} cannot hold {host_reason}"
                             + (" beside the optimizer's stream" if optimizer_host else "")
                             + (f" beside ZenFlow's state ({format_bytes(zenflow_host)})" if zenflow_host else "")
                             + f"; give at least {format_bytes(need)} ({need} bytes)")
    else:
        params_part = param_size
        if param_home == "nvme":
            op = z.offload_param
            params_part = min(param_size, pages((op.buffer_count * op.buffer_size + op.max_in_cpu) * element))
        grads_part = grad_size
        if grad_home == "nvme":
            oo = z.offload_optimizer
            grads_part = min(grad_size, pages(oo.buffer_count * z.sub_group_size * 4))
        host_budget = max(minimum_host, params_part + grads_part)
        if not known:
            host_budget = min(cap, host_budget)
        sources["host"] = "offload_param / offload_optimizer buffers (DeepSpeed's keys)" + (
            "" if known else ", at most a quarter of the memory available")
        if optimizer_offload == "nvme":
            oo = z.offload_optimizer
            buffers = pages(oo.buffer_count * z.sub_group_size * 4)
            if zenflow_nvme is not None:
                optimizer_host = max(zenflow_least, min(zenflow_nvme, buffers))
            else:
                optimizer_host = max(least_optimizer, min(pages(state_size), buffers))
            sources["optimizer"] = "offload_optimizer.buffer_count × sub_group_size"
        if zenflow_bytes is not None and zenflow_nvme is None:
            sources["optimizer"] = "ZenFlow's state, beside the store's host tier"
    prefetch_share, evict_distance = scheduler_settings(z, element, device_budget,
                                                        sum(i.numel for i in infos) / max(1, len(infos)))
    return Plan(compute_dtype=dtype, param_home=param_home, grad_home=grad_home,
                optimizer_offload=optimizer_offload, nvme_dir=nvme_dir, device_budget=pages(device_budget),
                host_budget=pages(host_budget), optimizer_host_budget=optimizer_host, params=tuple(infos),
                param_bytes=param_bytes, grad_bytes=grad_bytes, state_bytes=state_bytes,
                minimum_device=minimum_device, minimum_device_reason=device_reason,
                minimum_host=minimum_host, minimum_host_reason=host_reason, sources=sources,
                prefetch_share=prefetch_share, evict_distance=evict_distance,
                gather_ahead_bytes=prefetch_window(z, element), gather_chunk_bytes=t.gather_chunk,
                world_size=world_size,
                zenflow_bytes=zenflow_bytes, zenflow_nvme_bytes=zenflow_nvme,
                aio=config.aio.engine_options() if config.aio is not None else None)



def zenflow_host_bytes(shapes: Iterable[tuple[int, ...]], topk_ratio: float, overlap_step: bool, *,
                       selected: bool = True, hand_over: bool = True, nvme: bool = False) -> tuple[int, int, int]:
    """The host memory ZenFlow takes to step trainable parameters of
    ``shapes`` from fp32 masters (zero/zenflow.py), as (masters, moments,
    gradients) bytes: the masters and their gradients, and what the C++
    engine allocates for them (bindings/src/zenflow.cpp over
    core/src/zenflow/): its every-step side's moments of the selected columns
    (of none before the first selection, ``selected`` False), its windowed
    side's moments of every weight, each 2-D weight's window of gradient sums
    (two under ``overlap_step``, when the windowed side also keeps its own
    copy of the masters and stages what it computes), and with ``hand_over``
    the columns changing sides at a refresh, entering and leaving at once
    (master and moments of a weight's selected columns each way). With
    ``nvme`` the windowed side's masters and moments of the 2-D weights are
    files (:func:`zenflow_nvme_bytes`), not counted here; its master is its
    own copy, so the device side stages what it uploads, as under overlap."""
    master = moments = grads = 0
    windows = 2 if overlap_step else 1
    own_copy = overlap_step or nvme  # the windowed side's master is not the parameter
    for shape in shapes:
        n = math.prod(shape)
        if n == 0:
            continue  # ZenFlow leaves an empty parameter out
        master += 4 * n
        grads += 4 * n
        cols = shape[0] if len(shape) >= 2 else 1
        if cols > 1:  # the engine's 2-D weight: a column per output unit
            # The selection's size as core/src/zenflow/selection.cpp rounds it.
            chosen = min(cols, max(1, math.ceil(topk_ratio * cols - 1e-9))) * (n // cols)
            moments += (8 * chosen if selected else 0) + (2 * 12 * chosen if hand_over else 0)
            grads += 4 * n * windows
            master += 4 * n if own_copy else 0  # the staging copy of uploads
            if not nvme:
                moments += 8 * n
                master += 4 * n if overlap_step else 0
        else:  # a 1-D weight is the every-step side's, moments and all
            moments += 8 * n
            if not nvme:  # host memory keeps buffers for it too, never used
                moments += 8 * n
                master += 4 * n if overlap_step else 0
    return master, moments, grads


def zenflow_nvme_bytes(shapes: Iterable[tuple[int, ...]]) -> tuple[int, int]:
    """ZenFlow's windowed state on NVMe for trainable parameters of
    ``shapes`` (core/zenflow/streamed_host_state.hpp): the bytes of every 2-D
    weight's block (its master and two moments, rounded up to a page), and
    the largest one's (what its stream's host budget must hold at least)."""
    total = largest = 0
    for shape in shapes:
        n = math.prod(shape)
        if n == 0 or len(shape) < 2 or shape[0] <= 1:
            continue  # a 1-D weight (or a (1, n) one) is the every-step side's alone
        one = pages(12 * n)
        total += one
        largest = max(largest, one)
    return total, largest


_UNBOUNDED = 1 << 59  # an NVMe tier made without a budget (the stores' 2**60)


def tiers_of(telemetry: dict) -> dict[str, dict[str, int | None]]:
    """{"device": {"budget", "used", "high_water"}, ...} from a store's
    telemetry: what each tier holds beside its budget; an NVMe tier bounded
    only by its filesystem's free space has budget None."""
    return {t["kind"]: {"budget": t["budget_bytes"] if t["budget_bytes"] < _UNBOUNDED else None,
                        "used": t["used_bytes"], "high_water": t["high_water_bytes"]}
            for t in telemetry["tiers"]}


def links_of(telemetry: dict) -> dict[str, int]:
    """{"host->nvme": bytes, ...}: what each link of a store moved."""
    return {link["name"]: link["bytes"] for link in telemetry["links"]}


def prefetch_window(z: Any, element: int) -> int:
    """The bytes DeepSpeed's stage-3 keys let prefetches hold:
    ``stage3_prefetch_bucket_size`` elements, at most
    ``stage3_max_live_parameters``, of ``element`` bytes each."""
    return min(_resolved(z.stage3_prefetch_bucket_size, 50_000_000), z.stage3_max_live_parameters) * element


def scheduler_settings(z: Any, element: int, device_budget: int, mean_numel: float) -> tuple[float, int]:
    """DeepSpeed's stage-3 residency keys as the prefetch scheduler's options:
    prefetches may fill ``stage3_prefetch_bucket_size`` elements (at most
    ``stage3_max_live_parameters``, at most 3/4) of the device budget — 0 turns
    prefetch into the device off, as in DeepSpeed (parameters on NVMe are
    still staged into host memory ahead of use: :attr:`Plan.staging_share`)
    — and a parameter released with its next use
    within ``stage3_max_reuse_distance`` elements (counted in accesses of the
    mean parameter's size) stays in the device tier."""
    window = prefetch_window(z, element)
    share = min(0.75, window / device_budget) if device_budget else 0.0
    distance = max(1, round(z.stage3_max_reuse_distance / max(1.0, mean_numel)))
    return share, min(distance, 1 << 30)


def estimate_memory(model: torch.nn.Module, config: Any, *, print_table: bool = True,
                    world_size: int | None = None) -> Plan:
    """What each tier will hold for ``model`` under ``config`` (a DeepSpeed
    config's path or dict, or a :class:`~tierflow.config.Config`), before any
    work starts, on one of ``world_size`` data-parallel ranks (default: the
    process group's size, 1 without one): printed as a table (unless
    ``print_table`` is False) and returned as the :class:`Plan`. Raises
    ValueError as :func:`tierflow.initialize` would for budgets that cannot
    hold the working set."""
    from tierflow.config import from_deepspeed
    from tierflow.zero.comm import current_group

    if not isinstance(config, Config):
        config = from_deepspeed(config, model=model)
    if world_size is None:
        world_size = current_group().world_size
    elif not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: {world_size!r} (a positive int)")
    plan = make_plan(model, config, world_size=world_size)
    if print_table:
        print(plan.describe())
    return plan


def parameters_of(model: torch.nn.Module) -> Iterable[tuple[str, str, torch.nn.Parameter]]:
    """The distinct parameters of ``model`` with their names and owning modules."""
    return _named_params(model)
