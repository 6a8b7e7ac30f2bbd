"""The training engine: :func:`initialize` and :class:`Engine`, shaped like
DeepSpeed's, over tierflow's store and optimizers.

The engine is DeepSpeed's as its users and Hugging Face's Trainer call it:
the config, the counters, the fp16 loss scale, the accumulation boundary and
the clipping rule. Where the parameters live and how they are stepped is its
:class:`~tierflow.zero.runtime.Runtime`'s: stage 3's
:class:`~tierflow.zero.partitioned.PartitionedRuntime` keeps every parameter
in tierflow's store, stages 0–2's :class:`~tierflow.zero.resident.ResidentRuntime`
where the model has them.

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
from tierflow.config import AUTO, Config, from_deepspeed
from tierflow.zero import checkpoint as _checkpoint
from tierflow.zero.comm import Group, current_group
from tierflow.zero.init import store_of
from tierflow.zero.partition import ParamStore
from tierflow.zero.partitioned import PartitionedRuntime
from tierflow.zero.plan import Plan
from tierflow.zero.resident import ResidentRuntime
from tierflow.zero.runtime import Runtime, check_optimizer

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
    ``group`` (the data-parallel ranks, :class:`~tierflow.zero.comm.Group`),
    ``runtime`` (what keeps and steps the parameters: a
    :class:`~tierflow.zero.partitioned.PartitionedRuntime` at stage 3, a
    :class:`~tierflow.zero.resident.ResidentRuntime` at stages 0–2).
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
        self._busy = 0.0  # seconds inside forward, backward and step
        self._closed = False

        check_optimizer(config)  # before anything moves: a refused config leaves the model as it was
        self.group: Group = params.group if params is not None else current_group(config.tierflow)
        if self.stage != 3 and self.group.world_size > 1:
            raise ValueError(f"zero_optimization.stage: {self.stage} over {self.group.world_size} processes; "
                             "tierflow's data parallelism is stage 3's (give stage 3, or run one process)")
        if self.stage != 3 and params is not None:
            raise ValueError("zero_optimization.stage: the model was built under tierflow.zero.Init, which needs stage 3")
        trainable = list(model_parameters) if model_parameters is not None else list(model.parameters())
        trainable = [p for p in trainable if isinstance(p, torch.Tensor) and p.requires_grad] \
            if trainable and isinstance(trainable[0], torch.Tensor) else trainable
        if self.stage == 3:
            self.runtime: Runtime = PartitionedRuntime(model, config, trainable, group=self.group, store=params,
                                                       is_boundary=self.is_gradient_accumulation_boundary,
                                                       needs_norm=self.needs_norm)
        else:
            self.runtime = ResidentRuntime(model, config, trainable, precision=precision)
        self.optimizer = self.runtime.optimizer
        # DeepSpeed's optimizers say whether the last boundary's step was
        # skipped (accelerate's step_was_skipped reads it).
        self.optimizer.overflow = False
        _lifetime.track(self)
        if lr_scheduler is not None:
            self.lr_scheduler = lr_scheduler(self.optimizer) if callable(lr_scheduler) and not hasattr(lr_scheduler, "step") \
                else lr_scheduler
        elif config.scheduler is not None:
            self.lr_scheduler = config.scheduler.build(self.optimizer)
        else:
            self.lr_scheduler = None

    @property
    def plan(self) -> Plan | None:
        """Stage 3's plan (what each tier holds), else None."""
        return self.runtime.plan

    # ---- the training loop --------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward. At stage 3 its parameters are fetched module by
        module (prefetched during training from the recorded order)."""
        start = time.perf_counter()
        try:
            return self.runtime.forward(self.module, args, kwargs)
        finally:
            self._busy += time.perf_counter() - start

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
            need_norm = self.is_gradient_accumulation_boundary() and self.needs_norm
            self.runtime.backward(loss * scale, retain_graph, need_norm)
            return loss
        finally:
            self._busy += time.perf_counter() - start

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
            self.runtime.end_micro_batch()
            if not boundary:
                return
            factor: float | None = 1.0
            if self.needs_norm:
                try:
                    factor = self._clip_factor(*self.runtime.grad_norm_sq())
                except BaseException:
                    self.runtime.apply(None)  # the boundary's gradients go, whatever failed
                    raise
            self.runtime.apply(factor)
            self._step_applied = factor is not None
            self.optimizer.overflow = not self._step_applied
            # As DeepSpeed's: a skipped (fp16 overflow) step counts in
            # global_steps and skipped_steps, and does not step the schedule.
            if self._step_applied and self.lr_scheduler is not None:
                self.lr_scheduler.step()
            self.global_steps += 1
        finally:
            self._busy += time.perf_counter() - start

    def _clip_factor(self, norm_sq: float, finite: bool) -> float | None:
        """The factor that unscales and clips the gradients, or None when the step is skipped."""
        ls = self.scaler.scale if self.scaler is not None else 1.0
        overflow = not finite
        if self.scaler is not None:
            self.scaler.update(overflow)
            if overflow:
                self.skipped_steps += 1
                warnings.warn(f"tierflow: fp16 gradient overflow at step {self.global_steps + 1}; the step is "
                              f"skipped and the loss scale is now {self.scaler.scale:g}", RuntimeWarning,
                              stacklevel=3)
                return None
        elif overflow and self.checks_overflow:  # bf16.check_grad_overflow, as DeepSpeed's: no scale to lower
            self.skipped_steps += 1
            warnings.warn(f"tierflow: non-finite bf16 gradients at step {self.global_steps + 1}; the step is "
                          "skipped (bf16.check_grad_overflow)", RuntimeWarning, stacklevel=3)
            return None
        norm = math.sqrt(norm_sq) / ls if finite else math.inf
        self.last_grad_norm = norm
        factor = 1.0 / ls
        if self.gradient_clipping > 0 and norm > self.gradient_clipping:
            factor *= self.gradient_clipping / (norm + 1e-6)
        return factor

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drops the gradients accumulated since the last step."""
        self.runtime.zero_grad(set_to_none)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DeepSpeed's context for micro-batches whose gradients are not
        reduced across ranks. With one process there is nothing to skip:
        gradients accumulate in the store either way. With several at stage 3
        it is refused, as DeepSpeed refuses it: each rank keeps only its shard
        of a gradient, so a gradient cannot wait unreduced."""
        self.runtime.check_no_sync()
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
        "optimizer": {...}}`` (stages 0–2 keep no tiers of their own: only
        the optimizer's)."""
        return self.runtime.memory_stats(self._busy)

    def write_trace(self, path: str | os.PathLike) -> None:
        """Writes the Perfetto / Chrome trace of the store's transfers and waits
        (stage 3 with ``tierflow.trace`` true)."""
        self.runtime.write_trace(path)

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

    def _release_native(self) -> None:
        self.close()  # at interpreter exit (tierflow._lifetime): a script need not close its engine

    def close(self) -> None:
        """Releases the store and the optimizer's files (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.runtime.close()

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
        return self.runtime.device

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
        if not self.runtime.partitioned:
            raise ValueError("_zero3_consolidated_16bit_state_dict: needs zero_optimization.stage 3")
        self.runtime.finish()
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
