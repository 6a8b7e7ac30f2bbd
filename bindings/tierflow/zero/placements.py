"""A checkpoint's optimizer state loaded where this run keeps it, when the
run that saved it kept it elsewhere (``offload_optimizer.device`` "cpu" ↔
"nvme").

The two forms a checkpoint holds the state in are the optimizer's own:

- saved in host memory: ``optimizer.pt``, a torch ``state_dict``. A run on
  NVMe maps the file (``torch.load(mmap=True)``) and writes each
  parameter's state into its store in turn, so the state is never whole in
  RAM on the way;
- saved on NVMe: ``optimizer/``, the store's streamed checkpoint (checksummed
  blocks and ``optimizer.pt`` beside them). A run in host memory reads it
  through a scratch optimizer of the same parameters on NVMe, made in a
  directory beside the checkpoint (it needs as much free space there as the
  state takes, and is removed afterwards), into the ``state_dict`` its own
  load takes; the blocks are verified as they are read.

Either way the result is the same ``state_dict`` a checkpoint of this run's
own placement gives, checked by the same checks before anything is written.
tierflow's Adam and AdamW move; ZenFlow's windowed state does not yet (its
save holds the selections and the device-owned columns' state beside the
moments, in a layout of its own), and is refused by name.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from tierflow.zero.runtime import OptimizerSide

__all__ = ["check_movable", "state_saved_in_memory", "state_saved_on_nvme"]

_WHERE = {True: "on NVMe", False: "in host memory"}


def check_movable(side: "OptimizerSide", path: str, saved_on_nvme: bool) -> None:
    """Raises ValueError when the state ``path`` holds (saved on NVMe or
    not) cannot be loaded into ``side``'s other placement."""
    from tierflow.torch.optim import Adam

    if side.zenflow is not None or not isinstance(side.optimizer, Adam):
        zenflow = side.zenflow is not None or side.in_place
        kind = "ZenFlow's" if zenflow else f"{type(side.optimizer).__name__}'s"
        raise ValueError(f"load_checkpoint: {path} holds the optimizer's state saved {_WHERE[saved_on_nvme]}, this "
                         f"run keeps it {_WHERE[not saved_on_nvme]} (zero_optimization.offload_optimizer.device), "
                         f"and {kind} state moves between the two only for Adam/AdamW; give the same device, or "
                         "load_optimizer_states=False")


def state_saved_in_memory(file: str, load: Callable[..., Any]) -> Any:
    """The ``state_dict`` in ``file`` (``optimizer.pt``), mapped rather than
    read: a run on NVMe copies each tensor into its store as it loads.
    ``load`` is the checkpoint's checked ``torch.load``."""
    return load(file, "the optimizer's state", mmap=True)


def state_saved_on_nvme(side: "OptimizerSide", directory: str, load: Callable[..., Any]) -> dict[str, Any]:
    """The optimizer's NVMe checkpoint in ``directory`` as the ``state_dict``
    of ``side``'s optimizer (its state kept in host memory), read through a
    scratch optimizer of the same class and parameters on NVMe. Raises
    FileNotFoundError for a missing part, ValueError for another optimizer's
    layout, TierflowError for a corrupt block; nothing of ``side`` changes."""
    for name in ("optimizer.pt", "manifest.json"):
        if not os.path.isfile(os.path.join(directory, name)):
            file = os.path.join(directory, name)
            raise FileNotFoundError(errno.ENOENT, f"load_checkpoint: {file} is missing (the optimizer's NVMe "
                                                  "checkpoint)", file)
    meta = load(os.path.join(directory, "optimizer.pt"), "the optimizer's state")
    own = meta.get("tierflow") if isinstance(meta, dict) else None
    if not isinstance(own, dict) or "layout" not in own:
        raise ValueError(f"load_checkpoint: {os.path.join(directory, 'optimizer.pt')} is not an optimizer's NVMe "
                         "checkpoint")
    optimizer = side.optimizer
    groups = [dict(g) for g in optimizer.param_groups]  # the same tensors; the saved values replace the rest
    defaults = optimizer.defaults
    tag_dir = os.path.dirname(directory)
    try:
        scratch = tempfile.mkdtemp(prefix=".tierflow-moving-state-", dir=os.path.dirname(tag_dir))
    except OSError as e:
        raise OSError(e.errno, f"load_checkpoint: moving the optimizer's state from NVMe into host memory needs a "
                               f"scratch directory beside {tag_dir}: {e.strerror}", tag_dir) from None
    reader = None
    try:
        reader = type(optimizer)(groups, amsgrad=defaults["amsgrad"], offload="nvme", nvme_dir=scratch,
                                 host_memory=own["layout"]["host_memory"], threads=optimizer.threads,
                                 aio=getattr(optimizer, "_aio", None))
        reader.load_state(directory)
        saved = reader.state_dict()  # each parameter's state read from the store: the run's RAM form
    finally:
        if reader is not None:
            reader.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return saved  # (its tensors were read into RAM of their own: the scratch store is gone)
