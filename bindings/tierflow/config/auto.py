"""``"auto"`` resolved as Hugging Face's Trainer resolves it: the facts read
off the model (its parameter count and hidden size) and the optimizer (lr,
betas, eps, weight_decay) given to :func:`~tierflow.config.from_deepspeed`,
the resolvers that turn them into values, and DeepSpeed's batch rule
(``train_batch_size = micro × accumulation × world size``)."""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Union

from tierflow.config.schema import AUTO, ModelFacts

#: A resolver of one "auto" value: (value, how it was resolved), or None
#: when what it comes from was not given.
Resolver = Callable[[], Union[tuple[Any, str], None]]


def model_facts(model: Any) -> ModelFacts:
    if not (hasattr(model, "named_parameters") and callable(model.named_parameters)):
        raise TypeError(f"from_deepspeed: model= expects a torch.nn.Module, got {type(model).__name__}")
    unique = {id(p): p for _, p in model.named_parameters()}
    parameters = sum(int(p.numel()) for p in unique.values())
    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None) if config is not None else None
    if isinstance(hidden, int) and hidden > 0:
        return ModelFacts(parameters, hidden, "model.config.hidden_size")
    sizes = getattr(config, "hidden_sizes", None) if config is not None else None
    if sizes and all(isinstance(s, int) and s > 0 for s in sizes):
        return ModelFacts(parameters, max(sizes), "the largest of model.config.hidden_sizes")
    # A plain torch module: the width most of its matrices share is its hidden
    # size (a transformer's attention and MLP weights all have d_model on one side).
    dims: Counter[int] = Counter()
    matrices = [p for p in unique.values() if p.dim() == 2]
    for p in matrices:
        dims.update(int(d) for d in p.shape)
    if not dims:
        return ModelFacts(parameters, None, "no model.config.hidden_size and no 2-D weight to read it from")
    hidden = max(dims, key=lambda d: (dims[d], d))
    return ModelFacts(parameters, hidden,
                      f"the dimension most common among its {len(matrices)} 2-D weights; "
                      "no model.config.hidden_size")


def optimizer_facts(optimizer: Any) -> dict[str, tuple[Any, str]]:
    """lr, betas, eps and weight_decay of a torch optimizer, as HF's Trainer
    would fill them: the value all param groups share, else the largest group's."""
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list) or not groups or not all(isinstance(g, dict) for g in groups):
        raise TypeError(f"from_deepspeed: optimizer= expects a torch.optim.Optimizer, got {type(optimizer).__name__}")

    def plain(value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return tuple(plain(v) for v in value)
        return float(value.item()) if hasattr(value, "item") else value

    sizes = [sum(int(p.numel()) for p in g.get("params", [])) for g in groups]
    facts: dict[str, tuple[Any, str]] = {}
    for name in ("lr", "betas", "eps", "weight_decay"):
        values = [plain(g[name]) if name in g else None for g in groups]
        if all(v is None for v in values):
            continue
        if len(set(map(repr, values))) == 1:
            facts[name] = (values[0], f"the optimizer's {name}")
        else:
            i = max(range(len(groups)), key=lambda k: (values[k] is not None, sizes[k]))
            facts[name] = (values[i], f"the optimizer's {name} in param group {i}, its largest (the groups differ)")
    return facts


def from_optimizer(facts: dict[str, tuple[Any, str]] | None, name: str) -> Resolver:
    """The optimizer's ``name`` (its value and where it came from), when an optimizer was given."""

    def resolve() -> tuple[Any, str] | None:
        if facts is None or name not in facts:
            return None
        return facts[name]

    return resolve


def from_hidden(model: ModelFacts | None, rule: Callable[[int], int], text: str) -> Resolver:
    """``rule`` of the model's hidden size ``h`` (``text`` says it: "h²"), when it is known."""
    hidden = model.hidden_size if model is not None else None

    def resolve() -> tuple[int, str] | None:
        if hidden is None:
            return None
        return rule(hidden), f"{text}, the model's hidden size {hidden}"

    return resolve


def unresolved() -> None:
    """The resolver of a value the Trainer fills from its own arguments: unresolved here."""
    return None


BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def derive_batch(batch: Any, micro: Any, steps: Any, world: int, sources: dict[str, str],
                 unresolved: list[str]) -> tuple[Any, Any, Any]:
    """DeepSpeed's batch rule over the three sizes as given (None: absent,
    AUTO: unresolved): train_batch_size = micro batch × accumulation steps ×
    world size; the one missing is derived (with DeepSpeed's floor
    divisions), one alone makes accumulation 1, and the three must agree.
    Where each derived value came from goes into ``sources``; what follows
    from an unresolved value is unresolved too."""
    keys = BATCH_KEYS
    if AUTO in (batch, micro, steps):
        # What is absent follows from what is unresolved.
        values = []
        for key, value in zip(keys, (batch, micro, steps)):
            if value is None:
                unresolved.append(key)
                sources[key] = "derived: from unresolved values"
                value = AUTO
            values.append(value)
        return tuple(values)  # type: ignore[return-value]
    rule = "derived: DeepSpeed's train_batch_size = micro × accumulation × world size"
    if batch is not None and micro is not None and steps is None:
        steps = batch // micro // world
        sources["gradient_accumulation_steps"] = f"{rule} ({batch} // {micro} // {world})"
    elif batch is not None and steps is not None and micro is None:
        micro = batch // world // steps
        sources["train_micro_batch_size_per_gpu"] = f"{rule} ({batch} // {world} // {steps})"
    elif micro is not None and steps is not None and batch is None:
        batch = micro * steps * world
        sources["train_batch_size"] = f"{rule} ({micro} × {steps} × {world})"
    elif batch is not None and micro is None and steps is None:
        steps, micro = 1, batch // world
        sources["gradient_accumulation_steps"] = "derived: 1, as DeepSpeed takes it with train_batch_size alone"
        sources["train_micro_batch_size_per_gpu"] = f"{rule} ({batch} // {world})"
    elif micro is not None and batch is None and steps is None:
        steps, batch = 1, micro * world
        sources["gradient_accumulation_steps"] = ("derived: 1, as DeepSpeed takes it with "
                                                  "train_micro_batch_size_per_gpu alone")
        sources["train_batch_size"] = f"{rule} ({micro} × 1 × {world})"
    elif batch is None or micro is None:
        raise ValueError("train_batch_size, train_micro_batch_size_per_gpu: neither is given; DeepSpeed needs "
                         "one of them")
    if micro < 1 or steps < 1 or batch != micro * steps * world:
        raise ValueError(f"train_batch_size: {batch} is not train_micro_batch_size_per_gpu × "
                         f"gradient_accumulation_steps × world size = {micro} × {steps} × {world}")
    return batch, micro, steps
