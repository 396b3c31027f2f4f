"""Planned mode in the loops trainers really run: exact gradients, and no step over the limit.

Each test trains the same model twice from the same state, unwrapped and under planned TapeSAC,
with a real optimizer (steps end at ``optimizer.step()``), and compares every step's loss and
gradients bit for bit. Every step is measured by a meter of the test's own (a storage counter
entered around the whole step), and every step after the first plan must stay under the limit.
"""

from __future__ import annotations

import logging
import random
from typing import Callable

import pytest
import torch

import tapesac
from tapesac.autoplan import PlanConfig
from tapesac.meter import StorageCounter

from .loops import LOOPS, Loop, Model, _tracked, forwards_first, interleaved, steps, train


def assert_same(expected, actual) -> None:
    for step, ((le, ge, *_), (la, ga, *_)) in enumerate(zip(expected, actual)):
        assert all(torch.equal(a, b) for a, b in zip(le, la)), f"step {step}: losses differ"
        assert ge.keys() == ga.keys()
        for n in ge:
            assert torch.equal(ge[n], ga[n]), f"step {step}: grad of {n} differs"


def planned(model_fn: Callable[[], Model], loop: Loop, seqs: list[int], limit: float, allocator: bool = False,
            **config):
    """Train under a plan for ``limit``; (handle, per-step peaks by the test's counter, or with
    ``allocator`` by the profiler's allocator events, which see what no dispatch mode sees)."""
    expected = train(model_fn(), loop, seqs)
    model = model_fn()
    handle = tapesac.wrap(model.layers, plan_config=PlanConfig(memory_limit_bytes=int(limit), **config))
    try:
        actual = train(model, loop, seqs, handle, allocator=allocator)
    finally:
        handle.remove()  # a trace started at the last step boundary ends here
    assert_same(expected, actual)
    return handle, [a if allocator else peak for _l, _g, peak, a in actual]


def span(model_fn: Callable[[], Model], loop: Loop, seq: int) -> tuple[float, float]:
    """(smallest, largest useful) predicted step peak of this loop, from a first plan."""
    handle, _ = planned(model_fn, loop, [seq] * 3, 1e12)
    return handle.plan.smallest_peak_bytes, handle.plan.largest_useful_peak_bytes


def first_planned_step(handle) -> int:
    return min(r["step"] for r in handle.planner.history)


@pytest.mark.parametrize("name", sorted(LOOPS))
def test_loop_is_exact_and_every_planned_step_fits(name):
    loop, model_fn = LOOPS[name]
    lo, hi = span(model_fn, loop, 48)
    assert hi > lo
    limit = lo + 0.5 * (hi - lo)
    handle, peaks = planned(model_fn, loop, [48] * 6, limit)
    plan = handle.plan
    assert plan is not None and any(b.keep for b in plan.policy.blocks.values()), "a real plan keeps something"
    first = first_planned_step(handle)
    over = [(s, p) for s, p in enumerate(peaks) if s >= first - 1 and p > limit]
    assert not over, f"steps over the limit {limit:.0f}: {over}"
    rec = handle.planner.history[0]
    assert rec["measured_peak_bytes"] <= limit


def test_a_step_is_an_optimizer_step_not_a_forward():
    loop, model_fn = LOOPS["accumulate_forwards_first"]
    handle, _ = planned(model_fn, loop, [48] * 4, 1e12)
    # warm-up step 1, profiled step 2 (three micro-batches: 9 recordings), planned from step 3
    assert handle.planner.steps == 4
    assert handle.planner.history[0]["step"] == 3
    windows = next(iter(handle.planner.plans.values())).memory.windows
    assert max(len(w.alive) for w in windows) == 9  # all forwards before the first backward


def test_new_sequence_length_runs_replay_only_until_planned_and_plans_are_cached(caplog):
    model_fn = lambda: Model()  # noqa: E731
    loop = forwards_first(1)
    lo_long, _ = span(model_fn, loop, 192)
    _, hi_short = span(model_fn, loop, 24)
    # Everything fits at seq 24 (pass-through blocks); seq 192 needs replay-only's memory.
    limit = max(lo_long * 1.02, hi_short * 1.5)
    seqs = [24] * 4 + [192] * 4 + [24] * 2 + [192] * 2
    with caplog.at_level(logging.INFO, logger="tapesac"):
        handle, peaks = planned(model_fn, loop, seqs, limit)
    over = [(s, p) for s, p in enumerate(peaks) if s >= 1 and p > limit]
    assert not over, f"steps over the limit {limit:.0f}: {over}"
    assert len(handle.planner.plans) == 2
    assert sum("TapeSAC plan: limit" in r.message for r in caplog.records) == 2  # each shape planned once


def test_verifying_steps_fit_by_the_allocators_own_count():
    """A verification forward fingerprints every saved tensor with the modes off, so no dispatch
    mode sees its temporaries; the step model must include them anyway. Measured by the
    profiler's allocator events, each step after the first plan, the verifying ones among them
    (the first step under each plan, at each new length), stays under a limit close to
    replay-only's peak at the long length."""
    model_fn = lambda: Model()  # noqa: E731
    loop = forwards_first(1)
    lo_long, _ = span(model_fn, loop, 192)
    limit = lo_long * 1.05
    seqs = [24] * 3 + [192] * 3 + [24] * 2 + [192] * 2
    handle, peaks = planned(model_fn, loop, seqs, limit, allocator=True)
    first = first_planned_step(handle)
    over = [(s, p) for s, p in enumerate(peaks) if s >= first - 1 and p > limit]
    assert not over, f"steps over the limit {limit:.0f} by the allocator: {over}"
    assert len(handle.planner.history) == 2


def test_one_long_batch_while_profiling_then_constant_shapes():
    model_fn = lambda: Model()  # noqa: E731
    loop = forwards_first(1)
    lo, hi = span(model_fn, loop, 48)
    seqs = [48, 96] + [48] * 5  # step 2 (profiled) is longer than all the others
    handle, peaks = planned(model_fn, loop, seqs, 1e12)
    assert len(handle.planner.plans) == 2
    assert handle.planner.history[-1]["step_key"] in handle.planner.plans


def test_policy_files_that_cannot_be_read_give_a_warning_and_a_fresh_plan(tmp_path, caplog):
    loop, model_fn = LOOPS["accumulate_interleaved"]
    for i, content in enumerate([bytes(range(256)) * 3, b'{"version":1,"blocks":[]}', b"[1, 2]",
                                 b'{"version": 1, "blocks": {"0": {"signature": 5}}}', b""]):
        path = tmp_path / f"policy{i}.json"
        path.write_bytes(content)
        with caplog.at_level(logging.WARNING, logger="tapesac"):
            caplog.clear()
            handle, _ = planned(model_fn, loop, [48] * 3, 1e12, policy_path=str(path))
        assert handle.plan is not None, content
        assert any("ignoring policy file" in r.message for r in caplog.records), content
        assert tapesac.policy.Policy.load(path).blocks  # overwritten by the new plan


def test_a_saved_policy_is_loaded_without_profiling(tmp_path):
    loop, model_fn = LOOPS["accumulate_interleaved"]
    lo, hi = span(model_fn, loop, 48)
    path = tmp_path / "policy.json"
    planned(model_fn, loop, [48] * 4, (lo + hi) / 2, policy_path=str(path))
    handle, peaks = planned(model_fn, loop, [48] * 4, (lo + hi) / 2, policy_path=str(path))
    assert handle.planner.loaded_policy and handle.plan is None  # nothing profiled or solved
    assert handle.planner.history and all(p <= (lo + hi) / 2 for p in peaks[1:])


def _hog(inner: Loop, extra: float) -> Loop:
    """``inner`` with a scratch buffer of ``extra`` bytes, alive through every step's forwards and
    backwards from step 2 on: memory the profiled step (step 1) did not show."""
    def run(model: Model, step: int, seq: int) -> list[torch.Tensor]:
        scratch = torch.ones(int(extra) // 4) if step >= 2 else None  # float32: 4 bytes each
        losses = inner(model, step, seq)
        del scratch
        return losses
    return run


def test_measured_overshoot_replans_tighter_until_the_plan_fits(caplog):
    """Memory the profiled step did not show pushes the first planned step over the limit: the
    plan is tightened until it fits."""
    model_fn = lambda: Model()  # noqa: E731
    inner = forwards_first(1)
    lo, hi = span(model_fn, inner, 48)
    limit = lo + 0.8 * (hi - lo)
    with caplog.at_level(logging.INFO, logger="tapesac"):
        handle, peaks = planned(model_fn, _hog(inner, 0.5 * (hi - lo)), [48] * 8, limit)
    assert any("re-planning" in r.message for r in caplog.records)
    assert len(handle.planner.history) >= 2 and handle.planner.history[-1]["measured_peak_bytes"] <= limit
    assert peaks[-1] <= limit


@pytest.mark.parametrize("max_replans", [3, 0])
def test_a_limit_that_even_replay_only_measures_over_is_an_error_that_names_the_peak(max_replans):
    """When replay-only itself is measured over the limit, the run stops with a PlanError naming
    the measured peak instead of training on over the limit. Both ways there: a re-plan that finds
    no plan but replay-only, and re-plans used up (replay-only is measured before it is trusted)."""
    model_fn = lambda: Model()  # noqa: E731
    inner = forwards_first(1)
    lo, hi = span(model_fn, inner, 48)
    limit = lo + 0.8 * (hi - lo)
    model = model_fn()
    handle = tapesac.wrap(model.layers, plan_config=PlanConfig(memory_limit_bytes=int(limit),
                                                               max_replans=max_replans))
    history = handle.planner.history
    why = lambda: f"limit {limit:.0f}, floor {lo:.0f}; measured steps: {history}"  # noqa: E731
    try:
        with pytest.raises(tapesac.errors.PlanError, match="is infeasible: step [0-9]+ kept nothing") as info:
            # replay-only with the loop's buffer peaks about 2% of the floor over the limit
            train(model, _hog(inner, limit - 0.98 * lo), [48] * 12, handle)
    except (Exception, pytest.fail.Exception) as e:  # a failure shows every measured step
        raise AssertionError(f"{e}; {why()}") from e
    finally:
        handle.remove()
    last = history[-1]
    assert last["measured_peak_bytes"] > limit, why()
    assert f"({last['measured_peak_bytes']:.0f} bytes)" in str(info.value)
    entry = next(iter(handle.planner.plans.values()))
    assert not any(b.keep or b.passthrough for b in entry.policy.blocks.values()), why()
    assert history[0]["predicted_peak_bytes"] is not None, f"the first measured step was not under a plan; {why()}"
    assert 2 <= len(history) <= 2 + max_replans, why()


_SPANS: dict[str, tuple[float, float]] = {}


@pytest.mark.parametrize("seed", range(8))
def test_random_limits_and_hidden_buffers_fit_or_stop_with_a_plan_error(seed):
    """Seeded: a loop shape, a limit from just under the floor to over the top, and a buffer of
    the loop's own the profile never saw (alive from the first planned step on). Every step runs
    exactly as without TapeSAC; the run either ends with its last measured plan within the limit
    and every later step under it, or stops with a PlanError once replay-only is measured over."""
    rng = random.Random(seed)
    name = rng.choice(sorted(LOOPS))
    loop, model_fn = LOOPS[name]
    if name not in _SPANS:
        _SPANS[name] = span(model_fn, loop, 48)
    lo, hi = _SPANS[name]
    limit = int(lo + rng.uniform(0.0, 1.1) * (hi - lo))
    hidden = _hog(loop, rng.uniform(0.0, 0.6) * lo)
    n_steps = 9
    expected = train(model_fn(), hidden, [48] * n_steps)
    model = model_fn()
    handle = tapesac.wrap(model.layers, plan_config=PlanConfig(memory_limit_bytes=limit))
    results, error = [], None
    try:
        for result in steps(model, hidden, [48] * n_steps):
            results.append(result)
    except tapesac.PlanError as e:
        error = e
    finally:
        handle.remove()
    where = f"seed {seed}: {name}, limit {limit}, span {lo:.0f}..{hi:.0f}"
    assert_same(expected[:len(results)], results)
    history = handle.planner.history
    assert history, where
    if error is not None:
        assert "kept nothing" in str(error) and history[-1]["measured_peak_bytes"] > limit, (where, error)
        assert not any(b.keep for e in handle.planner.plans.values() for b in e.policy.blocks.values()), where
        return
    assert len(results) == n_steps and history[-1]["measured_peak_bytes"] <= limit, (where, history)
    assert all(peak <= limit for _l, _g, peak, _a in results[history[-1]["step"] + 1:]), where


def test_an_overshoot_larger_than_the_limit_goes_to_replay_only_without_a_negative_re_plan(caplog):
    model_fn = lambda: Model()  # noqa: E731
    inner = forwards_first(1)
    lo, hi = span(model_fn, inner, 48)
    limit = lo + 0.8 * (hi - lo)
    model = model_fn()
    handle = tapesac.wrap(model.layers, plan_config=PlanConfig(memory_limit_bytes=int(limit)))
    try:
        with caplog.at_level(logging.INFO, logger="tapesac"), pytest.raises(tapesac.PlanError, match="kept nothing"):
            train(model, _hog(inner, 3 * limit), [48] * 8)
    finally:
        handle.remove()
    assert any("more than any plan can save" in r.message for r in caplog.records)
    assert not any("re-planning for -" in r.message for r in caplog.records)
    assert len(handle.planner.history) == 2  # the plan's first step, then replay-only's


def test_on_infeasible_replay_only_trains_on_over_the_limit_with_a_warning(caplog):
    model_fn = lambda: Model()  # noqa: E731
    inner = forwards_first(1)
    lo, hi = span(model_fn, inner, 48)
    limit = lo + 0.8 * (hi - lo)
    with caplog.at_level(logging.INFO, logger="tapesac"):
        handle, peaks = planned(model_fn, _hog(inner, limit - lo * 0.98), [48] * 10, limit,
                                on_infeasible="replay_only")
    assert any("going on replay-only, over the limit" in r.message for r in caplog.records)
    entry = next(iter(handle.planner.plans.values()))
    assert not any(b.keep for b in entry.policy.blocks.values())
    assert handle.planner.history[-1]["measured_peak_bytes"] > limit
    # Measured once: the steps after it are not re-measured step after step.
    assert handle.planner.history[-1]["step"] < 9


def test_an_unknown_on_infeasible_setting_is_refused_with_the_choices():
    with pytest.raises(tapesac.ConfigError, match="on_infeasible must be one of error, replay_only, got 'warn'"):
        PlanConfig(memory_limit_bytes=10**9, on_infeasible="warn")


def test_flop_counter_around_planned_steps_sees_every_flop_and_leaves_the_stack_clean():
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    from torch.utils.flop_counter import FlopCounterMode

    loop, model_fn = LOOPS["accumulate_interleaved"]
    plain = model_fn()
    with FlopCounterMode(display=False) as plain_flops:
        train(plain, loop, [48] * 4)
    model = model_fn()
    handle = tapesac.wrap(model.layers, plan_config=PlanConfig(memory_limit_bytes=10**12))
    with FlopCounterMode(display=False) as flops:
        train(model, loop, [48] * 4)  # the step boundaries start and stop TapeSAC's meter inside
    assert [type(m) for m in _get_current_dispatch_mode_stack()] in ([], [StorageCounter])
    handle.remove()
    assert flops.get_total_flops() >= plain_flops.get_total_flops() > 0
    assert _get_current_dispatch_mode_stack() == []


def test_planning_never_draws_from_the_models_random_generator():
    loop, model_fn = LOOPS["dropout"]
    model = model_fn()
    handle = tapesac.wrap(model.layers, plan_config=PlanConfig(memory_limit_bytes=10**12))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for step in range(3):
        torch.manual_seed(step)
        loop(model, step, 48)
        state = torch.get_rng_state()
        opt.step()  # the boundary: profiling ends, calibration and planning happen here
        assert torch.equal(state, torch.get_rng_state()), f"step {step}"
    handle.remove()


def test_more_micro_batches_than_the_plan_was_made_for_never_exceed_the_limit():
    """A step that starts like the planned one but runs more micro-batches leaves the plan at its
    first extra recording: the rest runs replay-only and what the first micro-batch kept is
    released; the new step shape is then profiled and planned, and the old plan reused."""
    model_fn = lambda: Model(blocks=3)  # noqa: E731
    three, one = forwards_first(3), forwards_first(1)
    lo3, _ = span(model_fn, three, 48)
    lo1, hi1 = span(model_fn, one, 48)
    limit = max(lo3 * 1.02, lo1 + 0.9 * (hi1 - lo1))

    def varying(model: Model, step: int, seq: int) -> list[torch.Tensor]:
        return (three if 4 <= step < 8 else one)(model, step, seq)

    handle, peaks = planned(model_fn, varying, [48] * 10, limit)
    over = [(s, p) for s, p in enumerate(peaks) if s >= 2 and p > limit]
    assert not over, f"steps over the limit {limit:.0f}: {over}"
    assert len(handle.planner.plans) == 2


def test_a_pass_through_block_whose_program_changes_is_noticed(caplog, monkeypatch):
    """Blocks that keep everything run as plain autograd, unrecorded. Their program is checked
    (a hashing dispatch mode) in measured steps and every PASSTHROUGH_CHECK_EVERY-th forward
    only, so most forwards pay nothing per op, and a program that changed under unchanged input
    shapes is still noticed within that period."""
    import tapesac.block as block_mod

    checked = []

    class Counting(block_mod.ProgramCheck):
        def __enter__(self):
            checked.append(1)
            return super().__enter__()

    monkeypatch.setattr(block_mod, "ProgramCheck", Counting)
    every = block_mod.PASSTHROUGH_CHECK_EVERY
    model_fn = lambda: Model()  # noqa: E731
    inner = forwards_first(1)
    switch = 4 + every  # after `every` unchanged pass-through steps

    def switching(model: Model, step: int, seq: int) -> list[torch.Tensor]:
        model.layers[1].dropout = 0.1 if step >= switch else 0.0  # same shapes, one more op
        return inner(model, step, seq)

    with caplog.at_level(logging.WARNING, logger="tapesac"):
        handle, _ = planned(model_fn, switching, [48] * (switch + every + 3), 10**12)
    blocks, forwards = 3, switch + every + 3
    assert len(checked) < blocks * forwards / 4, "pass-through blocks checked (nearly) every forward"
    assert any("tape differs" in r.message for r in caplog.records)
    assert handle.planner.history[-1]["step"] > switch  # the new program was profiled, planned, verified


def test_shapes_that_alternate_every_step_are_each_profiled_once_and_verified():
    """The profiled step is chosen at its first block forward, not guessed at the boundary before
    it: with two sequence lengths in turn, each is profiled once, planned and measured, and then
    no step is profiled again."""
    handle, _ = planned(lambda: Model(), interleaved(2), [48, 96] * 6, 10**12)
    planner = handle.planner
    assert len(planner.plans) == 2 and all(e.verified for e in planner.plans.values())
    assert sorted(r["step_key"] for r in planner.history) == sorted(planner.plans)
    assert planner.last_step_mode == "planned"


def llama3_model():
    """torchtitan's llama3 at a tiny size: its parameters, gradients and optimizer state outweigh
    its activations, so what a retained graph holds while the gradients are allocated shows."""
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs

    torch.manual_seed(0)
    args = TransformerModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=64)
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model


def llama3_steps(model, seqs: list[int], micro: int, order: list[int], retains: Callable[[int], bool]) -> list[int]:
    """Train ``model`` one step per sequence length: ``micro`` micro-batches, the blocks applied in
    ``order``, and in the steps where ``retains(step)`` two backwards through a retained graph.
    Returns each step's peak (a storage counter around the whole step, as ``loops.train``)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    layers = list(model.layers.values())
    peaks = []
    for step, seq in enumerate(seqs):
        g = torch.Generator().manual_seed(step)
        counter = StorageCounter()
        counter.track(_tracked(model, opt))
        with counter:
            for _ in range(micro):
                h = model.tok_embeddings(torch.randint(0, 128, (2, seq), generator=g))
                for i in order:
                    h = layers[i](h, model.freqs_cis, attention_masks=None)
                loss = model.output(model.norm(h)).float().pow(2).mean()
                loss.backward(retain_graph=retains(step))
                if retains(step):
                    (0.5 * loss).backward()
            opt.step()
        opt.zero_grad(set_to_none=True)
        peaks.append(counter.peak_bytes)
    return peaks


def llama3_planned(seqs: list[int], micro: int, order: list[int], retains: Callable[[int], bool]):
    """A probe run without a limit gives the frontier; a second run, from the same weights, is
    planned at its midpoint. Returns (handle, limit, peaks of the planned run)."""
    import copy

    base = llama3_model()
    probe = copy.deepcopy(base)
    handle = tapesac.wrap(list(probe.layers.values()), plan_config=PlanConfig(memory_limit_bytes=10**12))
    llama3_steps(probe, seqs, micro, order, retains)
    lo, hi = handle.plan.smallest_peak_bytes, handle.plan.largest_useful_peak_bytes
    handle.remove()
    assert hi > lo
    limit = int(lo + 0.5 * (hi - lo))
    model = copy.deepcopy(base)
    handle = tapesac.wrap(list(model.layers.values()), plan_config=PlanConfig(memory_limit_bytes=limit))
    try:
        peaks = llama3_steps(model, seqs, micro, order, retains)
    finally:
        handle.remove()
    return handle, limit, peaks


def test_a_graph_retained_in_some_steps_only_is_planned_for():
    """The narrowest loop that went over its limit: one shape, one micro-batch, and a graph
    retained for a second backward every third step (before such steps were planned for, they
    measured 5.20 MB at a limit of 4.24 MB, predicted 4.22 MB). The step key
    names only the forwards, and the profiled step freed its graph as backward went; a step that
    retains it holds, through its first backward, all that trace saw freed while the gradients
    are allocated. Once a step has retained a graph (here the warm-up step), each step shape runs
    replay-only until a step of it that retains is traced; its plan is then made for both kinds
    of step, and every step fits."""
    handle, limit, peaks = llama3_planned([48] * 10, 1, [0, 1, 2], lambda s: s % 3 == 0)
    over = [(s, p) for s, p in enumerate(peaks) if p > limit]
    assert not over, f"limit {limit}: {over}"
    entry = next(iter(handle.planner.plans.values()))
    assert entry.retained and entry.policy.meta["retained"]
    assert any(b.keep for b in entry.policy.blocks.values()), "a real plan keeps something"
    assert handle.planner.last_step_mode == "planned"  # step 9 retains under the plan
    assert [r["measured_peak_bytes"] <= limit for r in handle.planner.history] == [True]


def test_a_graph_retained_first_under_a_plan_is_noticed_and_planned_for(caplog):
    """A loop that retains a graph for the first time in a planned step runs a step its plan was
    not made for, which nothing before it showed: that step may go over the limit, and a warning
    says so. From then on the shape runs replay-only until a retaining step is traced, and is
    planned for both kinds of step."""
    retains = lambda s: s >= 4 and s % 3 == 1  # noqa: E731
    with caplog.at_level(logging.WARNING, logger="tapesac"):
        handle, limit, peaks = llama3_planned([48] * 12, 1, [0, 1, 2], retains)
    assert any("its plan was not made for" in r.message for r in caplog.records)
    over = [(s, p) for s, p in enumerate(peaks) if s > 4 and p > limit]
    assert not over, f"limit {limit}, after the first retained graph: {over}"
    assert next(iter(handle.planner.plans.values())).retained
    assert handle.planner.last_step_mode == "planned"


def test_first_planned_step_fits_when_shapes_alternate_with_a_shared_block_and_retain_graph():
    """Two sequence lengths in turn, two micro-batches, a block applied twice and a graph retained
    every third step: the loop in which the gap was found (the 32-token shape's first planned
    step retained its graphs, which its profiled step had not: 5.42 MB measured at a limit of
    5.20 MB, predicted 5.09 MB)."""
    seqs = [32 if s % 2 else 48 for s in range(9)]
    handle, limit, peaks = llama3_planned(seqs, 2, [0, 1, 2, 1], lambda s: s % 3 == 0)
    over = [(s, p) for s, p in enumerate(peaks) if p > limit]
    assert not over, f"limit {limit}: {over}"
    assert len(handle.planner.plans) == 2 and all(e.retained and e.verified for e in handle.planner.plans.values())
    over = [(r["step"], r["measured_peak_bytes"]) for r in handle.planner.history if r["measured_peak_bytes"] > limit]
    assert not over, f"limit {limit}: {over}"
