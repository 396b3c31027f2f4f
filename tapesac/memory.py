"""Bytes for people. (The meters live in ``tapesac.meter``, the step-peak model the planner reads
in ``tapesac.stepmodel``.)"""

from __future__ import annotations


def fmt_bytes(n: float) -> str:
    """Bytes for people: 1.50 GiB, 312.0 MiB, 4.0 KiB, 12 B."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{n:.0f} B"
