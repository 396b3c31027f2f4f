"""Policy: which tape values each block keeps, keyed by stable tape positions, as versioned JSON."""

from __future__ import annotations

import dataclasses
import json
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
    def from_json(cls, data: dict[str, Any]) -> "Policy":
        if not isinstance(data, dict) or "blocks" not in data:
            raise PolicyError("not a TapeSAC policy: no 'blocks' field")
        version = data.get("version")
        if version != POLICY_VERSION:
            raise PolicyError(f"policy format version {version!r} is not supported (expected {POLICY_VERSION})")
        try:
            blocks = {
                int(i): BlockPolicy(b["signature"], [(int(p[0]), int(p[1])) for p in b["keep"]],
                                    int(b.get("kept_bytes", 0)), float(b.get("recompute_s", 0.0)),
                                    bool(b.get("passthrough", False)))
                for i, b in data["blocks"].items()
            }
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise PolicyError(f"malformed policy block entry: {e!r}") from None
        return cls(blocks, data.get("limit_bytes"), data.get("predicted_peak_bytes"),
                   data.get("predicted_recompute_s"), dict(data.get("meta") or {}))

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> "Policy":
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise PolicyError(f"policy file {path} is not valid JSON: {e}") from None
        return cls.from_json(data)
