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
tierflow's Adam and AdamW move so, and ZenFlow too: its NVMe checkpoint
(the windowed side's blocks, the selection and the device-owned columns'
state) is read by a scratch ZenFlow on NVMe over zeroed copies of the
parameters (its load writes the device's columns into its parameters, which
must not be the run's until every check has passed), and its ``state_dict``
(each column's moments at the device's step count, the selection, the
trigger) is what the run loads; a bf16/fp16 run's ``masters.pt`` is mapped
beside it. ZenFlow's ``load_state_dict`` keeps that state in RAM until its
first step makes the engine, so a ZenFlow state moved either way is whole in
RAM once on the way. Muon's moves as Adam's does: its NVMe checkpoint is a
directory per part (``muon/``, ``adamw/``), each read by a scratch part of
its class on NVMe into the joint ``state_dict``.
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
    from tierflow.torch.optim import Adam, ZenFlow
    from tierflow.zero.muon import MuonWithAuxAdam

    if not isinstance(side.optimizer, (Adam, ZenFlow, MuonWithAuxAdam)):
        raise ValueError(f"load_checkpoint: {path} holds the optimizer's state saved {_WHERE[saved_on_nvme]}, this "
                         f"run keeps it {_WHERE[not saved_on_nvme]} (zero_optimization.offload_optimizer.device), "
                         f"and {type(side.optimizer).__name__}'s state moves between the two only for Adam/AdamW, "
                         "Muon and ZenFlow; give the same device, or load_optimizer_states=False")


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
    from tierflow.torch.optim import ZenFlow
    from tierflow.zero.muon import MuonWithAuxAdam

    optimizer = side.optimizer
    files = (optimizer.checkpoint_files(directory) if isinstance(optimizer, MuonWithAuxAdam) else
             [os.path.join(directory, name) for name in ("optimizer.pt", "manifest.json")])
    for file in files:
        if not os.path.isfile(file):
            raise FileNotFoundError(errno.ENOENT, f"load_checkpoint: {file} is missing (the optimizer's NVMe "
                                                  "checkpoint)", file)

    meta = load(os.path.join(directory, "optimizer.pt"), "the optimizer's state")
    own = meta.get("tierflow") if isinstance(meta, dict) else None
    zenflow, muon = isinstance(optimizer, ZenFlow), isinstance(optimizer, MuonWithAuxAdam)
    kind = "a ZenFlow" if zenflow else "a Muon" if muon else "an Adam/AdamW"
    expected = "parts" if muon else "layout"
    if (not isinstance(own, dict) or expected not in own
            or (not muon and zenflow != isinstance(own["layout"], list))):
        raise ValueError(f"load_checkpoint: {os.path.join(directory, 'optimizer.pt')} is not {kind} optimizer's "
                         "NVMe checkpoint")
    tag_dir = os.path.dirname(directory)
    try:
        scratch = tempfile.mkdtemp(prefix=".tierflow-moving-state-", dir=os.path.dirname(tag_dir))
    except OSError as e:
        raise OSError(e.errno, f"load_checkpoint: moving the optimizer's state from NVMe into host memory needs a "
                               f"scratch directory beside {tag_dir}: {e.strerror}", tag_dir) from None
    reader = None
    try:
        reader = (_zenflow_reader(optimizer, scratch) if zenflow else
                  _muon_reader(optimizer, scratch, directory, load) if muon else
                  _adam_reader(optimizer, scratch, own["layout"]["host_memory"]))
        reader.load_state(directory)
        saved = reader.state_dict()  # each parameter's state read from the store: the run's RAM form
    finally:
        if reader is not None:
            reader.close()
        shutil.rmtree(scratch, ignore_errors=True)
    # (its tensors were read into RAM of their own: the scratch store is gone)
    if side.zenflow is None:
        return saved
    out = {"optimizer": saved}  # ZenFlow over masters: PartitionedZenFlow.state_dict's form
    masters = os.path.join(directory, "masters.pt")
    if os.path.isfile(masters):
        out["masters"] = load(masters, "the fp32 masters", mmap=True)
    return out


def _adam_reader(optimizer: Any, scratch: str, host_memory: int) -> Any:
    """An Adam/AdamW of ``optimizer``'s class and parameters on NVMe in ``scratch``."""
    groups = [dict(g) for g in optimizer.param_groups]  # the same tensors; the saved values replace the rest
    return type(optimizer)(groups, amsgrad=optimizer.defaults["amsgrad"], offload="nvme", nvme_dir=scratch,
                           host_memory=host_memory, threads=optimizer.threads, aio=getattr(optimizer, "_aio", None))


def _muon_reader(optimizer: Any, scratch: str, directory: str, load: Callable[..., Any]) -> Any:
    """A MuonWithAuxAdam of ``optimizer``'s parts (their classes, parameters
    and settings) on NVMe under ``scratch``, each part's host budget the one
    its checkpoint in ``directory`` was saved with."""
    from tierflow.torch.optim import Adam
    from tierflow.zero.muon import PART_NAMES, MuonWithAuxAdam, ShardedMuon

    made: dict[bool, Any] = {}
    try:
        for use_muon, part in ((True, optimizer.muon), (False, optimizer.adamw)):
            if part is None:
                continue
            name = PART_NAMES[use_muon]
            own = load(os.path.join(directory, name, "optimizer.pt"), f"the {name} part's state").get("tierflow", {})
            host_memory = own.get("layout", {}).get("host_memory")
            part_dir = os.path.join(scratch, name)
            os.makedirs(part_dir, mode=0o700)
            if isinstance(part, Adam):
                made[use_muon] = _adam_reader(part, part_dir, host_memory)
                continue
            where = dict(offload="nvme", nvme_dir=part_dir, host_memory=host_memory, threads=part.threads,
                         ns_dtype=part.ns_dtype)
            if isinstance(part, ShardedMuon):  # (its groups' values come back with load_state)
                made[use_muon] = ShardedMuon([p for g in part.param_groups for p in g["params"]], part._shapes,
                                             part.group, **where)
            else:
                made[use_muon] = type(part)([dict(g) for g in part.param_groups], **where)
        return MuonWithAuxAdam(made.get(True), made.get(False))
    except BaseException:
        for reader in made.values():
            reader.close()
        raise


def _zenflow_reader(optimizer: Any, scratch: str) -> Any:
    """A ZenFlow of ``optimizer``'s settings on NVMe in ``scratch``, over
    zeroed copies of its parameters (grouped and named as they are)."""
    import torch
    from tierflow.torch.optim import ZenFlow

    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [torch.zeros_like(p, requires_grad=p.requires_grad) for p in g["params"]]}
              for g in optimizer.param_groups]
    d = optimizer.defaults
    return ZenFlow(groups, lr=d["lr"], betas=d["betas"], eps=d["eps"], weight_decay=d["weight_decay"],
                   decoupled_weight_decay=d["decoupled_weight_decay"], zenflow=optimizer.zenflow_config,
                   threads=optimizer.threads, offload="nvme", nvme_dir=scratch,
                   aio=getattr(optimizer, "_aio", None))
