"""Strict conversion of the public functions' arguments (one place for every module).

Nothing here coerces: ``det_bin=1.5`` is not 1, ``apply_mask="no"`` is not True, a region
``(0.5, 10.7, ...)`` is not ``(0, 10, ...)``. A value of the wrong type raises
:class:`~quantem.gpu.ArgumentTypeError` (an ``InvalidArgumentError`` and a ``TypeError``); a
value of the right type that is out of range (negative, zero where a count is meant, NaN or
inf, a reversed region, an integer too large for the engine) raises
:class:`~quantem.gpu.InvalidArgumentError` (a ``ValueError``). Both name the operation and the
argument, and say what was expected and what was found, like the engine's own errors.

Integers are Python ``int`` or numpy integer scalars (``np.int64``), never ``bool`` and never
floats (not even ``2.0``); flags are ``bool`` or ``np.bool_``; numbers are ints or floats
(numpy scalars included), never ``bool`` or strings.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from typing import Any

import numpy as np

from quantem.gpu import _native

#: The largest integer the engine takes for a size, index or count (it converts to ``usize``
#: through ``i64``); larger ones are refused here instead of overflowing there.
I64_MAX = 2**63 - 1
#: The largest byte count (``u64``).
U64_MAX = 2**64 - 1


def _make(cls, op: str, message: str, expected: str | None, found: str | None):
    text = f"{op}: {message}"
    if expected is not None and found is not None:
        text += f" (expected {expected}, found {found})"
    elif expected is not None:
        text += f" (expected {expected})"
    elif found is not None:
        text += f" (found {found})"
    err = cls(text)
    for name, value in (
        ("kind", "invalid_argument"),
        ("op", op),
        ("file", None),
        ("frame", None),
        ("expected", expected),
        ("found", found),
        ("detail", message),
    ):
        setattr(err, name, value)
    return err


def invalid(op: str, message: str, expected: str | None = None, found: str | None = None):
    """An :class:`~quantem.gpu.InvalidArgumentError` shaped like the engine's own errors."""
    return _make(_native.InvalidArgumentError, op, message, expected, found)


def wrong_type(op: str, message: str, expected: str, value: Any):
    """An :class:`~quantem.gpu.ArgumentTypeError` for ``value`` (its repr and type named)."""
    return _make(_native.ArgumentTypeError, op, message, expected, found(value))


def found(value: Any) -> str:
    """``value`` as the ``found`` text of an error: its (shortened) repr and its type."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_real(value: Any) -> bool:
    return _is_int(value) or isinstance(value, (float, np.floating))


def integer(
    op: str, name: str, value: Any, *, minimum: int | None = None, maximum: int = I64_MAX
) -> int:
    """``value`` as an ``int`` in ``[minimum, maximum]``."""
    lo = "" if minimum is None else f" >= {minimum}"
    if not _is_int(value):
        raise wrong_type(op, f"{name} must be an integer", f"an integer{lo}", value)
    v = int(value)
    if (minimum is not None and v < minimum) or v > maximum:
        rng = f"an integer in [{minimum}, {maximum}]" if minimum is not None else f"<= {maximum}"
        raise invalid(op, f"{name} is out of range", rng, str(v))
    return v


def optional_integer(op: str, name: str, value: Any, **bounds) -> int | None:
    """``None`` or :func:`integer`."""
    return None if value is None else integer(op, name, value, **bounds)


def flag(op: str, name: str, value: Any) -> bool:
    """``value`` as a ``bool`` (``True``/``False`` or ``np.bool_``; nothing else)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise wrong_type(op, f"{name} must be a bool", "True or False", value)


def optional_flag(op: str, name: str, value: Any) -> bool | None:
    """``None`` or :func:`flag`."""
    return None if value is None else flag(op, name, value)


def number(
    op: str,
    name: str,
    value: Any,
    *,
    minimum: float | None = None,
    positive: bool = False,
    below: float | None = None,
) -> float:
    """``value`` as a finite ``float``: ``> 0`` when ``positive``, ``>= minimum``, ``< below``."""
    if positive:
        want = "a finite number > 0"
    elif minimum is not None and below is not None:
        want = f"a finite number in [{minimum:g}, {below:g})"
    elif minimum is not None:
        want = f"a finite number >= {minimum:g}"
    else:
        want = "a finite number"
    if not _is_real(value):
        raise wrong_type(op, f"{name} must be a number", want, value)
    try:
        v = float(value)
    except OverflowError:
        raise invalid(op, f"{name} is out of range", want, str(value)) from None
    if not math.isfinite(v):
        raise invalid(op, f"{name} must be finite", want, repr(v))
    if (
        (positive and v <= 0)
        or (minimum is not None and v < minimum)
        or (below is not None and v >= below)
    ):
        raise invalid(op, f"{name} is out of range", want, repr(v))
    return v


def optional_number(op: str, name: str, value: Any, **bounds) -> float | None:
    """``None`` or :func:`number`."""
    return None if value is None else number(op, name, value, **bounds)


def _items(op: str, name: str, value: Any, n: int, what: str) -> list[Any]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (Iterable, np.ndarray)):
        raise wrong_type(op, f"{name} must be a sequence", what, value)
    items = list(np.asarray(value).tolist()) if isinstance(value, np.ndarray) else list(value)
    if len(items) != n:
        raise invalid(op, f"{name} must have {n} elements", what, repr(tuple(items)))
    return items


def shape2(op: str, name: str, value: Any) -> list[int] | None:
    """``None`` or ``(rows, cols)``, each an integer ``>= 1``."""
    if value is None:
        return None
    items = _items(op, name, value, 2, "(rows, cols)")
    return [integer(op, f"{name}[{i}]", v, minimum=1) for i, v in enumerate(items)]


def region(op: str, name: str, value: Any) -> list[int] | None:
    """``None`` or a half-open ``(row_start, row_stop, col_start, col_stop)``: integers
    ``>= 0`` with ``start < stop`` on both axes (an empty or reversed region is refused)."""
    if value is None:
        return None
    what = "(row_start, row_stop, col_start, col_stop)"
    items = _items(op, name, value, 4, what)
    v = [integer(op, f"{name}[{i}]", x, minimum=0) for i, x in enumerate(items)]
    for axis, (start, stop) in (("row", (v[0], v[1])), ("column", (v[2], v[3]))):
        if start >= stop:
            raise invalid(
                op,
                f"{name} is empty or reversed along the {axis}s",
                f"{axis}_start < {axis}_stop",
                repr(tuple(v)),
            )
    return v


def pair(op: str, name: str, value: Any) -> list[float] | None:
    """``None`` or a ``(row, col)`` pair of finite numbers."""
    if value is None:
        return None
    items = _items(op, name, value, 2, "(row, col)")
    return [number(op, f"{name}[{i}]", v) for i, v in enumerate(items)]


def path(op: str, name: str, value: Any) -> str:
    """A filesystem path: ``str``, ``os.PathLike`` or ``bytes`` (``os.fsdecode``)."""
    if isinstance(value, (str, bytes, os.PathLike)):
        p = os.fsdecode(os.fspath(value))
        if "\0" in p:
            raise invalid(op, f"{name} contains a NUL byte", "a path", repr(p))
        if p == "":
            raise invalid(op, f"{name} is empty", "a path", "''")
        return p
    raise wrong_type(op, f"{name} must be a path", "str, bytes or os.PathLike", value)


def text(op: str, name: str, value: Any, choices: Iterable[str] | None = None) -> str:
    """A ``str`` (one of ``choices`` when given, compared in lower case)."""
    if not isinstance(value, str):
        what = " or ".join(repr(c) for c in choices) if choices is not None else "a str"
        raise wrong_type(op, f"{name} must be a str", what, value)
    if choices is not None:
        choices = tuple(choices)
        if value.lower() not in choices:
            raise invalid(op, f"unknown {name}", " or ".join(choices), repr(value))
        return value.lower()
    return value


def dataset(op: str, value: Any, name: str = "ds"):
    """``value`` when it is a loaded :class:`~quantem.gpu.io.Dataset`."""
    if isinstance(value, _native.Dataset):
        return value
    raise wrong_type(op, f"{name} must be a Dataset", "a Dataset from io.load", value)
