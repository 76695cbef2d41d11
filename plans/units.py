"""Reading and printing sizes: bytes (``"80GiB"``), FLOPs, counts.

>>> parse_bytes("80GiB")
85899345920
>>> format_bytes(85899345920)
'80.0 GiB'
"""

from __future__ import annotations

import re

from autopar_plans.errors import UsageError

_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(value: str | int | float) -> int:
    """``"80GiB"``, ``"80 GB"``, ``"1.5e9"`` or a number -> bytes. GB is 10^9, GiB 2^30."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        if value <= 0:
            raise UsageError(f"memory size {value}: must be positive")
        return int(value)
    match = _SIZE_RE.match(str(value))
    if match is None or match.group(2).lower() not in _BYTE_UNITS:
        raise UsageError(
            f"memory size {value!r}: write a number with a unit, such as 80GiB, 80GB or 512MiB"
        )
    size = float(match.group(1)) * _BYTE_UNITS[match.group(2).lower()]
    if size <= 0:
        raise UsageError(f"memory size {value!r}: must be positive")
    return int(size)


def format_bytes(size: float) -> str:
    """Binary units, one decimal: ``format_bytes(3 * 2**30) == '3.0 GiB'``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(size) >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size:.0f} B"


def format_flops(flops: float) -> str:
    """``format_flops(7.3e14) == '730.0 TFLOP'``."""
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if abs(flops) >= scale:
            return f"{flops / scale:.1f} {unit}"
    return f"{flops:.0f} FLOP"


def format_count(count: float) -> str:
    """``format_count(124_439_808) == '124.4M'``."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(count) >= scale:
            return f"{count / scale:.1f}{unit}"
    return f"{count:.0f}"


def format_seconds(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"
