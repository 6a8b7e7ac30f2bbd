"""tierflow beneath an unchanged DeepSpeed run.

``tierflow.deepspeed.install()``, called once before ``deepspeed.initialize``
(in every rank), makes DeepSpeed's ZeRO-Offload step its CPU optimizer with
tierflow's fused AdamW kernel where DeepSpeed would JIT-build and load its
``cpu_adam`` op, and its NVMe swappers move their files with tierflow's I/O
engine (below): :class:`CPUAdam` has ``DeepSpeedCPUAdam``'s constructor and
state (``step``, ``exp_avg``, ``exp_avg_sq``), and ``install()`` puts it in
``deepspeed.ops.adam.DeepSpeedCPUAdam``'s place, where DeepSpeed's engine
looks the class up when a config's ``optimizer`` section (Adam, AdamW) meets
``offload_optimizer`` "cpu" or "nvme", and among DeepSpeed's ZeRO-supported
optimizers. That is a replacement at run time of one name of DeepSpeed's
(version 0.19 read); :func:`uninstall` puts DeepSpeed's class back. The
script, its config and DeepSpeed's checkpoints stay as they are.

It also replaces DeepSpeed's ``async_io`` op, which its NVMe swappers take
from ``AsyncIOBuilder().load()`` (a JIT build against libaio): ``install()``
makes ``AsyncIOBuilder.load`` return a module whose ``aio_handle`` is
:class:`AioHandle`, tierflow's I/O engine behind the methods DeepSpeed's
``swap_tensor`` code calls — ``async_pread`` / ``async_pwrite`` (0 when
queued), ``wait()`` (how many ended), ``sync_pread`` / ``sync_pwrite``,
``new_cpu_locked_tensor`` / ``free_cpu_locked_tensor``, ``is_pinned`` (slices
of such tensors included) and the ``get_*`` settings. Every result is
checked: a read past the end of a swap file or a full disk raises
:class:`tierflow.TierflowError` naming the file, never short data (the libaio
op does not check ``io_event.res``). GPUDirect (``GDSBuilder``) is not
replaced.
"""

from __future__ import annotations

import ctypes
import functools
import types
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from tierflow import _core, _lifetime
from tierflow.torch.optim import Adam

__all__ = ["AioHandle", "CPUAdam", "install", "uninstall", "installed"]

_ALIGNMENT = 4096  # what O_DIRECT wants of a buffer's address

_SHIPPED: dict[str, Any] = {}


class CPUAdam(Adam):
    """``deepspeed.ops.adam.DeepSpeedCPUAdam``'s interface over tierflow's
    Adam/AdamW: ``adamw_mode`` True (DeepSpeed's default) is AdamW's
    decoupled decay, False Adam's L2; ``fp32_optimizer_states`` False keeps
    the moments in bf16 (DeepSpeed's ``bf16_optimizer_states``). DeepSpeed's
    ``amsgrad`` is refused as DeepSpeedCPUAdam refuses it, and
    ``bias_correction=False``, which tierflow's kernel does not compute, is
    refused by name. The parameters are DeepSpeed's fp32 partitions on the
    CPU, stepped in place."""

    def __init__(self, model_params: ParamsT, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> None:
        if amsgrad:
            raise RuntimeError("DeepSpeedCPUAdam does not support the AMSGrad variant.")  # DeepSpeed's words
        if not bias_correction:
            raise ValueError("bias_correction=False: tierflow's Adam always corrects the moments' bias "
                             "(DeepSpeed's default, bias_correction=True)")
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=adamw_mode,
                         state_dtype="fp32" if fp32_optimizer_states else "bf16")
        self.adamw_mode = adamw_mode
        self.fp32_optimizer_states = fp32_optimizer_states
        for group in self.param_groups:
            group.setdefault("bias_correction", True)  # (DeepSpeed's groups carry it)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if param_group.get("amsgrad", False):
            raise RuntimeError("DeepSpeedCPUAdam does not support the AMSGrad variant.")
        super().add_param_group(param_group)


class AioHandle:
    """DeepSpeed's ``aio_handle`` over tierflow's I/O engine (io_uring, or a
    thread pool where the kernel refuses a ring): its constructor's
    ``block_size``, ``queue_depth`` and ``intra_op_parallelism`` (the
    engine's threads) set the engine; ``single_submit`` and
    ``overlap_events`` are libaio's submission modes, recorded and given back
    by their getters (the engine batches its submissions itself). Buffers
    are C-contiguous CPU tensors, read or written whole."""

    def __init__(self, block_size: int = 1 << 20, queue_depth: int = 128, single_submit: bool = False,
                 overlap_events: bool = False, intra_op_parallelism: int = 1) -> None:
        self._io = _core.AioHandle(int(block_size), int(queue_depth), int(intra_op_parallelism))
        self._single_submit, self._overlap_events = bool(single_submit), bool(overlap_events)
        self._intra_op_parallelism = int(intra_op_parallelism)
        # address -> (bytes, the tensor that owns them, whether mlock locked its pages)
        self._locked: dict[int, tuple[int, Tensor, bool]] = {}
        _lifetime.track(self)  # DeepSpeed's swappers keep their handles to the end

    def _release_native(self) -> None:
        """At interpreter exit (tierflow._lifetime): waits for what is in
        flight and lets go of the engine."""
        if self._io is not None:
            try:
                self._io.wait()
            finally:
                self._io = None

    # ---- settings ------------------------------------------------------------------------------------

    def get_block_size(self) -> int:
        return self._io.block_size

    def get_queue_depth(self) -> int:
        return self._io.queue_depth

    def get_single_submit(self) -> bool:
        return self._single_submit

    def get_overlap_events(self) -> bool:
        return self._overlap_events

    def get_intra_op_parallelism(self) -> int:
        return self._intra_op_parallelism

    # ---- I/O -----------------------------------------------------------------------------------------

    @staticmethod
    def _buffer(buffer: Tensor, what: str) -> Tensor:
        if buffer.device.type != "cpu":
            raise ValueError(f"{what}: the buffer is on {buffer.device}; tierflow's aio_handle moves CPU tensors "
                             "(DeepSpeed's GPUDirect path is its GDSBuilder's)")
        if not buffer.is_contiguous():
            raise ValueError(f"{what}: the buffer is not contiguous")
        return buffer.detach()

    def async_pread(self, buffer: Tensor, filename: str, file_offset: int = 0) -> int:
        """Queues a read of the whole ``buffer`` from ``filename`` at
        ``file_offset``; 0 (DeepSpeed's "queued")."""
        self._io.read(self._buffer(buffer, "async_pread"), str(filename), int(file_offset))
        return 0

    def async_pwrite(self, buffer: Tensor, filename: str, file_offset: int = 0) -> int:
        """Queues a write of the whole ``buffer`` to ``filename`` at
        ``file_offset`` (the file made 0600 when missing); 0."""
        self._io.write(self._buffer(buffer, "async_pwrite"), str(filename), int(file_offset))
        return 0

    def sync_pread(self, buffer: Tensor, filename: str, file_offset: int = 0) -> int:
        """A read as :meth:`async_pread`, waited for with whatever else is in flight; how many ended."""
        self.async_pread(buffer, filename, file_offset)
        return self.wait()

    def sync_pwrite(self, buffer: Tensor, filename: str, file_offset: int = 0) -> int:
        """A write as :meth:`async_pwrite`, waited for with whatever else is in flight; how many ended."""
        self.async_pwrite(buffer, filename, file_offset)
        return self.wait()

    def wait(self) -> int:
        """Waits for every request in flight and returns how many there were;
        the first failure is raised (TierflowError naming its file) once all
        have ended."""
        return self._io.wait()

    # ---- buffers -------------------------------------------------------------------------------------

    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: Tensor) -> Tensor:
        """A CPU tensor of ``num_elem`` elements of ``example_tensor``'s dtype,
        its address aligned for O_DIRECT, its values unspecified (as
        DeepSpeed's), its pages resident: page-locked where torch can pin
        memory (a CUDA build with a driver), else locked with ``mlock`` as
        DeepSpeed's op locks them, else written once (where the locked-memory
        limit refuses more), so that no read into it waits on page faults."""
        dtype = example_tensor.dtype
        nbytes = int(num_elem) * torch.empty((), dtype=dtype).element_size()
        raw = torch.empty(nbytes + _ALIGNMENT, dtype=torch.uint8)
        locked = False
        if torch.cuda.is_available():
            raw = raw.pin_memory()
        elif nbytes:
            locked = _libc().mlock(ctypes.c_void_p(raw.data_ptr()), ctypes.c_size_t(raw.numel())) == 0
            if not locked:
                raw.zero_()  # resident, if not locked
        skip = -raw.data_ptr() % _ALIGNMENT
        tensor = raw[skip:skip + nbytes].view(dtype)
        self._locked[tensor.data_ptr()] = (nbytes, raw, locked)
        return tensor

    def free_cpu_locked_tensor(self, tensor: Tensor) -> None:
        """Forgets a tensor of :meth:`new_cpu_locked_tensor`, unlocking its
        pages (its memory goes with the last reference). Raises ValueError
        for any other tensor."""
        entry = self._locked.pop(tensor.data_ptr(), None)
        if entry is None:
            raise ValueError("free_cpu_locked_tensor: the tensor was not made by this handle's new_cpu_locked_tensor")
        _, raw, locked = entry
        if locked:
            _libc().munlock(ctypes.c_void_p(raw.data_ptr()), ctypes.c_size_t(raw.numel()))

    def is_pinned(self, tensor: Tensor) -> bool:
        """Whether ``tensor`` (or the tensor it is a slice of) was made by
        :meth:`new_cpu_locked_tensor`, or is page-locked memory of torch's."""
        if tensor.device.type != "cpu":
            return False
        address, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        for start, (size, _, _) in self._locked.items():
            if start <= address and address + nbytes <= start + size:
                return True
        return bool(torch.cuda.is_available() and tensor.is_pinned())


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _aio_module() -> types.ModuleType:
    module = types.ModuleType("tierflow.deepspeed.async_io",
                              "DeepSpeed's async_io op as AsyncIOBuilder().load() gives it, over tierflow's I/O engine")
    module.aio_handle = AioHandle
    return module


def install() -> None:
    """Puts :class:`CPUAdam` where DeepSpeed looks for DeepSpeedCPUAdam and
    :class:`AioHandle` where its swappers get their aio_handle (see the
    module's docstring). Idempotent; raises ImportError when DeepSpeed cannot
    be imported."""
    import deepspeed.ops.adam as ops_adam
    from deepspeed.ops.op_builder import AsyncIOBuilder
    from deepspeed.runtime.zero import utils as zero_utils

    if not _SHIPPED:
        _SHIPPED["DeepSpeedCPUAdam"] = ops_adam.DeepSpeedCPUAdam
        _SHIPPED["AsyncIOBuilder.load"] = AsyncIOBuilder.load
    ops_adam.DeepSpeedCPUAdam = CPUAdam
    aio = _aio_module()
    AsyncIOBuilder.load = lambda self, verbose=True: aio  # (the swappers bound the class at import)
    if CPUAdam not in zero_utils.ZERO_SUPPORTED_OPTIMIZERS:
        zero_utils.ZERO_SUPPORTED_OPTIMIZERS.append(CPUAdam)


def uninstall() -> None:
    """Puts DeepSpeed's DeepSpeedCPUAdam and AsyncIOBuilder.load back (a no-op when not installed)."""
    if not _SHIPPED:
        return
    import deepspeed.ops.adam as ops_adam
    from deepspeed.ops.op_builder import AsyncIOBuilder
    from deepspeed.runtime.zero import utils as zero_utils

    ops_adam.DeepSpeedCPUAdam = _SHIPPED.pop("DeepSpeedCPUAdam")
    AsyncIOBuilder.load = _SHIPPED.pop("AsyncIOBuilder.load")
    if CPUAdam in zero_utils.ZERO_SUPPORTED_OPTIMIZERS:
        zero_utils.ZERO_SUPPORTED_OPTIMIZERS.remove(CPUAdam)


def installed() -> bool:
    """Whether :func:`install` is in effect."""
    return bool(_SHIPPED)
