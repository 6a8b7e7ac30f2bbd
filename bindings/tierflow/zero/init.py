"""Building a model straight into the store (:class:`Init`) and full access
to chosen parameters (:class:`GatheredParameters`).

Under :class:`Init`, each module's parameters move into the store as soon as
the module's own ``__init__`` returns, so a model whose weights exceed host
memory is built one module at a time: the most that is ever in RAM is the
module being built (and the host tier's budget). What a parent module does to
its children's parameters afterwards (``self.apply(self._init_weights)``, a
tied weight) reaches the store through :class:`~tierflow.zero.access.ParameterAccess`,
active for the whole context.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Iterable

import torch

from tierflow.config import AUTO, Config, from_deepspeed
from tierflow.zero.access import ParameterAccess
from tierflow.zero.comm import Group
from tierflow.zero.partition import ParamStore
from tierflow.zero.plan import format_bytes, make_plan, pages

__all__ = ["Init", "GatheredParameters", "store_of"]

# A parameter in a store carries it (keeping the store alive as long as the model).
_STORE_ATTRIBUTE = "_tierflow_store"


def store_of(model: torch.nn.Module) -> ParamStore | None:
    """The store ``model``'s parameters were built into under :class:`Init`, if any."""
    for p in model.parameters():
        store = getattr(p, _STORE_ATTRIBUTE, None)
        if store is not None and store.part_of(p) is not None:
            return store
    return None


def mark(p: torch.nn.Parameter, store: ParamStore) -> None:
    """Records that ``p`` lives in ``store``."""
    setattr(p, _STORE_ATTRIBUTE, store)


def _all_subclasses(cls: type) -> list[type]:
    out, todo = [], [cls]
    while todo:
        c = todo.pop()
        for sub in c.__subclasses__():
            out.append(sub)
            todo.append(sub)
    return out


class Init:
    """``with tierflow.zero.Init(config=ds_config): model = MyModel()`` builds
    the model's parameters straight into a ZeRO-3 store, module by module;
    pass the model to :func:`tierflow.initialize` with the same config.

    ``config``: the DeepSpeed config (path, dict or Config; stage 3). The
    store's budgets come from its ``tierflow`` section (``device_memory``,
    ``host_memory``) or DeepSpeed's buffer keys, capped at a quarter of the
    memory available (the model's size is not known yet). ``enabled=False``
    builds the model normally. Parameters whose dtype is floating point are
    cast to the config's precision as they move in.
    """

    def __init__(self, config: str | os.PathLike | dict | Config | None = None, *, enabled: bool = True,
                 config_dict_or_path: Any = None, **ignored_deepspeed_arguments: Any) -> None:
        if ignored_deepspeed_arguments:
            raise ValueError(f"{next(iter(ignored_deepspeed_arguments))}: not an argument tierflow.zero.Init takes "
                             "(config, enabled, config_dict_or_path)")
        config = config if config is not None else config_dict_or_path
        self.enabled = enabled
        if not enabled:
            return
        if config is None:
            raise ValueError("config: tierflow.zero.Init needs the run's DeepSpeed config (stage 3)")
        self.config = config if isinstance(config, Config) else from_deepspeed(config)
        self.plan = make_plan(None, self.config)  # the same planner as the engine's, the model not built yet
        threshold = self.config.zero.stage3_param_persistence_threshold
        self.threshold = 100_000 if threshold is AUTO else int(threshold)
        self.params = ParamStore(self.plan, trace=self.config.tierflow.trace,
                                 group=Group.from_options(self.config.tierflow))
        self._patched: dict[type, Any] = {}  # class -> (its __init__, the wrapper put in its place)
        self._active = False
        self._access: ParameterAccess | None = None
        self._count = 0

    def _partition(self, module: torch.nn.Module) -> None:
        for local, p in module.named_parameters(recurse=False):
            if self.params.part_of(p) is not None:
                continue
            self._count += 1
            self.params.adopt(p, f"{type(module).__name__}.{local}#{self._count}",
                              persistent=p.numel() <= self.threshold)
            mark(p, self.params)

    def _wrap(self, cls: type) -> None:
        init = cls.__dict__.get("__init__")
        if init is None or cls in self._patched:
            return
        outer = self

        @functools.wraps(init)
        def wrapper(module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
            if not outer._active:  # kept inside another wrapper after the context ended (see __exit__)
                init(module, *args, **kwargs)
                return
            depth = module.__dict__.get("_tierflow_init_depth", 0)
            module.__dict__["_tierflow_init_depth"] = depth + 1
            try:
                init(module, *args, **kwargs)
            finally:
                module.__dict__["_tierflow_init_depth"] = depth
            if depth == 0:  # the module's own __init__, not a base class's inside it
                module.__dict__.pop("_tierflow_init_depth", None)
                outer._partition(module)

        self._patched[cls] = (init, wrapper)
        cls.__init__ = wrapper

    def __enter__(self) -> "Init":
        if not self.enabled:
            return self
        self._active = True
        for cls in _all_subclasses(torch.nn.Module):
            self._wrap(cls)
        original = torch.nn.Module.__dict__.get("__init_subclass__")
        self._init_subclass = original
        outer = self

        def init_subclass(cls: type, **kwargs: Any) -> None:
            super(torch.nn.Module, cls).__init_subclass__(**kwargs)
            outer._wrap(cls)

        torch.nn.Module.__init_subclass__ = classmethod(init_subclass)  # type: ignore[assignment]
        self._access = ParameterAccess(self.params, keep=False)
        self._access.__enter__()
        return self

    def close(self) -> None:
        """Releases the store (its NVMe files go) of a model built here that
        will not be trained: one :func:`tierflow.initialize` refused, say.
        The model's parameters keep placeholders of their shapes. An engine
        made from the model closes the store itself."""
        if self.enabled:
            self.params.close()

    def __exit__(self, *exc: Any) -> None:
        if not self.enabled:
            return
        self._access.__exit__(*exc)
        self._active = False
        # A class defined inside the context was wrapped as it was made; a
        # class decorator may since have put its own __init__ around the
        # wrapper (transformers' use_kernelized_func on its attention
        # layers). Putting back the class's first __init__ would drop the
        # decorator's; its __init__ stays, and the wrapper inside it now only
        # calls through.
        for cls, (init, wrapper) in self._patched.items():
            if cls.__dict__.get("__init__") is wrapper:
                cls.__init__ = init
        self._patched.clear()
        if self._init_subclass is None:
            del torch.nn.Module.__init_subclass__
        else:
            torch.nn.Module.__init_subclass__ = self._init_subclass  # type: ignore[assignment]


class GatheredParameters:
    """``with GatheredParameters(params, modifier_rank=0):`` every parameter in
    ``params`` (one, or an iterable) holds its full values (its host copy)
    inside the context; with ``modifier_rank`` not None what the block writes is
    kept — with several ranks, what rank ``modifier_rank`` wrote, broadcast to
    every rank, as DeepSpeed's. Parameters not in a tierflow store pass through
    untouched. Raises ValueError when the parameters cannot all fit in the host
    tier at once, or ``modifier_rank`` is not a rank of their store's group."""

    def __init__(self, params: torch.nn.Parameter | Iterable[torch.nn.Parameter], modifier_rank: int | None = None,
                 fwd_module: Any = None, enabled: bool = True) -> None:
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = list(params)
        self.write = modifier_rank is not None
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self.held: list[tuple[Any, Any, Any]] = []

    def __enter__(self) -> None:
        if not self.enabled:
            return
        by_store: dict[int, tuple[ParamStore, list]] = {}
        for p in self.params:
            store = getattr(p, _STORE_ATTRIBUTE, None)
            part = store.part_of(p) if store is not None else None
            if part is not None:
                by_store.setdefault(id(store), (store, []))[1].append(part)
        for store, parts in by_store.values():
            world = store.group.world_size
            if self.write and not (isinstance(self.modifier_rank, int) and 0 <= self.modifier_rank < world):
                raise ValueError(f"modifier_rank: {self.modifier_rank!r} is not a rank of the {world} the "
                                 f"parameters are partitioned over (give 0 to {world - 1}, or None to read only)")
            need = sum(pages(x.nbytes) for x in parts)
            if need > store.plan.host_budget:
                raise ValueError(f"params: {len(parts)} parameters need {format_bytes(need)} of host memory at once, "
                                 f"beyond the host tier's {format_bytes(store.plan.host_budget)}; gather fewer")
        try:
            for store, parts in by_store.values():
                for part in parts:
                    store.release(part)
                    lease, view = store.host_view(part, "write" if self.write else "read")
                    self.held.append((store, part, lease))
                    store.hold(part, view)
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> None:
        for store, part, lease in self.held:
            store.unhold(part)
            store.end_host(lease, dirty=self.write, source=self.modifier_rank or 0)
        self.held.clear()
