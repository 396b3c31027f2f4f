"""Words and units for people: what a plan keeps, and frontier numbers in MiB/GiB and ms.

Plain functions on plain data (no torch, no matplotlib): the planner writes summaries with them
into ``frontier.json``; ``tools/frontier.py`` and ``tapesac/plot.py`` read units with them.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable, Sequence

_BYTE_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))

# "%36.1 aten._scaled_dot_product_flash_attention_for_cpu.default": op 36's output slot 1.
_VALUE_NAME = re.compile(r"^%(?P<op>\d+)\.(?P<slot>\d+) (?P<op_name>\S+)$")
_SHORT = {"scaled_dot_product": "sdpa"}


def fmt_bytes(n: float) -> str:
    """Bytes for people: 1.50 GiB, 312.0 MiB, 4.0 KiB, 12 B."""
    for unit, size in _BYTE_UNITS:
        if abs(n) >= size:
            return f"{n / size:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{n:.0f} B"


def bytes_unit(largest: float) -> tuple[str, float]:
    """The unit that shows ``largest`` bytes with one to four digits before the point:
    ``("GiB", 2**30)``, ``("MiB", 2**20)``, ``("KiB", 2**10)`` or ``("B", 1)``."""
    for name, size in _BYTE_UNITS:
        if abs(largest) >= size:
            return name, float(size)
    return "B", 1.0


@dataclasses.dataclass
class Axes:
    """How to show a frontier's two numbers: each one's label, unit name and scale.

    A value ``x`` as stored shows as ``x / scale`` in ``unit``. Unitless frontiers (the abstract
    graphs of the frontier tool) have ``unit == ""`` and ``scale == 1``.
    """

    memory_label: str
    memory_unit: str
    memory_scale: float
    time_label: str
    time_unit: str
    time_scale: float

    def memory(self, x: float) -> float:
        return x / self.memory_scale

    def time(self, x: float) -> float:
        return x / self.time_scale

    def memory_title(self) -> str:
        return f"{self.memory_label} ({self.memory_unit})" if self.memory_unit else self.memory_label

    def time_title(self) -> str:
        return f"{self.time_label} ({self.time_unit})" if self.time_unit else self.time_label


def _split_unit(label: str, default_unit: str | None) -> tuple[str, str | None]:
    """``"predicted step peak (bytes)"`` -> ``("predicted step peak", "bytes")``; a label without a
    trailing unit keeps ``default_unit``."""
    m = re.match(r"^(.*?)\s*\((bytes|s|MiB|GiB|ms)\)$", label)
    return (m.group(1), m.group(2)) if m else (label, default_unit)


def frontier_axes(result: dict[str, Any]) -> Axes:
    """Labels and units for a frontier dict (``Plan.frontier_json``, ``tools/frontier.py``'s
    ``--json`` or the benchmark's plot input). Memory in bytes shows in the unit its largest value
    needs (``bytes_unit``), time in seconds shows in ms; other units show as they are.

    Files written before the units had fields of their own carry them in the labels
    (``"predicted step peak (bytes)"``); those are read too.
    """
    mem_label, mem_unit = _split_unit(result.get("memory_label", "memory"), result.get("memory_unit"))
    time_label, time_unit = _split_unit(result.get("time_label", "recompute time"), result.get("time_unit"))
    mems = [p["memory"] for p in result.get("frontier", [])]
    mems += [p["memory"] for f in result.get("frontiers", []) for p in f["points"]]
    if result.get("limit_bytes") is not None:
        mems.append(result["limit_bytes"])
    mem_scale = 1.0
    if mem_unit == "bytes":
        mem_unit, mem_scale = bytes_unit(max(mems, default=0.0))
    time_scale = 1.0
    if time_unit == "s":
        time_unit, time_scale = "ms", 1e-3
    return Axes(mem_label, mem_unit or "", mem_scale, time_label, time_unit or "", time_scale)


def short_op_name(name: str) -> tuple[str, int]:
    """A value name as people say it, and its output slot.

    ``"%36.1 aten._scaled_dot_product_flash_attention_for_cpu.default"`` -> ``("sdpa", 1)``,
    ``"%3.0 aten.rsqrt.default"`` -> ``("rsqrt", 0)``; names of another form (the abstract graphs'
    ``"x4"``) are returned as they are, slot 0.
    """
    m = _VALUE_NAME.match(name)
    if not m:
        return name, 0
    parts = m.group("op_name").split(".")
    op = parts[1] if len(parts) == 3 else m.group("op_name")  # namespace.op.overload
    op = op.lstrip("_")
    for prefix, short in _SHORT.items():
        if op.startswith(prefix):
            op = short
    return op, int(m.group("slot"))


def group_names(names: Iterable[str]) -> str:
    """``"mm x3, sdpa, sdpa[1]"``: value names grouped by op (``short_op_name``; an output slot
    above 0 in brackets), in the order they first appear."""
    counts: dict[str, int] = {}
    for name in names:
        op, slot = short_op_name(name)
        key = f"{op}[{slot}]" if slot else op
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(k if n == 1 else f"{k} x{n}" for k, n in counts.items())


def summarise_keep(names: Sequence[str] | None, kept: Iterable[int], read: Iterable[int]) -> str:
    """What a block keeps and what its backward rebuilds, grouped by op, in tape order.

    ``names`` are the graph's value names (``BlockGraph.names``; None: value indices), ``kept`` the
    kept values, ``read`` the values backward reads. Read values not kept are rebuilt by replay::

        summarise_keep(g.names, point.kept, g.read)
        -> "keeps: rsqrt x2, view x7, sdpa, sdpa[1]; recomputes: mul x2, silu"
    """
    kept = set(kept)
    name = (lambda v: names[v]) if names else (lambda v: f"value {v}")  # noqa: E731
    keeps = group_names(name(v) for v in sorted(kept)) or "nothing"
    recomputes = group_names(name(v) for v in sorted(set(read) - kept)) or "nothing"
    return f"keeps: {keeps}; recomputes: {recomputes}"


def block_ranges(blocks: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out: list[str] = []
    run: list[int] = []
    for b in sorted(blocks):
        if run and b != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(b)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)


def fmt_number(x: float) -> str:
    """A number for a label or a table cell, without exponent: whole numbers as they are, others
    to three significant digits (one decimal from 100, none from 1000): 23, 5.84, 0.38, 233.3."""
    if float(x).is_integer():
        return str(int(x))
    if abs(x) >= 1000:
        return f"{x:.0f}"
    if abs(x) >= 100:
        return f"{x:.1f}"
    return f"{x:.3g}"
