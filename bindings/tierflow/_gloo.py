"""tierflow's Gloo communicators beside torch.distributed: what they move,
and how one is made for a group of its ranks (the ZeRO-3 engine's, the
``"tierflow"`` torch.distributed backend's, FSDP2's custom collectives')."""

from __future__ import annotations

import os
from typing import Any

import torch

from tierflow._core import GlooCommunicator

__all__ = ["DTYPES", "moves", "connect"]

#: The dtypes a GlooCommunicator moves (CPU tensors).
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def moves(tensor: torch.Tensor) -> bool:
    """Whether a GlooCommunicator moves ``tensor``."""
    return tensor.device.type == "cpu" and tensor.dtype in DTYPES


def _hostname(size: int) -> str:
    """The address a rank listens on: ``TIERFLOW_GLOO_HOSTNAME``; else
    127.0.0.1 when every rank of the run is on this node (torchrun's
    LOCAL_WORLD_SIZE and WORLD_SIZE), this host's name otherwise."""
    given = os.environ.get("TIERFLOW_GLOO_HOSTNAME")
    if given:
        return given
    local = int(os.environ.get("LOCAL_WORLD_SIZE", size))
    if local >= int(os.environ.get("WORLD_SIZE", size)):
        return "127.0.0.1"
    import socket

    return socket.gethostname()


def connect(rank: int, size: int, store: Any, prefix: str, timeout: float) -> GlooCommunicator:
    """A GlooCommunicator for rank ``rank`` of ``size``, meeting through
    ``store`` (torch.distributed's) under ``prefix``."""
    return GlooCommunicator(rank, size, store=store, prefix=prefix, hostname=_hostname(size), timeout=timeout)
