"""tierflow: training beyond GPU memory, with state kept across the GPU, pinned
host memory and NVMe.

This package is the Python face of tierflow's C++ core (the extension
``tierflow._core``): :func:`info` reports what the machine offers,
:class:`Store` is the block store over tiers with budgets (its
:class:`Lease` gives a block's copy in a tier, zero-copy, and a
:class:`PrefetchScheduler` leases blocks ahead of a training loop), and
:mod:`tierflow.torch.optim` holds torch optimizers whose steps run in
tierflow's CPU kernels, :func:`tierflow.config.from_deepspeed` reads a
DeepSpeed config into tierflow's typed one, and :func:`initialize` with
:mod:`tierflow.zero` train a torch model under tierflow's ZeRO-3 engine.
Errors are :mod:`tierflow.errors`' classes.
"""

from __future__ import annotations

try:
    from tierflow import _core
except ImportError as e:  # the pure-Python files without the built extension
    raise ImportError(
        f"tierflow's extension tierflow._core cannot be loaded ({e}). Build and install the "
        "package with `pip install --no-build-isolation .` from tierflow's source tree "
        "(scripts/setup.sh does it into .venv/)."
    ) from e

from tierflow import config
from tierflow._core import GlooCommunicator, Lease, PrefetchScheduler, Store, Work
from tierflow.errors import BudgetError, TierflowError

__all__ = ["info", "simd_targets", "initialize", "Store", "Lease", "PrefetchScheduler", "GlooCommunicator",
           "Work", "config", "zero", "TierflowError", "BudgetError", "__version__"]

__version__: str = _core.__version__


def info(path: str | None = None) -> dict:
    """What this machine offers tierflow, every fact probed: the dict that
    ``tierflow info --json`` prints (CPU and SIMD level, cores and NUMA nodes,
    memory and the pinning limit, io_uring, CUDA devices). With ``path``, also
    that directory's filesystem, O_DIRECT support and free space; a path that
    does not exist, is not a directory or cannot be written raises
    :class:`TierflowError` (an OSError: ``errno`` ENOENT, ENOTDIR, EROFS...,
    ``filename`` the path)."""
    return _core.info(None if path is None else str(path))


def simd_targets() -> list[str]:
    """The SIMD targets the optimizer kernels can run here, best first."""
    return _core.simd_targets()


def initialize(*args, **kwargs):
    """``engine, optimizer, dataloader, lr_scheduler = tierflow.initialize(model=...,
    config=ds_config)``: :func:`tierflow.zero.initialize`, DeepSpeed's shape."""
    from tierflow.zero import initialize as _initialize

    return _initialize(*args, **kwargs)


def __getattr__(name: str):
    # tierflow.zero imports torch: only when it is used.
    if name == "zero":
        import importlib

        return importlib.import_module("tierflow.zero")
    raise AttributeError(f"module 'tierflow' has no attribute {name!r}")
