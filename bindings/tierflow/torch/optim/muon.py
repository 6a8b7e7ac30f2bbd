"""Muon for torch whose step runs in tierflow's C++ kernel, and the split of a
model's parameters between Muon and AdamW.

:class:`Muon` is a ``torch.optim.Optimizer`` subclass with torch.optim.Muon's
signature, defaults, validation and state layout, so LR schedulers,
``torch.amp.GradScaler`` and checkpoint tools treat it as torch's own, and
state_dicts load both ways between it and torch.optim.Muon.
:func:`muon_param_groups` splits a model by the C++ engine's own rule
(optim/grouping.hpp): Muon for hidden matrices, AdamW for the rest.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Iterable, Literal, NamedTuple

import torch
from torch import Tensor
from torch.optim.optimizer import Optimizer, ParamsT

from tierflow import _core, _lifetime
from tierflow.torch.optim.adam import (
    _LOW_PRECISION,
    MASTER_KEY,
    _DTensor,
    _NvmeState,
    _as_dtensor_state,
    _as_local_state,
    _check_offload,
    _local,
    _kernel_view,
    _master_of,
    _parse_state_dtype,
    _restore_fp32_state,
    _scalar,
)

__all__ = ["Muon", "muon", "muon_param_groups", "MuonParamGroups"]

# torch.optim.Muon's defaults (Keller Jordan's constants).
_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
_ADJUST_LR_FNS = ("original", "match_rms_adamw", "spectral_unclamped")
_NS_DTYPES = (torch.bfloat16, torch.float32)
# The state a bf16/fp16 parameter keeps in fp32 (MASTER_KEY is the fp32 copy
# the kernel updates; the parameter is written from it in the same pass).
_FP32_STATE = (MASTER_KEY, "momentum_buffer")
_MOMENTUM_KEY = "momentum_buffer"


def _check_hyper_parameters(lr, weight_decay, momentum, ns_coefficients, eps, ns_steps,
                            adjust_lr_fn) -> None:
    """torch.optim.Muon's checks, worded as torch words them (those torch makes
    only at its first step are made here), then tierflow's own for values
    torch lets through that the kernel refuses."""
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
    if not 0.0 <= momentum:
        raise ValueError(f"momentum should be >= 0 but is: {momentum}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
    if adjust_lr_fn is not None and adjust_lr_fn not in _ADJUST_LR_FNS:
        raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")
    if len(ns_coefficients) != 3:
        raise ValueError("Coefficients must be a tuple of exactly 3 values")
    if not isinstance(ns_steps, int) or isinstance(ns_steps, bool) or ns_steps < 0:
        raise ValueError(f"ns_steps should be an int >= 0 but is: {ns_steps!r}")
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    # torch accepts these, to no meaning: a momentum of 1 or more never lets the
    # gradient in (or extrapolates), eps = 0 divides a zero update by zero.
    if not momentum < 1.0:
        raise ValueError(f"momentum should be < 1 but is: {momentum}")
    if not eps > 0.0:
        raise ValueError(f"eps should be > 0 but is: {eps}")
    for name, value in (("Learning rate", lr), ("weight decay", weight_decay), ("eps", eps)):
        if not math.isfinite(_scalar(value)):
            raise ValueError(f"{name} should be finite but is: {value}")
    if not all(math.isfinite(float(c)) for c in ns_coefficients):
        raise ValueError(f"ns_coefficients should be finite but are: {tuple(ns_coefficients)}")


def _check_group(group: dict[str, Any]) -> None:
    """Refuses parameters the kernel does not step: Muon's 2-D rule in torch's
    words, then the CPU and the dtypes."""
    for i, p in enumerate(group["params"]):
        if p.ndim != 2:
            raise ValueError(
                f"Muon only supports 2D parameters whereas we found a parameter with size: {p.size()}"
            )
        if p.device.type != "cpu":
            raise ValueError(
                f"params[{i}] is on {p.device}: Muon steps parameters on the CPU only (for CUDA "
                "parameters, Adam/AdamW bring them down to host memory and back)"
            )
        if p.dtype not in (torch.float32, *_LOW_PRECISION):
            raise ValueError(
                f"params[{i}] is {p.dtype}: float32, bfloat16 or float16 parameters expected"
            )


def muon(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    masters: list[Tensor | None],
    *,
    executor: _core.Executor,
    workspace: _core.MuonWorkspace | None,
    lr: float | Tensor,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    ns_coefficients: tuple[float, float, float],
    eps: float,
    ns_steps: int,
    adjust_lr_fn: str | None,
    ns_dtype: torch.dtype = torch.bfloat16,
) -> None:
    """One Muon step over 2-D parameters and their momentum buffers, in place.

    Each matrix is updated by one call of tierflow's kernel on ``executor``'s
    threads (``_core.muon_step``), reading and writing the tensors where they
    are (no copy; the GIL is released meanwhile); ``workspace`` keeps its
    Newton–Schulz buffers between matrices and steps. ``masters[i]``, when not
    None, is the fp32 copy of a bf16/fp16 ``params[i]``: the kernel updates it
    and writes ``params[i]`` from it in the same pass. ``ns_dtype`` is the
    Newton–Schulz GEMMs' precision: torch.bfloat16 as torch.optim.Muon, or
    torch.float32.
    """
    lr, weight_decay, momentum = _scalar(lr), _scalar(weight_decay), _scalar(momentum)
    a, b, c = (float(x) for x in ns_coefficients)
    gemm = str(ns_dtype).removeprefix("torch.")
    for i, param in enumerate(params):
        grad = grads[i]
        if grad.ndim != 2:
            raise ValueError("Param gradient must be a 2D matrix")
        if not grad.is_contiguous():
            grad = grad.contiguous()
        master = masters[i]
        target = param if master is None else master
        # A non-contiguous fp32 parameter (a transposed view) is stepped in a
        # contiguous copy of the same rows x cols and written back: the kernel
        # walks one row-major buffer.
        work = target if target.is_contiguous() else target.contiguous()
        copy = None
        if master is not None:
            copy = param if param.is_contiguous() else torch.empty_like(param, memory_format=torch.contiguous_format)
        rows, cols = param.shape
        _core.muon_step(
            executor,
            _kernel_view(work),
            _kernel_view(grad),
            _kernel_view(momentum_buffers[i]),
            None if copy is None else _kernel_view(copy),
            rows=rows,
            cols=cols,
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=bool(nesterov),
            ns_coefficients=(a, b, c),
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
            ns_dtype=gemm,
            workspace=workspace,
        )
        if work is not target:
            target.copy_(work)
        if copy is not None and copy is not param:
            param.copy_(copy)


class _MuonNvmeState(_NvmeState):
    """Muon's NVMe store, for tierflow's Muon and the ZeRO engine's
    ShardedMuon alike: one fp32 momentum buffer a parameter, of its shape
    (a stage-3 shard's, flat)."""

    _NVME_CLASS = _core.OffloadedMuon

    def _nvme_bytes(self, p: Tensor, group: dict[str, Any]) -> int:
        return _local(p).numel() * 4  # its fp32 momentum buffer (an FSDP2 shard's)

    def _add_nvme_param(self, p: Tensor, group: dict[str, Any]) -> int:
        return self._nvme.add_param(_local(p).numel())

    def _read_state(self, p: Tensor, group: dict[str, Any]) -> dict[str, Tensor]:
        """p's momentum buffer from NVMe, as a torch tensor of p's shape (in
        RAM); none when p has not stepped since its buffer was (re)started.
        (``group`` is _NvmeState's: Adam's keys depend on it, the one buffer
        here does not.)"""
        slot = self._slots[p]
        if not self._nvme.has(slot):
            return {}
        value = torch.empty(_local(p).shape, dtype=torch.float32)
        self._nvme.read(slot, value)
        return {_MOMENTUM_KEY: value}

    def _write_state(self, p: Tensor, saved: dict[str, Any]) -> None:
        """Writes p's momentum buffer in `saved` to NVMe; without one, p's
        buffer starts again as torch's (zeros)."""
        slot = self._slots[p]
        value = saved.get(_MOMENTUM_KEY)
        if not torch.is_tensor(value):
            self._nvme.forget(slot)
            return
        self._nvme.write(slot, value.detach().to(device="cpu", dtype=torch.float32,
                                                 memory_format=torch.contiguous_format).reshape(_local(p).shape))

    def _layout(self) -> dict[str, Any]:
        """What the NVMe state's blocks are: checked by load_state()."""
        return {"host_memory": self._nvme.host_memory,
                "slots": [self._slots[p] for g in self.param_groups for p in g["params"]],
                "state": self._nvme.layout()}

    def _fresh_chunks(self) -> list[list[bool]]:
        """Per slot: which chunks of its buffer were never written."""
        return [self._nvme.fresh_chunks(slot) for slot in range(self._nvme.slot_count)]

    def _load_muon_state(self, directory: str | os.PathLike, check: Callable[[dict[str, Any]], None]) -> None:
        """load_state's work: the blocks verified and written, the groups and
        the fp32 masters loaded, each group passed to ``check``."""
        meta, fresh = self._load_nvme(directory, "parameters or host_memory")
        Optimizer.load_state_dict(self, meta)
        _restore_fp32_state(self, meta, (MASTER_KEY,))
        for group in self.param_groups:
            check(group)
        for slot, chunks in enumerate(fresh):
            self._nvme.set_fresh_chunks(slot, chunks)


class Muon(_MuonNvmeState, Optimizer):
    r"""torch.optim.Muon with its step in tierflow's C++ kernel.

    The update, for each 2-D parameter :math:`\theta` (``rows`` x ``cols``)
    with gradient :math:`g`:

    .. math::
        B &\leftarrow B + (1-\mu)(g - B)
            \quad\text{(torch's } B.\mathrm{lerp}(g, 1-\mu)\text{)} \\
        U &= g + \mu (B - g) \text{ with nesterov, else } B \\
        O &= \mathrm{NS}^{(a,b,c)}_{k}(U;\ \varepsilon) \\
        \theta &\leftarrow \theta (1 - \gamma\lambda) - \mathrm{AdjustLR}(\gamma)\, O

    NS transposes a tall :math:`U`, divides it by
    :math:`\max(\lVert U\rVert_F, \varepsilon)`, then :math:`k` times computes
    :math:`A = XX^\top`, :math:`X \leftarrow aX + (bA + cA^2)X`.
    AdjustLR is ``adjust_lr_fn``'s rule: None or ``"original"``
    :math:`\gamma\sqrt{\max(1, rows/cols)}`; ``"match_rms_adamw"``
    :math:`0.2\gamma\sqrt{\max(rows, cols)}` (reuse AdamW's lr and weight
    decay); ``"spectral_unclamped"`` :math:`\gamma\sqrt{rows/cols}`.

    Arguments are torch.optim.Muon's, with its defaults and error messages
    (``lr`` may be a 1-element tensor). torch checks ``ns_coefficients`` and
    ``ns_steps`` at its first step; tierflow at construction. tierflow also
    refuses, with ValueError, what torch lets through to no meaning:
    ``momentum >= 1``, ``eps <= 0``, ``ns_steps < 0`` and non-finite values.
    tierflow's own arguments:

    * ``ns_dtype``: the precision of the Newton–Schulz GEMMs.
      ``torch.bfloat16`` (default) rounds their operands to bf16 as
      torch.optim.Muon does; ``torch.float32`` keeps them in fp32 (closer to
      the exact iteration, slower where the CPU has bf16 matrix units). On a
      CPU without bf16 GEMMs (before AVX-512) bf16 runs fp32 GEMMs on the
      same bf16 operands and rounds their results to bf16, as fast as fp32.
    * ``threads``: the CPU threads of the step; default
      ``torch.get_num_threads()``. The step runs between torch's operations,
      on the OpenMP runtime torch's intra-op threads use, and gives torch its
      own thread count back afterwards.
    * ``state_dtype``: the dtype ``momentum_buffer`` is stored in: ``"fp32"``
      (the default; also ``torch.float32``) or ``"bf16"`` (also
      ``"bfloat16"``, ``torch.bfloat16``), which halves it. The kernel keeps
      its momentum in fp32: a bf16 buffer is widened for the step and rounded
      back to nearest-even after it (two passes over the matrix, small beside
      the Newton–Schulz GEMMs). The fp32 master of a bfloat16/float16
      parameter stays fp32. state_dicts keep torch's layout, the buffer
      bf16; an fp32 one (torch's) is rounded as it loads. ``offload="nvme"``
      streams fp32 buffers only, so ``state_dtype="bf16"`` with it is refused
      (ValueError).
    * ``offload``: where the momentum buffers live. ``"cpu"`` (the default):
      torch tensors in ``self.state``. ``"nvme"``: blocks of files in
      ``nvme_dir``, streamed through ``host_memory`` bytes of pinned host
      memory at each step, as :class:`~tierflow.torch.optim.Adam`'s state with
      ``offload="nvme"`` (same directory rules, errors and ``host_memory``
      default: the buffers' size up to 256 MiB). The momentum rule is
      elementwise, so each parameter's buffer streams chunk by chunk (a
      quarter of ``host_memory`` each): each chunk is read, updated and
      written back while the next is read, and its Nesterov update goes into
      an fp32 matrix in RAM. Newton–Schulz needs that whole matrix and runs
      on it afterwards, then the parameter's update. So the host memory the
      optimizer uses is ``host_memory`` plus that matrix and the Newton–Schulz
      workspace, both sized by the largest parameter (a few copies of it, as
      with ``offload="cpu"``), plus the fp32 master of each bfloat16/float16
      parameter, which stays in ``self.state``. The results are
      ``offload="cpu"``'s, bit for bit. :meth:`state_dict` reads the buffers
      from NVMe (torch's layout), :meth:`load_state_dict` writes them there,
      :meth:`save_state` / :meth:`load_state` checkpoint them through the host
      budget without holding them in RAM, :meth:`telemetry` gives the store's
      counters and :meth:`close` removes the files.
    * ``nvme_dir``, ``host_memory``: with ``offload="nvme"``, as Adam's.

    Muon is for the hidden layers' matrices: every parameter must be 2-D (else
    ValueError, as torch), on the CPU, float32, bfloat16 or float16; it is
    updated in place. Give embeddings, the output head, norms and biases to
    AdamW: :func:`muon_param_groups` splits a model so. A bfloat16/float16
    parameter gets an fp32 master copy in its state under ``"master_param"``
    (and a momentum buffer of ``state_dtype``): the kernel updates the
    master and writes the parameter from it in the same pass. The state is
    torch's: ``momentum_buffer`` per parameter, so a state_dict loads into
    torch.optim.Muon and one from it loads here (a torch buffer of a
    low-precision parameter is converted to ``state_dtype``, the master made
    from the parameter).

    Example::

        hidden, rest = muon_param_groups(model)
        opt_muon = tierflow.torch.optim.Muon(hidden, lr=0.02)
        opt_adamw = tierflow.torch.optim.AdamW(rest, lr=3e-4, weight_decay=0.01)
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = _NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        ns_dtype: torch.dtype = torch.bfloat16,
        threads: int | None = None,
        state_dtype: str | torch.dtype = "fp32",
        offload: Literal["cpu", "nvme"] = "cpu",
        nvme_dir: str | os.PathLike | None = None,
        host_memory: int | str | None = None,
    ) -> None:
        _check_hyper_parameters(lr, weight_decay, momentum, ns_coefficients, eps, ns_steps, adjust_lr_fn)
        if ns_dtype not in _NS_DTYPES:
            raise ValueError(f"Invalid ns_dtype: {ns_dtype} (torch.bfloat16 or torch.float32)")
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ValueError(f"Invalid threads: {threads!r} (a positive int, or None)")
        _check_offload(offload, nvme_dir, host_memory)
        self.state_dtype = _parse_state_dtype(state_dtype)
        if self.state_dtype != torch.float32 and offload == "nvme":
            raise ValueError(f"state_dtype={state_dtype!r} with offload='nvme': the momentum buffers streamed "
                             "from NVMe are float32 only (use state_dtype='fp32' or offload='cpu')")
        self.offload = offload
        self._nvme: _core.OffloadedMuon | None = None
        self._slots: dict[Tensor, int] = {}
        self.ns_dtype = ns_dtype
        self.threads = threads if threads is not None else torch.get_num_threads()
        self._executor = _core.Executor(self.threads)
        self._workspace = _core.MuonWorkspace()
        _lifetime.track(self)
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
        }
        super().__init__(params, defaults)
        if offload == "nvme":
            self._open_nvme(os.fspath(nvme_dir), host_memory)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        own = {"ns_dtype": self.ns_dtype, "threads": self.threads, "state_dtype": self.state_dtype,
               "offload": self.offload}
        self._pickle_nvme(own)
        state["tierflow"] = own
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        own = state.pop("tierflow", None)
        super().__setstate__(state)
        if own is not None:  # unpickled or deep-copied: the executor, workspace and store are made again
            self.ns_dtype, self.threads = own["ns_dtype"], own["threads"]
            self.state_dtype = own.get("state_dtype", torch.float32)
            self.offload = own.get("offload", "cpu")
            self._executor = _core.Executor(self.threads)
            self._workspace = _core.MuonWorkspace()
            self._unpickle_nvme(own)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, and then the group's hyper-parameters and parameters are
        checked as the constructor checks them (a refused group is not added)."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            _check_hyper_parameters(group["lr"], group["weight_decay"], group["momentum"],
                                    group["ns_coefficients"], group["eps"], group["ns_steps"],
                                    group["adjust_lr_fn"])
            _check_group(group)
            if getattr(self, "_nvme", None) is not None:  # (during __init__, _open_nvme does it)
                self._register(group)
        except BaseException:
            self.param_groups.pop()
            raise

    def save_state(self, directory: str | os.PathLike) -> None:
        """With offload="nvme", saves the optimizer into ``directory`` (made
        0700 when missing) without reading its buffers into RAM, as
        :meth:`Adam.save_state <tierflow.torch.optim.Adam.save_state>`: the
        blocks go through the host budget into tierflow's crash-safe
        checkpoint there (``manifest.json`` and ``blocks-<n>.bin``), the rest
        (param groups, the masters of bf16/fp16 parameters, which buffers hold
        state) into ``optimizer.pt`` beside it. :meth:`load_state` resumes it
        into an optimizer made with the same parameters and ``host_memory``.
        With offload="cpu", ``torch.save(state_dict())``."""
        self._save_nvme(directory)

    def load_state(self, directory: str | os.PathLike) -> None:
        """With offload="nvme", resumes what :meth:`save_state` saved in
        ``directory``: the blocks are verified, then written through the host
        budget. Raises ValueError when the directory holds another
        optimizer's layout (other parameters or host_memory) or an interrupted
        save, and :class:`tierflow.TierflowError` when the checkpoint is
        missing or corrupt; nothing changes then."""
        self._load_muon_state(directory, check=_check_group)

    def state_dict(self) -> dict[str, Any]:
        """torch's state_dict. With offload="nvme" the momentum buffers are read
        from NVMe into RAM (fp32 tensors: mind their size; :meth:`save_state`
        saves without that)."""
        state_dict = super().state_dict()
        if self._nvme is not None:
            state_dict = self._merge_nvme_state(state_dict)
        return _as_dtensor_state(self, state_dict)  # an FSDP2 matrix's buffer as a DTensor, as its parameter

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, except that the fp32 master and momentum buffer of a
        bf16/fp16 parameter stay fp32 (torch's load casts every state tensor to
        its parameter's dtype). A master that does not round to the parameter
        was carried, untouched, through an optimizer that updated the parameter
        alone (torch.optim's): it is made again from the parameter. With
        state_dtype bf16 the momentum buffers are rounded to bf16 as they load.
        With offload="nvme" the momentum buffers are written to NVMe (a
        parameter without one starts from zeros, as torch's) and only the
        masters stay in ``self.state``."""
        state_dict = _as_local_state(state_dict)
        if self._nvme is not None:
            params = [p for g in self.param_groups for p in g["params"]]
            saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
            for saved_id, p in zip(saved_ids, params):  # refused before anything changes
                value = state_dict["state"].get(saved_id, {}).get(_MOMENTUM_KEY)
                if torch.is_tensor(value) and value.numel() != _local(p).numel():
                    raise ValueError(f"state {saved_id} {_MOMENTUM_KEY}: {value.numel()} elements for a "
                                     f"parameter of {_local(p).numel()}")
            stripped = dict(state_dict)
            stripped["state"] = {i: {k: v for k, v in s.items() if k != _MOMENTUM_KEY}
                                 for i, s in state_dict["state"].items()}
            super().load_state_dict(stripped)
            _restore_fp32_state(self, stripped, (MASTER_KEY,))
            for group in self.param_groups:
                _check_group(group)
            for saved_id, p in zip(saved_ids, params):
                self._write_state(p, state_dict["state"].get(saved_id, {}))
            return
        super().load_state_dict(state_dict)
        _restore_fp32_state(self, state_dict, _FP32_STATE)
        if self.state_dtype != torch.float32:
            for state in self.state.values():
                if torch.is_tensor(state.get("momentum_buffer")):
                    state["momentum_buffer"] = state["momentum_buffer"].to(
                        self.state_dtype, memory_format=torch.contiguous_format)
        for group in self.param_groups:
            _check_group(group)

    def _init_group(self, group: dict[str, Any], chosen: list[Tensor] | None = None):
        params, grads, momentum_buffers, masters = [], [], [], []
        for p in group["params"] if chosen is None else chosen:
            if p.grad is None:
                continue
            if torch.is_complex(p):
                raise RuntimeError("Muon does not support complex parameters")
            if p.grad.is_sparse:
                raise RuntimeError("Muon does not support sparse gradients")
            state = self.state[p]
            low_precision = p.dtype in _LOW_PRECISION
            if low_precision and MASTER_KEY not in state:  # new, or a torch state_dict's state
                state[MASTER_KEY] = _master_of(p)
            params.append(p)
            grads.append(p.grad)
            masters.append(state[MASTER_KEY] if low_precision else None)
            if self._nvme is not None:  # (its buffer is on NVMe; self.state[p] marks it stepped)
                continue
            buf = state.get("momentum_buffer")
            if buf is None:
                state["momentum_buffer"] = torch.zeros_like(
                    p, dtype=self.state_dtype, memory_format=torch.contiguous_format)
            elif buf.dtype != self.state_dtype or not buf.is_contiguous():
                state["momentum_buffer"] = buf.to(self.state_dtype, memory_format=torch.contiguous_format)
            momentum_buffers.append(state["momentum_buffer"])
        return params, grads, momentum_buffers, masters

    def _step_nvme(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor],
                   masters: list[Tensor | None]) -> None:
        """:func:`muon`'s step of one group with the momentum buffers on NVMe:
        one C++ call per matrix (GIL released), its buffer streamed."""
        a, b, c = (float(x) for x in group["ns_coefficients"])
        gemm = str(self.ns_dtype).removeprefix("torch.")
        for param, grad, master in zip(params, grads, masters):
            if grad.ndim != 2:
                raise ValueError("Param gradient must be a 2D matrix")
            grad = _kernel_view(grad)
            if not grad.is_contiguous():
                grad = grad.contiguous()
            target = param if master is None else master
            # A non-contiguous parameter is stepped in a contiguous copy and
            # written back, as muon() does.
            work = _kernel_view(target) if target.is_contiguous() else target.detach().contiguous()
            rows, cols = param.shape
            self._nvme.step(
                self._executor, self._slots[param], work, grad,
                rows=rows, cols=cols,
                lr=_scalar(group["lr"]),
                weight_decay=_scalar(group["weight_decay"]),
                momentum=_scalar(group["momentum"]),
                nesterov=bool(group["nesterov"]),
                ns_coefficients=(a, b, c),
                eps=float(group["eps"]),
                ns_steps=group["ns_steps"],
                adjust_lr_fn=group["adjust_lr_fn"],
                ns_dtype=gemm,
            )
            if work is not target and not target.is_contiguous():
                target.detach().copy_(work)
            if master is not None:  # nearest-even, as the kernel writes a parameter from its master
                param.detach().copy_(master)

    def _step_group(self, group: dict[str, Any], chosen: list[Tensor] | None = None) -> None:
        """One step of ``group``'s parameters that have a gradient (of
        ``chosen`` alone, when given: parameters of this group)."""
        _check_group(group)
        todo = [p for p in (group["params"] if chosen is None else chosen) if p.grad is not None]
        for p in todo:
            if _local(p) is not p:
                self._step_sharded(group, p)
        chosen = [p for p in todo if _local(p) is p]
        if not chosen:
            return
        params, grads, momentum_buffers, masters = self._init_group(group, chosen)
        if self._nvme is not None:
            self._step_nvme(group, params, grads, masters)
            return
        muon(
            params, grads, momentum_buffers, masters,
            executor=self._executor,
            workspace=self._workspace,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            momentum=group["momentum"],
            nesterov=group["nesterov"],
            ns_coefficients=group["ns_coefficients"],
            eps=group["eps"],
            ns_steps=group["ns_steps"],
            adjust_lr_fn=group["adjust_lr_fn"],
            ns_dtype=self.ns_dtype,
        )

    def _step_sharded(self, group: dict[str, Any], p: Tensor) -> None:
        """One step of an FSDP2 matrix (a DTensor of rows sharded over a 1-D
        mesh: ``Shard(0)``), every rank at once, in the order of the groups.
        The momentum rule is elementwise, so each rank updates its rows of the
        buffer and of the momentum update, B <- B + (1-mu)(g - B), U = g +
        mu (B - g) with Nesterov (else B); then the ranks gather U and the
        matrix whole (two all-gathers), each runs the Muon kernel on the whole
        (U as its gradient, momentum 0: Newton–Schulz of U and the update of
        the whole matrix) and keeps its own rows. Every rank computes the same
        matrix; a rank's transient memory is two whole matrices."""
        local, grad = _local(p), _local(p.grad)
        if p.dtype != torch.float32:
            raise ValueError(f"an FSDP2 parameter of {p.dtype}: Muon steps fp32 shards (keep the sharded "
                             "parameters fp32, with MixedPrecisionPolicy for the compute)")
        mesh, placements = p.device_mesh, tuple(p.placements)
        if mesh.ndim != 1 or len(placements) != 1 or type(placements[0]).__name__ != "Shard" or placements[0].dim != 0:
            raise ValueError(f"an FSDP2 parameter placed {placements} on a {mesh.ndim}-D mesh: Muon gathers "
                             "rows sharded over one mesh dimension (fully_shard's Shard(0))")
        if p.ndim != 2:
            raise ValueError("Param gradient must be a 2D matrix")
        state = self.state[p]
        if self._nvme is not None:
            buf = self._read_state(p, group).get(_MOMENTUM_KEY)
            buf = torch.zeros(local.shape, dtype=torch.float32) if buf is None else buf
        else:
            buf = state.get(_MOMENTUM_KEY)
            if buf is None or buf.dtype != torch.float32:
                buf = state[_MOMENTUM_KEY] = (torch.zeros(local.shape, dtype=torch.float32) if buf is None
                                              else buf.to(torch.float32, memory_format=torch.contiguous_format))
        g = grad.to(torch.float32)
        # The kernel's momentum rule in its own fp32 arithmetic (mu and 1 - mu rounded to fp32).
        mu = torch.tensor(_scalar(group["momentum"]), dtype=torch.float32)
        buf.add_((1 - mu) * (g - buf))
        update = g + mu * (buf - g) if group["nesterov"] else buf

        def whole(t: Tensor) -> Tensor:
            return _DTensor.from_local(t.contiguous(), mesh, placements, run_check=False, shape=p.shape,
                                       stride=p.stride()).full_tensor().contiguous()

        full_update, full = whole(update), whole(local)
        muon([full], [full_update], [torch.zeros_like(full_update)], [None],
             executor=self._executor, workspace=self._workspace, lr=group["lr"],
             weight_decay=group["weight_decay"], momentum=0.0, nesterov=False,
             ns_coefficients=group["ns_coefficients"], eps=group["eps"], ns_steps=group["ns_steps"],
             adjust_lr_fn=group["adjust_lr_fn"], ns_dtype=self.ns_dtype)
        pieces = torch.chunk(full, mesh.size(), dim=0)  # DTensor's Shard(0) split
        rank = mesh.get_local_rank()
        mine = pieces[rank] if rank < len(pieces) else full[:0]
        local.copy_(mine[: local.shape[0]])
        if self._nvme is not None:  # (self.state[p], made above, marks it stepped)
            self._write_state(p, {_MOMENTUM_KEY: buf})

    @torch.no_grad()
    def step_parameters(self, params: list[Tensor]) -> set[Tensor]:
        """Steps only ``params`` (host matrices, each with its ``.grad``),
        each with its own param group's hyper-parameters, as
        :meth:`Adam.step_parameters <tierflow.torch.optim.Adam.step_parameters>`:
        for an engine that steps parameters as their gradients become final.
        Each matrix's step is its own (Newton–Schulz of its whole momentum
        update), so the result is :meth:`step`'s whatever the order or the
        batching. Runs no step hooks. Returns the parameters skipped for a
        non-finite gradient: none (Muon steps every gradient it is given)."""
        chosen: dict[int, list[Tensor]] = {}
        index_of = {id(q): i for i, g in enumerate(self.param_groups) for q in g["params"]}
        for p in params:
            if p.grad is None:
                raise ValueError("step_parameters: a parameter without a gradient")
            index = index_of.get(id(p))
            if index is None:
                raise ValueError("step_parameters: a parameter this optimizer does not hold")
            chosen.setdefault(index, []).append(p)
        for index in sorted(chosen):
            self._step_group(self.param_groups[index], chosen[index])
        return set()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One step over every parameter that has a gradient; returns the
        closure's loss when a closure is given (evaluated with grad enabled)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss


class MuonParamGroups(NamedTuple):
    """A model's parameters split for training with Muon: ``muon`` for
    :class:`Muon`, ``adamw`` for AdamW. Unpacks as two lists."""

    muon: list[Tensor]
    adamw: list[Tensor]


def muon_param_groups(
    model_or_named_params: torch.nn.Module | Iterable[tuple[str, Tensor]],
) -> MuonParamGroups:
    """Splits parameters between Muon and AdamW by the rule tierflow's C++
    engine applies (optim/grouping.hpp, called through the extension): Muon
    takes a parameter of two dimensions, both > 1, whose dotted name has no
    part marking an embedding or an output head (``embed``, ``embeddings``,
    ``embed_tokens``, ``tok_embeddings``, ``wte``, ``wpe``, ``lm_head``,
    ``head``, ``output``, ``classifier``, in any case); AdamW takes everything
    else: embeddings, the head, norms, biases, convolutions.

    Takes a module (every parameter, frozen ones too) or ``(name, parameter)``
    pairs such as ``model.named_parameters()``. A tensor reached under several
    names (an LM head tied to the embedding) appears once, in the order first
    met, and goes to AdamW if any of its names says so: a module's parameters
    are read with ``remove_duplicate=False`` so a tied head's name is seen even
    where the embedding's name alone would not mark it.

    Example::

        hidden, rest = muon_param_groups(model)
        opt_muon = Muon(hidden, lr=0.02)
        opt_adamw = AdamW(rest, lr=3e-4)
    """
    if isinstance(model_or_named_params, torch.nn.Module):
        named = list(model_or_named_params.named_parameters(remove_duplicate=False))
    else:
        named = list(model_or_named_params)
        for item in named:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                    and isinstance(item[1], Tensor)):
                raise ValueError(
                    f"muon_param_groups takes a module or (name, parameter) pairs, got {type(item).__name__}"
                )
    _, adamw_indices = _core.group_parameters([(name, tuple(p.shape)) for name, p in named])
    to_adamw = {id(named[i][1]) for i in adamw_indices}
    seen: set[int] = set()
    groups = MuonParamGroups([], [])
    for _, p in named:
        if id(p) in seen:
            continue
        seen.add(id(p))
        (groups.adamw if id(p) in to_adamw else groups.muon).append(p)
    return groups
