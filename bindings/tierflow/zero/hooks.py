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
  (fp32, accumulated across micro-batches) and releases the parameter. A
  frozen parameter has no gradient: the backward releases it as soon as the
  autograd nodes that unpacked it have run.
* Every forward of the whole model — through the engine, or the model called
  directly (``engine.module(x)``, ``generate()``) — runs under
  :class:`~tierflow.zero.access.ParameterAccess`, which fetches any parameter a
  module uses without owning it (a tied weight, a parent's
  ``x @ self.child.weight``) and registers it with that module, whose hooks
  fetch it from then on (as :func:`register_external_parameter` does).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from tierflow.zero.access import ParameterAccess
from tierflow.zero.partition import ParamStore, Partition, _Saved, data_of, in_backward, set_data

__all__ = ["ModuleHooks", "saved_tensor_hooks", "in_backward", "register_external_parameter",
           "unregister_external_parameter"]

# A module's list of the parameters its forward uses without owning them.
_EXTERNAL = "_tierflow_external_params"


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Tells tierflow that ``module``'s forward uses ``parameter``, which
    another module owns (DeepSpeed's function of the same name): the
    module's forward hooks then fetch it with the module's own. tierflow also
    finds such uses by itself on the first forward; registering them only
    saves that first pass its on-demand fetch."""
    if not isinstance(parameter, torch.nn.Parameter):
        raise TypeError(f"parameter: a torch.nn.Parameter, not {type(parameter).__name__}")
    found = module.__dict__.setdefault(_EXTERNAL, [])
    if not any(p is parameter for p in found):
        found.append(parameter)


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Undoes :func:`register_external_parameter` (a parameter found on the
    first forward is found again if the forward still uses it)."""
    found = module.__dict__.get(_EXTERNAL, [])
    module.__dict__[_EXTERNAL] = [p for p in found if p is not parameter]


def saved_tensor_hooks(params: ParamStore) -> torch.autograd.graph.saved_tensors_hooks:
    """Pack/unpack hooks that save a view of a resident parameter as the
    parameter itself (so its memory can go back to the tier) and fetch it
    again in the backward."""

    def pack(t: torch.Tensor) -> Any:
        part = params.resident_part(t)
        if part is None:
            return t
        return _Saved(part, t.storage_offset(), t.size(), t.stride(), t.dtype)

    uses: dict[int, int] = {}  # frozen parameter -> autograd nodes that unpacked it and have not run

    def done(part: Partition) -> None:
        left = uses.get(part.index, 0) - 1
        if left > 0:
            uses[part.index] = left
            return
        uses.pop(part.index, None)
        if left == 0 and not part.persistent and in_backward():
            params.release(part)

    def unpack(saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Saved):
            return saved
        part = saved.part
        params.fetch(part)
        if not part.requires_grad and not part.persistent:
            # No gradient hook will release a frozen parameter: the node that
            # unpacks it does, once it has run (its post hook).
            node = torch._C._current_autograd_node()
            if node is not None:
                uses[part.index] = uses.get(part.index, 0) + 1
                node.register_hook(lambda grad_inputs, grad_outputs: done(part))
        data = data_of(part.param)
        if saved.dtype != data.dtype:
            data = data.view(saved.dtype)
        return data.as_strided(saved.size, saved.stride, saved.offset)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


class ModuleHooks:
    """The forward hooks of every module of ``model``, the gradient hook of
    every parameter in the store, and the model's own pair that runs each
    forward of the whole model under :class:`ParameterAccess`;
    :meth:`remove` takes them off.

    ``on_grad(part, grad)`` takes each gradient; ``on_forward(starting)`` is
    called as a forward of the whole model starts (True) and ends (False),
    whoever called it."""

    def __init__(self, model: torch.nn.Module, params: ParamStore,
                 on_grad: Callable[[Partition, torch.Tensor], None],
                 on_forward: Callable[[bool], None] | None = None) -> None:
        self.params = params
        self.on_forward = on_forward
        self.handles: list[Any] = []
        self._restore: list[Partition] = []  # loaded by load_state_dict, holding a scratch tensor
        self._running: list[torch.nn.Module] = []  # the modules whose forward is running, outermost first
        self._forward: list[tuple[ParameterAccess, Any]] = []  # the whole model's forward in progress
        self.handles.append(model.register_forward_pre_hook(self._model_pre, prepend=True))
        self.handles.append(model.register_forward_hook(self._model_post, always_call=True))
        self._owner: dict[int, torch.nn.Module] = {}  # partition -> the module that holds it
        for module in model.modules():
            own = [params.part_of(p) for p in module.parameters(recurse=False)]
            own = [p for p in own if p is not None]
            for part in own:
                self._owner.setdefault(part.index, module)
            self.handles.append(module.register_forward_pre_hook(self._pre(own)))
            self.handles.append(module.register_forward_hook(self._post(own), always_call=True))
            if not own:
                continue
            self.handles.append(module._register_state_dict_hook(self._state_dict_hook(module)))
            self.handles.append(module._register_load_state_dict_pre_hook(self._load_pre_hook(module), with_module=False))
            self.handles.append(module.register_load_state_dict_post_hook(
                lambda module, incompatible: self.restore_placeholders()))
        for part in params.parts:
            if part.requires_grad:
                self.handles.append(part.param.register_post_accumulate_grad_hook(self._grad_hook(part, on_grad)))

    # ---- the whole model's forward ------------------------------------------------------------

    def _model_pre(self, model: torch.nn.Module, args: Any) -> None:
        if self._forward or in_backward():  # a forward inside one, or a re-forward: already covered
            self._forward.append((None, None))
            return
        if self.on_forward is not None:
            self.on_forward(True)
        access = ParameterAccess(self.params, keep=True, on_external=self._found_external)
        saved = saved_tensor_hooks(self.params)
        access.__enter__()
        try:
            saved.__enter__()
        except BaseException:
            access.__exit__(None, None, None)
            raise
        self._forward.append((access, saved))

    def _model_post(self, model: torch.nn.Module, args: Any, output: Any) -> None:
        if not self._forward:
            return
        access, saved = self._forward.pop()
        if access is None:
            return
        saved.__exit__(None, None, None)
        access.__exit__(None, None, None)
        access.release_kept()
        self._running.clear()
        if self.on_forward is not None:
            self.on_forward(False)

    def _found_external(self, part: Partition) -> None:
        """A forward used ``part`` without its hooks having fetched it: the
        module running registers it, so that its hooks fetch it next time."""
        if self._running:
            register_external_parameter(self._running[-1], part.param)

    # ---- each module --------------------------------------------------------------------------

    def _parts(self, module: torch.nn.Module, own: list[Partition]) -> list[Partition]:
        external = module.__dict__.get(_EXTERNAL)
        if not external:
            return own
        parts = list(own)
        for p in external:
            part = self.params.part_of(p)
            if part is not None and part not in parts:
                parts.append(part)
        return parts

    def _pre(self, own: list[Partition]) -> Callable:
        def hook(module: torch.nn.Module, args: Any) -> None:
            self._running.append(module)
            for part in self._parts(module, own):
                self.params.fetch(part)
        return hook

    def _post(self, own: list[Partition]) -> Callable:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if self._running and self._running[-1] is module:
                self._running.pop()
            if in_backward():  # a re-forward: what it saved views the parameters; the gradient hook releases them
                return
            for part in self._parts(module, own):
                if part.persistent:
                    continue
                # A parameter of a module still running (a child using its
                # parent's weight) may be viewed by what that module holds:
                # its owner releases it.
                owner = self._owner.get(part.index, module)
                if owner is not module and any(m is owner for m in self._running):
                    continue
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
                self.params.hold(part, torch.empty(part.shape, dtype=part.dtype))
                self._restore.append(part)
        return hook

    def restore_placeholders(self) -> None:
        """After ``load_state_dict``: the scratch tensors become placeholders again."""
        for part in self._restore:
            self.params.unhold(part)  # write() released it: nothing fetched it since
        self._restore.clear()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
