"""Policy: which tape values each block keeps, keyed by stable tape positions, as versioned JSON."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from .errors import PolicyError

POLICY_VERSION = 1


@dataclasses.dataclass
class BlockPolicy:
    """What one block keeps."""

    signature: str
    """Tape signature the positions refer to; a block whose tape differs must not use them."""
    keep: list[tuple[int, int]]
    """Positions ``(op index, slot)`` of the values to keep."""
    kept_bytes: int = 0
    """Predicted bytes of the kept storages."""
    recompute_s: float = 0.0
    """Predicted replay time of this block's backward, in seconds."""
    passthrough: bool = False
    """The block keeps everything backward reads: run it as plain autograd, not recorded."""


@dataclasses.dataclass
class Policy:
    """Per-block keep sets plus the numbers the plan was made with."""

    blocks: dict[int, BlockPolicy]
    limit_bytes: int | None = None
    """Step-peak limit the plan was solved for."""
    predicted_peak_bytes: int | None = None
    predicted_recompute_s: float | None = None
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Free-form facts about where the plan came from (world size, model, solver status)."""

    def for_block(self, index: int) -> BlockPolicy:
        try:
            return self.blocks[index]
        except KeyError:
            raise PolicyError(
                f"the policy has no entry for block {index} (it covers blocks "
                f"{sorted(self.blocks)}); it was made for a different model"
            ) from None

    @classmethod
    def replay_only(cls, signatures: dict[int, str]) -> "Policy":
        return cls({i: BlockPolicy(sig, []) for i, sig in signatures.items()})

    def to_json(self) -> dict[str, Any]:
        return {
            "version": POLICY_VERSION,
            "limit_bytes": self.limit_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "predicted_recompute_s": self.predicted_recompute_s,
            "meta": self.meta,
            "blocks": {
                str(i): {"signature": b.signature, "keep": [list(p) for p in b.keep],
                         "kept_bytes": b.kept_bytes, "recompute_s": b.recompute_s,
                         "passthrough": b.passthrough}
                for i, b in sorted(self.blocks.items())
            },
        }

    @classmethod
    def from_json(cls, data: Any, source: str = "policy") -> "Policy":
        """The policy ``data`` (parsed JSON) describes; :class:`PolicyError` for anything else.

        Every malformed input, whatever its shape, is a ``PolicyError`` whose message names
        ``source`` and the first field that is wrong, so a caller can fall back to a fresh plan.
        Unknown fields are ignored: a newer writer may add facts an older reader does not need.
        """
        try:
            return cls._parse(data)
        except _Malformed as e:
            raise PolicyError(f"{source} is not a usable TapeSAC policy: {e}") from None

    @classmethod
    def _parse(cls, data: Any) -> "Policy":
        if not isinstance(data, dict):
            raise _Malformed(f"the top level is {_kind(data)}, expected an object with 'version' and 'blocks'")
        if "version" not in data:
            raise _Malformed("no 'version' field")
        version = data["version"]
        if type(version) is not int or version != POLICY_VERSION:
            raise _Malformed(f"format version {_short(version)} is not supported (expected {POLICY_VERSION})")
        if "blocks" not in data:
            raise _Malformed("no 'blocks' field")
        raw_blocks = data["blocks"]
        if not isinstance(raw_blocks, dict):
            raise _Malformed(f"'blocks' is {_kind(raw_blocks)}, expected an object keyed by block index")
        blocks: dict[int, BlockPolicy] = {}
        for key, entry in raw_blocks.items():
            index = _block_index(key)
            if index in blocks:
                raise _Malformed(f"block {index} appears twice in 'blocks'")
            blocks[index] = _block(f"blocks[{_short(key)}]", entry)
        meta = data.get("meta")
        if meta is not None and not isinstance(meta, dict):
            raise _Malformed(f"'meta' is {_kind(meta)}, expected an object")
        return cls(blocks, _optional_count("limit_bytes", data.get("limit_bytes")),
                   _optional_count("predicted_peak_bytes", data.get("predicted_peak_bytes")),
                   _optional_seconds("predicted_recompute_s", data.get("predicted_recompute_s")),
                   dict(meta or {}))

    def save(self, path: str | Path) -> None:
        """Write the policy to ``path`` atomically: readers see the old file or the new one, whole.

        The JSON goes to a uniquely named temporary file in the same directory (two writers never
        share it), is flushed to disk, and then replaces ``path`` in one rename.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.to_json(), indent=1)
        try:
            mode = path.stat().st_mode & 0o777
        except OSError:
            mode = 0o644  # NamedTemporaryFile creates 0600; a policy is meant to be shared
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=path.parent, prefix=f".{path.name}.",
                                         suffix=".tmp", delete=False) as f:
            tmp = Path(f.name)
            try:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
                os.chmod(tmp, mode)
            except BaseException:
                f.close()
                tmp.unlink(missing_ok=True)
                raise
        try:
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(path.parent)

    @classmethod
    def load(cls, path: str | Path) -> "Policy":
        """The policy saved at ``path``. Raises only :class:`PolicyError`, naming the file and why."""
        where = f"policy file {path}"
        try:
            raw = Path(path).read_bytes()
        except OSError as e:
            raise PolicyError(f"{where} cannot be read: {e.strerror or e}") from None
        if not raw.strip():
            raise PolicyError(f"{where} is empty (an interrupted write?)")
        try:
            data = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise PolicyError(f"{where} is not text (not UTF-8 at byte {e.start})") from None
        except ValueError as e:  # JSONDecodeError, or a number too long to convert
            raise PolicyError(f"{where} is not valid JSON: {e}") from None
        except RecursionError:
            raise PolicyError(f"{where} is not valid JSON: nested too deeply") from None
        return cls.from_json(data, source=where)


class _Malformed(Exception):
    """A field of a policy is wrong; :meth:`Policy.from_json` turns it into a PolicyError."""


def _short(x: Any, limit: int = 60) -> str:
    """``repr(x)`` cut to ``limit`` characters: a message must stay readable whatever the file holds."""
    r = repr(x)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _kind(x: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(x), type(x).__name__)


def _block_index(key: Any) -> int:
    # JSON keys are strings; a dict built in Python may use ints. Only the canonical spelling
    # counts, so "3" and "03" cannot both name block 3.
    if type(key) is int and key >= 0:
        return key
    if isinstance(key, str) and key.isascii() and key.isdigit() and str(int(key)) == key:
        return int(key)
    raise _Malformed(f"block key {_short(key)} is not a non-negative integer")


def _block(where: str, entry: Any) -> BlockPolicy:
    if not isinstance(entry, dict):
        raise _Malformed(f"{where} is {_kind(entry)}, expected an object")
    if not isinstance(entry.get("signature"), str):
        raise _Malformed(f"{where}.signature is missing or not a string")
    keep = entry.get("keep")
    if not isinstance(keep, list):
        raise _Malformed(f"{where}.keep is missing or not a list")
    positions = []
    for i, p in enumerate(keep):
        if not (isinstance(p, (list, tuple)) and len(p) == 2 and all(type(x) is int and x >= 0 for x in p)):
            raise _Malformed(f"{where}.keep[{i}] = {_short(p)} is not an [op index, slot] pair of non-negative integers")
        positions.append((p[0], p[1]))
    passthrough = entry.get("passthrough", False)
    if type(passthrough) is not bool:
        raise _Malformed(f"{where}.passthrough = {_short(passthrough)} is not true or false")
    kept_bytes = _optional_count(f"{where}.kept_bytes", entry.get("kept_bytes", 0))
    recompute_s = _optional_seconds(f"{where}.recompute_s", entry.get("recompute_s", 0.0))
    return BlockPolicy(entry["signature"], positions, kept_bytes or 0,
                       0.0 if recompute_s is None else recompute_s, passthrough)


def _optional_count(where: str, x: Any) -> int | None:
    if x is None:
        return None
    if type(x) is int and x >= 0:
        return x
    if type(x) is float and x.is_integer() and x >= 0:
        return int(x)
    raise _Malformed(f"{where} = {_short(x)} is not a non-negative integer")


def _optional_seconds(where: str, x: Any) -> float | None:
    if x is None:
        return None
    if type(x) in (int, float) and math.isfinite(x) and x >= 0:
        return float(x)
    raise _Malformed(f"{where} = {_short(x)} is not a finite non-negative number of seconds")


def _fsync_dir(folder: Path) -> None:
    """Make the rename itself durable; not every platform can open a directory, so best effort."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
