"""The exceptions tierflow raises, one class per kind of failure.

tierflow's C++ core throws one family of errors; the extension translates each
once, on its way out:

* an environment failure (a system call, an I/O completion, a CUDA call) is a
  :class:`TierflowError`, an :class:`OSError` with ``errno`` and ``filename``
  and the context tierflow knows (``operation``, ``offset``, ``length``,
  ``tier``, ``block``, ``where``);
* a tier's budget that cannot hold a request is a :class:`BudgetError`, both a
  :class:`MemoryError` and a :class:`TierflowError`, naming the tier, its
  budget and the request;
* a bad argument or configuration value is a plain :class:`ValueError` whose
  message names the argument.
"""

from __future__ import annotations

__all__ = ["TierflowError", "BudgetError"]


class TierflowError(OSError):
    """An operation on a file, device or tier failed.

    Besides OSError's ``errno``, ``strerror`` (tierflow's one-line message) and
    ``filename`` (the path, or None), it carries: ``operation`` (e.g. "read",
    "open"), ``offset`` and ``length`` (bytes, or None), ``tier`` ("device",
    "host", "nvme" or None), ``block`` (the block's name or None) and ``where``
    (the C++ "file:line" that raised it).
    """

    def __init__(self, errno: int, message: str, filename: str | None = None, *,
                 operation: str | None = None, offset: int | None = None,
                 length: int | None = None, tier: str | None = None,
                 block: str | None = None, where: str | None = None) -> None:
        super().__init__(errno, message)
        # Set after construction so that str() is tierflow's message alone
        # (which already names the path), not OSError's "[Errno n] ...: path".
        self.filename = filename
        self.operation = operation
        self.offset = offset
        self.length = length
        self.tier = tier
        self.block = block
        self.where = where

    def __str__(self) -> str:
        return self.strerror

    def __reduce__(self):
        return (_rebuild, (type(self), self.errno, self.strerror, self.filename, self.__dict__))


class BudgetError(TierflowError, MemoryError):
    """A tier's budget cannot hold a request: ``tier`` names the tier, ``budget``
    its size in bytes and ``request`` the bytes asked for (``block`` names the
    block they were for)."""

    def __init__(self, errno: int, message: str, filename: str | None = None, *,
                 budget: int | None = None, request: int | None = None, **context) -> None:
        super().__init__(errno, message, filename, **context)
        self.budget = budget
        self.request = request


def _rebuild(cls, errno, message, filename, attributes):
    error = cls(errno, message, filename)
    error.__dict__.update(attributes)
    return error
