"""Byte counts for people: adaptive binary units (torch-free, shared by messages, logs and reports)."""

from __future__ import annotations

__all__ = ["format_bytes"]

_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(n: int | float) -> str:
    """``n`` bytes in the largest binary unit that keeps the number at least 1, to three significant figures:
    ``"512 B"``, ``"3.20 KiB"``, ``"24.0 MiB"``, ``"117 MiB"``, ``"1.50 GiB"``. Counts below 1 KiB are whole
    bytes, so a small size never reads as zero of a larger unit."""
    if n < 0:
        return "-" + format_bytes(-n)
    if round(n) < 1024:
        return f"{round(n)} B"
    value, unit = float(n), 0
    while unit + 1 < len(_BINARY_UNITS) and (value >= 1024 or float(_three_figures(value)) >= 1024):
        value, unit = value / 1024, unit + 1
    return f"{_three_figures(value)} {_BINARY_UNITS[unit]}"


def _three_figures(value: float) -> str:
    """``value`` (at least 1) with the decimals that leave three significant figures (none from 100 up)."""
    for decimals in (2, 1):
        text = f"{value:.{decimals}f}"
        if float(text) < 10 ** (3 - decimals):
            return text
    return f"{value:.0f}"
