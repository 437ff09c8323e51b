"""Human byte sizes: parse `64MiB`, `1.5GiB`, `1e9`, `4096`; format bytes for people."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")

SIZE_HINT = "a byte count such as 4096, 1e9, 64MiB or 1.5GiB"


def parse_size(value: object, *, what: str = "size") -> int:
    """Return `value` as a whole number of bytes.

    Accepts ints, floats that are whole numbers of bytes, and strings such as ``"64MiB"``,
    ``"1.5GiB"``, ``"1e9"``, ``"512k"``. Binary units (KiB, MiB, GiB, TiB) are powers of 1024,
    decimal ones (kB, MB, GB, TB) powers of 1000. Raises ValueError naming `what` otherwise.
    """
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected {SIZE_HINT}, got {value!r}")
    if isinstance(value, int):
        number: float = value
        unit = 1
    elif isinstance(value, float):
        number, unit = value, 1
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"{what}: expected {SIZE_HINT}, got {value!r}")
        number, unit = float(match.group(1)), _UNITS[match.group(2).lower()]
    else:
        raise ValueError(f"{what}: expected {SIZE_HINT}, got {type(value).__name__} {value!r}")
    total = number * unit
    if total != int(total):
        raise ValueError(f"{what}: {value!r} is not a whole number of bytes")
    if total < 0:
        raise ValueError(f"{what}: expected a size >= 0, got {value!r}")
    return int(total)


def format_size(nbytes: float) -> str:
    """Return `nbytes` in binary units with three significant digits, e.g. ``1.50 GiB``."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
