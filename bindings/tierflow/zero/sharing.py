"""The NVMe queue depth that ranks on one node split between them.

Every rank of a multi-rank run has its own store and its own I/O engine, each
keeping up to ``queue_depth`` chunks in flight. Ranks whose NVMe directories
lie on one device share that device: with a full depth each, the device holds
``ranks × queue_depth`` chunks at once, no more bandwidth than a fraction of
them would give, and every chunk waits behind all the others — so a shard
needed now is read no sooner than the ones needed later, on every rank, and
the gathers that need every rank's shard wait for the slowest. The depth
configured (the ``aio`` section's ``queue_depth``, else the engine's own
default) is therefore read as the device's, and each rank sharing it gets an
equal part of it, at least one chunk.

Which ranks share a device is asked, not assumed: each rank tells the others
its node (the kernel's boot id, the host's name where there is none) and the
device of its directory, one small all-gather when the store is made.
"""

from __future__ import annotations

import os
import socket
import zlib
from typing import Any

from tierflow import _core

__all__ = ["device_of", "ranks_sharing", "share_of"]


def _node() -> int:
    """A number naming this machine: the same on every process of it."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            name = f.read().strip()
    except OSError:
        name = socket.gethostname()
    return zlib.crc32(name.encode())


def device_of(path: str | os.PathLike) -> tuple[int, int]:
    """(node, device) of the directory ``path``: equal for two directories on
    one file system of one machine."""
    return _node(), os.stat(path).st_dev


def ranks_sharing(group: Any, path: str | os.PathLike) -> int:
    """How many ranks of ``group`` (this one included) have their NVMe
    directory on the device of ``path``, on this machine. Collective: every
    rank of the group calls it."""
    mine = device_of(path)
    return sum(1 for theirs in group.gather_ints(*mine) if theirs == mine)


def share_of(aio: dict[str, int] | None, sharing: int) -> dict[str, int] | None:
    """The I/O engine options of one of ``sharing`` ranks on one device:
    ``aio`` (None: the engine's defaults) with its ``queue_depth`` split
    evenly, at least 1. Unchanged for one rank."""
    if sharing <= 1:
        return aio
    options = dict(aio) if aio is not None else {}
    depth = options.get("queue_depth", _core.aio_config({})["queue_depth"])
    options["queue_depth"] = max(1, depth // sharing)
    return options
