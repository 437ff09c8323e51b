"""Human byte sizes: parse `64MiB`, `1.5GiB`, `1e9`, `4096`; format bytes for people; quote values briefly."""

from __future__ import annotations

import math
import re
import reprlib
from fractions import Fraction

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

# Direct I/O needs offsets, lengths and addresses aligned to the drive's logical block; 4 KiB covers every NVMe
# drive tiermem targets, so every on-disk granule (blocks, stripes, partition sizes) is a multiple of it. The one
# definition: tiermem.io.buffers (ALIGN, aligned, check_io_size) and the config's checks take it from here.
IO_ALIGN = 4096

# The largest byte count anything can use: file offsets (off_t) and tensor sizes are signed 64-bit.
MAX_SIZE = 2**63 - 1

# Longest quote of a value in a message; the value itself may be a megabyte string or an alias bomb.
SHORT_REPR_CHARS = 80


class _ShortRepr(reprlib.Repr):
    """reprlib with room for a path, and enormous ints described instead of converted to digits."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxstring = self.maxother = SHORT_REPR_CHARS
        self.maxlong = 40

    def repr_int(self, x: int, level: int) -> str:
        # str() of an int past 4300 digits raises ValueError (and takes quadratic time before that)
        if x.bit_length() > 256:
            return f"<an integer of about {int(x.bit_length() * math.log10(2)) + 1} digits>"
        return super().repr_int(x, level)


_short_repr = _ShortRepr()


def short_repr(value: object) -> str:
    """repr(value) cut to about 80 characters, for error messages.

    It visits at most a few levels and items of a container, so a deeply nested or alias-shared structure
    (YAML's "billion laughs") costs no more to quote than a small one.
    """
    text = _short_repr.repr(value)
    return text if len(text) <= SHORT_REPR_CHARS else text[: SHORT_REPR_CHARS - 3] + "..."


def parse_size(value: object, *, what: str = "size") -> int:
    """Return `value` as a whole number of bytes.

    Accepts ints, floats that are whole numbers of bytes, and strings such as ``"64MiB"``,
    ``"1.5GiB"``, ``"1e9"``, ``"512k"``. Binary units (KiB, MiB, GiB, TiB) are powers of 1024,
    decimal ones (kB, MB, GB, TB) powers of 1000. The result is at most `MAX_SIZE`.

    Raises:
        ValueError: the message starts with `what` (a config key or a command-line flag), so callers
            can pass it on as it is; inf, nan and sizes past `MAX_SIZE` (``"1e400"``) included.
    """
    shown = short_repr(value)
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected {SIZE_HINT}, got {shown}")
    if isinstance(value, int):
        number: float = value
        unit = 1
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{what}: expected {SIZE_HINT}, got {shown}, which is not finite")
        number, unit = value, 1
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"{what}: expected {SIZE_HINT}, got {shown}")
        number, unit = float(match.group(1)), _UNITS[match.group(2).lower()]  # "1e400" reads as inf
    else:
        raise ValueError(f"{what}: expected {SIZE_HINT}, got {type(value).__name__} {shown}")
    total = number * unit
    if total > MAX_SIZE:  # an infinite product too; checked before int(), which cannot take inf
        raise ValueError(f"{what}: expected at most {MAX_SIZE} bytes (8 EiB), got {shown}")
    if total != int(total):
        raise ValueError(f"{what}: {shown} is not a whole number of bytes")
    if total < 0:
        raise ValueError(f"{what}: expected a size >= 0, got {shown}")
    return int(total)


def format_size(nbytes: float) -> str:
    """Return `nbytes` in binary units with three significant digits, e.g. ``1.50 GiB``."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_size_up(nbytes: int) -> str:
    """`nbytes` in binary units like `format_size`, but rounded up (and without exponents): the figure is never
    less than `nbytes`, so advice such as "raise memory.host_budget to at least 24.1 MiB" names a value that
    works. ``format_size_up(24 * 2**20 + 1)`` is ``24.1 MiB`` where `format_size` says ``24 MiB``."""
    if nbytes < 1024:
        return f"{max(0, math.ceil(nbytes))} B"
    value = Fraction(math.ceil(nbytes))
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    decimals = max(0, 3 - len(str(int(value))))  # three significant digits, or the whole number above 999
    scaled = math.ceil(value * 10**decimals)
    text = f"{scaled / 10**decimals:.{decimals}f}"
    return f"{text.rstrip('0').rstrip('.') if decimals else text} {unit}"
