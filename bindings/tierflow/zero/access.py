"""Uses of ZeRO-3 parameters that no module hook announces, seen by torch's
own dispatch: a parameter used outside its own module (a tied weight, a
parent's ``x @ self.child.weight``), an initialisation after the module was
built (``self.apply(self._init_weights)``), a write through ``.data``.

:class:`ParameterAccess` is a torch function mode. It looks at every call's
tensors for a parameter whose values are in the store, or for a view of one
(an *alias*, see below), and gives the call the real values:

* in a forward (``keep=True``) the parameter is fetched onto the device and
  kept until the forward ends, as its own module's would be, and the module
  whose forward used it is told (:attr:`on_external`), so that its hooks fetch
  it from then on (DeepSpeed's ``register_external_parameter``, found on the
  first pass);
* elsewhere (``zero.Init``, the engine's evaluation) the call runs on the
  parameter's host copy, leased for the one call.

What a call wrote is read off the operator schemas of the aten operations it
ran (:class:`_Writes`, a dispatch mode): an argument whose schema marks it
written (``Tensor(a!)``) and whose storage is a parameter's copy makes that
copy dirty, so the write is kept — ``fill_``, ``normal_``, ``copy_``,
``__setitem__``, ``out=``, whatever the name. Nothing is guessed from names.

``param.data`` of a parameter whose values are away is an *alias*: an empty
tensor that remembers the parameter and the chain of view operations applied
to it since (``.data[0]``, ``.view(...)``, ``.t()``). A call on an alias
leases the parameter's copy, replays the chain on it and runs on the result,
so ``module.weight.data.normal_()`` and ``module.weight.data[idx].zero_()``
write the store, as they write an ordinary parameter.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from tierflow.zero.partition import ParamStore, Partition, data_of, set_data, tensors_in

__all__ = ["ParameterAccess"]

_ALIAS = "_tierflow_alias"


class _Self:
    """Where an alias's chain puts the tensor the previous step gave."""

    def __repr__(self) -> str:
        return "<self>"


_SELF = _Self()


_aliases_made = 0  # none yet: a call's tensors need no look for one (every call of a forward asks)


def _alias(part: Partition, chain: tuple) -> torch.Tensor:
    global _aliases_made
    _aliases_made += 1
    t = torch.empty(0, dtype=part.dtype, device=part.placeholder.device)
    t.__dict__[_ALIAS] = (part, chain)
    return t


def _data_getter(func: Any) -> bool:
    return getattr(func, "__name__", "") == "__get__" and getattr(func, "__self__", None) is torch.Tensor.data


def _data_setter(func: Any) -> bool:
    return getattr(func, "__name__", "") == "__set__" and getattr(func, "__self__", None) is torch.Tensor.data


class _Writes(TorchDispatchMode):
    """Records the storages the aten operations run under it write, as their
    schemas say (an argument with a write alias, ``Tensor(a!)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.written: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
            for t in tree_flatten(value)[0]:
                if isinstance(t, torch.Tensor):
                    self.written.add(t.untyped_storage().data_ptr())
        return func(*args, **kwargs)


class ParameterAccess(TorchFunctionMode):
    """Gives a torch call the values of the store's parameters it uses (see
    the module's docstring). ``keep``: a forward's access, which fetches onto
    the device and keeps until :meth:`release_kept`; ``on_external(part)`` is
    called for a parameter a forward used that no hook had fetched."""

    def __init__(self, params: ParamStore, keep: bool,
                 on_external: Callable[[Partition], None] | None = None) -> None:
        super().__init__()
        self.params = params
        self.keep = keep
        self.on_external = on_external
        self.kept: list[Partition] = []

    # ---- which tensors of a call are the store's ------------------------------------------------

    def _operands(self, args: tuple, kwargs: dict) -> list[tuple[Any, Partition, tuple | None]]:
        """(tensor, partition, alias chain or None for the parameter itself)
        for each tensor of the call whose values are in the store."""
        found = []
        params = self.params
        look = _aliases_made > 0
        for a in tensors_in(args, kwargs):
            alias = a.__dict__.get(_ALIAS) if look and type(a) is torch.Tensor else None
            if alias is not None:  # replayed on the values, gathered meanwhile or not
                found.append((a, alias[0], alias[1]))
                continue
            if isinstance(a, torch.nn.Parameter):
                part = params.part_of(a)
                if part is not None and not part.available:
                    found.append((a, part, None))
        return found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _data_setter(func):  # the store's own moves, and a user's p.data = t (the hooks' business)
            return func(*args, **kwargs)
        operands = self._operands(args, kwargs)
        if not operands:
            return func(*args, **kwargs)
        if _data_getter(func) and operands[0][2] is None:
            return _alias(operands[0][1], ())  # the values are leased when a call uses them
        if self.keep and all(chain is None for _, _, chain in operands):
            return self._on_device(func, args, kwargs, operands)
        return self._on_host(func, args, kwargs, operands)

    # ---- a forward's use: fetched onto the device, kept ----------------------------------------

    def _on_device(self, func, args: tuple, kwargs: dict, operands: list) -> Any:
        parts = []
        for _, part, _ in operands:
            if part not in parts:
                parts.append(part)
        for part in parts:
            self.params.fetch(part)
            self.kept.append(part)
            if self.on_external is not None:
                self.on_external(part)
        writes = _Writes()
        with writes:
            result = func(*args, **kwargs)
        for part in parts:  # a write in a forward reaches the store too (the lease is a read)
            values = data_of(part.param)
            if values.untyped_storage().data_ptr() in writes.written:
                self.params.write(part, values.detach().clone())
                self.params.fetch(part)
        return result

    # ---- elsewhere: the call runs on the host copies ---------------------------------------------

    def _on_host(self, func, args: tuple, kwargs: dict, operands: list) -> Any:
        params = self.params
        views: dict[int, tuple[Partition, Any, torch.Tensor]] = {}
        try:
            for _, part, _ in operands:
                if part.index in views:
                    continue
                if part.available:  # an alias of a parameter gathered since: its values as they are
                    views[part.index] = (part, None, data_of(part.param))
                    continue
                lease, view = params.host_view(part, "write")
                views[part.index] = (part, lease, view)
                params.hold(part, view)  # the parameter itself sees its values for the call

            def replay(a: Any) -> Any:
                alias = a.__dict__.get(_ALIAS) if type(a) is torch.Tensor else None
                if alias is None:
                    return a
                part, chain = alias
                value = views[part.index][2]
                for step, step_args, step_kwargs in chain:
                    put = lambda x: value if x is _SELF else x  # noqa: E731
                    value = step(*tree_map(put, step_args), **tree_map(put, step_kwargs))
                return value

            run_args, run_kwargs = tree_map(replay, (args, kwargs))
            writes = _Writes()
            with writes:
                result = func(*run_args, **run_kwargs)
            owned = {v[2].untyped_storage().data_ptr(): v[0] for v in views.values()}
            only = operands[0] if len(operands) == 1 else None

            def out(r: Any) -> Any:
                if not isinstance(r, torch.Tensor) or isinstance(r, torch.nn.Parameter):
                    return r
                if r.untyped_storage().data_ptr() not in owned:
                    return r
                if only is None:  # a view of several parameters' copies: a copy of it
                    return r.clone()
                tensor, part, chain = only
                if run_args and r is run_args[0]:
                    return tensor  # an in-place method returns its operand
                template = tree_map(lambda x: _SELF if x is tensor else x, (args, kwargs))
                return _alias(part, (chain or ()) + ((func, template[0], template[1]),))

            result = tree_map(out, result)
            dirty = {part.index for ptr, part in owned.items() if ptr in writes.written}
        except BaseException:
            dirty = set()
            raise
        finally:
            for part, lease, _ in views.values():
                if lease is None:
                    continue
                params.unhold(part)
                params.end_host(lease, dirty=part.index in dirty)
        return result

    def release_kept(self) -> None:
        for part in self.kept:
            if not part.persistent:
                self.params.release(part)
        self.kept.clear()
