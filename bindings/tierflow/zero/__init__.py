"""tierflow's ZeRO-3 engine for PyTorch: :func:`initialize` (DeepSpeed's
shape, DeepSpeed's config as it is), :class:`Init` to build a model straight
into the store, :class:`GatheredParameters` for full access to chosen
parameters, :func:`register_external_parameter` for a parameter a module
uses without owning it, and :func:`estimate_memory` to see what each tier
will hold before any work starts. A parameter in the store is a
:class:`StoredParameter`: outside a gathering it holds no values, and a
computation with it raises :class:`NotGatheredError` naming it."""

from tierflow.zero.engine import Engine, LossScaler, initialize
from tierflow.zero.hooks import register_external_parameter, unregister_external_parameter
from tierflow.zero.init import GatheredParameters, Init
from tierflow.zero.partition import NotGatheredError, StoredParameter
from tierflow.zero.plan import Plan, estimate_memory

__all__ = ["initialize", "Engine", "Init", "GatheredParameters", "estimate_memory", "Plan", "LossScaler",
           "register_external_parameter", "unregister_external_parameter", "StoredParameter", "NotGatheredError"]
