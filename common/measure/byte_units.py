"""Byte counts as a person reads them: the binary unit a number reads best in (``byte_unit``)
and the number written in it (``fmt_bytes``: "1.50 MiB"), for every table, figure and line
the tutorial prints."""
from __future__ import annotations


def byte_unit(n: float) -> tuple[int, str]:
    """The binary unit a byte count reads best in (at least KiB: for axes and tables)."""
    return (2**30, "GiB") if abs(n) >= 2**30 else (2**20, "MiB") if abs(n) >= 2**20 else (2**10, "KiB")


def fmt_bytes(n: float, spec: str = ".2f") -> str:
    """``n`` bytes in its unit: "1.50 MiB"; ``spec=".4g"`` drops trailing zeros ("1 MiB")."""
    if abs(n) < 2**10:
        return f"{n:{'.0f' if spec == '.2f' else 'g'}} B"
    scale, unit = byte_unit(n)
    return f"{n / scale:{spec}} {unit}"
