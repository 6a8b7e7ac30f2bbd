"""What tierflow's Python objects hold of its C++ core ends before the
interpreter does.

An engine, a store, an optimizer hold handles of ``tierflow._core`` (a store
with its files and threads, a thread pool, an NVMe state). A script that
ends without closing them leaves them to the interpreter's shutdown, which
frees reference cycles (an engine and its hooks) only after it has torn the
extension down: their files and threads outlive the library that owns them,
and nanobind rightly reports the instances as leaked. Each such object is
tracked here (weakly: tracking keeps nothing alive) and released at exit,
while the extension is whole, in the reverse order of making: engines before
the stores and optimizers they hold.
"""

from __future__ import annotations

import atexit
import gc
import itertools
import weakref
from typing import Any, Protocol

__all__ = ["track"]


class Releasable(Protocol):
    def _release_native(self) -> None:
        """Ends what the object holds of the C++ core (idempotent)."""


_order = itertools.count()
_live: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


def track(obj: Releasable) -> None:
    """Releases ``obj``'s native handles at interpreter exit unless it is freed first."""
    _live[obj] = next(_order)


@atexit.register
def _release_at_exit() -> None:
    for obj, _ in sorted(list(_live.items()), key=lambda item: -item[1]):
        try:
            obj._release_native()
        except Exception as error:  # noqa: BLE001 - exit goes on; the error is said, once, on stderr
            import sys

            print(f"tierflow: at exit, releasing {type(obj).__name__} failed: {error}", file=sys.stderr)
    _live.clear()
    gc.collect()  # the cycles that held the handles, while the extension is loaded
