"""FSDP2's internals that :func:`tierflow.torch.fsdp.offload` relies on, and
nothing else of tierflow touches.

FSDP2 has no public seam for a third party to own where a sharded parameter's
local shard lives: the shard is ``FSDPParam._sharded_param_data`` (the flat,
padded tensor its all-gather reads) and ``FSDPParam.sharded_param._local_tensor``
(a view of it, the parameter the optimizer steps), and FSDP2 reads the first
in ``FSDPParamGroup.unshard`` (and, on one rank, in ``wait_for_unshard``).
This module finds those, points both views at memory tierflow owns (or at a
hollow storage, as FSDP2 leaves its own unsharded parameters outside their
use) and wraps each group's ``unshard``/``wait_for_unshard`` with callbacks.
Every name it uses is checked once, by :func:`check`, against the torch
installed: a torch whose FSDP2 lacks one is refused with a message naming it,
never half-used.

Checked against torch 2.15 (the version the project's CI installs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn

__all__ = ["Shard", "check", "shards", "wrap_unshard", "wrap_post_backward", "hollow", "point_at", "gathers_now",
           "reads_shard", "in_backward", "device_of", "grad_offload_event", "set_local", "wrap_reset"]


def _internals() -> tuple[Any, Any, Any]:
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group  # noqa: PLC0415
    return _fsdp_param.FSDPParam, _fsdp_param_group.FSDPParamGroup, _fsdp_param_group.TrainingState


_checked = False


def check() -> None:
    """Raises RuntimeError, naming the torch version and what is missing,
    unless FSDP2's internals are as this module uses them."""
    global _checked
    if _checked:
        return
    where = f"tierflow.torch.fsdp.offload: torch {torch.__version__}'s FSDP2"
    try:
        fsdp_param, group, training_state = _internals()
        from torch.distributed.fsdp import FSDPModule  # noqa: F401, PLC0415
    except ImportError as e:
        raise RuntimeError(f"{where} lacks {e.name or e} (checked against torch 2.15)") from None
    missing = [f"{owner.__name__}.{name}" for owner, names in (
        (group, ("unshard", "wait_for_unshard", "post_backward", "lazy_init", "is_unsharded")),
        (fsdp_param, ("all_gather_inputs", "reset_sharded_param", "_sharded_local_tensor")),
        (training_state, ("PRE_BACKWARD", "FORWARD"))) for name in names if not hasattr(owner, name)]
    if missing:
        raise RuntimeError(f"{where} lacks {', '.join(missing)}, which placing shards needs "
                           "(checked against torch 2.15)")
    _checked = True


@dataclass(eq=False)
class Shard:
    """One parameter's local shard as FSDP2 holds it."""

    name: str  # the parameter's name from the root module
    param: Any  # the FSDPParam
    group: Any  # its FSDPParamGroup
    module: nn.Module  # the module the parameter is registered on
    real: Tensor  # the local tensor FSDP2 made: a view of ``data``, wherever that points

    @property
    def data(self) -> Tensor:
        """The flat, padded shard the all-gather reads."""
        return self.param._sharded_param_data

    @property
    def local(self) -> Tensor:
        """The sharded parameter's local tensor now: ``real``, or what
        :func:`hollow` left in its place."""
        return self.param.sharded_param._local_tensor

    @property
    def parameter(self) -> nn.Parameter:
        return self.param.sharded_param

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @property
    def room(self) -> int:
        """The bytes of storage the views need: their offset in it and the shard's own."""
        return self.data.storage_offset() * self.data.element_size() + self.nbytes

    @property
    def offloaded_to_cpu(self) -> bool:
        return bool(self.param.offload_to_cpu)


_GROUP_FIELDS = ("fsdp_params", "device", "_all_gather_result", "_training_state", "unshard_in_backward")
_PARAM_FIELDS = ("_sharded_param_data", "sharded_param", "sharded_state", "offload_to_cpu", "_module_info", "_param_fqn",
                 "grad_offload_event")


def _check_instance(obj: Any, fields: tuple[str, ...]) -> None:
    missing = [name for name in fields if not hasattr(obj, name)]
    if missing:
        raise RuntimeError(f"tierflow.torch.fsdp.offload: torch {torch.__version__}'s {type(obj).__name__} lacks "
                           f"{', '.join(missing)}, which placing shards needs (checked against torch 2.15)")


def shards(model: nn.Module) -> list[Shard]:
    """Every shard of the ``fully_shard`` model ``model`` (its root), in the
    order of ``model.named_modules()``, after FSDP2's lazy initialization
    (which the first forward would run: it re-pads the shards, so it must come
    before they move). Raises ValueError when ``model`` is not the root."""
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415

    if not isinstance(model, FSDPModule):
        raise ValueError(f"tierflow.torch.fsdp.offload: {type(model).__name__} is not a fully_shard module "
                         "(apply fully_shard to it and its blocks first)")
    state = model._get_fsdp_state()
    if state._is_root is False:
        raise ValueError("tierflow.torch.fsdp.offload: give the root fully_shard module, not one of its blocks")
    state._lazy_init()
    out, seen = [], set()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            if id(group) in seen:
                continue
            seen.add(id(group))
            _check_instance(group, _GROUP_FIELDS)
            for p in group.fsdp_params:
                _check_instance(p, _PARAM_FIELDS)
                out.append(Shard(p._param_fqn or p._module_info.param_name, p, group, p._module_info.module,
                                 p.sharded_param._local_tensor))
    return out


def set_local(dtensor: Tensor, local: Tensor) -> None:
    """Makes ``local`` the DTensor's local tensor (its shape and dtype)."""
    dtensor._local_tensor = local


def point_at(shard: Shard, storage: torch.UntypedStorage) -> None:
    """Makes the shard's two views (``data`` and ``real``) use ``storage``
    (at least ``room`` bytes), their shapes and offsets as they are, and
    ``real`` the parameter's local tensor again."""
    with torch.no_grad():
        for view in (shard.data, shard.real):
            view.set_(storage, view.storage_offset(), view.size(), view.stride())
    set_local(shard.parameter, shard.real)


def hollow(shard: Shard, stand_in: Tensor) -> None:
    """Leaves the shard's views their shapes over a storage of no bytes, as
    FSDP2 leaves an unsharded parameter between its uses (its old memory no
    longer referenced by FSDP2 or the parameter), and ``stand_in`` (of the
    local tensor's shape and dtype) as the parameter's local tensor in the
    meantime: what anything but an all-gather reads of it."""
    storage = torch.UntypedStorage(max(shard.room, 1))
    with torch.no_grad():
        for view in (shard.data, shard.real):
            view.set_(storage, view.storage_offset(), view.size(), view.stride())
    storage.resize_(0)
    set_local(shard.parameter, stand_in)


def gathers_now(group: Any) -> bool:
    """Whether ``group.unshard()`` would all-gather now (not return at once:
    already gathered, pending, or in a backward that does not gather)."""
    _, _, training_state = _internals()
    if group._all_gather_result is not None or group.is_unsharded:
        return False
    return group.unshard_in_backward or group._training_state != training_state.PRE_BACKWARD


def in_backward(group: Any) -> bool:
    """Whether ``group`` is gathering for backward."""
    _, _, training_state = _internals()
    return group._training_state == training_state.PRE_BACKWARD


def reads_shard(shard: Shard) -> bool:
    """Whether the shard's all-gather reads its sharded data (not the
    smaller post-forward copy ``reshard_after_forward=<int>`` keeps)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState  # noqa: PLC0415

    return shard.param.sharded_state == ShardedState.SHARDED


def grad_offload_event(shard: Shard) -> Any:
    """The event after which the gradient FSDP2 copies to the host for the
    shard (a non-blocking copy from the GPU) is there; None when it is now."""
    return shard.param.grad_offload_event


def device_of(group: Any) -> torch.device:
    """The device the group gathers on."""
    return group.device


def wrap_unshard(group: Any, before: Callable[[Any], None], after: Callable[[Any], None]) -> Callable[[], None]:
    """Wraps ``group``'s ``unshard`` and ``wait_for_unshard`` (on the
    instance; every FSDP2 caller — its hooks, its prefetches,
    ``FSDPModule.unshard`` — reaches them through it): ``before(group)``
    runs ahead of an ``unshard`` that will all-gather, ``after(group)`` once
    ``wait_for_unshard`` has read the shards (FSDP2 reads them in one or the
    other), even when it raises. Returns the function that undoes it."""
    unshard, wait = group.unshard, group.wait_for_unshard

    def wrapped_unshard(*args: Any, **kwargs: Any) -> Any:
        if gathers_now(group):
            before(group)
        return unshard(*args, **kwargs)

    def wrapped_wait(*args: Any, **kwargs: Any) -> Any:
        try:
            return wait(*args, **kwargs)
        finally:
            after(group)

    group.unshard, group.wait_for_unshard = wrapped_unshard, wrapped_wait

    def undo() -> None:
        group.__dict__.pop("unshard", None)
        group.__dict__.pop("wait_for_unshard", None)

    return undo


def wrap_post_backward(group: Any, after: Callable[[Any], None]) -> Callable[[], None]:
    """Wraps ``group``'s ``post_backward`` (where FSDP2 reduce-scatters the
    group's gradients and assigns or accumulates its shards' ``.grad``) on the
    instance: ``after(group)`` runs once it has returned. Returns the
    function that undoes it."""
    post_backward = group.post_backward

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        out = post_backward(*args, **kwargs)
        after(group)
        return out

    group.post_backward = wrapped

    def undo() -> None:
        group.__dict__.pop("post_backward", None)

    return undo


def wrap_reset(shard: Shard, before: Callable[[], None], after: Callable[[], None]) -> Callable[[], None]:
    """Wraps the shard's ``FSDPParam.reset_sharded_param`` (FSDP2 runs it
    after ``module.to(...)``/``_apply`` and ``load_state_dict(assign=True)``,
    re-padding the local tensor and re-saving both views): ``before()``
    ahead of it, ``after()`` once it has returned, with ``shard.real`` the
    local tensor it left. Returns the function that undoes it."""
    reset = shard.param.reset_sharded_param

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        before()
        out = reset(*args, **kwargs)
        shard.real = shard.param.sharded_param._local_tensor
        after()
        return out

    shard.param.reset_sharded_param = wrapped

    def undo() -> None:
        shard.param.__dict__.pop("reset_sharded_param", None)

    return undo
