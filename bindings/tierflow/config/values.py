"""The JSON values of a DeepSpeed config, checked and converted as DeepSpeed
reads them: numbers written as strings ("1e-4") or floats with a whole value
(5e8), flags, choices, paths, sizes. Each converter takes the dotted key and
the raw value and raises ValueError naming both."""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Mapping

from tierflow import _core
from tierflow.config.schema import _show


def _number(path: str, raw: Any) -> int | float:
    """A JSON number, or a string holding one ("1e-4"), as DeepSpeed's configs
    carry them; bools, non-finite values and anything else are refused."""
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        raise ValueError(f"{path}: {_show(raw)} is not a number")
    value: int | float
    if isinstance(raw, str):
        text = raw.strip()
        try:
            value = int(text)
        except ValueError:
            try:
                value = float(text)
            except ValueError:
                raise ValueError(f"{path}: {_show(raw)} is not a number") from None
    else:
        value = raw
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{path}: {_show(raw)} is not a finite number")
    return value


def _whole(minimum: int = 0, maximum: int | None = None) -> Callable[[str, Any], int]:
    """A whole number in [minimum, maximum]; 5e8 and "5e8" are 500000000."""

    def convert(path: str, raw: Any) -> int:
        value = _number(path, raw)
        if isinstance(value, float):
            if not value.is_integer():
                raise ValueError(f"{path}: {_show(raw)} is not a whole number")
            value = int(value)
        if value < minimum or (maximum is not None and value > maximum):
            upper = "" if maximum is None else f" and ≤ {maximum}"
            raise ValueError(f"{path}: {_show(raw)} is not a whole number ≥ {minimum}{upper}")
        return value

    return convert


def _real(low: float | None = None, high: float | None = None, *, low_open: bool = False,
          high_open: bool = False) -> Callable[[str, Any], float]:
    """A finite number in the interval given (open or closed at each end)."""

    def convert(path: str, raw: Any) -> float:
        value = float(_number(path, raw))
        below = low is not None and (value <= low if low_open else value < low)
        above = high is not None and (value >= high if high_open else value > high)
        if below or above:
            left = "(" if low_open else "["
            right = ")" if high_open else "]"
            lo = "-inf" if low is None else f"{low:g}"
            hi = "inf" if high is None else f"{high:g}"
            raise ValueError(f"{path}: {_show(raw)} is outside {left}{lo}, {hi}{right}")
        return value

    return convert


def _flag(path: str, raw: Any) -> bool:
    if not isinstance(raw, bool):
        raise ValueError(f"{path}: {_show(raw)} is not true or false")
    return raw


def _choice(*options: str) -> Callable[[str, Any], str]:
    def convert(path: str, raw: Any) -> str:
        if not isinstance(raw, str) or raw not in options:
            listed = ", ".join(f'"{o}"' for o in options[:-1]) + f' or "{options[-1]}"'
            raise ValueError(f"{path}: {_show(raw)} is not {listed}")
        return raw

    return convert


def _text(path: str, raw: Any) -> str:
    if isinstance(raw, os.PathLike):
        raw = os.fspath(raw)
    if not isinstance(raw, str) or not raw:
        raise ValueError(f"{path}: {_show(raw)} is not a path")
    return raw


def _stage(path: str, raw: Any) -> int:
    value = _number(path, raw)
    if value not in (0, 1, 2, 3):
        raise ValueError(f"{path}: {_show(raw)} is not a ZeRO stage (0, 1, 2 or 3)")
    return int(value)


def _betas(path: str, raw: Any) -> tuple[float, float]:
    if not isinstance(raw, (list, tuple)) or len(raw) != 2:
        raise ValueError(f"{path}: {_show(raw)} is not a pair of numbers [beta1, beta2]")
    unit = _real(0.0, 1.0, high_open=True)
    return (unit(f"{path}[0]", raw[0]), unit(f"{path}[1]", raw[1]))


def _lr_or_lrs(positive: bool) -> Callable[[str, Any], float | tuple[float, ...]]:
    """A learning rate, or one per param group (DeepSpeed's schedulers take both)."""
    one = _real(0.0, low_open=positive)

    def convert(path: str, raw: Any) -> float | tuple[float, ...]:
        if isinstance(raw, (list, tuple)):
            if not raw:
                raise ValueError(f"{path}: [] has no learning rate")
            return tuple(one(f"{path}[{i}]", v) for i, v in enumerate(raw))
        return one(path, raw)

    return convert


def _size(path: str, raw: Any) -> int:
    """Bytes: an int (5e8 too) or a size string "8G", "512M" as the CLI's flags take."""
    if isinstance(raw, str):
        try:
            return _whole(1)(path, raw)
        except ValueError:
            return _core.parse_size(raw, path)
    return _whole(1)(path, raw)


def _json_numbers(section: Mapping[str, Any]) -> dict[str, Any]:
    """A section for a C++ parser: numbers written as strings ("1e6") or as
    floats with a whole value (1e6) become JSON numbers of the kind a whole
    number is, so the C++ type checks see what DeepSpeed's JSON would hold."""
    out: dict[str, Any] = {}
    for key, value in section.items():
        if isinstance(value, str) and value.strip() not in ("", "auto"):
            try:
                value = _number(key, value)
            except ValueError:
                pass
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        out[key] = value
    return out
