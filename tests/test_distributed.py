"""Rank 0 plans for everyone: signature checks, profile reduction and broadcast over gloo."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from tapesac import distributed as tdist
from tapesac.errors import PolicyError
from tapesac.stepmodel import StepMemory, Window

from .net import close_group, run_ranks


def _worker(rank: int, world: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = {}
        try:  # rank 1 recorded other tapes for block 1
            tdist.check_signatures({0: "a", 1: "b" if rank == 0 else "c"})
        except PolicyError as e:
            result["error"] = str(e)
        tdist.check_signatures({0: "a", 1: "b"})  # equal: no error
        memory = StepMemory([Window("w", 100.0 + rank, [0], 0, [10.0 * rank, 5.0])])
        times, sizes, merged = tdist.reduce_profile({0: [1.0 + rank, 2.0]}, {0: [4.0, 8.0 - rank]}, memory, "max")
        result["times"], result["sizes"] = times, sizes
        result["memory"] = merged.to_json()
        result["mean"] = tdist.reduce_profile({0: [1.0 + rank]}, {0: [1.0]}, memory, "mean")[0]
        result["broadcast"] = tdist.broadcast({"from": rank})
        queue.put((rank, result))
    finally:
        close_group()


def test_signature_check_profile_reduction_and_broadcast_across_ranks():
    results = run_ranks(_worker, timeout_s=120)
    for rank in (0, 1):
        r = results[rank]
        assert "ranks [1] recorded different block tapes than rank 0 (blocks [1])" in r["error"]
        assert r["times"] == {0: [2.0, 2.0]} and r["sizes"] == {0: [4.0, 8.0]}
        assert r["memory"]["windows"][0]["peak_bytes"] == 101.0
        assert r["memory"]["windows"][0]["intervals"] == [10.0, 5.0]
        assert r["mean"] == {0: [1.5]}
        assert r["broadcast"] == {"from": 0}


def test_unknown_timing_reduction_is_an_error():
    with pytest.raises(ValueError, match="unknown timing reduction"):
        tdist.reduce_profile({}, {}, StepMemory([]), "sum")
