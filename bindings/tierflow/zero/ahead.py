"""The order a training iteration gathers its sharded parameters in, so that
the next iteration gathers each one ahead of its use.

With several ranks, :meth:`~tierflow.zero.partition.ParamStore.fetch`
gathers a parameter from every rank's shard. An iteration (the micro-batches
up to an optimizer step) fetches the same parameters in the same order as
the one before it, on every rank alike, so :class:`FetchOrder` records the
order and, during the next iteration, tells which fetches come next: the
store issues their gathers then, and each runs on the communicator while the
layers before it compute. An iteration that departs from the record gets no
more gathers ahead (every fetch of it on demand) and becomes the record.

Every rank decides from the same record and the same budgets, never from
timing, so every rank issues the same collectives in the same order.
"""

from __future__ import annotations

from typing import Iterator

__all__ = ["FetchOrder"]


class FetchOrder:
    """The sharded fetches of the last iteration (partition indices, in
    order) and where the iteration under way stands in them."""

    def __init__(self) -> None:
        self.last: list[int] = []  # the record: the last complete iteration's fetches
        self._now: list[int] = []  # this iteration's, so far
        self._cursor = 0           # fetches of the record this iteration has made
        self.on_track = False      # whether this iteration has followed the record so far
        self.departures = 0        # iterations that departed from the record (or had none)

    def begin(self) -> None:
        self._now, self._cursor = [], 0
        self.on_track = bool(self.last)

    def fetched(self, index: int) -> None:
        """Partition ``index`` is being fetched (not resident: a gather)."""
        self._now.append(index)
        if not self.on_track:
            return
        if self._cursor < len(self.last) and self.last[self._cursor] == index:
            self._cursor += 1
        else:
            self.on_track = False

    def upcoming(self) -> Iterator[int]:
        """The fetches the record says come next (none once this iteration
        has departed from it)."""
        if self.on_track:
            yield from self.last[self._cursor:]

    def end(self) -> None:
        """Ends the iteration; one that departed from the record (or made
        fewer fetches) becomes the record."""
        if self._now != self.last:
            self.departures += 1
            self.last = self._now
        self._now, self._cursor, self.on_track = [], 0, False
