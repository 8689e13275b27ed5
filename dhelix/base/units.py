"""Sizes and times as people write and read them: '2GiB', '500MB'; '1.23 ms'."""
from __future__ import annotations

import re
from typing import Optional

_UNITS = {"": 1, "b": 1,
          "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


class SizeError(ValueError):
    """A size that cannot be read, or is not positive."""


def parse_bytes(text: str, flag: Optional[str] = None) -> float:
    """'2GiB' -> 2147483648, '500MB' -> 5e8, '1.5G' -> 1.5 * 2**30, '123' -> 123.

    KB/MB/GB/TB are powers of 1000; KiB/MiB/GiB/TiB and the bare K/M/G/T powers of 1024.
    A bad value raises SizeError, its message starting with `flag: ` when one is given."""
    where = f"{flag}: " if flag else ""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise SizeError(f"{where}cannot read {text!r} as a size; write e.g. 2GiB, "
                        f"500MB, 1.5G or a number of bytes")
    v = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if v <= 0:
        raise SizeError(f"{where}{text!r} is not a positive size")
    return v


def fmt_bytes(v: Optional[float]) -> str:
    if v is None:
        return "-"
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(v) >= k:
            return f"{v / k:.2f} {unit}"
    return f"{v:.0f} B"


def fmt_time(s: Optional[float]) -> str:
    if s is None:
        return "-"
    if abs(s) >= 1.0:
        return f"{s:.3f} s"
    if abs(s) >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.2f} µs"
