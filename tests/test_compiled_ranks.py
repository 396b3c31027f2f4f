"""Compiled mode on two gloo ranks: which step measures a plan is decided alike on every rank,
even when one rank's compiled code differs from the other's.

Compiled mode on CPU measures a plan on a step that compiles nothing (compiling under the
allocator's profiler crashed the process), so whether a step is measured depends on which code
is compiled, and the measure is a collective. One rank whose compile fell back (its trace
departed from the tape: full AC for that block, compiled at its next forward) must not measure
while another does: the ranks would wait in different collectives. Blocks compile with
``aot_eager`` (the decision is the same under every backend; inductor on CPU is slow)."""

from __future__ import annotations

import os
import traceback
import warnings

import torch
import torch.distributed as dist

from .net import close_group, run_ranks

LIMIT = 450_000
"""Here the plan keeps some values of both blocks, not all (no pass-through block): the frontier
runs from 368,648 bytes (recompute everything) up; the plan measured 418,184 bytes, one rank."""
STEPS = 7
"""Warm-up, profile, the step that compiles the plan, then four steps under it."""


def departing(forward, block: int):
    """``CompiledRunner.forward`` whose first compiled forward of ``block`` under a plan departs
    from the tape (injected): that policy breaks, and the block's next forward compiles full AC."""
    def departing_forward(self, state, key, args, kwargs):
        out = forward(self, state, key, args, kwargs)
        if state.index == block and key != "recompute-all" and key not in self.broken:
            self._break(state.index, key, "the test's injected departure")
        return out

    return departing_forward


def train(seqs=(16,) * STEPS, limit: int = LIMIT, check=None) -> dict:
    """Train two blocks in compiled mode, one step per sequence length in ``seqs``; what the
    planner decided, per step and at the end. ``check(planner)`` runs at every step boundary."""
    import tapesac
    from tapesac.autoplan import PlanConfig

    from .loops import Model, tokens

    model = Model(blocks=2)
    handle = tapesac.wrap(model.layers, compile=True, compile_options={"backend": "aot_eager"},
                          plan_config=PlanConfig(memory_limit_bytes=limit))
    try:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        planner = handle.planner
        modes, measuring = [], []
        for step, seq in enumerate(seqs):
            opt.zero_grad()
            model(tokens(step, 0, seq)).backward()
            opt.step()
            modes.append(planner.last_step_mode)
            measuring.append(planner.measuring or planner.compiled.allocator is not None)  # the next step's
            if check is not None:
                check(planner)
        runner = handle.blocks[0].compiled
        return dict(modes=modes, measuring=measuring, history=planner.history,
                    broken=sorted(str(k) for k in runner.broken),
                    passthrough=[p.passthrough for p in handle.plan.policy.blocks.values()],
                    compiled=[s["compiled"] for s in handle.stats().values()])
    finally:
        handle.remove()


def _worker(rank: int, world: int, port: int, scenario: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result: dict = {}
    try:
        from tapesac.compiled import CompiledRunner, MappingWarning
        from tapesac.meter import AllocatorStepMeter

        if scenario == "fallback_on_rank_1" and rank == 1:
            CompiledRunner.forward = departing(CompiledRunner.forward, block=1)
        warnings.simplefilter("ignore", MappingWarning)
        if scenario == "profiler_on_rank_0":
            if rank == 0:  # as if the user profiled rank 0: the allocator meter cannot run there
                AllocatorStepMeter.available = staticmethod(lambda: False)
            result = train(seqs=(16, 24) * 5, limit=10**12)
        else:
            result = train()
    except Exception:  # noqa: BLE001 - report, don't hang the other rank's queue.get
        result["crash"] = traceback.format_exc()
    finally:
        queue.put((rank, result))
        close_group()


def _run(scenario: str) -> dict[int, dict]:
    results = run_ranks(_worker, scenario, timeout_s=60)  # a rank left in a collective: no result
    for r in results.values():
        assert "crash" not in r, r["crash"]
    return results


def test_a_compile_that_fell_back_on_one_rank_delays_the_measure_on_every_rank():
    r = _run("fallback_on_rank_1")
    assert not r[0]["broken"] and r[1]["broken"], "only rank 1's block 1 should have fallen back"
    assert r[0]["passthrough"] == [False, False]
    # The step after the compiling one would have been measured; rank 1 compiles full AC for
    # block 1 in it, so every rank measures the one after.
    assert r[0]["modes"] == r[1]["modes"] == ["warm-up", "profiled", "planned", "planned", "verified",
                                               "planned", "planned"]
    assert r[0]["measuring"] == r[1]["measuring"]
    assert r[0]["history"] == r[1]["history"] and len(r[0]["history"]) == 1
    assert r[0]["history"][0]["meter"] == "allocator events"
    assert r[0]["compiled"] == r[1]["compiled"] == [True, True]


def test_a_profiler_on_one_rank_changes_how_every_rank_measures():
    """A profiler the user runs on rank 0 only keeps the allocator meter out there: every rank
    then measures its compiled steps with the storage counter, at the same steps. Shapes
    alternate, so a step of one shape meets the other's plan not yet measured."""
    r = _run("profiler_on_rank_0")
    assert r[0]["modes"] == r[1]["modes"] and r[0]["measuring"] == r[1]["measuring"]
    assert r[0]["history"] == r[1]["history"] and len({h["step_key"] for h in r[0]["history"]}) == 2
    assert {h["meter"] for h in r[0]["history"]} == {"trace"}


def test_one_process_measures_when_its_own_compiled_code_says(monkeypatch):
    """Without a process group the agreed answer is this process's own: at every step boundary,
    a plan counts as compiled exactly when every block has compiled code for it here, through
    a fall back too."""
    from tapesac.compiled import CompiledRunner, MappingWarning

    monkeypatch.setattr(CompiledRunner, "forward", departing(CompiledRunner.forward, block=1))
    answers = []

    def check(planner):
        runner = planner.handle.blocks[0].compiled
        for entry in planner.plans.values():
            own = all(runner.has_compiled(b, p) for b, p in entry.policy.blocks.items())
            answers.append((planner.steps, planner.compiled.compiled_already(entry), own))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MappingWarning)
        r = train(check=check)
    assert r["broken"]
    assert r["modes"] == ["warm-up", "profiled", "planned", "planned", "verified", "planned", "planned"]
    assert all(agreed == own for _, agreed, own in answers), answers
    assert [agreed for _, agreed, _ in answers] == [False, False, True, True, True, True], answers
