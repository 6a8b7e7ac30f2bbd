"""Adam and AdamW for torch whose step runs in tierflow's fused CPU kernel,
with the optimizer state in host memory (``offload="cpu"``) or on NVMe
(``offload="nvme"``), streamed through a bounded host budget, for parameters
on the CPU or on a CUDA device (whose gradients come down to host memory and
whose updated values go back up, _device.py).

The classes are ``torch.optim.Optimizer`` subclasses with torch.optim.Adam's
and AdamW's signatures, defaults, validation and state layout, so LR
schedulers, ``torch.amp.GradScaler`` and checkpoint tools treat them as
torch's own, and state_dicts load both ways between them and torch.optim.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable, Literal

import torch
from torch import Tensor
from torch.optim.optimizer import Optimizer, ParamsT

from tierflow import _core, _lifetime
from tierflow.torch.optim import _device

__all__ = ["Adam", "AdamW", "adam"]

_LOW_PRECISION = (torch.bfloat16, torch.float16)
# The state a bf16/fp16 parameter keeps in fp32 (MASTER_KEY is the fp32 copy
# the kernel updates; the parameter is written from it in the same pass).
MASTER_KEY = "master_param"
_FP32_STATE = (MASTER_KEY, "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
# The state an AdamSlot views, in _Slot.tensors' order.
_SLOT_STATE = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", MASTER_KEY)


def _scalar(value: float | Tensor) -> float:
    return float(value.item()) if isinstance(value, Tensor) else float(value)


def _check_hyper_parameters(lr, betas, eps, weight_decay, foreach, capturable) -> None:
    """torch.optim.Adam's checks, worded as torch words them."""
    if isinstance(lr, Tensor):
        if foreach and not capturable:
            raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if not (all(isinstance(b, float) for b in betas[:2]) or all(isinstance(b, Tensor) for b in betas[:2])):
        raise ValueError("betas must be either both floats or both Tensors")
    for i in (0, 1):
        if isinstance(betas[i], Tensor):
            if foreach and not capturable:
                raise ValueError(f"betas[{i}] as a Tensor is not supported for capturable=False and foreach=True")
            if betas[i].numel() != 1:
                raise ValueError(f"Tensor betas[{i}] must be 1-element")


def _check_group(group: dict[str, Any]) -> None:
    """Refuses what would change results and that tierflow does not do."""
    for flag in ("capturable", "differentiable"):
        if group.get(flag):
            raise ValueError(
                f"{flag}=True is not supported: tierflow's step runs on the CPU outside "
                "autograd and CUDA graphs"
            )
    if group.get("fused") and group.get("foreach"):
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")  # torch's type and words
    for i, p in enumerate(group["params"]):
        if p.device.type != "cpu" and not _device.on_device(p):
            raise ValueError(
                f"params[{i}] is on {p.device}: parameters on the CPU or on a CUDA device expected"
            )
        if p.dtype not in (torch.float32, *_LOW_PRECISION):
            raise ValueError(
                f"params[{i}] is {p.dtype}: float32, bfloat16 or float16 parameters expected"
            )


def _one_device(groups: list[dict[str, Any]]) -> torch.device | None:
    """The device of the groups' device parameters (None without any);
    ValueError when they are on several: each device has its own streams."""
    devices = {p.device for group in groups for p in group["params"] if _device.on_device(p)}
    if len(devices) > 1:
        raise ValueError(f"params on {' and '.join(sorted(map(str, devices)))}: one optimizer steps the "
                         "parameters of one CUDA device (make one optimizer per device)")
    return next(iter(devices), None)


try:  # (a torch built without distributed has no DTensor, and then no FSDP2 parameters)
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # pragma: no cover
    _DTensor = None


def _local(t: Tensor) -> Tensor:
    """What the kernel steps for ``t``: a DTensor's local shard (FSDP2's
    ``fully_shard`` parameters and gradients: this rank's rows, a plain
    tensor), any other tensor itself. The optimizer keys its state by the
    parameter and sizes it by this."""
    if _DTensor is not None and isinstance(t, _DTensor):
        return t._local_tensor  # (to_local() under no_grad gives this very tensor, without dispatch)
    return t


def _as_dtensor_state(optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with each state tensor of a DTensor parameter (a local
    shard of its shape) made a DTensor over it, on the parameter's mesh and
    placements; unchanged when no parameter is a DTensor."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    sharded = {i: p for i, p in zip(ids, params) if _local(p) is not p}
    if not sharded:
        return state_dict
    state = dict(state_dict["state"])
    for i, p in sharded.items():
        if i not in state:
            continue
        local_shape = _local(p).shape

        def shard(v: Any) -> Any:  # the moments and masters; "step" (a scalar) stays a tensor, as torch's
            if not torch.is_tensor(v) or v.dim() == 0 or v.shape != local_shape:
                return v
            return _DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                       stride=p.stride())

        state[i] = {k: shard(v) for k, v in state[i].items()}
    return {**state_dict, "state": state}


def _as_local_state(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with every DTensor in its state replaced by its local shard."""
    if _DTensor is None or not any(isinstance(v, _DTensor) for s in state_dict["state"].values() for v in s.values()):
        return state_dict
    return {**state_dict, "state": {i: {k: _local(v) if torch.is_tensor(v) else v for k, v in s.items()}
                                    for i, s in state_dict["state"].items()}}


def _master_of(p: Tensor) -> Tensor:
    """The fp32 master of a low-precision parameter, contiguous for the kernel."""
    return p.detach().to(torch.float32, memory_format=torch.contiguous_format, copy=True)


def _restore_fp32_state(optimizer: Optimizer, state_dict: dict[str, Any], keys: tuple[str, ...]) -> None:
    """After torch's load_state_dict, which casts every state tensor to its
    parameter's dtype: gives each bf16/fp16 parameter back its fp32 `keys`
    from `state_dict`, and remakes a master that does not round to the
    parameter (carried, untouched, through an optimizer that updated the
    parameter alone: torch.optim's) from the parameter."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    for saved_id, p in zip(saved_ids, params):
        saved = state_dict["state"].get(saved_id)
        # (Adam places a device parameter's state itself: it never went to the device.)
        if p.dtype not in _LOW_PRECISION or saved is None or _device.on_device(p):
            continue
        state = optimizer.state[p]
        for key in keys:
            if torch.is_tensor(saved.get(key)):
                state[key] = saved[key].to(device="cpu", dtype=torch.float32, copy=True)
        master = state.get(MASTER_KEY)
        if master is not None and not torch.equal(master.to(p.dtype), p.detach()):
            state[MASTER_KEY] = _master_of(p)


def _kernel_view(t: Tensor) -> Tensor:
    """The tensor itself as the kernel reads it (a DLPack view needs no autograd)."""
    return t.detach()


def adam(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor],
    state_steps: list[Tensor],
    masters: list[Tensor | None],
    *,
    executor: _core.Executor,
    amsgrad: bool,
    beta1: float,
    beta2: float,
    lr: float | Tensor,
    weight_decay: float,
    eps: float,
    maximize: bool,
    decoupled_weight_decay: bool,
) -> None:
    """One Adam/AdamW step over parameters and their state, in place.

    Each parameter is updated by one call of tierflow's fused kernel on
    ``executor``'s threads, reading and writing the tensors where they are
    (no copy; the GIL is released meanwhile). ``masters[i]``, when not None,
    is the fp32 copy of a bf16/fp16 ``params[i]``: the kernel updates it and
    writes ``params[i]`` from it in the same pass. ``state_steps`` are
    incremented first, as torch does.
    """
    lr, beta1, beta2 = _scalar(lr), _scalar(beta1), _scalar(beta2)
    for i, param in enumerate(params):
        grad = grads[i]
        if not grad.is_contiguous():
            grad = grad.contiguous()
        state_steps[i] += 1
        master = masters[i]
        target = param if master is None else master
        # A non-contiguous fp32 parameter is stepped in a contiguous copy and
        # written back: the kernel walks one flat buffer.
        work = target if target.is_contiguous() else target.contiguous()
        copy = None
        if master is not None:
            copy = param if param.is_contiguous() else torch.empty_like(param, memory_format=torch.contiguous_format)
        _core.adam_step(
            executor,
            _kernel_view(work),
            _kernel_view(grad),
            _kernel_view(exp_avgs[i]),
            _kernel_view(exp_avg_sqs[i]),
            _kernel_view(max_exp_avg_sqs[i]) if amsgrad else None,
            None if copy is None else _kernel_view(copy),
            step=int(state_steps[i].item()),
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=weight_decay,
            decoupled=decoupled_weight_decay,
            maximize=maximize,
        )
        if work is not target:
            target.copy_(work)
        if copy is not None and copy is not param:
            param.copy_(copy)


class _Slot:
    """A parameter's _core.AdamSlot (None for a non-contiguous parameter,
    stepped in a contiguous copy) and what it was made from, so that a step
    checks with a few identity tests that it still fits."""

    __slots__ = ("core", "address", "numel", "contiguous", "amsgrad", "tensors")

    def __init__(self, p: Tensor, state: dict[str, Any], amsgrad: bool) -> None:
        self.address, self.numel, self.contiguous = p.data_ptr(), p.numel(), p.is_contiguous()
        self.amsgrad = amsgrad
        self.tensors = tuple(state.get(key) for key in _SLOT_STATE)
        self.core = self._make(p) if self.contiguous else None

    def fits(self, p: Tensor, state: dict[str, Any], amsgrad: bool) -> bool:
        """Whether p and its state are still what the slot views."""
        if (p.data_ptr() != self.address or p.numel() != self.numel or amsgrad != self.amsgrad
                or p.is_contiguous() != self.contiguous):
            return False
        return all(state.get(key) is t for key, t in zip(_SLOT_STATE, self.tensors))

    def scratch(self, p: Tensor) -> tuple[_core.AdamSlot, Tensor]:
        """A slot for one step of a non-contiguous p in a contiguous stand-in,
        and the stand-in, to copy into p after the step."""
        if p.dtype in _LOW_PRECISION:  # the master steps; the stand-in receives its copy
            stand_in = torch.empty_like(p, memory_format=torch.contiguous_format)
        else:
            stand_in = p.detach().contiguous()
        return self._make(stand_in), stand_in

    def _make(self, p: Tensor) -> _core.AdamSlot:
        """An AdamSlot over p (or its contiguous stand-in) and the state: a
        float32 p is stepped itself; a bfloat16/float16 one is written from its
        master in the same pass."""
        step, exp_avg, exp_avg_sq, max_exp_avg_sq, master = self.tensors
        p = p.detach()
        param, copy = (master.detach(), p) if p.dtype in _LOW_PRECISION else (p, None)
        return _core.AdamSlot(param, exp_avg.detach(), exp_avg_sq.detach(),
                              max_exp_avg_sq.detach() if self.amsgrad else None, copy, step.detach())


# offload="nvme": the host budget holds four sub-groups (one updating, two
# loading, one being written back); without host_memory, the state's own size
# up to four sub-groups of 64 MiB, and at least the 64 KiB minimum.
_SUB_GROUPS_IN_BUDGET = 4
_DEFAULT_SUB_GROUP_BYTES = 64 << 20
_MIN_HOST_MEMORY = 64 << 10
_PAGE = 4096


def _save_file(obj: Any, path: str) -> None:
    """torch.save of ``obj`` into ``path``, whole or not at all: written
    beside it, synced, then renamed over it."""
    with open(path + ".tmp", "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
_MAX_FILE_BYTES = 256 << 20
_OFFLOADS = ("cpu", "nvme")
# state_dtype's spellings; the moments are fp32 or bf16 (the kernel's two state dtypes).
_STATE_DTYPES = {"fp32": torch.float32, "float32": torch.float32, torch.float32: torch.float32,
                 "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, torch.bfloat16: torch.bfloat16}
_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def _nvme_sizes(total: int, host_memory: int | str | None) -> tuple[int | str, int]:
    """(host_memory, file_size) for a state of ``total`` bytes on NVMe: the
    host budget given, or the state's own size up to four sub-groups of 64 MiB
    (at least the minimum); files no larger than the state needs (a small
    model does not preallocate 256 MiB; a block larger than a file gets a file
    of its own)."""
    pages = max(_PAGE, -(-total // _PAGE) * _PAGE)
    if host_memory is None:
        host_memory = min(_SUB_GROUPS_IN_BUDGET * _DEFAULT_SUB_GROUP_BYTES, max(_MIN_HOST_MEMORY, pages))
    return host_memory, min(_MAX_FILE_BYTES, pages)


def _state_bytes(p: Tensor, amsgrad: bool) -> int:
    """The bytes of a parameter's fp32 state: the moments, the amsgrad maximum
    and the master of a low-precision parameter."""
    buffers = 2 + int(amsgrad) + int(p.dtype in _LOW_PRECISION)
    return _local(p).numel() * 4 * buffers


def _parse_state_dtype(state_dtype: Any) -> torch.dtype:
    """state_dtype as a torch dtype: float32 or bfloat16."""
    try:
        return _STATE_DTYPES[state_dtype]
    except (KeyError, TypeError):  # (TypeError: an unhashable value)
        raise ValueError(f"Invalid state_dtype: {state_dtype!r} ('fp32' or 'bf16', torch.float32 or "
                         "torch.bfloat16)") from None


def _check_offload(offload: Any, nvme_dir: Any, host_memory: Any, minimum: int = _MIN_HOST_MEMORY,
                   aio: Any = None) -> None:
    """Refuses a bad placement by name: offload, nvme_dir, host_memory
    (bytes, at least ``minimum``, or a size the extension reads) and aio (a
    dict, whose keys and values the extension checks)."""
    if offload not in _OFFLOADS:
        raise ValueError(f"Invalid offload: {offload!r} (one of 'cpu', 'nvme')")
    if aio is not None and not isinstance(aio, dict):
        raise ValueError(f"Invalid aio: {aio!r} (a dict of block_size, queue_depth, threads, submit_batch, or None)")
    if offload == "cpu":
        for name, value in (("nvme_dir", nvme_dir), ("host_memory", host_memory), ("aio", aio)):
            if value is not None:
                raise ValueError(f"{name} is used only with offload='nvme' (got offload='cpu')")
        return
    if nvme_dir is None:
        raise ValueError("nvme_dir: offload='nvme' needs the directory its state files go in")
    if not isinstance(nvme_dir, (str, os.PathLike)):
        raise ValueError(f"Invalid nvme_dir: {nvme_dir!r} (a path)")
    if host_memory is None or isinstance(host_memory, str):
        return  # a size such as "2G" is read by the extension, as the CLI reads its flags
    if isinstance(host_memory, bool) or not isinstance(host_memory, int):
        raise ValueError(f"Invalid host_memory: {host_memory!r} (bytes, a size such as '2G', or None)")
    if host_memory < minimum:
        raise ValueError(f"Invalid host_memory: {host_memory} (at least {minimum} bytes)")


class _NvmeState:
    """What Adam and Muon share with offload="nvme": the store ``self._nvme``
    (``_NVME_CLASS``: _core.OffloadedAdam or _core.OffloadedMuon; None with
    offload="cpu") and each parameter's slot in it, ``self._slots``. It
    makes and fills the store, gives its properties, :meth:`telemetry` and
    :meth:`close`, and carries its state through save_state/load_state,
    pickling and state_dict. The optimizer says what its state is:
    ``_nvme_bytes(p, group)`` (the bytes of p's state),
    ``_add_nvme_param(p, group)`` (registers p, returns its slot),
    ``_read_state(p, group)`` / ``_write_state(p, saved)`` (p's state as
    torch tensors, from and to the store), ``_layout()`` and
    ``_fresh_chunks()`` (what save_state keeps of the store's blocks)."""

    _NVME_CLASS: Any  # the extension class of the store, set by each optimizer
    _aio: dict[str, int] | None = None  # the files' I/O engine (Adam's aio=), None: its defaults

    def _open_nvme(self, nvme_dir: str, host_memory: int | str | None) -> None:
        """Makes the store and preallocates every parameter's state, with
        _nvme_sizes' defaults for the budget and the file size."""
        total = sum(self._nvme_bytes(p, g) for g in self.param_groups for p in g["params"])
        host_memory, file_size = _nvme_sizes(total, host_memory)
        io = {} if self._aio is None else {"aio": self._aio}
        self._nvme = self._NVME_CLASS(nvme_dir, host_memory, file_size, **io)
        for group in self.param_groups:
            self._register(group)

    def _register(self, group: dict[str, Any]) -> None:
        """Registers the group's parameters in the store: all or none."""
        added = []
        try:
            for p in group["params"]:
                self._slots[p] = self._add_nvme_param(p, group)
                added.append(p)
        except BaseException:
            for p in added:
                del self._slots[p]
            raise

    @property
    def nvme_dir(self) -> str | None:
        """The directory of the state's files (offload="nvme"), else None."""
        return None if self._nvme is None else self._nvme.nvme_dir

    @property
    def host_memory(self) -> int | None:
        """The host budget the state streams through, in bytes (offload="nvme"), else None."""
        return None if self._nvme is None else self._nvme.host_memory

    def telemetry(self) -> dict | None:
        """With offload="nvme", the store's counters: per tier its budget, use
        and high-water mark (``tiers[k]["high_water_bytes"]``), per link the
        bytes moved; None with offload="cpu"."""
        return None if self._nvme is None else self._nvme.telemetry()

    def close(self) -> None:
        """With offload="nvme", writes nothing more, removes the state's files
        and frees the host budget: the optimizer cannot step or give its state
        afterwards (take :meth:`state_dict` first to keep it). Freeing the
        optimizer does the same. Does nothing with offload="cpu"."""
        if self._nvme is not None:
            self._nvme.close()

    def _forget_views(self, params: Iterable[Tensor]) -> None:
        """Drops the kernel's views of ``params``' memory (made again at their
        next step): for memory that is theirs only while a step runs, as
        tierflow.torch.fsdp.offload's leases of NVMe-homed shards."""
        slots = getattr(self, "_cpu_slots", None)
        if slots:
            for p in params:
                slots.pop(p, None)

    def _release_native(self) -> None:
        """At interpreter exit (tierflow._lifetime): closes, and lets go of the C++ objects."""
        self.close()
        self._nvme = None
        self._executor = None
        for name in ("_cpu_slots", "_workspace"):  # Adam's kernel slots, Muon's workspace
            if hasattr(self, name):
                setattr(self, name, {} if name == "_cpu_slots" else None)

    def _pickle_nvme(self, own: dict[str, Any]) -> None:
        """Puts into ``own`` (the pickle's tierflow part) what makes the store
        again, and the state itself: a copy or a pickle carries it."""
        if self._nvme is not None:
            own["nvme_dir"], own["host_memory"] = self._nvme.nvme_dir, self._nvme.host_memory
            own["aio"] = self._aio
            own["nvme_state"] = {p: self._read_state(p, g) for g in self.param_groups
                                 for p in g["params"] if p in self.state}

    def _unpickle_nvme(self, own: dict[str, Any]) -> None:
        """Makes the store again from what _pickle_nvme put into ``own``
        (self.offload set first), and writes the state into it."""
        self._nvme, self._slots = None, {}
        if self.offload == "nvme":
            self._aio = own.get("aio")
            self._open_nvme(own["nvme_dir"], own["host_memory"])
            for p, saved in own["nvme_state"].items():
                self._write_state(p, saved)

    def _save_nvme(self, directory: str | os.PathLike) -> None:
        """save_state(): the blocks into the checkpoint in ``directory``, then
        what self.state holds, the layout and the fresh chunks into
        ``optimizer.pt`` beside it, replaced whole."""
        if self._nvme is None:
            raise ValueError("save_state: the state is not on NVMe (offload='cpu'); torch.save(state_dict()) saves it")
        directory = os.fspath(directory)
        own = {"layout": self._layout(), "fresh": self._fresh_chunks()}
        own["generation"] = self._nvme.save(directory)
        meta = Optimizer.state_dict(self)  # param groups and what self.state holds (steps, masters)
        meta["tierflow"] = own
        _save_file(meta, os.path.join(directory, "optimizer.pt"))

    def _load_nvme(self, directory: str | os.PathLike, layout: str) -> tuple[dict[str, Any], Any]:
        """load_state(): checks that ``directory`` holds this optimizer's
        layout (``layout`` names what makes it, for the message) and restores
        the blocks; returns optimizer.pt's state_dict, for the optimizer to
        load, and the fresh chunks saved."""
        if self._nvme is None:
            raise ValueError("load_state: the state is not on NVMe (offload='cpu'); use load_state_dict()")
        directory = os.fspath(directory)
        meta = torch.load(os.path.join(directory, "optimizer.pt"), weights_only=True)
        own = meta.pop("tierflow")
        if own["layout"] != self._layout():
            raise ValueError(f"load_state: {directory} holds the state of another layout ({layout}): saved "
                             f"{own['layout']['host_memory']} bytes of host_memory and "
                             f"{len(own['layout']['state'])} parameters, this optimizer "
                             f"{self._nvme.host_memory} and {self._nvme.slot_count}")
        self._nvme.load(directory, own["generation"])
        return meta, own["fresh"]

    def _merge_nvme_state(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """torch's ``state_dict`` with each stepped parameter's state read
        from NVMe into it."""
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                if index in state_dict["state"]:  # (the dict torch packs is self.state[p] itself)
                    state_dict["state"][index] = {**state_dict["state"][index], **self._read_state(p, group)}
                index += 1
        return state_dict


class Adam(_NvmeState, Optimizer):
    r"""torch.optim.Adam with its step in tierflow's fused CPU kernel, and its
    state in host memory or on NVMe.

    The update, for each parameter :math:`\theta` with gradient :math:`g`
    (negated with ``maximize``), at step :math:`t`:

    .. math::
        g &\leftarrow g + \lambda\theta \quad\text{(L2 decay; AdamW instead: }
            \theta \leftarrow \theta - \gamma\lambda\theta)\\
        m &\leftarrow \beta_1 m + (1-\beta_1) g, \qquad
        v \leftarrow \beta_2 v + (1-\beta_2) g^2 \\
        \hat v &= \max(\hat v, v) \text{ with amsgrad, else } v \\
        \theta &\leftarrow \theta - \frac{\gamma}{1-\beta_1^t}\,
            \frac{m}{\sqrt{\hat v}/\sqrt{1-\beta_2^t} + \epsilon}

    computed in fp32 in one pass over each parameter's buffers.

    Arguments are torch.optim.Adam's, with its defaults and error messages.
    ``foreach`` and ``fused`` are accepted and recorded (they choose one of
    torch's implementations, not a result): tierflow's step is always one fused
    pass per parameter (per chunk of it with ``offload="nvme"``), whatever they
    say. ``capturable=True`` and ``differentiable=True`` are refused with
    ValueError. tierflow's own arguments (keyword-only):

    * ``offload``: where the optimizer state lives. ``"cpu"`` (the default):
      torch tensors in host memory beside the parameters. ``"nvme"``: blocks
      of files in ``nvme_dir``, streamed through ``host_memory`` bytes of pinned
      host memory at each step (below).
    * ``nvme_dir``: with ``offload="nvme"``, the directory the state's files
      (``tierflow-<pid>-<n>.nvme``, mode 0600) are made in; created (0700) when
      missing, its parent must exist. Use a directory on a fast local NVMe
      drive. The files are preallocated at construction (and by
      ``add_param_group``) for every parameter given, so a full disk fails
      there rather than in the middle of training, and are removed by
      :meth:`close` or when the optimizer is freed; the directory is left. They
      are scratch, not a checkpoint: resume from :meth:`state_dict`, loaded
      with :meth:`load_state_dict` into a new optimizer.
    * ``host_memory``: with ``offload="nvme"``, the host memory the state
      streams through, in bytes or as a size such as ``"512M"`` or ``"2G"``
      (at least 64 KiB, rounded down to 4 KiB). It is one pinned region mapped
      at construction, and the optimizer holds no more state than it in host
      memory, whatever the size of the state or of a tensor: tensors are cut
      into chunks so that one chunk of all of a parameter's state buffers (a
      sub-group) is a quarter of ``host_memory``, and the step keeps four
      sub-groups in it: one updating, two being read, one being written back.
      Default: the state's size, capped at 256 MiB (four 64 MiB sub-groups).
      Larger sub-groups mean larger, faster I/O; a smaller budget only slows
      the step.
    * ``aio``: with ``offload="nvme"``, the I/O engine of the state's files, a
      dict of ``block_size``, ``queue_depth``, ``threads`` and
      ``submit_batch`` (each optional), as a DeepSpeed config's ``aio``
      section sets them (``Config.aio.engine_options()``); None: the
      engine's own defaults.
    * ``threads``: the CPU threads of the step; default
      ``torch.get_num_threads()``. The step runs between torch's operations,
      while torch's intra-op threads wait, so the two pools take turns on the
      same cores rather than oversubscribing them.
    * ``skip_nonfinite``: when True, a parameter whose gradient holds an inf
      or a nan is not updated: the kernel reads its whole gradient before it
      writes anything (with ``offload="nvme"``, before any of its state
      streams), and leaves the parameter, its state and its ``step`` count as
      they were. The check is per parameter, as the kernel runs: the other
      parameters of the same step are updated. ``skipped_steps`` counts the
      steps that skipped at least one parameter and ``last_step_skipped`` says
      whether the last one did (both kept in a copy or a pickle, not in
      :meth:`state_dict`). A trainer that wants a whole step dropped on an
      overflow checks before calling step(), as ``torch.amp.GradScaler`` does
      for fp16 (its skipped steps never reach this optimizer, and count here
      as none). Default False: an inf or a nan flows into the update, as in
      torch.optim.
    * ``state_dtype``: the dtype the moments (``exp_avg``, ``exp_avg_sq``,
      ``max_exp_avg_sq``) are stored in: ``"fp32"`` (the default; also
      ``torch.float32``) or ``"bf16"`` (also ``"bfloat16"``,
      ``torch.bfloat16``), which halves them. The step still computes in fp32:
      it widens each moment as it reads it and rounds it to nearest-even as it
      stores it. The fp32 master of a bfloat16/float16 parameter stays fp32
      whatever ``state_dtype`` says (rounding it would lose the small updates
      it exists to accumulate). :meth:`state_dict` keeps torch's layout, the
      moments as bfloat16 tensors; a state_dict with fp32 moments (torch's)
      is rounded to bf16 as it loads. ``offload="nvme"`` streams fp32 state
      only, so ``state_dtype="bf16"`` with it is refused (ValueError).

    Parameters must be on the CPU or on one CUDA device (below), float32,
    bfloat16 or float16, and are updated in place. A bfloat16/float16
    parameter gets an fp32 master copy in its state under ``"master_param"``
    (and moments of ``state_dtype``, not of the parameter's dtype): the kernel
    updates the master and writes the parameter from it in the same pass. A
    torch state_dict without the master (torch keeps low-precision moments)
    loads: the master is made from the parameter and the moments converted to
    ``state_dtype``. The state is torch's: ``step`` (a float32 scalar tensor), ``exp_avg``,
    ``exp_avg_sq`` and, with amsgrad, ``max_exp_avg_sq``.

    With ``offload="cpu"`` one step is one C++ call per param group, with the
    GIL released: the kernel runs on each parameter in turn. Each parameter's
    state and (contiguous) storage are viewed by a slot made at its first step
    and checked by identity at each step, so that only the gradients cross;
    a slot is made again when a state tensor is replaced (load_state_dict, or
    an assignment into ``self.state[p]``) or the parameter's storage moves
    (``p.data = ...``). ``step`` is advanced in place, as torch's ``+= 1``.

    With ``offload="nvme"`` one step is one C++ call over every parameter that
    has a gradient, with the GIL released: each sub-group is read from NVMe
    while the one before it is updated and the one before that is written
    back. The numerics are those of ``offload="cpu"`` (the same kernel, the
    same bits). Parameters and gradients stay in torch's memory and are read
    and written there; only ``self.state[p]["step"]`` is kept in Python, and
    :meth:`state_dict` reads the rest from NVMe into RAM (torch's layout, so a
    state_dict moves between ``"cpu"``, ``"nvme"`` and torch.optim either
    way). Errors: a directory that cannot be made or written and a full disk
    raise :class:`tierflow.TierflowError` (an OSError with ``errno``, e.g.
    ENOENT, EROFS, ENOSPC, and ``filename``) at construction or in
    ``add_param_group``, which then adds nothing (space already preallocated
    for it stays reserved until :meth:`close`). A step checks every parameter
    and gradient before it writes anything (ValueError changes nothing); an I/O
    error in the middle of a step (EIO from the drive) leaves the chunks
    before it stepped and the rest not, and names the block and file.

    **CUDA parameters** (ZeRO-Offload for one GPU): the parameters and their
    gradients stay on the device, the step runs on the CPU, and the optimizer
    keeps nothing in device memory. Each CUDA parameter has an image in
    pinned host memory, read from it at its first step: for a float32
    parameter the fp32 master itself, for a bfloat16/float16 one the copy the
    kernel writes from its fp32 master (``"master_param"`` in the state, as on
    the CPU), and a pinned buffer for its gradient. The state lives where
    ``offload`` says (host memory or NVMe; ``host_memory`` bounds only the
    state streamed from NVMe, the images and gradient buffers are besides it).
    One step:

    1. the gradients come down to their buffers on a download stream of the
       device, queued after the work on the current stream (which made them),
       in buckets of 16 MiB, each followed by a CUDA event;
    2. CPU parameters (an optimizer may mix the two) step meanwhile; then each
       bucket steps once its event passed, so the CPU step of one bucket runs
       while the next comes down;
    3. each bucket's images go up into their parameters on an upload stream,
       queued as soon as the bucket stepped (a parameter skipped by
       ``skip_nonfinite`` is not uploaded);
    4. the current stream is made to wait for both streams, and step()
       returns without waiting for the uploads: work queued on the current
       stream afterwards (the next forward pass) reads the updated values.

    What this asks of the caller: the gradients are complete in the current
    stream's order when step() is called (as for torch's own optimizers),
    and the parameters are neither read nor written on another stream
    until that stream waits for the current one. The host image is the
    optimizer's truth between steps: a CUDA parameter written outside
    step() (weights loaded into the model) is read again only by
    :meth:`load_state_dict` (load the weights first) or when its storage
    moves (``p.data = ...``); otherwise the next step overwrites it. The
    state (``state_dict()``, ``self.state``) stays in host memory, CPU
    tensors in torch's layout; a torch state_dict of CUDA tensors loads into
    host memory without passing through the device. All CUDA parameters of
    an optimizer must be on one device (ValueError otherwise). An error in
    the middle of a step leaves the buckets before it stepped and uploaded,
    and the rest untouched, on the host and the device alike.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool = False,
        offload: Literal["cpu", "nvme"] = "cpu",
        nvme_dir: str | os.PathLike | None = None,
        host_memory: int | str | None = None,
        threads: int | None = None,
        skip_nonfinite: bool = False,
        state_dtype: str | torch.dtype = "fp32",
        aio: dict[str, int] | None = None,
    ) -> None:
        _check_hyper_parameters(lr, betas, eps, weight_decay, foreach, capturable)
        _check_offload(offload, nvme_dir, host_memory, aio=aio)
        moment_dtype = _parse_state_dtype(state_dtype)
        if moment_dtype != torch.float32 and offload == "nvme":
            raise ValueError(f"state_dtype={state_dtype!r} with offload='nvme': the state streamed "
                             "from NVMe is float32 only (use state_dtype='fp32' or offload='cpu')")
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ValueError(f"Invalid threads: {threads!r} (a positive int, or None)")
        if not isinstance(skip_nonfinite, bool):
            raise ValueError(f"Invalid skip_nonfinite: {skip_nonfinite!r} (True or False)")
        self.offload = offload
        self._aio = aio
        self.threads = threads if threads is not None else torch.get_num_threads()
        self.skip_nonfinite = skip_nonfinite
        self.state_dtype = moment_dtype
        self.skipped_steps = 0
        self.last_step_skipped = False
        self._skipped_since_step: set[Tensor] = set()
        self._executor = _core.Executor(self.threads)
        _lifetime.track(self)
        self._nvme: _core.OffloadedAdam | None = None
        self._slots: dict[Tensor, int] = {}
        self._cpu_slots: dict[Tensor, _Slot] = {}
        self._device_params: _device.DeviceParams | None = None
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
        super().__init__(params, defaults)
        if offload == "nvme":
            self._open_nvme(os.fspath(nvme_dir), host_memory)

    _NVME_CLASS = _core.OffloadedAdam

    def _nvme_bytes(self, p: Tensor, group: dict[str, Any]) -> int:
        return _state_bytes(p, group["amsgrad"])

    def _add_nvme_param(self, p: Tensor, group: dict[str, Any]) -> int:
        return self._nvme.add_param(_local(p).numel(), p.dtype in _LOW_PRECISION, bool(group["amsgrad"]))

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        own = {"offload": self.offload, "threads": self.threads, "skip_nonfinite": self.skip_nonfinite,
               "state_dtype": self.state_dtype,
               "skipped_steps": self.skipped_steps, "last_step_skipped": self.last_step_skipped}
        self._pickle_nvme(own)
        state["tierflow"] = own
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        own = state.pop("tierflow", None)
        super().__setstate__(state)
        self._cpu_slots = {}  # views of the state this optimizer held, if any: made again
        if own is not None or not hasattr(self, "_device_params"):  # (torch's load comes here too)
            self._device_params = None  # a copy's streams and host buffers: made at its next step
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("foreach", None)
            group.setdefault("capturable", False)
            group.setdefault("differentiable", False)
            group.setdefault("decoupled_weight_decay", False)
            group.setdefault("fused", None)
        if own is not None:  # unpickled: the executor (and the NVMe state) are made again
            self.offload, self.threads = own["offload"], own["threads"]
            self.skip_nonfinite = own.get("skip_nonfinite", False)
            self.state_dtype = own.get("state_dtype", torch.float32)
            self.skipped_steps = own.get("skipped_steps", 0)
            self.last_step_skipped = own.get("last_step_skipped", False)
            self._executor = _core.Executor(self.threads)
            self._unpickle_nvme(own)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            _check_hyper_parameters(group["lr"], group["betas"], group["eps"], group["weight_decay"],
                                    group["foreach"], group["capturable"])
            _check_group(group)
            _one_device(self.param_groups)
            if getattr(self, "_nvme", None) is not None:  # (during __init__, _open_nvme does it)
                self._register(group)
        except BaseException:
            self.param_groups.pop()
            raise

    def _read_state(self, p: Tensor, group: dict[str, Any]) -> dict[str, Tensor]:
        """p's state from NVMe, as torch tensors of p's shape (in RAM)."""
        slot = self._slots[p]
        keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])
        if p.dtype in _LOW_PRECISION:
            keys.append(MASTER_KEY)
        out = {}
        for key in keys:
            value = torch.empty(_local(p).shape, dtype=torch.float32)
            if key == MASTER_KEY:
                self._nvme.read(slot, key, value, _kernel_view(self._host_of(p)).contiguous())
            elif self._nvme.has(slot, key):
                self._nvme.read(slot, key, value)
            else:  # amsgrad turned on since p's last step: torch's start
                value.zero_()
            out[key] = value
        return out

    def _write_state(self, p: Tensor, saved: dict[str, Any]) -> None:
        """Writes p's state tensors in `saved` to NVMe; a key absent (or a
        master that does not round to p) starts again as torch would."""
        slot = self._slots[p]
        for key in _FP32_STATE:
            value = saved.get(key)
            if key == MASTER_KEY and p.dtype not in _LOW_PRECISION:
                continue
            if not torch.is_tensor(value):
                self._nvme.forget(slot, key)
                continue
            value = value.detach().to(device="cpu", dtype=torch.float32, memory_format=torch.contiguous_format)
            # A master carried, untouched, through an optimizer that updated
            # the parameter alone (torch.optim's) is made again from it.
            if key == MASTER_KEY and not torch.equal(value.view(_local(p).shape).to(p.dtype),
                                                     self._host_of(p).detach()):
                self._nvme.forget(slot, key)
                continue
            self._nvme.write(slot, key, value)

    def _set_master(self, p: Tensor, value: Tensor) -> None:
        """Sets bf16/fp16 p's fp32 master to ``value`` as it is, in RAM or on
        NVMe, whether or not it rounds to p: a checkpoint's master, loaded for
        a parameter whose values live elsewhere (the ZeRO-3 engine's store)."""
        value = value.detach().to(device="cpu", dtype=torch.float32, memory_format=torch.contiguous_format)
        if self._nvme is not None:
            self._nvme.write(self._slots[p], MASTER_KEY, value)
        else:
            self.state[p][MASTER_KEY] = value.view(_local(p).shape)

    def _layout(self) -> dict[str, Any]:
        """What the NVMe state's blocks are: checked by load_state()."""
        return {"host_memory": self._nvme.host_memory,
                "slots": [self._slots[p] for g in self.param_groups for p in g["params"]],
                "state": [list(entry) for entry in self._nvme.layout()]}

    def _fresh_chunks(self) -> dict[int, dict[str, list[bool]]]:
        """Per slot and state key: which of its chunks were never written."""
        return {slot: {key: self._nvme.fresh_chunks(slot, key) for key in keys}
                for slot, (_, _, keys) in enumerate(self._nvme.layout())}

    def save_state(self, directory: str | os.PathLike) -> None:
        """With offload="nvme", saves the optimizer into ``directory`` (made
        0700 when missing) without reading its state into RAM: every block of
        the state goes through the host budget into tierflow's crash-safe
        checkpoint there (``manifest.json`` and ``blocks-<n>.bin``, each block
        checksummed; a new save replaces the last one), and the rest (param
        groups, step counts, which buffers hold state) into ``optimizer.pt``
        beside it. :meth:`load_state` of that directory into an optimizer made
        with the same parameters, ``host_memory`` and amsgrad resumes it. A
        save interrupted by a crash is refused by load_state (its two parts'
        generations differ). With offload="cpu", ``torch.save(state_dict())``."""
        self._save_nvme(directory)

    def load_state(self, directory: str | os.PathLike) -> None:
        """With offload="nvme", resumes what :meth:`save_state` saved in
        ``directory``: the state's blocks are verified, then written through the
        host budget (never the whole state in RAM). Raises ValueError when the
        directory holds another optimizer's layout (other parameters,
        host_memory or amsgrad) or an interrupted save, and
        :class:`tierflow.TierflowError` when the checkpoint is missing or
        corrupt; nothing changes then."""
        meta, fresh = self._load_nvme(directory, "parameters, host_memory or amsgrad")
        Optimizer.load_state_dict(self, meta)
        for group in self.param_groups:
            _check_group(group)
        for slot, keys in fresh.items():
            for key, fresh in keys.items():
                self._nvme.set_fresh_chunks(slot, key, fresh)

    def refresh_masters(self) -> None:
        """Starts each bf16/fp16 parameter's fp32 master again from the
        parameter's value at its next step, as DeepSpeed's
        ``refresh_fp32_params``: after the parameters were given new values
        without the optimizer's state (a checkpoint's weights loaded alone),
        whose step would otherwise write the old master's values back. The
        moments and step counts stay."""
        self._cpu_slots.clear()
        if self._device_params is not None:
            self._device_params.forget()  # a device parameter's host image is read again
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype not in _LOW_PRECISION:
                    continue
                if self._nvme is not None:
                    if p in self._slots:
                        self._nvme.forget(self._slots[p], MASTER_KEY)
                elif p in self.state:
                    self.state[p].pop(MASTER_KEY, None)

    def state_dict(self) -> dict[str, Any]:
        """torch's state_dict. With offload="nvme" the state tensors are read
        from NVMe into RAM (the whole state, as fp32 tensors: mind its size;
        :meth:`save_state` saves without that). The state of an FSDP2
        (DTensor) parameter is given as DTensors sharded as the parameter is,
        as torch.optim's is, so torch.distributed.checkpoint saves and loads
        it by the parameter's name."""
        state_dict = super().state_dict()
        if self._nvme is not None:
            state_dict = self._merge_nvme_state(state_dict)
        return _as_dtensor_state(self, state_dict)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, except that the fp32 master and moments of a bf16/fp16
        parameter stay fp32 (torch's load casts every state tensor to its
        parameter's dtype). A master that does not round to the parameter was
        carried, untouched, through an optimizer that updated the parameter
        alone (torch.optim's): it is made again from the parameter. With
        offload="nvme" the state tensors are written to NVMe (this is how a new
        optimizer resumes) and only ``step`` stays in ``self.state``. The
        state of a CUDA parameter is placed in host memory, never on its device
        (torch's load would move it there), and its host copy is read again
        from the parameter: load the model's weights first."""
        state_dict = _as_local_state(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        if self._device_params is not None:
            self._device_params.forget()
        if self._nvme is not None:
            for saved_id, p in zip(saved_ids, params):  # refused before anything changes
                for key, value in state_dict["state"].get(saved_id, {}).items():
                    if key in _FP32_STATE and torch.is_tensor(value) and _local(value).numel() != _local(p).numel():
                        raise ValueError(f"state {saved_id} {key}: {_local(value).numel()} elements for a "
                                         f"parameter of {_local(p).numel()}")
            stripped = dict(state_dict)
            stripped["state"] = {i: {k: v for k, v in s.items() if k not in _FP32_STATE}
                                 for i, s in state_dict["state"].items()}
            super().load_state_dict(stripped)
            for group in self.param_groups:
                _check_group(group)
            for saved_id, p in zip(saved_ids, params):
                self._write_state(p, state_dict["state"].get(saved_id, {}))
            return
        on_device = {saved_id: p for saved_id, p in zip(saved_ids, params) if _device.on_device(p)}
        if on_device:  # their tensors are placed below, not by torch
            stripped = dict(state_dict)
            stripped["state"] = {i: {k: v for k, v in s.items() if i not in on_device or k not in _FP32_STATE}
                                 for i, s in state_dict["state"].items()}
            super().load_state_dict(stripped)
        else:
            super().load_state_dict(state_dict)
        self._cpu_slots.clear()  # they hold the replaced state
        _restore_fp32_state(self, state_dict, _FP32_STATE)
        for saved_id, p in on_device.items():
            saved = state_dict["state"].get(saved_id)
            if not saved:
                continue
            state = self.state[p]
            step = state.get("step")
            if torch.is_tensor(step) and step.device.type != "cpu":  # torch's load moves it with fused=True
                state["step"] = step.to(device="cpu", dtype=torch.float32)
            for key in _MOMENTS:
                if torch.is_tensor(saved.get(key)):
                    state[key] = saved[key].detach().to(device="cpu", dtype=self.state_dtype,
                                                        memory_format=torch.contiguous_format, copy=True)
            master = saved.get(MASTER_KEY)
            # A master that does not round to the parameter is made again from it (as on the CPU).
            if p.dtype in _LOW_PRECISION and torch.is_tensor(master):
                master = master.detach().to(device="cpu", dtype=torch.float32,
                                            memory_format=torch.contiguous_format, copy=True).view(p.shape)
                image = self._host_of(p)
                state[MASTER_KEY] = master if torch.equal(master.to(p.dtype), image) else _master_of(image)
        if self.state_dtype != torch.float32:  # a torch (fp32) state_dict's moments, narrowed now
            for state in self.state.values():
                for key in _MOMENTS:
                    if torch.is_tensor(state.get(key)):
                        state[key] = state[key].to(self.state_dtype, memory_format=torch.contiguous_format)
        for group in self.param_groups:
            _check_group(group)

    def _slot_of(self, p: Tensor, state: dict[str, Any], amsgrad: bool) -> _Slot:
        """p's state made ready for the kernel (torch's layout: made when
        missing, the moments and the master fp32 and contiguous) and held in a
        new _core.AdamSlot. Runs when p first steps and again when the slot no
        longer fits (a state tensor replaced, p's storage moved)."""
        step = state.get("step")
        if step is None:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
        elif not torch.is_tensor(step):  # an old state_dict's number, made torch's tensor
            state["step"] = torch.tensor(float(step), dtype=torch.float32)
        elif step.device.type != "cpu":  # torch's load puts it on a device parameter's device with fused=True
            state["step"] = step.to(device="cpu", dtype=torch.float32)
        low_precision = p.dtype in _LOW_PRECISION
        if low_precision:
            master = state.get(MASTER_KEY)
            if master is None:  # a new parameter, or a torch state_dict's state
                state[MASTER_KEY] = _master_of(p)
            elif not master.is_contiguous():
                state[MASTER_KEY] = master.contiguous()
        moment_keys = _MOMENTS if amsgrad else _MOMENTS[:2]
        dtype = self.state_dtype
        for key in moment_keys:
            if key not in state:
                state[key] = torch.zeros_like(p, dtype=dtype, memory_format=torch.contiguous_format)
            elif state[key].dtype != dtype or not state[key].is_contiguous():
                state[key] = state[key].to(dtype, memory_format=torch.contiguous_format)
        return _Slot(p, state, amsgrad)

    def _step_group(self, group: dict[str, Any], items: list[tuple[Tensor, Tensor, Tensor]]) -> set[Tensor]:
        """One step of `items`, (parameter, the tensor the kernel steps for it,
        its gradient in host memory) of one param group: one C++ call over
        their slots (GIL released once); only the gradients cross. The tensor
        stepped is the parameter itself on the CPU, its host image for a
        device one. Returns the parameters skipped for a non-finite gradient."""
        amsgrad = bool(group["amsgrad"])
        slots, cores, grads = self._cpu_slots, [], []
        scratch: list[tuple[int, Tensor, Tensor]] = []
        for p, target, grad in items:
            state = self.state[p]
            slot = slots.get(p)
            if slot is None or not slot.fits(target, state, amsgrad):
                slot = slots[p] = self._slot_of(target, state, amsgrad)
            core = slot.core
            if core is None:  # a non-contiguous parameter: a contiguous copy, written back after
                core, written = slot.scratch(target)
                scratch.append((len(cores), target, written))
            cores.append(core)
            if grad.requires_grad:
                grad = grad.detach()
            grads.append(grad if grad.is_contiguous() else grad.contiguous())
        if not cores:
            return set()
        beta1, beta2 = group["betas"]
        skipped = _core.adam_step_group(
            self._executor, cores, grads,
            lr=_scalar(group["lr"]),
            beta1=_scalar(beta1),
            beta2=_scalar(beta2),
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            decoupled=group["decoupled_weight_decay"],
            maximize=group["maximize"],
            skip_nonfinite=self.skip_nonfinite,
        )
        for index, target, written in scratch:
            if index not in skipped:  # (a skipped stand-in was never written)
                target.copy_(written)
        return {items[i][0] for i in skipped}

    def _step_nvme(self, groups: list[tuple[int, list[tuple[Tensor, Tensor, Tensor]]]]) -> set[Tensor]:
        """One step of `groups`' items (as _step_group's, per param group
        index), state on NVMe: one C++ call (GIL released) that streams every
        chunk of their state. Returns the parameters skipped for a
        non-finite gradient."""
        hyper = []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            hyper.append((_scalar(group["lr"]), _scalar(beta1), _scalar(beta2), float(group["eps"]),
                          float(group["weight_decay"]), bool(group["decoupled_weight_decay"]),
                          bool(group["amsgrad"]), bool(group["maximize"])))
        entries, stepped = [], []
        for index, items in groups:
            for p, target, grad in items:
                state = self.state.get(p, {})
                step = int(state["step"].item()) + 1 if "step" in state else 1
                grad = _kernel_view(grad)
                if not grad.is_contiguous():
                    grad = grad.contiguous()
                # A non-contiguous parameter is stepped in a contiguous copy
                # and written back: the kernel walks one flat buffer.
                work = _kernel_view(target) if target.is_contiguous() else target.detach().contiguous()
                entries.append((self._slots[p], work, grad, step, index))
                stepped.append((p, target, work))
        if not entries:
            return set()
        skipped = set(self._nvme.step(self._executor, entries, hyper, skip_nonfinite=self.skip_nonfinite))
        for p, target, work in stepped:  # the step counts move only once the step is done, as its state
            if self._slots[p] in skipped:
                continue
            if work is not target and not target.is_contiguous():
                target.detach().copy_(work)
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["step"] += 1
        return {p for p, _, _ in stepped if self._slots[p] in skipped}

    def _step_items(self, groups: list[tuple[int, list[tuple[Tensor, Tensor, Tensor]]]]) -> set[Tensor]:
        """_step_group per group, or _step_nvme over all of them."""
        if self._nvme is not None:
            return self._step_nvme(groups)
        skipped: set[Tensor] = set()
        for index, items in groups:
            skipped |= self._step_group(self.param_groups[index], items)
        return skipped

    def _device_side(self) -> _device.DeviceParams:
        """The host side of the device parameters (made at first need)."""
        if self._device_params is None:
            self._device_params = _device.DeviceParams(_device.link_for(_one_device(self.param_groups)))
        return self._device_params

    def _host_of(self, p: Tensor) -> Tensor:
        """p's values in host memory: p itself (an FSDP2 parameter's local
        shard), or a device parameter's image."""
        return self._device_side().image(p) if _device.on_device(p) else _local(p)

    def _group_index(self, p: Tensor) -> int:
        """The index of the param group holding ``p``, from a map made again
        whenever the groups change (a cost of the number of groups a call)."""
        key = tuple((id(g["params"]), len(g["params"])) for g in self.param_groups)
        if getattr(self, "_group_key", None) != key:
            self._group_of = {id(q): i for i, g in enumerate(self.param_groups) for q in g["params"]}
            self._group_key = key
        found = self._group_of.get(id(p))
        if found is None:
            raise ValueError("step_parameters: a parameter this optimizer does not hold")
        return found

    @torch.no_grad()
    def step_parameters(self, params: list[Tensor]) -> set[Tensor]:
        """Steps only ``params`` (host parameters, each with its ``.grad``),
        each with its own param group's hyper-parameters: the cost is theirs
        alone, whatever the optimizer holds besides. For an engine that steps
        parameters as their gradients become final; it runs no step hooks and
        counts nothing in ``skipped_steps`` — a :meth:`step` after the last
        of them (with no gradients left, it updates nothing) does both once.
        Returns the parameters skipped for a non-finite gradient."""
        groups: dict[int, list[tuple[Tensor, Tensor, Tensor]]] = {}
        for p in params:
            if p.grad is None:
                raise ValueError("step_parameters: a parameter without a gradient")
            if _device.on_device(p):
                raise ValueError("step_parameters: steps host parameters; a device one goes through step()")
            index = self._group_index(p)
            _check_group(self.param_groups[index])
            groups.setdefault(index, []).append((p, _local(p), _local(p.grad)))
        skipped = self._step_items(sorted(groups.items()))
        self._skipped_since_step = getattr(self, "_skipped_since_step", set()) | skipped
        return skipped

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One step over every parameter that has a gradient; returns the
        closure's loss when a closure is given (evaluated with grad enabled).
        With CUDA parameters it returns once their uploads are queued and the
        current stream waits for them (see the class docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        host, device = [], []
        for index, group in enumerate(self.param_groups):
            _check_group(group)
            on_host, on_device = [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(
                        "Adam does not support sparse gradients, please consider SparseAdam instead"
                    )
                if _device.on_device(p) and _local(p) is not p:
                    raise ValueError("an FSDP2 (DTensor) parameter on a GPU: tierflow's Adam steps FSDP2's "
                                     "shards in host memory; give fully_shard offload_policy=CPUOffloadPolicy()")
                (on_device if _device.on_device(p) else on_host).append(p)
            if on_host:
                host.append((index, [(p, _local(p), _local(p.grad)) for p in on_host]))
            if on_device:
                device.append((index, on_device))
        if not device:
            skipped = self._step_items(host)
        else:
            side = self._device_side()
            try:
                buckets = side.begin(device)
                # The host parameters step while the device ones' gradients come down.
                skipped = self._step_items(host)
                for bucket in buckets:
                    side.wait(bucket)
                    bucket_skipped = self._step_items(
                        [(bucket.group, [(p, side.image(p), side.grad(p)) for p in bucket.params])])
                    side.upload(bucket, bucket_skipped)
                    skipped |= bucket_skipped
            finally:
                side.end()
        skipped |= getattr(self, "_skipped_since_step", set())  # what step_parameters() stepped since
        self._skipped_since_step = set()
        self.last_step_skipped = bool(skipped)
        self.skipped_steps += int(bool(skipped))
        return loss


class AdamW(Adam):
    """torch.optim.AdamW (decoupled weight decay, default 1e-2) with its step in
    tierflow's fused CPU kernel; everything else (``offload``, ``nvme_dir``,
    ``host_memory``, ``threads``, ``skip_nonfinite``, ``state_dtype``, ``aio``) as :class:`Adam`."""

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
        offload: Literal["cpu", "nvme"] = "cpu",
        nvme_dir: str | os.PathLike | None = None,
        host_memory: int | str | None = None,
        threads: int | None = None,
        skip_nonfinite: bool = False,
        state_dtype: str | torch.dtype = "fp32",
        aio: dict[str, int] | None = None,
    ) -> None:
        super().__init__(
            params, lr, betas, eps, weight_decay, amsgrad,
            foreach=foreach, maximize=maximize, capturable=capturable,
            differentiable=differentiable, fused=fused, decoupled_weight_decay=True,
            offload=offload, nvme_dir=nvme_dir, host_memory=host_memory, threads=threads,
            skip_nonfinite=skip_nonfinite, state_dtype=state_dtype, aio=aio,
        )

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group["decoupled_weight_decay"] = True
