"""tierflow beneath an unchanged DeepSpeed run.

``tierflow.deepspeed.install()``, called once before ``deepspeed.initialize``
(in every rank), makes DeepSpeed's ZeRO-Offload step its CPU optimizer with
tierflow's fused AdamW kernel where DeepSpeed would JIT-build and load its
``cpu_adam`` op: :class:`CPUAdam` has ``DeepSpeedCPUAdam``'s constructor and
state (``step``, ``exp_avg``, ``exp_avg_sq``), and ``install()`` puts it in
``deepspeed.ops.adam.DeepSpeedCPUAdam``'s place, where DeepSpeed's engine
looks the class up when a config's ``optimizer`` section (Adam, AdamW) meets
``offload_optimizer`` "cpu" or "nvme", and among DeepSpeed's ZeRO-supported
optimizers. That is a replacement at run time of one name of DeepSpeed's
(version 0.19 read); :func:`uninstall` puts DeepSpeed's class back. The
script, its config and DeepSpeed's checkpoints stay as they are.

DeepSpeed's NVMe swappers (its ``async_io`` op) are not replaced yet.
"""

from __future__ import annotations

from typing import Any

from torch.optim.optimizer import ParamsT

from tierflow.torch.optim import Adam

__all__ = ["CPUAdam", "install", "uninstall", "installed"]

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


def install() -> None:
    """Puts :class:`CPUAdam` where DeepSpeed looks for DeepSpeedCPUAdam (see
    the module's docstring). Idempotent; raises ImportError when DeepSpeed
    cannot be imported."""
    import deepspeed.ops.adam as ops_adam
    from deepspeed.runtime.zero import utils as zero_utils

    if not _SHIPPED:
        _SHIPPED["DeepSpeedCPUAdam"] = ops_adam.DeepSpeedCPUAdam
    ops_adam.DeepSpeedCPUAdam = CPUAdam
    if CPUAdam not in zero_utils.ZERO_SUPPORTED_OPTIMIZERS:
        zero_utils.ZERO_SUPPORTED_OPTIMIZERS.append(CPUAdam)


def uninstall() -> None:
    """Puts DeepSpeed's DeepSpeedCPUAdam back (a no-op when not installed)."""
    if not _SHIPPED:
        return
    import deepspeed.ops.adam as ops_adam
    from deepspeed.runtime.zero import utils as zero_utils

    ops_adam.DeepSpeedCPUAdam = _SHIPPED.pop("DeepSpeedCPUAdam")
    if CPUAdam in zero_utils.ZERO_SUPPORTED_OPTIMIZERS:
        zero_utils.ZERO_SUPPORTED_OPTIMIZERS.remove(CPUAdam)


def installed() -> bool:
    """Whether :func:`install` is in effect."""
    return bool(_SHIPPED)
