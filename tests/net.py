"""Loopback helpers for the multi-rank tests."""

from __future__ import annotations

import socket
from datetime import timedelta


def close_group() -> None:
    """End a rank's process group once every rank is done with it. A rank that tears its group
    down while a peer still talks to it can take the peer down at exit (seen once in a full run:
    a rank that had reported its results aborted with "terminate called without an active
    exception"). A peer that crashed or hangs does not hold this rank past the timeout: its own
    report says what happened."""
    import torch.distributed as dist

    try:
        dist.monitored_barrier(timeout=timedelta(seconds=60))
    except RuntimeError:
        pass
    dist.destroy_process_group()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for a gloo rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target, *args, world: int = 2, timeout_s: float = 300) -> dict[int, object]:
    """Run ``target(rank, world, port, *args, queue)`` on ``world`` spawned processes (gloo on
    loopback) and return what each put on the queue as ``(rank, result)``, by rank. Every
    process must exit cleanly; one left waiting in a collective (its peer failed) is killed."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=timeout_s) for _ in procs)
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0, f"a rank exited with {p.exitcode}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return results


def in_ranks(body, *args, world: int = 2, timeout_s: float = 300) -> dict[int, dict]:
    """Run ``body(rank, world, *args) -> dict`` on ``world`` gloo ranks (one thread each) and
    return each rank's dict, by rank. A rank whose body raised fails the caller with its
    traceback. ``body`` must be a module-level function (it is pickled by name)."""
    results = run_ranks(_rank_main, body, *args, world=world, timeout_s=timeout_s)
    for r in results.values():
        assert "crash" not in r, r["crash"]
    return results


def _rank_main(rank: int, world: int, port: int, body, *rest) -> None:
    import os
    import traceback

    import torch
    import torch.distributed as dist

    *args, queue = rest
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result: dict = {}
    try:
        result = body(rank, world, *args)
    except Exception:  # noqa: BLE001 - report, don't hang the other rank's queue.get
        result = {"crash": traceback.format_exc()}
    finally:
        queue.put((rank, result))
        close_group()
