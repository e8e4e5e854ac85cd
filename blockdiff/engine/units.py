"""Byte counts as people read them, for the engine's messages, ``view`` and
the command line."""

from __future__ import annotations


def human_size(n: int) -> str:
    """A byte count in binary units, e.g. '4.0 KiB'."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError
