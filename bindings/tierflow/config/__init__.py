"""A DeepSpeed config, read as DeepSpeed reads it, as tierflow's one typed
description of a run.

:func:`from_deepspeed` takes the JSON a DeepSpeed user already has (a path or
a dict) and returns a :class:`Config`: frozen dataclasses, one per section
(``optimizer``, ``scheduler``, ``zero``, ``aio``, ``fp16``, ``bf16``,
``tierflow``), every value checked and every default DeepSpeed's own. What
it does not act on is said by name: keys tierflow does not know, and keys
DeepSpeed has that tierflow leaves alone on purpose (monitoring, profilers,
collective tuning), each with its dotted path, in one
:class:`TierflowConfigWarning` (or one ValueError with ``strict=True``).

``"auto"`` values, the placeholders Hugging Face's Trainer fills in, are
resolved by the Trainer's rules from the ``model`` (its hidden size) and the
``optimizer`` (its lr, betas, eps, weight_decay) given; those neither can
resolve keep the value :data:`AUTO` and are listed in ``Config.unresolved``.

ZenFlow's section and the aio section are read by tierflow's C++ parsers (the
same the engine and the CLI use), so their keys are checked in one place.

The package, by job: ``schema.py`` (the dataclasses, :data:`AUTO`,
:class:`UnusedKey`, :class:`TierflowConfigWarning`), ``reader.py`` (the
sections as DeepSpeed reads them, :func:`from_deepspeed`), ``auto.py`` (the
model's and the optimizer's facts, the batch rule), ``schedules.py``
(:class:`SchedulerConfig` and its LambdaLR), ``optimizers.py``
(:class:`AdamConfig`, :class:`MuonConfig` and the optimizers they build),
``values.py`` (the JSON values' checks).
"""

from tierflow.config.optimizers import AdamConfig, MuonConfig
from tierflow.config.reader import from_deepspeed
from tierflow.config.schedules import SchedulerConfig
from tierflow.config.schema import (AUTO, AioConfig, Bf16Config, Config, Fp16Config, ModelFacts, OffloadOptimizerConfig,
                                    OffloadParamConfig, TierflowConfigWarning, TierflowOptions, UnusedKey,
                                    ZenflowConfig, ZeroConfig)

__all__ = [
    "from_deepspeed",
    "Config",
    "AdamConfig",
    "MuonConfig",
    "SchedulerConfig",
    "ZeroConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "ZenflowConfig",
    "AioConfig",
    "Fp16Config",
    "Bf16Config",
    "TierflowOptions",
    "ModelFacts",
    "UnusedKey",
    "TierflowConfigWarning",
    "AUTO",
]
