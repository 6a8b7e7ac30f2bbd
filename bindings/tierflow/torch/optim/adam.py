"""Adam and AdamW for torch whose step runs in tierflow's fused CPU kernel.

The classes are ``torch.optim.Optimizer`` subclasses with torch.optim.Adam's
and AdamW's signatures, defaults, validation and state layout, so LR
schedulers, ``torch.amp.GradScaler`` and checkpoint tools treat them as
torch's own, and state_dicts load both ways between them and torch.optim.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor
from torch.optim.optimizer import Optimizer, ParamsT

from tierflow import _core

__all__ = ["Adam", "AdamW", "adam"]

_LOW_PRECISION = (torch.bfloat16, torch.float16)
# The state a bf16/fp16 parameter keeps in fp32 (MASTER_KEY is the fp32 copy
# the kernel updates; the parameter is written from it in the same pass).
MASTER_KEY = "master_param"
_FP32_STATE = (MASTER_KEY, "exp_avg", "exp_avg_sq", "max_exp_avg_sq")


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


def _check_group(group: dict[str, Any]) -> None:
    """Refuses what would change results and that tierflow does not do."""
    for flag in ("capturable", "differentiable"):
        if group.get(flag):
            raise ValueError(
                f"{flag}=True is not supported: tierflow's step runs on the CPU outside "
                "autograd and CUDA graphs"
            )
    if group.get("fused") and group.get("foreach"):
        raise ValueError("`fused` and `foreach` cannot be `True` together.")
    for i, p in enumerate(group["params"]):
        if p.device.type != "cpu":
            raise ValueError(
                f"params[{i}] is on {p.device}: this version steps parameters on the CPU only"
            )
        if p.dtype not in (torch.float32, *_LOW_PRECISION):
            raise ValueError(
                f"params[{i}] is {p.dtype}: float32, bfloat16 or float16 parameters expected"
            )


def _master_of(p: Tensor) -> Tensor:
    """The fp32 master of a low-precision parameter, contiguous for the kernel."""
    return p.detach().to(torch.float32, memory_format=torch.contiguous_format, copy=True)


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


class Adam(Optimizer):
    r"""torch.optim.Adam with its step in tierflow's fused CPU kernel.

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
    pass per parameter. ``capturable=True`` and ``differentiable=True`` are
    refused with ValueError. tierflow's own arguments:

    * ``offload``: where the optimizer state lives; ``"cpu"`` (this version
      keeps it in host memory beside the parameters).
    * ``threads``: the CPU threads of the step; default
      ``torch.get_num_threads()``. The step runs between torch's operations,
      while torch's intra-op threads wait, so the two pools take turns on the
      same cores rather than oversubscribing them.

    Parameters must be on the CPU, float32, bfloat16 or float16, and are
    updated in place. A bfloat16/float16 parameter gets an fp32 master copy in
    its state under ``"master_param"`` (and fp32 moments): the kernel updates
    the master and writes the parameter from it in the same pass. A torch
    state_dict without the master (torch keeps low-precision moments) loads:
    the master is made from the parameter and the moments widened to fp32.
    The state is torch's: ``step`` (a float32 scalar tensor), ``exp_avg``,
    ``exp_avg_sq`` and, with amsgrad, ``max_exp_avg_sq``.
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
        offload: str = "cpu",
        threads: int | None = None,
    ) -> None:
        _check_hyper_parameters(lr, betas, eps, weight_decay, foreach, capturable)
        if offload != "cpu":
            raise ValueError(f"Invalid offload: {offload!r} (this version keeps the state on 'cpu')")
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ValueError(f"Invalid threads: {threads!r} (a positive int, or None)")
        self.offload = offload
        self.threads = threads if threads is not None else torch.get_num_threads()
        self._executor = _core.Executor(self.threads)
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

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["tierflow"] = {"offload": self.offload, "threads": self.threads}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        own = state.pop("tierflow", None)
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("foreach", None)
            group.setdefault("capturable", False)
            group.setdefault("differentiable", False)
            group.setdefault("decoupled_weight_decay", False)
            group.setdefault("fused", None)
        if own is not None:  # unpickled: the executor is made again
            self.offload, self.threads = own["offload"], own["threads"]
            self._executor = _core.Executor(self.threads)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_hyper_parameters(group["lr"], group["betas"], group["eps"], group["weight_decay"],
                                group["foreach"], group["capturable"])
        _check_group(group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, except that the fp32 master and moments of a bf16/fp16
        parameter stay fp32 (torch's load casts every state tensor to its
        parameter's dtype). A master that does not round to the parameter was
        carried, untouched, through an optimizer that updated the parameter
        alone (torch.optim's): it is made again from the parameter."""
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        for saved_id, p in zip(saved_ids, params):
            saved = state_dict["state"].get(saved_id)
            if p.dtype not in _LOW_PRECISION or saved is None:
                continue
            state = self.state[p]
            for key in _FP32_STATE:
                if torch.is_tensor(saved.get(key)):
                    state[key] = saved[key].to(device="cpu", dtype=torch.float32, copy=True)
            master = state.get(MASTER_KEY)
            if master is not None and not torch.equal(master.to(p.dtype), p.detach()):
                state[MASTER_KEY] = _master_of(p)
        for group in self.param_groups:
            _check_group(group)

    def _init_group(self, group: dict[str, Any]):
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, masters = ([] for _ in range(7))
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(
                    "Adam does not support sparse gradients, please consider SparseAdam instead"
                )
            state = self.state[p]
            low_precision = p.dtype in _LOW_PRECISION
            if len(state) == 0:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                if low_precision:
                    state[MASTER_KEY] = _master_of(p)
            elif low_precision and MASTER_KEY not in state:  # a torch state_dict's state
                state[MASTER_KEY] = _master_of(p)
            moment_keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())
            for key in moment_keys:
                if key not in state:
                    state[key] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
                elif state[key].dtype != torch.float32 or not state[key].is_contiguous():
                    state[key] = state[key].to(torch.float32, memory_format=torch.contiguous_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            if group["amsgrad"]:
                max_exp_avg_sqs.append(state["max_exp_avg_sq"])
            steps.append(state["step"])
            masters.append(state.get(MASTER_KEY) if low_precision else None)
        return params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, masters

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One step over every parameter that has a gradient; returns the
        closure's loss when a closure is given (evaluated with grad enabled)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            _check_group(group)
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, masters = self._init_group(group)
            beta1, beta2 = group["betas"]
            adam(
                params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, masters,
                executor=self._executor,
                amsgrad=group["amsgrad"],
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=group["maximize"],
                decoupled_weight_decay=group["decoupled_weight_decay"],
            )
        return loss


class AdamW(Adam):
    """torch.optim.AdamW (decoupled weight decay, default 1e-2) with its step in
    tierflow's fused CPU kernel; everything else as :class:`Adam`."""

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
        offload: str = "cpu",
        threads: int | None = None,
    ) -> None:
        super().__init__(
            params, lr, betas, eps, weight_decay, amsgrad,
            foreach=foreach, maximize=maximize, capturable=capturable,
            differentiable=differentiable, fused=fused, decoupled_weight_decay=True,
            offload=offload, threads=threads,
        )

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group["decoupled_weight_decay"] = True
