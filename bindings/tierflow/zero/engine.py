"""The training engine: :func:`initialize` and :class:`Engine`, shaped like
DeepSpeed's, over tierflow's store and optimizers.

Stage 3 keeps every parameter in the store (partition.py) and fetches it
around its module's forward and backward (hooks.py); the optimizer steps the
parameters batch by batch in host memory, each batch's compute copies and
gradients leased there while its state streams from where it lives; with
``zero_optimization.zenflow`` ZenFlow steps fp32 masters in host memory
instead (zenflow.py), its windowed state in host memory or streamed from
NVMe (``offload_optimizer.device``). Stages 0–2 keep the parameters where the model has them
and step them with tierflow's optimizer (state in host memory or on NVMe) or
ZenFlow.

DeepSpeed's semantics hold: :meth:`Engine.backward` scales the loss by
1/``gradient_accumulation_steps`` (and by the loss scale under fp16),
:meth:`Engine.step` is called after every micro-batch and updates at the
accumulation boundary, clipping the gradients' global norm to
``gradient_clipping`` first.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import warnings
from typing import Any, Callable, Iterable, Iterator

import torch

from tierflow import _lifetime
from tierflow.config import AUTO, AdamConfig, Config, MuonConfig, from_deepspeed
from tierflow.zero import checkpoint as _checkpoint
from tierflow.zero import copies
from tierflow.zero.comm import Group, current_group
from tierflow.zero.init import mark, store_of
from tierflow.zero.hooks import ModuleHooks
from tierflow.zero.overlap import OverlappedStep, overlappable
from tierflow.zero.partition import ParamStore, Partition
from tierflow.zero.plan import Plan, format_bytes, links_of, make_plan, parameters_of, tiers_of
from tierflow.zero.zenflow import PartitionedZenFlow, ResidentParams

__all__ = ["Engine", "initialize", "LossScaler"]


class LossScaler:
    """fp16's dynamic loss scale, as DeepSpeed's: an overflow skips the step
    and divides the scale by 2 (after ``hysteresis`` overflows in a row), and
    ``loss_scale_window`` steps without one double it; a static scale when
    ``loss_scale`` is given."""

    def __init__(self, initial: float, dynamic: bool, window: int, hysteresis: int, minimum: float) -> None:
        self.scale = float(initial)
        self.dynamic = dynamic
        self.window = window
        self.hysteresis = hysteresis
        self.minimum = float(minimum)
        self._good = 0
        self._hysteresis_left = hysteresis
        self.overflows = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.overflows += 1
            self._good = 0
            if not self.dynamic:
                return
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.minimum, self.scale / 2)
                self._hysteresis_left = self.hysteresis
            return
        self._good += 1
        if self.dynamic and self._good % self.window == 0:
            self.scale *= 2
            self._hysteresis_left = self.hysteresis

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good": self._good, "hysteresis_left": self._hysteresis_left,
                "overflows": self.overflows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self._good = int(state["good"])
        self._hysteresis_left = int(state["hysteresis_left"])
        self.overflows = int(state["overflows"])


def _whole_value(config: Config, name: str) -> int:
    value = getattr(config, name)
    if value is AUTO:
        raise ValueError(f'{name}: "auto" is unresolved; give a number (initialize() has no Trainer to fill it in)')
    return int(value)


class Engine:
    """A model trained under tierflow: call it as the model, then
    :meth:`backward` and :meth:`step` after every micro-batch.

    Attributes: ``module`` (the model), ``optimizer``, ``lr_scheduler``,
    ``config`` (the :class:`~tierflow.config.Config`), ``plan`` (stage 3's
    :class:`~tierflow.zero.plan.Plan`, else None), ``global_steps``,
    ``micro_steps``, ``skipped_steps`` (fp16 overflows), ``loss_scale``,
    ``group`` (the data-parallel ranks, :class:`~tierflow.zero.comm.Group`).
    At stage 3 the optimizer's parameters are the engine's own, one per
    model parameter (its shape, or this rank's flat shard with several
    ranks), over host copies leased only while it steps.
    """

    def __init__(self, model: torch.nn.Module, config: Config, model_parameters: Iterable | None = None,
                 lr_scheduler: Any = None, params: ParamStore | None = None) -> None:
        self.module = model
        self.config = config
        self._gradient_accumulation_steps = _whole_value(config, "gradient_accumulation_steps")
        clip = config.gradient_clipping
        if clip is AUTO:
            raise ValueError('gradient_clipping: "auto" is unresolved; give a number (0 turns clipping off)')
        self.gradient_clipping = float(clip)
        precision = config.precision
        if precision is AUTO:
            raise ValueError('bf16.enabled / fp16.enabled: "auto" is unresolved; give true or false')
        self.precision = precision
        self.stage = config.zero.stage
        self.global_steps = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None
        f = config.fp16
        # Whether a step with a non-finite gradient norm is skipped (which
        # needs the norm): fp16's loss scale, and bf16.check_grad_overflow.
        self.checks_overflow = precision == "fp16" or (precision == "bf16" and config.bf16.check_grad_overflow)
        self.scaler = LossScaler(f.initial_scale, f.dynamic, f.loss_scale_window, f.hysteresis,
                                 f.min_loss_scale) if precision == "fp16" else None
        self.plan: Plan | None = None
        self.params: ParamStore | None = None
        self.hooks: ModuleHooks | None = None
        # ZenFlow over fp32 masters: stage 3, or a bf16/fp16 model at stages 1-2.
        self.zenflow: PartitionedZenFlow | None = None
        self._in_place_zenflow: Any = None  # ZenFlow stepping an fp32 model in place (stages 1-2)
        self._finish_hook: Any = None
        self._norm_sq = 0.0
        self._finite = True
        self._norm_counted: set[int] = set()
        self._busy = 0.0  # seconds inside forward, backward and step
        self._closed = False
        self._overlap: OverlappedStep | None = None

        self._check_optimizer()  # before anything moves: a refused config leaves the model as it was
        self.group: Group = params.group if params is not None else current_group()
        if self.stage != 3 and self.group.world_size > 1:
            raise ValueError(f"zero_optimization.stage: {self.stage} over {self.group.world_size} processes; "
                             "tierflow's data parallelism is stage 3's (give stage 3, or run one process)")
        if self.stage == 3:
            self._partition(model, params)
        elif params is not None:
            raise ValueError("zero_optimization.stage: the model was built under tierflow.zero.Init, which needs stage 3")
        elif precision != "fp32":
            model.to({"bf16": torch.bfloat16, "fp16": torch.float16}[precision])
        trainable = list(model_parameters) if model_parameters is not None else list(model.parameters())
        trainable = [p for p in trainable if isinstance(p, torch.Tensor) and p.requires_grad] \
            if trainable and isinstance(trainable[0], torch.Tensor) else trainable
        try:
            self.optimizer = self._make_optimizer(trainable)
        except BaseException:
            if self.params is not None:  # the model gets its values back, the store its files
                if self.hooks is not None:
                    self.hooks.remove()
                self.params.restore_all()
                self.params.close()
            raise
        self._overlap = OverlappedStep(self.params, self.optimizer) if overlappable(self) else None
        _lifetime.track(self)
        if lr_scheduler is not None:
            self.lr_scheduler = lr_scheduler(self.optimizer) if callable(lr_scheduler) and not hasattr(lr_scheduler, "step") \
                else lr_scheduler
        elif config.scheduler is not None:
            self.lr_scheduler = config.scheduler.build(self.optimizer)
        else:
            self.lr_scheduler = None

    # ---- construction -------------------------------------------------------------------------

    def _partition(self, model: torch.nn.Module, params: ParamStore | None) -> None:
        group = self.group
        if params is not None and group.world_size != current_group().world_size:
            raise ValueError(f"tierflow.zero.Init: the model was built for {group.world_size} ranks, the process "
                             f"group now has {current_group().world_size}; build it under the same group")
        plan = make_plan(model, self.config, world_size=group.world_size)
        if params is None:
            params = ParamStore(plan, trace=bool(getattr(self.config.tierflow, "trace", False)), group=group)
        else:  # built under zero.Init: its store's budgets must hold this model's working set
            if params.plan.device_budget < plan.minimum_device:
                raise ValueError(f"tierflow.device_memory: {format_bytes(params.plan.device_budget)} cannot hold "
                                 f"{plan.minimum_device_reason}; give at least {plan.minimum_device} bytes")
            if params.plan.host_budget < plan.minimum_host:
                raise ValueError(f"tierflow.host_memory: {format_bytes(params.plan.host_budget)} cannot hold "
                                 f"{plan.minimum_host_reason}; give at least {plan.minimum_host} bytes")
            total = self.config.tierflow.host_memory
            zenflow_host = sum(plan.zenflow_bytes) + (plan.optimizer_host_budget or 0) \
                if plan.zenflow_bytes is not None else 0
            if zenflow_host and total is not None and params.plan.host_budget + zenflow_host > int(total):
                # zero.Init sized its store before the model (and so ZenFlow's state) was known.
                raise ValueError(
                    f"tierflow.host_memory: {format_bytes(int(total))} cannot hold ZenFlow's state "
                    f"({format_bytes(zenflow_host)}) beside the {format_bytes(params.plan.host_budget)} "
                    "the store of tierflow.zero.Init took; ZenFlow keeps fp32 masters of the whole model in host "
                    "memory, so build the model without zero.Init, or give tierflow.host_memory at least "
                    f"{params.plan.host_budget + zenflow_host} bytes")
            plan = _with_budgets(plan, params.plan)
            params.plan = plan
        self.plan = plan
        self.params = params
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
        self.hooks = ModuleHooks(model, params, self._on_grad, self._model_forward)

    def _check_optimizer(self) -> None:
        opt = self.config.optimizer
        if opt is None:
            raise ValueError("optimizer: missing; the engine steps the optimizer the config names "
                             "(type Adam or AdamW, with its params)")
        if self.config.zero.zenflow is not None:
            if not isinstance(opt, AdamConfig):
                raise ValueError(f"optimizer.type: {opt.type} with zenflow; ZenFlow steps Adam or AdamW")
        if isinstance(opt, MuonConfig):
            raise ValueError("optimizer.type: Muon; the engine steps Adam or AdamW for now "
                             "(tierflow.torch.optim.Muon steps Muon in a plain torch loop)")
        for name in ("lr", "betas", "eps", "weight_decay"):
            if getattr(opt, name) is AUTO:
                raise ValueError(f'optimizer.params.{name}: "auto" is unresolved; give a value')

    def _stepped(self, trainable: list) -> list:
        """What the optimizer steps for ``trainable`` (parameters, or param
        groups): at stage 3 each partition's :attr:`~Partition.step_param` —
        a parameter of the model's shape over its host copy with one rank,
        over this rank's flat shard with several (as DeepSpeed's stage-3
        optimizer holds flat partitions)."""
        if self.params is None:
            return trainable

        def own(p: Any) -> Any:
            part = self.params.part_of(p)
            return part.step_param if part is not None else p

        return [{**g, "params": [own(p) for p in g["params"]]} if isinstance(g, dict) else own(g)
                for g in trainable]

    def _make_optimizer(self, trainable: list) -> torch.optim.Optimizer:
        opt = self.config.optimizer
        threads = self.config.tierflow.threads
        z = self.config.zero
        if z.zenflow is not None:
            from tierflow.torch.optim import ZenFlow

            zf = {k: getattr(z.zenflow, k) for k in ("topk_ratio", "select_strategy", "select_interval",
                                                      "update_interval", "overlap_step", "auto_ratio",
                                                      "full_warm_up_rounds", "pt_reserved_cores_perc",
                                                      "importance_norm")}
            if z.zenflow.steps_per_epoch is not None:
                zf["steps_per_epoch"] = z.zenflow.steps_per_epoch
            options = dict(lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay,
                           decoupled_weight_decay=opt.decoupled_weight_decay, zenflow=zf, threads=threads,
                           **self._optimizer_nvme())
            if self.params is not None:  # stage 3: ZenFlow steps fp32 masters in host memory
                self.zenflow = PartitionedZenFlow(self.params, self.module, trainable, options)
                return self.zenflow.optimizer
            if self.precision != "fp32":  # ZenFlow's engine steps fp32 parameters in place: masters, as at stage 3
                resident = ResidentParams(self.module, z.zenflow, nvme="nvme_dir" in options)
                self.zenflow = PartitionedZenFlow(resident, self.module, trainable, options)
                return self.zenflow.optimizer
            zenflow = self._in_place_zenflow = ZenFlow(trainable, **options)
            # The model's values lag the open window until finish(): a
            # state_dict() of the model reads them after it.
            self._finish_hook = self.module.register_state_dict_pre_hook(
                lambda module, prefix, keep_vars: zenflow.finish())
            return zenflow
        from tierflow.torch.optim import Adam, AdamW

        trainable = self._stepped(trainable)
        cls = AdamW if opt.decoupled_weight_decay else Adam
        kwargs: dict[str, Any] = dict(lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay,
                                      amsgrad=opt.amsgrad, threads=threads)
        kwargs.update(self._optimizer_nvme())
        return cls(trainable, **kwargs)

    def _optimizer_nvme(self) -> dict[str, Any]:
        """The optimizer's placement keywords with ``offload_optimizer.device``
        "nvme" (its directory made, this rank's own; the plan's stream budget
        at stage 3; the aio section's I/O engine for its files), else none."""
        z = self.config.zero
        if z.offload_optimizer.device != "nvme":
            return {}
        root = z.offload_optimizer.nvme_path or self.config.tierflow.nvme_dir
        rank_dir = f"rank{self.group.rank}" if self.group.world_size > 1 else ""
        out: dict[str, Any] = {"offload": "nvme", "nvme_dir": os.path.join(root, "tierflow-optimizer", rank_dir)}
        os.makedirs(out["nvme_dir"], mode=0o700, exist_ok=True)
        if self.plan is not None and self.plan.optimizer_host_budget is not None:
            out["host_memory"] = self.plan.optimizer_host_budget
        if self.config.aio is not None:
            out["aio"] = self.config.aio.engine_options()
        return out

    # ---- the training loop --------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward. At stage 3 its parameters are fetched module by
        module (prefetched during training from the recorded order)."""
        start = time.perf_counter()
        try:
            if self.params is None:
                if not (self.module.training and torch.is_grad_enabled()):
                    self._finish_optimizer()  # an evaluation reads the newest values
                return self.module(*args, **kwargs)
            return self.module(*args, **kwargs)  # the hooks' _model_forward brackets it
        finally:
            self._busy += time.perf_counter() - start

    def _model_forward(self, starting: bool) -> None:
        """A forward of the whole model starts or ends (stage 3), through
        :meth:`forward` or the model called directly (``engine.module(x)``,
        ``generate()``): a training forward opens the scheduler's iteration,
        an evaluation reads the newest values and gives the device back."""
        training = self.module.training and torch.is_grad_enabled()
        if starting:
            if self._overlap is not None:  # a forward before step(): the steps of a backward end first
                self._overlap.wait()
            if training:
                self.params.begin_iteration()
            else:
                self._finish_optimizer()
        elif not training:
            self.params.release_all(keep_persistent=self.params.in_iteration)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss`` / gradient_accumulation_steps (× the loss scale
        under fp16); with ``scale_wrt_gas`` false (DeepSpeed's keyword, which
        Hugging Face's Trainer gives when it has divided the loss itself) the
        loss is not divided. At stage 3 each gradient goes to the store as it
        is made. Returns the loss, unscaled."""
        start = time.perf_counter()
        try:
            scale = 1.0 / self._gradient_accumulation_steps if scale_wrt_gas else 1.0
            if self.scaler is not None:
                scale *= self.scaler.scale
            self._need_norm = self.is_gradient_accumulation_boundary() and self.needs_norm
            try:
                (loss * scale).backward(retain_graph=retain_graph)
            finally:
                if self.params is not None:
                    self.params.release_all(keep_persistent=True)
                    self.params.settle()
            return loss
        finally:
            self._busy += time.perf_counter() - start

    def _on_grad(self, part: Partition, grad: torch.Tensor) -> None:
        if self._overlap is not None and self._overlap.take(part, grad, self.is_gradient_accumulation_boundary()):
            return  # its last gradient of the boundary: stepped now, while the backward goes on
        need = getattr(self, "_need_norm", False)
        sq, finite = self.params.accumulate_grad(part, grad, norm=need)
        if need:
            self._norm_sq += sq
            self._finite = self._finite and finite
            self._norm_counted.add(part.index)

    @property
    def needs_norm(self) -> bool:
        """Whether a step needs the gradients' global norm: to clip them
        (``gradient_clipping`` > 0), or to skip a non-finite step (fp16's loss
        scale, ``bf16.check_grad_overflow``)."""
        return self.gradient_clipping > 0 or self.checks_overflow

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next :meth:`step` updates the parameters (what
        :meth:`set_gradient_accumulation_boundary` set, when it was called)."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self._gradient_accumulation_steps == 0

    def step(self) -> None:
        """Ends a micro-batch; at the accumulation boundary, clips, steps the
        optimizer and the lr scheduler (fp16: an overflow skips the update,
        lowers the scale and counts in ``skipped_steps``)."""
        start = time.perf_counter()
        try:
            boundary = self.is_gradient_accumulation_boundary()
            self.micro_steps += 1
            self._step_applied = False
            if self._overlap is not None:
                self._overlap.end_micro_batch()
            if not boundary:
                return
            if self.params is not None:
                applied = self._step_partitioned()
            else:
                applied = self._step_resident()
            self._step_applied = applied
            # As DeepSpeed's: a skipped (fp16 overflow) step counts in
            # global_steps and skipped_steps, and does not step the schedule.
            if applied and self.lr_scheduler is not None:
                self.lr_scheduler.step()
            self.global_steps += 1
        finally:
            self._busy += time.perf_counter() - start

    def _clip_factor(self, norm_sq: float, finite: bool) -> tuple[float, bool]:
        """The factor that unscales and clips the gradients, and whether the step goes ahead."""
        ls = self.scaler.scale if self.scaler is not None else 1.0
        overflow = not finite
        if self.scaler is not None:
            self.scaler.update(overflow)
            if overflow:
                self.skipped_steps += 1
                warnings.warn(f"tierflow: fp16 gradient overflow at step {self.global_steps + 1}; the step is "
                              f"skipped and the loss scale is now {self.scaler.scale:g}", RuntimeWarning,
                              stacklevel=3)
                return 0.0, False
        elif overflow and self.checks_overflow:  # bf16.check_grad_overflow, as DeepSpeed's: no scale to lower
            self.skipped_steps += 1
            warnings.warn(f"tierflow: non-finite bf16 gradients at step {self.global_steps + 1}; the step is "
                          "skipped (bf16.check_grad_overflow)", RuntimeWarning, stacklevel=3)
            return 0.0, False
        norm = math.sqrt(norm_sq) / ls if finite else math.inf
        self.last_grad_norm = norm if self.needs_norm else None
        factor = 1.0 / ls
        if self.gradient_clipping > 0 and norm > self.gradient_clipping:
            factor *= self.gradient_clipping / (norm + 1e-6)
        return factor, True

    def _step_partitioned(self) -> bool:
        params = self.params
        factor, go = 1.0, True
        if self.needs_norm:
            norm_sq, finite = self._norm_sq, self._finite
            for part in params.parts:  # gradients the last micro-batch did not touch
                if not part.grad_empty and part.index not in self._norm_counted:
                    sq, ok = params.grad_norm_sq(part)
                    norm_sq, finite = norm_sq + sq, finite and ok
            # Each rank holds its shards' share of the global norm (and may alone overflow).
            norm_sq, bad = params.group.sum(norm_sq if finite else 0.0, 0.0 if finite else 1.0)
            finite = bad == 0 and math.isfinite(norm_sq)
            factor, go = self._clip_factor(norm_sq, finite)
        self._norm_sq, self._finite = 0.0, True
        self._norm_counted.clear()
        try:
            if self._overlap is not None:
                self._overlap.wait()  # the backward's last parameter
            if go:
                params.release_all(keep_persistent=False)
                if self.zenflow is not None:
                    self.zenflow.step(factor)
                else:
                    # A batch of parameters at a time (ParamStore.stepping);
                    # the scheduler loads the next ones' blocks meanwhile.
                    # With the step overlapped, these are the parameters the
                    # boundary's backward did not reach (a module skipped then).
                    parts = list(params.step_parts())
                    while parts:
                        with params.stepping(parts, factor) as batch:
                            self.optimizer.step_parameters([part.step_param for part in batch])
                        parts = parts[len(batch):]
                    # Once a step: the optimizer's own step hooks and counters
                    # (no gradient is left, so it updates nothing).
                    self.optimizer.step()
        finally:
            params.clear_grads()
            params.end_iteration()
        return go

    def _step_resident(self) -> bool:
        stepped = self.module.parameters() if self.zenflow is not None else \
            (p for g in self.optimizer.param_groups for p in g["params"])
        grads = [p for p in stepped if p.grad is not None]
        go = True
        if self.needs_norm:
            norm_sq = sum(copies.norm_sq(p.grad) for p in grads)
            factor, go = self._clip_factor(norm_sq, math.isfinite(norm_sq))
            if go and factor != 1.0 and self.zenflow is None:
                with torch.no_grad():
                    for p in grads:
                        p.grad.mul_(factor)
        else:
            factor = 1.0
        if go and self.zenflow is not None:
            self.zenflow.step(factor)  # the model's gradients into the masters, scaled; the masters back
        elif go:
            self.optimizer.step()
        self.zero_grad()
        return go

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drops the gradients accumulated since the last step."""
        if self.params is not None:
            self.params.clear_grads()
        elif self.zenflow is not None:  # the masters' gradients are ZenFlow's buffers, refilled each step
            self.module.zero_grad(set_to_none=set_to_none)
        else:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DeepSpeed's context for micro-batches whose gradients are not
        reduced across ranks. With one process there is nothing to skip:
        gradients accumulate in the store either way. With several at stage 3
        it is refused, as DeepSpeed refuses it: each rank keeps only its shard
        of a gradient, so a gradient cannot wait unreduced."""
        if self.params is not None and self.params.group.world_size > 1:
            raise RuntimeError("no_sync: incompatible with ZeRO stage 3 over several ranks (each keeps only its "
                               "shard of a gradient, reduced as it is made)")
        yield

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    def get_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    # ---- reports ------------------------------------------------------------------------------

    def memory_stats(self) -> dict[str, Any]:
        """What each tier holds and held at most (bytes), the bytes moved on
        each link, and the time forward/backward/step waited for parameters:
        ``{"tiers": {name: {"budget", "used", "high_water"}}`` (an NVMe budget of
        None: the filesystem's free space), ``"bytes":
        {"nvme->host": n, ...}, "stall_seconds", "stall_fraction",
        "optimizer": {...}}``."""
        out: dict[str, Any] = {"tiers": {}, "bytes": {}, "stall_seconds": 0.0, "stall_fraction": 0.0}
        if self.params is not None:
            t = self.params.telemetry()
            out["tiers"] = tiers_of(t)
            if self.params.group.world_size > 1:  # the parameters gathered from every rank's shards
                out["tiers"]["gathered"] = {"budget": self.params.gather_budget,
                                            "used": self.params.gathered_bytes,
                                            "high_water": self.params.gathered_high_water}
            out["bytes"] = links_of(t)
            out["stall_seconds"] = t["stall_seconds"]
            out["stall_fraction"] = t["stall_seconds"] / self._busy if self._busy > 0 else 0.0
            out["scheduler"] = self.params.scheduler.stats
        telemetry = getattr(self.optimizer, "telemetry", None)
        if self.zenflow is not None:
            out["optimizer"] = self.zenflow.memory_stats()
        elif callable(telemetry):
            opt = telemetry()
            if opt is not None:
                out["optimizer"] = {"tiers": tiers_of(opt), "bytes": links_of(opt)}
        return out

    def write_trace(self, path: str | os.PathLike) -> None:
        """Writes the Perfetto / Chrome trace of the store's transfers and waits
        (stage 3 with ``tierflow.trace`` true)."""
        if self.params is None:
            raise ValueError("write_trace: only stage 3 keeps parameters in the store")
        self.params.write_trace(path)

    # ---- checkpoints --------------------------------------------------------------------------

    def save_checkpoint(self, save_dir: str | os.PathLike, tag: str | None = None,
                        client_state: dict | None = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> str:
        """Saves the model, the optimizer and the engine into ``save_dir/tag``
        (tag default ``global_step<N>``) and, with ``save_latest``, names it in
        ``save_dir/latest``, as DeepSpeed's (its files for ``zero_to_fp32.py``
        included); ``exclude_frozen_parameters`` leaves out the parameters that
        do not require grad (load such a checkpoint with
        ``load_module_strict=False``). Every rank calls it. A save interrupted
        (even by SIGKILL) leaves the previous tag and ``latest`` as they were.
        Returns the tag's path."""
        return _checkpoint.save(self, os.fspath(save_dir), tag, client_state or {}, save_latest,
                                exclude_frozen=exclude_frozen_parameters)

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False,
                        custom_load_fn: Callable | None = None) -> tuple[str | None, dict | None]:
        """DeepSpeed's ``load_checkpoint``, its arguments in its order: loads
        ``load_dir/tag`` (default: the tag ``latest`` names) and returns
        ``(path, client_state)``; ``(None, None)``, with a warning, when there
        is no ``latest``. ``load_module_strict=False`` loads the parameters and
        buffers the checkpoint and the model both have (as torch's
        ``load_state_dict(strict=False)``; their shapes must still match);
        ``load_module_only`` the model's weights alone — no optimizer state,
        lr scheduler, counters or loss scale. Without the optimizer's state
        the fp32 masters start again from the loaded weights (DeepSpeed's
        ``refresh_fp32_params``). Everything is checked before anything
        changes: a load that raises leaves the engine as it was."""
        if custom_load_fn is not None:
            raise ValueError("custom_load_fn: not taken; tierflow streams a checkpoint's weights into its store one "
                             "parameter at a time and never holds the state_dict such a function takes (leave it "
                             "None, or read the tag's model.safetensors yourself)")
        return _checkpoint.load(self, os.fspath(load_dir), tag, strict=bool(load_module_strict),
                                load_optimizer=bool(load_optimizer_states),
                                load_scheduler=bool(load_lr_scheduler_states), module_only=bool(load_module_only))

    def save_16bit_model(self, save_dir: str | os.PathLike, save_filename: str = "model.safetensors",
                         exclude_frozen_parameters: bool = False) -> str:
        """The model's weights in their compute dtype (bf16/fp16, or fp32 when
        training in fp32) as one safetensors file, streamed parameter by
        parameter; ``exclude_frozen_parameters``: the trainable ones only.
        Returns its path."""
        return _checkpoint.export(self, os.fspath(save_dir), save_filename, fp32=False,
                                  exclude_frozen=exclude_frozen_parameters)

    def save_fp32_model(self, save_dir: str | os.PathLike, save_filename: str = "model_fp32.safetensors",
                        exclude_frozen_parameters: bool = False) -> str:
        """The fp32 master weights as one safetensors file, streamed. Returns its path."""
        return _checkpoint.export(self, os.fspath(save_dir), save_filename, fp32=True,
                                  exclude_frozen=exclude_frozen_parameters)

    def _finish_optimizer(self) -> None:
        """Applies ZenFlow's window in flight and the open one, so that the
        model (and the store) hold the newest values: what an evaluation, a
        save and an export do first. Nothing without ZenFlow."""
        if self.zenflow is not None:
            self.zenflow.finish()
        elif self._in_place_zenflow is not None:
            self._in_place_zenflow.finish()

    def _release_native(self) -> None:
        self.close()  # at interpreter exit (tierflow._lifetime): a script need not close its engine

    def close(self) -> None:
        """Releases the store and the optimizer's files (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.hooks is not None:
            self.hooks.remove()
        if self._finish_hook is not None:
            self._finish_hook.remove()
        if self._overlap is not None:
            self._overlap.close()
        if self.zenflow is not None:
            self.zenflow.close()
        close = getattr(self.optimizer, "close", None)
        if callable(close):
            close()
        if self.params is not None:
            self.params.close()


    # ---- DeepSpeed's API ----
    # What DeepSpeed's engine offers and Hugging Face's Trainer (through
    # accelerate) or a DeepSpeed script calls, with DeepSpeed's meaning.

    _boundary_override: bool | None = None  # what set_gradient_accumulation_boundary set
    _step_applied: bool = False  # whether the last step() updated the parameters

    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step (the config's)."""
        return self._gradient_accumulation_steps

    def train_batch_size(self) -> int:
        """Samples per optimizer step over every rank: micro-batch ×
        accumulation steps × world size (the config's)."""
        return _whole_value(self.config, "train_batch_size")

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per micro-batch on one rank (the config's)."""
        return _whole_value(self.config, "train_micro_batch_size_per_gpu")

    @property
    def device(self) -> torch.device:
        """Where the model computes: at stage 3 the device tier's (the GPU,
        or the CPU under the host stand-in), else the model's parameters'."""
        if self.params is not None:
            return self.params.device
        first = next(self.module.parameters(), None)
        return first.device if first is not None else torch.device("cpu")

    @property
    def world_size(self) -> int:
        """Data-parallel ranks."""
        return self.group.world_size

    @property
    def global_rank(self) -> int:
        """This process's rank among them."""
        return self.group.rank

    @property
    def local_rank(self) -> int:
        """This process's rank on its node: ``LOCAL_RANK`` as the launcher
        (torchrun, deepspeed) sets it, else the global rank (tierflow runs
        on one node)."""
        value = os.environ.get("LOCAL_RANK")
        return int(value) if value not in (None, "") else self.group.rank

    def zero_optimization_stage(self) -> int:
        return self.stage

    def bfloat16_enabled(self) -> bool:
        return self.precision == "bf16"

    def fp16_enabled(self) -> bool:
        return self.precision == "fp16"

    def was_step_applied(self) -> bool:
        """Whether the last :meth:`step` updated the parameters: False between
        accumulation boundaries and when an fp16 overflow skipped it."""
        return self._step_applied

    def get_global_grad_norm(self) -> float | None:
        """The gradients' global L2 norm at the last boundary, before
        clipping and unscaled; None until a step computed it — the engine
        computes it only when it needs it (:attr:`needs_norm`), as DeepSpeed's
        stages 1–2 return None when they do not."""
        return self.last_grad_norm

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Overrides the micro-step count's boundary, as DeepSpeed's (and
        accelerate calls it before every backward): with ``True`` the next
        :meth:`step` updates the parameters, with ``False`` it accumulates.
        It holds until set again."""
        self._boundary_override = bool(is_boundary)

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """``zero_optimization.stage3_gather_16bit_weights_on_model_save``."""
        return bool(self.config.zero.stage3_gather_16bit_weights_on_model_save)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        """The model's whole state_dict in its compute dtype, on rank 0 (None
        elsewhere; every rank calls it), as DeepSpeed's, which accelerate's
        ``get_state_dict`` calls for a Trainer's ``save_model``: it holds the
        whole model in RAM (:meth:`save_16bit_model` streams it instead)."""
        if self.params is None:
            raise ValueError("_zero3_consolidated_16bit_state_dict: needs zero_optimization.stage 3")
        self._finish_optimizer()
        state = self.module.state_dict()
        if exclude_frozen_parameters:
            frozen = {name for name, p in self.module.named_parameters(remove_duplicate=False)
                      if not p.requires_grad}
            state = type(state)((k, v) for k, v in state.items() if k not in frozen)
        return state if self.group.rank == 0 else None

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        """The model's parameters (DeepSpeed's engine is a torch module over
        it; the Trainer counts them)."""
        return self.module.parameters(recurse=recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """The model's parameters by name, under ``module.`` as DeepSpeed's engine names them."""
        return self.module.named_parameters(prefix=f"{prefix}.module" if prefix else "module", recurse=recurse,
                                            remove_duplicate=remove_duplicate)

    def destroy(self) -> None:
        """DeepSpeed's name for :meth:`close` (accelerate calls it)."""
        self.close()


def _with_budgets(plan: Plan, given: Plan) -> Plan:
    import dataclasses

    return dataclasses.replace(plan, device_budget=given.device_budget, host_budget=given.host_budget,
                               param_home=given.param_home, grad_home=given.grad_home, nvme_dir=given.nvme_dir)


def initialize(model: torch.nn.Module | None = None, model_parameters: Iterable | None = None,
               config: str | os.PathLike | dict | Config | None = None, training_data: Any = None,
               lr_scheduler: Any = None, *, optimizer: Any = None, collate_fn: Callable | None = None,
               config_params: dict | None = None,
               args: Any = None) -> tuple[Engine, torch.optim.Optimizer, Any, Any]:
    """``engine, optimizer, dataloader, lr_scheduler`` for ``model`` under a
    DeepSpeed config (a JSON path, a dict, or :class:`~tierflow.config.Config`),
    as ``deepspeed.initialize`` returns them.

    The config is read by :func:`tierflow.config.from_deepspeed` (every key it
    does not act on is warned about by name). ``model_parameters`` are the
    parameters to train (default: all that require grad). ``training_data``
    (a torch Dataset) gives a DataLoader of ``train_micro_batch_size_per_gpu``
    with shuffling; ``lr_scheduler`` (an instance, or a callable taking the
    optimizer) replaces the config's scheduler. A client ``optimizer`` is not
    taken: the engine steps the optimizer the config names.
    """
    if model is None:
        raise ValueError("model: initialize() needs the torch module to train")
    if optimizer is not None:
        raise ValueError("optimizer: a client optimizer is not taken; name it in the config's optimizer "
                         "section (tierflow steps its own Adam/AdamW)")
    if config is None:
        config = config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None)
    if config is None:
        raise ValueError("config: initialize() needs a DeepSpeed config (a path, a dict or a tierflow Config)")
    store = store_of(model)
    if not isinstance(config, Config):  # DeepSpeed's batch rule counts the ranks
        config = from_deepspeed(config, model=model, world_size=(store.group if store else current_group()).world_size)
    engine = Engine(model, config, model_parameters, lr_scheduler, params=store)
    loader = None
    if training_data is not None:
        batch = config.train_micro_batch_size_per_gpu
        if batch is AUTO:
            raise ValueError('train_micro_batch_size_per_gpu: "auto" is unresolved; give the micro-batch size')
        group = engine.group
        sampler = torch.utils.data.DistributedSampler(training_data, num_replicas=group.world_size, rank=group.rank,
                                                      shuffle=True) if group.world_size > 1 else None
        loader = torch.utils.data.DataLoader(training_data, batch_size=int(batch), shuffle=sampler is None,
                                             sampler=sampler, collate_fn=collate_fn)
    return engine, engine.optimizer, loader, engine.lr_scheduler
