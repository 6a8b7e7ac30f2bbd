"""When a ZeRO-3 parameter is fetched and released: torch's hooks.

* A module's forward pre-hook fetches the parameters it holds directly; its
  forward hook releases them (persistent ones stay until the step). Inside a
  backward (the re-forward of activation checkpointing) they are kept: what
  the re-forward saved views them, and the gradient hook releases them.
* Autograd saves tensors for the backward; one that views a parameter's
  memory is saved as the parameter and the view's geometry instead
  (:class:`saved_tensors_hooks`), and the backward fetches the parameter again
  when it unpacks it — prefetched, during a training iteration, by the
  scheduler from the recorded order.
* A parameter's post-accumulate-grad hook moves its gradient into the store
  (fp32, accumulated across micro-batches) and releases the parameter.
* :class:`ParameterAccess`, a torch function mode active during the forward,
  zero.Init and GatheredParameters, catches any use of a parameter that is not
  resident — a parameter used outside its own module, a tied weight, an
  initialisation after the module was built — and fetches it for that use.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

from tierflow.zero.partition import ParamStore, Partition, _Saved

__all__ = ["ModuleHooks", "ParameterAccess", "saved_tensor_hooks", "in_backward"]


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread right now."""
    return torch._C._current_graph_task_id() != -1


def saved_tensor_hooks(params: ParamStore) -> torch.autograd.graph.saved_tensors_hooks:
    """Pack/unpack hooks that save a view of a resident parameter as the
    parameter itself (so its memory can go back to the tier) and fetch it
    again in the backward."""

    def pack(t: torch.Tensor) -> Any:
        part = params.resident_part(t)
        if part is None:
            return t
        return _Saved(part, t.storage_offset(), t.size(), t.stride(), t.dtype)

    def unpack(saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Saved):
            return saved
        part = saved.part
        params.fetch(part)
        data = part.param.data
        if saved.dtype != data.dtype:
            data = data.view(saved.dtype)
        return data.as_strided(saved.size, saved.stride, saved.offset)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _parameters_in(args: tuple, kwargs: dict | None, params: ParamStore) -> list[Partition]:
    found = []
    for group in (args, (kwargs or {}).values()):
        for a in group:
            if isinstance(a, torch.nn.Parameter):
                part = params.part_of(a)
                if part is not None and not part.resident:
                    found.append(part)
            elif isinstance(a, (list, tuple)):
                for b in a:
                    if isinstance(b, torch.nn.Parameter):
                        part = params.part_of(b)
                        if part is not None and not part.resident:
                            found.append(part)
    return found


def _mutates(func: Callable, kwargs: dict | None) -> bool:
    """Whether a torch function writes its first argument or ``out``: torch's
    naming rule for in-place methods (``add_``, ``copy_``, ``normal_``...)."""
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or bool(kwargs and "out" in kwargs)


class ParameterAccess(TorchFunctionMode):
    """Fetches a parameter that is not resident when a torch function uses it.

    In a forward (``keep=True``) the parameter stays resident until the
    forward's end, as its own module's would. Elsewhere it is resident for the
    one call: a write (an in-place method, ``out=``) goes to its host copy and
    is kept; a result that views the parameter is returned as a copy, since
    the memory it would view goes back to the tier.
    """

    def __init__(self, params: ParamStore, keep: bool) -> None:
        super().__init__()
        self.params = params
        self.keep = keep
        self.kept: list[Partition] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        parts = _parameters_in(args, kwargs, self.params)
        if not parts:
            return func(*args, **(kwargs or {}))
        if self.keep and not _mutates(func, kwargs):
            for part in parts:
                self.params.fetch(part)
                self.kept.append(part)
            return func(*args, **(kwargs or {}))
        write = _mutates(func, kwargs)
        leases = []
        try:
            for part in parts:
                lease, view = self.params.host_view(part, "write" if write else "read")
                leases.append((part, lease))
                part.param.data = view
            result = func(*args, **(kwargs or {}))
            if isinstance(result, torch.Tensor) and not isinstance(result, torch.nn.Parameter):
                if any(result.untyped_storage().data_ptr() == p.param.data.untyped_storage().data_ptr()
                       for p in parts):
                    result = result.clone()
            return result
        finally:
            for part, lease in leases:
                part.param.data = part.placeholder
                self.params.end_host(lease, dirty=write)

    def release_kept(self) -> None:
        for part in self.kept:
            if not part.persistent:
                self.params.release(part)
        self.kept.clear()


class ModuleHooks:
    """The forward hooks of every module that holds parameters in the store,
    and the gradient hook of every parameter; :meth:`remove` takes them off."""

    def __init__(self, model: torch.nn.Module, params: ParamStore,
                 on_grad: Callable[[Partition, torch.Tensor], None]) -> None:
        self.params = params
        self.handles: list[Any] = []
        self._restore: list[Partition] = []  # loaded by load_state_dict, holding a scratch tensor
        for module in model.modules():
            own = [params.part_of(p) for p in module.parameters(recurse=False)]
            own = [p for p in own if p is not None]
            if not own:
                continue
            self.handles.append(module.register_forward_pre_hook(self._pre(own)))
            self.handles.append(module.register_forward_hook(self._post(own)))
            self.handles.append(module._register_state_dict_hook(self._state_dict_hook(module)))
            self.handles.append(module._register_load_state_dict_pre_hook(self._load_pre_hook(module), with_module=False))
            self.handles.append(module.register_load_state_dict_post_hook(
                lambda module, incompatible: self.restore_placeholders()))
        for part in params.parts:
            if part.requires_grad:
                self.handles.append(part.param.register_post_accumulate_grad_hook(self._grad_hook(part, on_grad)))

    def _pre(self, own: list[Partition]) -> Callable:
        def hook(module: torch.nn.Module, args: Any) -> None:
            for part in own:
                self.params.fetch(part)
        return hook

    def _post(self, own: list[Partition]) -> Callable:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if in_backward():  # a re-forward: what it saved views the parameters; the gradient hook releases them
                return
            for part in own:
                if not part.persistent:
                    self.params.release(part)
        return hook

    def _grad_hook(self, part: Partition, on_grad: Callable) -> Callable:
        def hook(param: torch.nn.Parameter) -> None:
            grad = param.grad
            param.grad = None
            if grad is not None:
                on_grad(part, grad)
            if not part.persistent:
                self.params.release(part)
        return hook

    def _state_dict_hook(self, module: torch.nn.Module) -> Callable:
        """Gives ``state_dict()`` the parameters' values (CPU copies read from
        the store) in place of their placeholders."""
        def hook(mod: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
            for local, p in mod.named_parameters(recurse=False):
                part = self.params.part_of(p)
                key = prefix + local
                if part is not None and key in state_dict:
                    state_dict[key] = self.params.read(part) if not part.resident else p.detach().cpu().clone()
        return hook

    def _load_pre_hook(self, module: torch.nn.Module) -> Callable:
        """``load_state_dict()``: each value is written into the store, and
        torch's own copy then lands in a fresh placeholder."""
        def hook(state_dict: dict, prefix: str, local_metadata: Any, strict: bool, missing: list,
                 unexpected: list, errors: list) -> None:
            for local, p in module.named_parameters(recurse=False):
                part = self.params.part_of(p)
                key = prefix + local
                if part is None or key not in state_dict:
                    continue
                value = state_dict[key]
                if tuple(value.shape) != part.shape:
                    continue  # torch's own check reports the mismatch
                self.params.write(part, value)
                # torch copies the value into the parameter next: give it a
                # scratch tensor of the shape so the copy is legal and harmless.
                p.data = torch.empty(part.shape, dtype=part.dtype)
                self._restore.append(part)
        return hook

    def restore_placeholders(self) -> None:
        """After ``load_state_dict``: the scratch tensors become placeholders again."""
        for part in self._restore:
            if not part.resident:
                part.param.data = part.placeholder
        self._restore.clear()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
