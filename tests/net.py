"""Loopback helpers for the multi-rank tests."""

from __future__ import annotations

import socket


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
