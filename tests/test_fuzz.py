"""Random block programs give bit-identical results under TapeSAC, a TapeSACError, or the same error.

Each seed builds one program (tests/fuzz.py) and runs it under one loop shape, plain and wrapped.
The seed range is fixed so CI is deterministic; ``TAPESAC_FUZZ_PROGRAMS=5000`` runs more.
A failure prints its repro: ``python tools/fuzz.py --seed S --loop L``.
"""

from __future__ import annotations

import collections
import os

import pytest
import torch

from . import fuzz

N_PROGRAMS = int(os.environ.get("TAPESAC_FUZZ_PROGRAMS", "400"))
SEEDS = range(N_PROGRAMS)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bit-identical runs, and no contention on a shared machine
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("seed", SEEDS, ids=[f"seed{s}-{fuzz.default_loop(s)}" for s in SEEDS])
def test_program_matches_plain_autograd(seed):
    out = fuzz.check(seed)
    assert out.status != fuzz.MISMATCH, out.message() + f"\n  program: {fuzz.describe(seed)}"


@pytest.mark.parametrize("loop", sorted(fuzz.LOOPS))
def test_plain_runs_are_reproducible(loop):
    """The oracle itself is deterministic: two plain runs of a program agree bit for bit."""
    for seed in range(3):
        try:
            first, _ = fuzz.run_program(seed, loop, wrapped=False)
        except RuntimeError:
            continue
        again, _ = fuzz.run_program(seed, loop, wrapped=False)
        assert fuzz.compare(first, again) is None


def test_every_feature_appears_in_the_ci_seed_range():
    counts = collections.Counter()
    for seed in SEEDS:
        counts.update(fuzz.features_of(seed))
    vocabulary = set(fuzz.all_features())
    assert set(counts) <= vocabulary, f"features missing from all_features(): {set(counts) - vocabulary}"
    rare = {f: counts[f] for f in vocabulary if counts[f] < max(1, N_PROGRAMS // 200)}
    assert not rare, f"features (almost) never generated: {rare}"


def test_plain_autograd_rejects_only_the_programs_meant_to_be_rejected():
    """Keeps BOTH_RAISED honest: a generator bug would hide behind 'plain autograd raised too'."""
    rejected = []
    for seed in range(min(N_PROGRAMS, 300)):
        try:
            fuzz.run_program(seed, "single", wrapped=False)
        except RuntimeError:
            model = fuzz.FuzzModel(seed)
            leaf_written = model.blocks[0].writes_input and model.pre is None and not model.copy_input
            # a later block writing its input writes what the block before it may have saved
            saved_written = any(b.writes_input for b in model.blocks[1:])
            if "illegal_inplace" not in model.features and not leaf_written and not saved_written:
                rejected.append(seed)
    assert not rejected, f"plain autograd rejects programs the generator meant to be legal: {rejected}"


def test_compare_sees_one_ulp_and_missing_gradients():
    a = torch.tensor([1.0, 2.0], dtype=torch.float64)
    b = a.clone()
    b[1] = torch.nextafter(b[1], torch.tensor(3.0, dtype=torch.float64))
    assert fuzz.compare({"g": a}, {"g": a.clone()}) is None
    assert "differs" in fuzz.compare({"g": a}, {"g": b})
    assert "no gradient" in fuzz.compare({"g": a}, {"g": None})
    nan = torch.tensor([float("nan")])
    assert fuzz.compare({"g": nan}, {"g": nan.clone()}) is None
    assert fuzz.compare({"g": torch.tensor([0.0])}, {"g": torch.tensor([-0.0])}) is not None
