"""Saved policies: rank 0 reads and checks the policy file, every rank applies the same.

A policy saved by planned mode names the limit it was planned for, the facts it was made under
(``PlanConfig.policy_meta``), and the step it was made for (its key and recordings); a file that
does not fit this run is ignored with a warning, and the run profiles instead.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from .. import distributed as tdist
from ..errors import PolicyError
from ..policy import Policy
from ..report import fmt_bytes
from .config import PlanConfig
from .ranks import say
from .step import StepPlan


def load_policy(config: PlanConfig, blocks: int) -> StepPlan | None:
    """The plan of ``config.policy_path``, if the file fits this run (of ``blocks`` blocks).
    Rank 0 reads the file and decides; every rank applies the same (one broadcast). Nothing
    rank 0 meets in the file may stop it before the broadcast (the others wait there)."""
    path = config.policy_path
    if not path:
        return None
    group = config.process_group
    payload: Any = (None, None)
    if tdist.rank(group) == 0:
        if os.path.exists(path):
            try:
                policy = Policy.load(path)
                recordings = check_loaded(policy, config, blocks)
                payload = ("policy", (policy.to_json(), recordings))
            except PolicyError as e:
                payload = ("ignored", str(e))
            except Exception as e:  # noqa: BLE001 - a file must never crash a run
                payload = ("ignored", f"{type(e).__name__}: {e}")
    kind, value = tdist.broadcast(payload, group)
    if kind == "ignored":
        say(group, logging.WARNING, "TapeSAC: ignoring policy file %s (%s); profiling instead", path, value)
    elif kind == "policy":
        data, recordings = value
        policy = Policy.from_json(data)
        entry = StepPlan(policy.meta["step_key"], recordings, policy,
                         limit_bytes=float(policy.limit_bytes or config.memory_limit_bytes),
                         verified=not config.verify, retained=policy.meta.get("retained") is True)
        say(group, logging.INFO, "TapeSAC: loaded policy %s (checked against the recorded tapes)", path)
        return entry
    return None


def check_loaded(policy: Policy, config: PlanConfig, blocks: int) -> list[tuple[int, str]]:
    """Why ``policy`` does not fit this run (PolicyError), or the recordings it was made for."""
    requested = policy.meta.get("limit_requested_bytes", policy.limit_bytes)
    if requested != config.memory_limit_bytes:
        shown = fmt_bytes(requested) if isinstance(requested, (int, float)) else repr(requested)
        raise PolicyError(f"it was planned for a limit of {shown}, not "
                          f"{fmt_bytes(config.memory_limit_bytes)}")
    for key, value in config.policy_meta.items():
        if policy.meta.get(key) != value:
            raise PolicyError(f"it was planned for {key}={policy.meta.get(key)!r}, not {value!r}")
    recordings = policy.meta.get("recordings")
    if not isinstance(policy.meta.get("step_key"), str) or not isinstance(recordings, list) or any(
            not (isinstance(r, list) and len(r) == 2 and type(r[0]) is int and isinstance(r[1], str))
            for r in recordings):
        raise PolicyError("it does not say which step it was made for (made by an older TapeSAC?)")
    recordings = [(b, k) for b, k in recordings]
    if {b for b, _k in recordings} != set(policy.blocks):
        raise PolicyError("its blocks and its step's recordings do not match")
    if not set(policy.blocks) <= set(range(blocks)):
        raise PolicyError(f"it covers blocks {sorted(policy.blocks)}, this model has {blocks}")
    return recordings
