"""ZenFlow for torch: AdamW whose update is split between the "device" and the
host by tierflow's C++ ZenFlow engine (docs/zenflow.md).

:class:`ZenFlow` is a ``torch.optim.Optimizer`` subclass with
torch.optim.AdamW's signature, defaults and state layout, plus DeepSpeed's
``zero_optimization.zenflow`` settings, so LR schedulers and checkpoint tools
treat it as torch's own and state_dicts load both ways between it and
torch.optim.AdamW.
"""

from __future__ import annotations

import os
import warnings
from collections import defaultdict
from typing import Any, Callable, Iterable, Literal

import torch
from torch import Tensor
from torch.optim.optimizer import Optimizer, ParamsT

from tierflow import _core, _lifetime
from tierflow.torch.optim.adam import (_PAGE, _check_hyper_parameters, _check_offload, _nvme_sizes, _save_file,
                                        _scalar)
from tierflow.torch.optim.muon import _ADJUST_LR_FNS, muon_param_groups

__all__ = ["ZenFlow"]

# The key of the engine's own state in a state_dict (beside torch's "state"
# and "param_groups", which torch.optim.AdamW reads and this entry it ignores).
ZENFLOW_KEY = "zenflow"
_ZENFLOW_KEYS = (
    "topk_ratio", "select_strategy", "select_interval", "update_interval", "overlap_step", "offload",
    "auto_ratio", "full_warm_up_rounds", "pt_reserved_cores_perc", "importance_norm", "steps_per_epoch",
)


def _check_group(group: dict[str, Any]) -> None:
    """Refuses what the engine's rule does not compute, by name."""
    if group.get("amsgrad"):
        raise ValueError(
            "amsgrad=True is not supported by ZenFlow: its engine keeps two state buffers per "
            "element (exp_avg, exp_avg_sq), not amsgrad's third"
        )
    if group.get("maximize"):
        raise ValueError(
            "maximize=True is not supported by ZenFlow: its kernels take the gradient as it is; "
            "minimize the negated objective instead"
        )
    for flag in ("capturable", "differentiable"):
        if group.get(flag):
            raise ValueError(
                f"{flag}=True is not supported: ZenFlow's step runs in C++ outside autograd and CUDA graphs"
            )
    if group.get("fused") and group.get("foreach"):
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")  # torch's type and words


class ZenFlow(Optimizer):
    r"""torch.optim.AdamW with ZenFlow's split update, in tierflow's C++ engine.

    Every step, for each 2-D parameter the top ``topk_ratio`` of its
    *columns* by gradient mass (:math:`\sum|g|`; ``importance_norm`` ``"l2"``:
    :math:`\sum g^2`) and every 1-D parameter get AdamW's update from this
    step's gradient at once (the "device" side). The other columns'
    gradients are summed over a window of ``update_interval`` steps, and at
    the window's end the "host" side applies AdamW once with the window's mean
    gradient — with ``overlap_step`` on the engine's own thread while the next
    window's steps run, so those columns lag by one window. The selection is
    refreshed every ``select_interval`` steps (or epochs). Each side counts
    its own steps for the bias correction (the device one per step, the host
    one per window) and a column crossing sides has its moments rebased, so
    its bias-corrected moments are unchanged. With ``update_interval: 1`` and
    no overlap ZenFlow computes exactly what AdamW computes, whatever the
    selection. The update itself is AdamW's,

    .. math::
        \theta &\leftarrow \theta - \gamma\lambda\theta, \quad
        m \leftarrow \beta_1 m + (1-\beta_1) g, \quad
        v \leftarrow \beta_2 v + (1-\beta_2) g^2 \\
        \theta &\leftarrow \theta - \frac{\gamma}{1-\beta_1^t}\,
            \frac{m}{\sqrt{v}/\sqrt{1-\beta_2^t} + \epsilon}

    in tierflow's fused kernel (the same as :class:`tierflow.torch.optim.AdamW`'s,
    which matches torch.optim.AdamW to rounding), or Muon's for ``muon_params``.

    **Columns.** A row-major ``(out, in)`` weight's column is one output
    unit: its row of ``in`` contiguous values (the engine's column is
    contiguous, ``rows = in``, ``cols = out``; nothing is transposed). A
    weight of more dimensions (a convolution's ``(out, in, kh, kw)``) is
    taken as ``(out, in·kh·kw)``; one of shape ``(1, n)``, and every 1-D or
    0-D parameter (biases, norms), is the device side's always.

    **Arguments.** ``lr``, ``betas``, ``eps``, ``weight_decay`` are AdamW's,
    with its defaults and error messages, per parameter group (several
    groups may differ in all of them; the values are read at every step, so
    LR schedulers act from the next step on, on both sides: the host's window
    applies the values of the step that ends it). ``foreach`` and ``fused``
    are accepted and recorded (they choose torch's implementation, not a
    result). ``amsgrad``, ``maximize``, ``capturable`` and
    ``differentiable`` set to True are refused with ValueError: the engine's
    rule does not compute them. ``decoupled_weight_decay=False`` gives Adam's
    L2 decay instead (a torch.optim.Adam state_dict carries it). tierflow's
    own:

    * ``zenflow``: DeepSpeed's ``zero_optimization.zenflow`` keys as they are
      (``topk_ratio`` 0.1, ``select_strategy`` "auto", ``select_interval``
      "auto", ``update_interval`` "auto", ``overlap_step`` false,
      ``offload`` false (only), ``auto_ratio`` 0.99, ``full_warm_up_rounds``
      0, ``pt_reserved_cores_perc`` 0.5), plus tierflow's
      ``importance_norm`` ("l1" or "l2") and ``steps_per_epoch``. An unknown
      key or a bad value raises ValueError naming it, here.
    * ``muon_params``: parameters (2-D hidden matrices, among ``params``) to
      update with Muon instead, each as a whole matrix (the top
      ``topk_ratio`` of those matrices by gradient mass are the device's
      every step), or a module, whose hidden matrices
      :func:`~tierflow.torch.optim.muon_param_groups` picks. Muon takes its
      group's ``lr`` and ``weight_decay``, scaled by ``muon_adjust_lr_fn``
      (default ``"match_rms_adamw"``: :math:`0.2\gamma\sqrt{\max(rows, cols)}`,
      so AdamW's values serve), with ``muon_momentum`` (0.95), Nesterov, 5
      Newton–Schulz steps in bf16.
    * ``threads``: the CPU threads of the host's step; default the
      optimizer's share of the CPUs (``pt_reserved_cores_perc``). The host's
      step runs on that share; give torch's own threads the trainer's,
      ``torch.set_num_threads(len(opt.schedule["trainer_cpus"]))``, or
      torch's intra-op threads spin on the optimizer's CPUs (on a 2-CPU
      machine a 0.2 s run of the tests took seconds so).
    * ``offload``: where the host side's fp32 master values and moments
      live: ``"cpu"`` (host memory, the default, as DeepSpeed's ZenFlow
      keeps them) or ``"nvme"``: in files under ``nvme_dir``, streamed a
      weight at a time through ``host_memory`` bytes of pinned memory by
      every host step (bytes or a size such as ``"512M"``; at least the
      largest matrix's master and moments, 12 bytes an element; default four
      of those, or the whole state if smaller). The selected columns' state
      and the window's summed gradients stay in memory. The files are removed
      when the optimizer is freed or :meth:`close` d; :meth:`telemetry`
      gives the store's counters. ``aio`` sets their I/O engine, as
      :class:`~tierflow.torch.optim.Adam`'s does.

    :attr:`schedule` is the resolved schedule and the CPU split, known from
    the construction on.

    **Parameters** must be float32 CPU tensors, contiguous: the engine
    computes on them where they lie (zero-copy) and reads each step's
    ``.grad`` where it lies. Parameters with ``requires_grad=False`` and
    empty ones are left out, as torch leaves them untouched. A trainable
    parameter whose ``.grad`` is None at a step is stepped with a zero
    gradient (the engine needs every gradient): unlike torch.optim.AdamW,
    its momentum and weight decay still move it. CUDA parameters go through
    the engine's CUDA device side (Adam only, one group, no ``muon_params``);
    that path compiles in a CUDA build of tierflow but has not been run from
    Python (it was written without a GPU); a build without CUDA refuses CUDA
    parameters with ValueError.

    **The engine** is made at the first step, from the parameters' values
    then. :meth:`finish` waits for the host's step in flight and applies the
    open window at once: call it before evaluating, saving or copying the
    model, so the parameters hold the newest values (state_dict() calls it,
    and so does pickling or deep-copying the optimizer, which then resumes
    from what state_dict() would give).

    **State.** ``state[p]`` holds ``step`` (the engine's step count). The
    moments live in the engine; :meth:`state_dict` gathers them in
    torch.optim.AdamW's layout (``step``, ``exp_avg``, ``exp_avg_sq``;
    ``momentum_buffer`` for a Muon parameter) from both sides, at the
    engine's step count: the host-owned columns' moments are rebased from
    the host's count to it, so torch's bias correction at ``step`` gives the
    same corrected moments ZenFlow had (the raw moments of those columns
    therefore differ from what the host holds by the factors
    :math:`(1-\beta^{step})/(1-\beta^{host\ steps})`). The state_dict's
    ``"zenflow"`` entry holds the engine's own state (step counts, selection,
    the "auto" trigger) so that loading it resumes the run: bit for bit with
    ``update_interval: 1`` without overlap, otherwise up to one rounding of
    the host-owned columns' moments (the rebasing's round trip). A
    torch.optim.AdamW state_dict loads too (no ``"zenflow"`` entry): its
    moments are placed, each parameter's rebased from its own step to the
    largest, and a selection is made fresh at the next step. With
    ``offload="nvme"`` :meth:`state_dict` reads the whole state into RAM;
    :meth:`save_state` / :meth:`load_state` save and resume it through
    ``host_memory`` instead, bit for bit.

    Example::

        opt = ZenFlow(model.parameters(), lr=3e-4,
                      zenflow={"topk_ratio": 0.1, "update_interval": 4, "overlap_step": True})
        for x, y in data:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
        opt.finish()  # before evaluation
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool = True,
        zenflow: dict[str, Any] | None = None,
        muon_params: Iterable[Tensor] | torch.nn.Module | None = None,
        muon_momentum: float = 0.95,
        muon_adjust_lr_fn: str = "match_rms_adamw",
        threads: int | None = None,
        offload: Literal["cpu", "nvme"] = "cpu",
        nvme_dir: str | os.PathLike | None = None,
        host_memory: int | str | None = None,
        aio: dict[str, int] | None = None,
    ) -> None:
        _check_hyper_parameters(lr, betas, eps, weight_decay, foreach, capturable)
        # The least that works depends on the largest matrix: the engine says it, naming the matrix.
        _check_offload(offload, nvme_dir, host_memory, minimum=_PAGE, aio=aio)
        if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
            raise ValueError(f"Invalid threads: {threads!r} (a positive int, or None)")
        if not 0.0 <= muon_momentum < 1.0:
            raise ValueError(f"Invalid muon_momentum: {muon_momentum} (in [0, 1))")
        if muon_adjust_lr_fn not in _ADJUST_LR_FNS:
            raise ValueError(f"Invalid muon_adjust_lr_fn: {muon_adjust_lr_fn!r} (one of {', '.join(_ADJUST_LR_FNS)})")
        if zenflow is not None and not isinstance(zenflow, dict):
            raise ValueError(f"Invalid zenflow: {zenflow!r} (a dict of zero_optimization.zenflow keys, or None)")
        self.zenflow_config: dict[str, Any] = dict(zenflow or {})
        self.schedule = _core.zenflow_schedule(self.zenflow_config)  # ValueError naming a bad key or value
        self.threads = threads
        self.offload = offload
        self._nvme_dir = None if nvme_dir is None else os.fspath(nvme_dir)
        self._host_memory = host_memory
        self._aio = aio
        self._closed = False
        self.muon_momentum = float(muon_momentum)
        self.muon_adjust_lr_fn = muon_adjust_lr_fn
        defaults = {
            "lr": lr,
            "betas": (_scalar(betas[0]), _scalar(betas[1])),
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
            "foreach": foreach,
            "capturable": capturable,
            "differentiable": differentiable,
            "fused": fused,
            "decoupled_weight_decay": decoupled_weight_decay,
        }
        self._engine: _core.ZenFlowEngine | None = None
        _lifetime.track(self)
        self._engine_params: list[Tensor] = []
        self._layout: tuple | None = None
        self._pending: tuple[dict[int, dict[str, Tensor]], dict[str, Any] | None] | None = None
        self._zeros: dict[int, Tensor] = {}
        # The state of parameters the engine leaves out (frozen now), kept for
        # the state_dict and for an engine that takes them again.
        self._carried: dict[int, dict[str, Tensor]] = {}
        super().__init__(params, defaults)
        self._muon_ids = self._muon_ids_of(muon_params)

    # ---- torch.optim.Optimizer's protocol -------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's; the group is checked as the constructor checks (a refused
        group is not added). A group added after the first step makes the
        engine anew at the next step, the state carried over (the selection
        made fresh)."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            _check_hyper_parameters(group["lr"], group["betas"], group["eps"], group["weight_decay"],
                                    group["foreach"], group["capturable"])
            _check_group(group)
        except ValueError:
            self.param_groups.pop()
            raise
        if getattr(self, "_engine", None) is not None:
            self._retire_engine()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One ZenFlow step over every trainable parameter (a None gradient
        counts as zero); returns the closure's loss when a closure is given
        (evaluated with grad enabled)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            _check_group(group)
        if self._closed:
            raise RuntimeError("ZenFlow.step: the optimizer was closed (its NVMe state is gone)")
        engine = self._engine_for_step()
        if engine is None:
            return loss
        self._set_groups(engine, self._engine_params)
        engine.step([self._gradient_of(p) for p in self._engine_params])
        steps = float(engine.stats()["steps"])
        for p in self._engine_params:
            self.state[p]["step"].fill_(steps)
        return loss

    def finish(self) -> None:
        """Waits for the host's step in flight and runs the open window at once,
        so the parameters hold the newest values: before evaluation, saving the
        model, or reading the parameters for anything but the next step."""
        if self._engine is not None:
            self._engine.finish()

    def reload_values(self) -> None:
        """Takes the parameters' values again after they were replaced in
        place from outside the optimizer (a model's ``load_state_dict``, a
        copy into ``p.data``): the host side keeps its own copy of the
        columns it steps (under ``overlap_step``, or with ``offload="nvme"``
        in its files), which the next window would otherwise write back over
        the new values. Each copy is taken from the parameters again — with
        ``offload="nvme"`` a weight at a time through ``host_memory``, never
        the state whole in RAM — and every moment, step count and selection
        is kept, as torch.optim.AdamW keeps its state when a model's weights
        are loaded. Call :meth:`finish` before replacing the values (an
        update in flight would land on them); raises RuntimeError when a
        window is open or a step in flight. CPU parameters only: for CUDA
        ones (fp32 masters kept apart) load the state_dict again."""
        if self._engine is None:  # the next step's engine is made from the values as they are
            return
        try:
            self._engine.reload_values()
        except ValueError as e:
            raise RuntimeError(str(e)) from None

    @property
    def nvme_dir(self) -> str | None:
        """The directory of the host state's files (offload="nvme"), else None."""
        return self._nvme_dir

    @property
    def host_memory(self) -> int | None:
        """The host budget the state streams through, in bytes, once the engine
        is made (offload="nvme"), else None."""
        return None if self._engine is None else self._engine.host_memory

    def telemetry(self) -> dict | None:
        """With offload="nvme" and the engine made, the store's counters: per
        tier its budget, use and high-water mark, per link the bytes moved;
        else None."""
        return None if self._engine is None else self._engine.telemetry()

    def close(self) -> None:
        """With offload="nvme", removes the state's files and frees the host
        budget: the optimizer cannot step or give its state afterwards (take
        :meth:`state_dict` first to keep it). Freeing the optimizer does the
        same. Does nothing with offload="cpu"."""
        if self.offload == "nvme":
            self._drop_engine()
            self._pending = None
            self._closed = True

    def _release_native(self) -> None:
        """At interpreter exit (tierflow._lifetime): the engine's window ends
        (its state as a close leaves it) and the C++ engine goes."""
        self._drop_engine()
        self._pending = None

    def zenflow_stats(self) -> dict[str, Any]:
        """The engine's counters (steps, CPU steps, refreshes, waits) and its
        resolved schedule; before the first step, the schedule alone."""
        if self._engine is None:
            return {"schedule": dict(self.schedule)}
        return {**self._engine.stats(), "schedule": self._engine.schedule()}

    def state_dict(self) -> dict[str, Any]:
        """torch.optim.AdamW's layout (see the class's docstring), gathered
        from both sides after :meth:`finish`, with the engine's own state
        under ``"zenflow"``."""
        sd = super().state_dict()
        moments, zen = self._exported_state()
        index_of = {id(p): i for i, p in enumerate(self._all_params())}
        for pid, entry in moments.items():
            sd["state"][index_of[pid]] = entry
        if zen is not None:
            sd[ZENFLOW_KEY] = zen
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load of the param_groups; the moments (a ZenFlow or a
        torch.optim.AdamW state_dict's) are kept on the CPU in fp32 and given
        to the engine made at the next step, with the ``"zenflow"`` entry's
        selection and step counts when there is one."""
        zen = state_dict.get(ZENFLOW_KEY)
        torch_part = {k: v for k, v in state_dict.items() if k != ZENFLOW_KEY}
        super().load_state_dict(torch_part)
        for group in self.param_groups:
            _check_group(group)
        params = self._all_params()
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        pending: dict[int, dict[str, Tensor]] = {}
        for saved_id, p in zip(saved_ids, params):
            saved = state_dict["state"].get(saved_id)
            if not saved:
                self.state.pop(p, None)
                continue
            entry = {}
            for key, value in saved.items():
                if torch.is_tensor(value):
                    # Not torch's cast onto the parameter's device and dtype: fp32 on the CPU.
                    entry[key] = value.detach().to(device="cpu", dtype=torch.float32, copy=True).contiguous()
            pending[id(p)] = entry
            step = float(entry["step"]) if "step" in entry else 0.0
            self.state[p] = {"step": torch.tensor(step, dtype=torch.float32)}
        if zen is not None:
            zen = dict(zen)
            zen["_saved_ids"] = saved_ids
        self._drop_engine()
        self._pending = (pending, zen)

    def save_state(self, directory: str | os.PathLike) -> None:
        """With offload="nvme", saves the optimizer into ``directory`` (made
        0700 when missing) without reading the host's state into RAM: after
        :meth:`finish`, the host side's masters and moments go, as their blocks
        are, through ``host_memory`` into tierflow's crash-safe checkpoint
        there (``manifest.json`` and ``blocks-<n>.bin``, each block
        checksummed; a new save replaces the last one), and the rest (param
        groups, step counts, the device side's columns, the selection, a
        frozen parameter's carried state) into ``optimizer.pt`` beside it.
        :meth:`load_state` of that directory into a ZenFlow over the same
        parameters resumes the run bit for bit: nothing is rebased, unlike a
        :meth:`state_dict` round trip. With offload="cpu",
        ``torch.save(state_dict())`` saves it."""
        if self.offload != "nvme":
            raise ValueError("save_state: the state is not on NVMe (offload='cpu'); torch.save(state_dict()) saves it")
        if self._closed:
            raise RuntimeError("ZenFlow.save_state: the optimizer was closed (its NVMe state is gone)")
        directory = os.fspath(directory)
        engine = self._engine_for_step()  # a state loaded and not yet stepped is the engine's first
        if engine is None:
            raise ValueError("save_state: no trainable parameters, so no state on NVMe to save")
        engine.finish()
        params = self._engine_params
        checkpoint = engine.checkpoint()
        device = self._device_buffers(engine, checkpoint["selected"])
        engine.read_device_state(*device)
        index_of = {id(p): i for i, p in enumerate(self._all_params())}
        own = {
            "layout": self._engine_layout(params), "checkpoint": checkpoint, "device": device,
            "carried": {index_of[pid]: entry for pid, entry in self._carried.items()},
            "generation": engine.save_state(directory),
        }
        meta = Optimizer.state_dict(self)  # the param groups, and each parameter's step
        meta["state"] = {index_of[id(p)]: {"step": self.state[p]["step"].clone()} for p in params}
        meta["tierflow"] = own
        _save_file(meta, os.path.join(directory, "optimizer.pt"))

    def load_state(self, directory: str | os.PathLike) -> None:
        """With offload="nvme", resumes what :meth:`save_state` saved in
        ``directory``: a new engine is made over the parameters' values now
        (load the model's weights first) and takes the saved state, the host
        side's blocks verified and then written through ``host_memory``
        (never whole in RAM). Raises ValueError when the directory holds the
        state of other parameters (shapes, names, Muon's) or an interrupted
        save, and :class:`tierflow.TierflowError` when the checkpoint is
        missing or corrupt; the optimizer is as it was then."""
        if self.offload != "nvme":
            raise ValueError("load_state: the state is not on NVMe (offload='cpu'); use load_state_dict()")
        if self._closed:
            raise RuntimeError("ZenFlow.load_state: the optimizer was closed (its NVMe state is gone)")
        directory = os.fspath(directory)
        meta = torch.load(os.path.join(directory, "optimizer.pt"), weights_only=True)
        own = meta.pop("tierflow")
        ours = self._engine_layout(self._trainable())
        if own["layout"] != ours:
            diff = next(((a, b) for a, b in zip(own["layout"], ours) if a != b), (len(own["layout"]), len(ours)))
            raise ValueError(f"load_state: {directory} holds the state of other parameters (saved {diff[0]}, "
                             f"this optimizer {diff[1]})")
        saved_sizes = [len(g["params"]) for g in meta["param_groups"]]
        if saved_sizes != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(f"load_state: {directory} holds param groups of {saved_sizes} parameters, this "
                             f"optimizer {[len(g['params']) for g in self.param_groups]}")
        kept = (self._engine, self._engine_params, self._layout, self._carried, self._pending)
        self._drop_engine()
        self._pending = None
        try:
            engine = self._engine_for_step()
            engine.load_state(directory, own["generation"], own["checkpoint"], *own["device"])
        except BaseException:
            self._engine, self._engine_params, self._layout, self._carried, self._pending = kept
            raise
        del kept  # the engine before this one, its store and files
        params = self._all_params()
        Optimizer.load_state_dict(self, meta)
        for group in self.param_groups:
            _check_group(group)
        steps = float(own["checkpoint"]["steps"])
        for p in self._engine_params:
            self.state[p] = {"step": torch.tensor(steps, dtype=torch.float32)}
        self._carried = {id(params[i]): {k: v.to(torch.float32) if torch.is_tensor(v) and k != "step" else v
                                         for k, v in entry.items()}
                         for i, entry in own["carried"].items()}

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        moments, zen = self._exported_state()
        params = {id(p): p for p in self._all_params()}
        state["state"] = defaultdict(dict, {params[pid]: entry for pid, entry in moments.items()})
        state["tierflow"] = {
            "zenflow_config": self.zenflow_config, "threads": self.threads, "offload": self.offload,
            "nvme_dir": self._nvme_dir, "host_memory": self._host_memory, "aio": self._aio,
            "muon_momentum": self.muon_momentum, "muon_adjust_lr_fn": self.muon_adjust_lr_fn,
            "muon": [id(p) in self._muon_ids for p in self._all_params()], "zen": zen,
        }
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        own = state.pop("tierflow", None)
        super().__setstate__(state)
        for group in self.param_groups:
            for key, default in (("amsgrad", False), ("maximize", False), ("foreach", None),
                                 ("capturable", False), ("differentiable", False), ("fused", None),
                                 ("decoupled_weight_decay", True)):
                group.setdefault(key, default)
        if own is None:
            return
        # Unpickled or deep-copied: the engine is made again at the next step.
        self.zenflow_config, self.threads = own["zenflow_config"], own["threads"]
        self.offload, self._nvme_dir = own.get("offload", "cpu"), own.get("nvme_dir")
        self._host_memory, self._closed = own.get("host_memory"), False
        self._aio = own.get("aio")
        self.muon_momentum, self.muon_adjust_lr_fn = own["muon_momentum"], own["muon_adjust_lr_fn"]
        self.schedule = _core.zenflow_schedule(self.zenflow_config)
        params = self._all_params()
        self._muon_ids = {id(p) for p, muon in zip(params, own["muon"]) if muon}
        self._engine, self._engine_params, self._layout, self._zeros, self._carried = None, [], None, {}, {}
        pending = {}
        for p in params:
            entry = self.state.get(p)
            if entry:
                pending[id(p)] = {k: v for k, v in entry.items()}
                self.state[p] = {"step": entry["step"].clone()}
        zen = own["zen"]
        if zen is not None:
            zen = dict(zen)
            zen["_saved_ids"] = list(range(len(params)))
        self._pending = (pending, zen)

    # ---- the engine -------------------------------------------------------------------

    def _all_params(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _muon_ids_of(self, muon_params: Iterable[Tensor] | torch.nn.Module | None) -> set[int]:
        if muon_params is None:
            return set()
        if isinstance(muon_params, torch.nn.Module):
            chosen = muon_param_groups(muon_params).muon
        else:
            chosen = list(muon_params)
        ours = {id(p) for p in self._all_params()}
        ids = set()
        for i, p in enumerate(chosen):
            if not isinstance(p, Tensor) or id(p) not in ours:
                raise ValueError(f"muon_params[{i}] is not among the optimizer's parameters")
            if p.ndim != 2:
                raise ValueError(
                    f"muon_params[{i}]: Muon only supports 2D parameters whereas we found a parameter "
                    f"with size: {p.size()}"
                )
            ids.add(id(p))
        return ids

    def _trainable(self) -> list[Tensor]:
        return [p for p in self._all_params() if p.requires_grad and p.numel() > 0]

    def _engine_for_step(self) -> _core.ZenFlowEngine | None:
        layout = tuple((id(p), p.requires_grad) for p in self._all_params())
        if self._engine is not None and layout != self._layout:
            self._retire_engine()  # a parameter was frozen or unfrozen: made anew, state carried over
        if self._engine is None:
            self._build_engine()
            self._layout = layout
        return self._engine

    def _build_engine(self) -> None:
        params = self._trainable()
        if not params:
            return
        index_of = {id(p): i for i, p in enumerate(self._all_params())}
        self._group_of = {id(p): g for g, group in enumerate(self.param_groups) for p in group["params"]}
        names = []
        for p in params:
            i = index_of[id(p)]
            names.append(self._name_of(p, i))
            if p.device.type == "cpu":
                if p.dtype != torch.float32:
                    raise ValueError(f"params[{i}] is {p.dtype}: ZenFlow steps float32 CPU parameters in place")
                if not p.is_contiguous():
                    raise ValueError(
                        f"params[{i}] is not contiguous: ZenFlow computes on parameters where they lie"
                    )
            elif p.device.type == "cuda":
                if not _core.info()["cuda"]["compiled"]:
                    raise ValueError(
                        f"params[{i}] is on {p.device}, but this build of tierflow has no CUDA: "
                        "rebuild it where nvcc is found, or keep the parameters on the CPU"
                    )
                if not p.is_contiguous():
                    raise ValueError(f"params[{i}] is not contiguous")
            else:
                raise ValueError(f"params[{i}] is on {p.device}: ZenFlow takes CPU (or CUDA) parameters")
        cuda = params[0].device.type == "cuda"
        pending, zen = self._pending if self._pending is not None else ({}, None)
        masters = None
        stream = 0
        if cuda:
            masters = [pending.get(id(p), {}).get("master_param", p.detach().float().cpu()).contiguous()
                       for p in params]
            stream = torch.cuda.current_stream(params[0].device).cuda_stream
        file_size = 0
        if self._nvme_dir is not None:  # files no larger than the state (a matrix's master and moments)
            _, file_size = _nvme_sizes(sum(12 * p.numel() for p in params if p.ndim >= 2 and p.shape[0] > 1), None)
        engine = _core.ZenFlowEngine(
            [p.detach() for p in params], names, self.zenflow_config,
            [self._group_of[id(p)] for p in params], [id(p) in self._muon_ids for p in params],
            threads=self.threads, masters=masters, stream=stream,
            nvme_dir=self._nvme_dir, host_memory=self._host_memory, file_size=file_size, aio=self._aio,
        )
        # The restore below rebases the host's columns' moments by the groups' betas.
        self._set_groups(engine, params)
        ids = {id(p) for p in params}
        if any(pid in ids for pid in pending):
            self._restore(engine, params, pending, zen, index_of)
        self._engine, self._engine_params, self._pending = engine, params, None
        self._carried = {pid: entry for pid, entry in pending.items() if pid not in ids}
        for p in params:
            self.state[p].setdefault("step", torch.tensor(0.0, dtype=torch.float32))

    def _set_groups(self, engine: _core.ZenFlowEngine, params: list[Tensor]) -> None:
        """Gives ``engine`` each group's hyper-parameters as they are now: for
        the next step, and for the moments a restore rebases by their betas."""
        for index, group in enumerate(self.param_groups):
            if not any(self._group_of[id(p)] == index for p in params):
                continue
            beta1, beta2 = group["betas"]
            engine.set_group(
                index,
                lr=_scalar(group["lr"]),
                beta1=_scalar(beta1),
                beta2=_scalar(beta2),
                eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]),
                decoupled=bool(group.get("decoupled_weight_decay", True)),
                muon_momentum=self.muon_momentum,
                muon_adjust_lr_fn=self.muon_adjust_lr_fn,
            )

    def _engine_layout(self, params: list[Tensor]) -> list[tuple[int, str, tuple[int, ...], bool]]:
        """What makes the engine's state (save_state() checks it at load):
        per trainable parameter, its index, name, shape and whether Muon
        steps it."""
        index_of = {id(p): i for i, p in enumerate(self._all_params())}
        return [(index_of[id(p)], self._name_of(p, index_of[id(p)]), tuple(p.shape), id(p) in self._muon_ids)
                for p in params]

    @staticmethod
    def _device_buffers(engine: _core.ZenFlowEngine, selected: list[list[int]]) -> tuple[list[Tensor], ...]:
        """Buffers for the device side's columns (read_device_state): per
        parameter, len(selected) × rows float32 elements, three times."""
        sizes = [len(columns) * rows for columns, (_, rows, _) in zip(selected, engine.shapes())]
        return tuple([torch.empty(n, dtype=torch.float32) for n in sizes] for _ in range(3))

    def _name_of(self, p: Tensor, index: int) -> str:
        for group in self.param_groups:
            names = group.get("param_names")
            if names is None:
                continue
            for q, name in zip(group["params"], names):
                if q is p:
                    return name
        return f"params[{index}]"

    def _restore(self, engine, params, pending, zen, index_of) -> None:
        """Gives the engine the loaded state (see load_state_dict)."""
        state0, state1, known = [], [], []
        for p in params:
            entry = pending.get(id(p), {})
            i = index_of[id(p)]
            muon = id(p) in self._muon_ids
            keys = ("momentum_buffer",) if muon else ("exp_avg", "exp_avg_sq")
            if entry and not all(k in entry for k in keys):
                raise ValueError(
                    f"params[{i}]: the loaded state has {sorted(entry)}, not {list(keys)}"
                    f" ({'Muon' if muon else 'AdamW'} is what ZenFlow runs for it)"
                )
            first = entry.get(keys[0])
            second = entry.get("exp_avg_sq") if not muon else None
            for t, key in ((first, keys[0]), (second, "exp_avg_sq")):
                if t is not None and t.numel() != p.numel():
                    raise ValueError(f"params[{i}]: the loaded {key} has {t.numel()} elements, not {p.numel()}")
            state0.append(first.reshape(p.shape).contiguous() if first is not None else
                          torch.zeros(p.shape, dtype=torch.float32))
            state1.append(second.reshape(p.shape).contiguous() if second is not None else
                          torch.zeros(p.shape, dtype=torch.float32))
            # A state without a step (torch.optim.Muon's) is taken at the others' count.
            known.append(int(float(entry["step"])) if "step" in entry else (None if entry else 0))
        steps = max([c for c in known if c is not None], default=0)
        counts = [steps if c is None else c for c in known]
        masters = None
        if params[0].device.type == "cuda":
            masters = [pending.get(id(p), {}).get("master_param", p.detach().float().cpu()).contiguous()
                       for p in params]
        checkpoint = engine.checkpoint()  # a new engine's: no selection, the trigger empty
        resumed = self._zenflow_entry(zen, params, index_of, steps)
        if resumed is not None:
            checkpoint.update(resumed)
        else:
            checkpoint.update(steps=steps, host_steps=steps)
        engine.restore(checkpoint, state0, state1, masters, counts)
        for p in params:
            self.state[p] = {"step": torch.tensor(float(steps), dtype=torch.float32)}

    def _zenflow_entry(self, zen, params, index_of, steps) -> dict[str, Any] | None:
        """The saved engine state when it fits these parameters, else None
        (with a warning: the selection is made fresh)."""
        if zen is None:
            return None
        saved_ids = zen.get("_saved_ids")
        try:
            by_saved = {int(k): v for k, v in zen["selected"].items()}
            saved_params = [int(i) for i in zen["params"]]
            ours = [saved_ids[index_of[id(p)]] for p in params]
            if ours != saved_params or int(zen["steps"]) != steps:
                raise KeyError("parameters")
            selected = [list(by_saved[i]) for i in ours]
            return {
                "steps": int(zen["steps"]), "host_steps": int(zen["host_steps"]),
                "selection_made": bool(zen["selection_made"]), "selected": selected,
                "trigger_important": [float(x) for x in zen["trigger_important"]],
                "trigger_unimportant": [float(x) for x in zen["trigger_unimportant"]],
                "trigger_seen": [int(x) for x in zen["trigger_seen"]],
            }
        except (KeyError, TypeError, ValueError, IndexError):
            if not zen.get("_internal"):
                warnings.warn(
                    "the state_dict's 'zenflow' entry does not fit these parameters (another set of "
                    "trainable parameters or step counts): its moments are loaded, the selection is made fresh",
                    stacklevel=4,
                )
            return None

    def _exported_state(self) -> tuple[dict[int, dict[str, Tensor]], dict[str, Any] | None]:
        """Per parameter id, its state in torch's layout, and the engine's own
        state; the loaded state when no engine was made since."""
        if self._engine is None:
            if self._pending is None:
                return {}, None
            pending, zen = self._pending
            if zen is not None:
                zen = {k: v for k, v in zen.items() if not k.startswith("_")}
            return {pid: dict(entry) for pid, entry in pending.items()}, zen
        engine, params = self._engine, self._engine_params
        engine.finish()
        carried = {pid: dict(entry) for pid, entry in self._carried.items()}
        state0 = [torch.empty(p.shape, dtype=torch.float32) for p in params]
        state1 = [torch.empty(p.shape, dtype=torch.float32) for p in params]
        cuda = params[0].device.type == "cuda"
        masters = [torch.empty(p.shape, dtype=torch.float32) for p in params] if cuda else None
        engine.read_state(state0, state1, masters)
        ck = engine.checkpoint()
        steps = torch.tensor(float(ck["steps"]), dtype=torch.float32)
        index_of = {id(p): i for i, p in enumerate(self._all_params())}
        moments: dict[int, dict[str, Tensor]] = carried
        for k, p in enumerate(params):
            if id(p) in self._muon_ids:
                entry = {"step": steps.clone(), "momentum_buffer": state0[k]}
            else:
                entry = {"step": steps.clone(), "exp_avg": state0[k], "exp_avg_sq": state1[k]}
            if cuda and p.dtype != torch.float32:
                entry["master_param"] = masters[k]
            moments[id(p)] = entry
        indices = [index_of[id(p)] for p in params]
        zen = {
            "steps": int(ck["steps"]), "host_steps": int(ck["host_steps"]),
            "selection_made": bool(ck["selection_made"]), "params": indices,
            "selected": {i: list(s) for i, s in zip(indices, ck["selected"])},
            "trigger_important": list(ck["trigger_important"]),
            "trigger_unimportant": list(ck["trigger_unimportant"]),
            "trigger_seen": list(ck["trigger_seen"]),
            "config": dict(self.zenflow_config),
        }
        return moments, zen

    def _retire_engine(self) -> None:
        """Finishes the engine and keeps its state for the next one."""
        moments, zen = self._exported_state()
        if zen is not None:
            zen["_saved_ids"] = list(range(len(self._all_params())))
            zen["_internal"] = True
        self._drop_engine()
        self._pending = (moments, zen)

    def _drop_engine(self) -> None:
        self._engine, self._engine_params, self._layout, self._carried = None, [], None, {}

    def _gradient_of(self, p: Tensor) -> Tensor:
        g = p.grad
        if g is None:
            zeros = self._zeros.get(id(p))
            if zeros is None:
                zeros = self._zeros[id(p)] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            return zeros
        if g.is_sparse:
            raise RuntimeError("ZenFlow does not support sparse gradients")
        if g.dtype != p.dtype:
            raise ValueError(f"a gradient of {g.dtype} for a {p.dtype} parameter")
        return g.detach() if g.is_contiguous() else g.detach().contiguous()

