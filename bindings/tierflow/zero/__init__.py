"""tierflow's ZeRO-3 engine for PyTorch: :func:`initialize` (DeepSpeed's
shape, DeepSpeed's config as it is), :class:`Init` to build a model straight
into the store, :class:`GatheredParameters` for full access to chosen
parameters, and :func:`estimate_memory` to see what each tier will hold
before any work starts."""

from tierflow.zero.engine import Engine, LossScaler, initialize
from tierflow.zero.init import GatheredParameters, Init
from tierflow.zero.plan import Plan, estimate_memory

__all__ = ["initialize", "Engine", "Init", "GatheredParameters", "estimate_memory", "Plan", "LossScaler"]
