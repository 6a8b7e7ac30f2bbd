"""A tensor whose bytes live elsewhere (in a block of tierflow's store, homed
on NVMe) and which every torch operation reads, and in-place operations
write, through to that home.

:func:`tierflow.torch.fsdp.offload` leaves one as the local tensor of each
NVMe-homed shard's parameter (and gradient) between its uses, where FSDP2
itself would leave a storage of no bytes, which any operation on it would
read out of bounds. With one, ``param.sum()``, ``print(param)``,
``grad.zero_()``, ``clip_grad_norm_`` and FSDP2's gradient accumulation all
work, each at the cost of bringing the bytes in (and, when written, sending
them home).

Views (``view``, ``detach``, slices, DTensor's ``to_local()``) are tensors
of the same kind: a view records how it is taken from its home's tensor and
takes it again on each use, so a write through a view reaches the home. A
``_foreach_`` op (torch's optimizers', ``clip_grad_norm_``'s) runs one tensor
at a time, so it holds one home's bytes at a time.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, NamedTuple

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["HomedTensor", "Home", "Layout"]


class Layout(NamedTuple):
    """A tensor's size, stride, storage offset (in elements) and dtype."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype

    @classmethod
    def of(cls, t: Tensor) -> "Layout":
        return cls(tuple(t.size()), tuple(t.stride()), t.storage_offset(), t.dtype)

    @classmethod
    def contiguous(cls, size: Any, dtype: torch.dtype) -> "Layout":
        size = tuple(size)
        stride, step = [], 1
        for n in reversed(size):
            stride.append(step)
            step *= max(n, 1)
        return cls(size, tuple(reversed(stride)), 0, dtype)

    def over(self, storage: torch.UntypedStorage) -> Tensor:
        """A tensor of this layout over ``storage`` (no copy)."""
        return torch.empty(0, dtype=self.dtype).set_(storage, self.offset, self.size, self.stride)

    @property
    def room(self) -> int:
        """The bytes of storage a tensor of this layout reaches."""
        span = sum((n - 1) * s for n, s in zip(self.size, self.stride)) + 1 if all(self.size) else 0
        return (self.offset + span) * self.dtype.itemsize


class Home:
    """Where a :class:`HomedTensor`'s bytes are: ``open(write)`` is a context
    manager giving a plain tensor over them, of the home's ``layout``
    (writable when ``write``, its writes kept when the block exits without an
    exception), and ``name`` what errors call it."""

    def __init__(self, name: str, layout: Layout, open: Callable[[bool], ContextManager[Tensor]]) -> None:
        self.name, self.layout, self.open = name, layout, open


class HomedTensor(torch.Tensor):
    """A tensor of a given size, stride and dtype whose values are its
    :class:`Home`'s, taken through ``views`` (the view operations, as
    ``(op, args, kwargs)`` with the tensor's place held by None, applied in
    order to the home's tensor)."""

    _home: Home
    _views: tuple

    @staticmethod
    def __new__(cls, home: Home, layout: Layout | None = None, views: tuple = ()) -> "HomedTensor":
        layout = layout or home.layout
        t = torch.Tensor._make_wrapper_subclass(cls, layout.size, strides=layout.stride,
                                                storage_offset=layout.offset, dtype=layout.dtype,
                                                device="cpu", requires_grad=False)
        t._home, t._views = home, views
        return t

    def __init__(self, home: Home, layout: Layout | None = None, views: tuple = ()) -> None:
        pass

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"HomedTensor({self._home.name}, size={tuple(self.shape)}, dtype={self.dtype})"

    def _taken(self, base: Tensor) -> Tensor:
        for op, args, kwargs in self._views:
            base = op(base, *args, **kwargs)
        return base

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func.__name__.startswith("_foreach_"):
            n = next((len(a) for a in args if isinstance(a, (list, tuple))), 0)
            if n > 1:  # one tensor at a time: one home's bytes in at a time
                return _each(func, n, args, kwargs)
        written = _written_arguments(func._schema, args, kwargs)
        homes: dict[int, tuple[Home, bool]] = {}
        for value in tree_flatten((args, kwargs))[0]:
            if isinstance(value, HomedTensor):
                home = value._home
                was = homes.get(id(home), (home, False))[1]
                homes[id(home)] = (home, was or any(value is w for w in written))
        with contextlib.ExitStack() as stack:
            bases = {key: stack.enter_context(home.open(write)) for key, (home, write) in homes.items()}
            reals: dict[int, Tensor] = {}

            def real(x: Any) -> Any:
                if not isinstance(x, HomedTensor):
                    return x
                reals[id(x)] = t = x._taken(bases[id(x._home)])
                return t

            out = func(*tree_map(real, args), **tree_map(real, kwargs))
            return _rewrap(func, args, kwargs, out, reals, bases)


def _each(func: Any, n: int, args: tuple, kwargs: dict) -> Any:
    """A ``_foreach_`` op over lists of ``n`` run as ``n`` ops over lists of one."""
    def nth(value: Any, i: int) -> Any:
        return [value[i]] if isinstance(value, (list, tuple)) and len(value) == n else value

    outs = [func(*(nth(a, i) for a in args), **{k: nth(v, i) for k, v in kwargs.items()}) for i in range(n)]
    return None if outs[0] is None else [o[0] for o in outs]


def _written_arguments(schema: Any, args: tuple, kwargs: dict) -> list[Tensor]:
    """The tensor arguments the op writes (``Tensor(a!)``: in-place ``self``, ``out=``)."""
    written = []
    for i, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        written += [v for v in tree_flatten(value)[0] if isinstance(v, Tensor)]
    return written


def _rewrap(func: Any, args: tuple, kwargs: dict, out: Any, reals: dict[int, Tensor],
            bases: dict[int, Tensor]) -> Any:
    """``out`` with no tensor over a home's bytes left in it (those bytes go
    back when the op returns): an argument given back (an in-place op's
    ``self``, ``out=``) is the HomedTensor given; a view of one (aliasing its
    storage) a new HomedTensor taking the same view of the home on each use."""
    storages = {b.untyped_storage().data_ptr() for b in bases.values()}
    by_real = {id(r): key for key, r in reals.items()}
    homed = {id(v): v for v in tree_flatten((args, kwargs))[0] if isinstance(v, HomedTensor)}
    sources = [(i, a) for i, a in enumerate(args) if isinstance(a, HomedTensor)]

    def back(t: Any, n: int | None) -> Any:
        if not isinstance(t, Tensor) or t.untyped_storage().data_ptr() not in storages:
            return t
        if id(t) in by_real:
            return homed[by_real[id(t)]]
        if len(sources) != 1 or any(isinstance(v, Tensor) for v in tree_flatten(
                ([a for i, a in enumerate(args) if i != sources[0][0]], kwargs))[0]):
            raise RuntimeError(f"{func}: a view of {sources[0][1]._home.name if sources else 'a homed tensor'} "
                               "taken with other tensors is not supported; take a copy first (.clone())")
        index, value = sources[0]
        rest = tuple(a for i, a in enumerate(args) if i != index)
        if index != 0:
            raise RuntimeError(f"{func}: a view of {value._home.name} that is not the op's first argument "
                               "is not supported; take a copy first (.clone())")
        op = func if n is None else _nth(func, n)
        return HomedTensor(value._home, Layout.of(t), value._views + ((op, rest, kwargs),))

    if isinstance(out, (tuple, list)):
        return type(out)(back(t, n) for n, t in enumerate(out))
    return back(out, None)


def _nth(func: Any, n: int) -> Callable[..., Tensor]:
    """The view op giving the ``n``-th of ``func``'s tensors (split's, unbind's)."""
    def view(base: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return func(base, *args, **kwargs)[n]
    return view
