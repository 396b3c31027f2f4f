"""Compiled mode maps a plan's tape positions onto compiled traces (``tapesac/compiled.py``,
compiled invariant 1): the spellings dynamo traces differently from eager code map, with the
plan's decision for each output; any other departure still warns and runs full AC.

Compiling on CPU is slow: blocks are tiny; the MoE block compiles once, in about half a minute.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from pathlib import Path

import pytest
import torch

import tapesac
from tapesac.compiled import MappingWarning, TapePolicy
from tapesac.policy import BlockPolicy, Policy

from .loops import Block
from .test_compiled import GRAD_TOL, Departing, UnbindBlock, compiled_forward, recorded_tape

_UNBIND = torch.ops.aten.unbind.int


def _positions(tape, func) -> list[tuple[int, int]]:
    return [(i, 0) for i, op in enumerate(tape.ops) if op.func is func]


@pytest.mark.parametrize("keep", ["matmuls", "q"])
def test_unpacking_a_tensor_maps_and_saves_what_unbind_saves(keep):
    """``q, k, v = t`` runs ``unbind`` eagerly and traces as three ``select`` (and ``Block``'s
    dropout with p = 0 as a ``clone``): the plan maps without a warning, and the compiled forward
    saves exactly what the same plan saves on a block that calls ``unbind`` (which traces as
    ``unbind``), and what it saves beyond keeping nothing is what eager TapeSAC keeps. Keeping q
    alone keeps the qkv matmul's storage: the partitioner drops a saved ``select``, so the
    matmul is saved for it (compiled invariant 7)."""
    torch.manual_seed(0)
    unpacking, x = Block(), torch.randn(4, 32, 32, requires_grad=True)
    unbinding = UnbindBlock()
    unbinding.load_state_dict(unpacking.state_dict())
    tape = recorded_tape(unpacking, x)
    assert tape.signature() == recorded_tape(unbinding, x).signature()
    (unbind,) = _positions(tape, _UNBIND)
    # "q": the first output of the unbind alone, a view of the qkv matmul's output.
    positions = _positions(tape, torch.ops.aten.addmm.default) if keep == "matmuls" else [unbind]
    _, nothing, _, warned, _ = compiled_forward(unpacking, x, [], tape.signature())
    assert not warned
    kept, saved, grad, warned, _ = compiled_forward(unpacking, x, positions, tape.signature())
    assert not warned, [str(w.message) for w in warned]
    _, saved_by_unbind, grad_by_unbind, warned, _ = compiled_forward(unbinding, x, positions, tape.signature())
    assert not warned
    assert kept > 0 and saved == saved_by_unbind
    assert saved - nothing == kept
    torch.testing.assert_close(grad, grad_by_unbind, rtol=0, atol=GRAD_TOL)


def test_a_kept_unbind_output_is_saved_as_its_select_and_through_its_storage():
    torch.manual_seed(0)
    block, x = Block(), torch.randn(2, 8, 32, requires_grad=True)
    tape = recorded_tape(block, x)
    (unbind,) = _positions(tape, _UNBIND)
    policy = TapePolicy(0, tape, {(unbind[0], 2)})  # keeps v
    k = policy.expected.index(_UNBIND)
    assert policy.save[k] and policy.spellings[k] == (0, (False, False, True))
    qkv = policy.expected.index(torch.ops.aten.addmm.default)  # made the storage v views
    assert [i for i, saved in enumerate(policy.save) if saved] == [qkv, k]


@pytest.mark.parametrize("how, departure", [
    ("another op", r"aten\.add\.Tensor where the tape has aten\.mul\.Tensor"),
    ("selects out of order", r"aten\.select\.int where the tape has aten\.unbind\.int"),
])
def test_a_trace_that_departs_otherwise_still_warns(how, departure):
    torch.manual_seed(0)
    block, x = Departing(how), torch.randn(4, 8, 32, requires_grad=True)
    tape = recorded_tape(block, x)
    _, _, grad, warned, _ = compiled_forward(block, x, _positions(tape, torch.ops.aten.addmm.default),
                                             tape.signature())
    assert len(warned) == 1 and re.search(departure, str(warned[0].message)), [str(w.message) for w in warned]
    expected = torch.autograd.grad(block(x).sum(), x)[0]
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-5)  # the departing forward is exact


class UnpacksItsInput(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        a, b = x
        return torch.tanh(self.lin(a)) * b


def test_unpacking_a_block_input_maps_though_the_trace_runs_no_op_for_it():
    """Views of a block input are taken outside SAC's region under compile: the tape's unbind
    (its outputs free to hold, as views of an input) has no op in the trace."""
    torch.manual_seed(0)
    block, x = UnpacksItsInput(), torch.randn(2, 4, 8, requires_grad=True)
    tape = recorded_tape(block, x)
    kept, _, grad, warned, _ = compiled_forward(block, x, _positions(tape, torch.ops.aten.addmm.default),
                                                tape.signature())
    assert not warned, [str(w.message) for w in warned]
    assert kept == 4 * 8 * 4
    torch.testing.assert_close(grad, torch.autograd.grad(block(x).sum(), x)[0], rtol=1e-5, atol=1e-6)


class SplitByCounts(torch.nn.Module):
    """Tokens grouped by a data-dependent count per group, as MoE experts split theirs: eagerly
    ``counts.tolist()`` dispatches no op; traced, it reads each count with a select and a
    ``_local_scalar_dense``. ``reversed_read`` reads the counts last to first under compile."""

    def __init__(self, reversed_read: bool = False) -> None:
        super().__init__()
        self.reversed_read = reversed_read
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        group = h.argmax(-1) % 4
        counts = torch.histc(group.float(), bins=4, min=0, max=4).long()
        if self.reversed_read and torch.compiler.is_compiling():
            sizes = [counts[i].item() for i in (3, 2, 1, 0)][::-1]
        else:
            sizes = counts.tolist()
        # Sliced to the sum of the sizes first, as torchtitan's experts loop does: splitting all
        # rows at once, inductor (torch 2.13) fails to compile the backward under activation
        # checkpointing, torch's own full AC too ("expected [u4, ...] to have been codegen-ed").
        routed = h[group.argsort(stable=True)]
        parts = torch.split(routed[: sum(sizes)], sizes)
        out = torch.cat([torch.tanh(p) * (i + 1) for i, p in enumerate(parts)])
        return torch.vstack((out, out.new_zeros((x.shape[0] - sum(sizes), out.shape[-1]))))


@pytest.mark.parametrize("reversed_read", [False, True])
def test_a_tolist_maps_only_as_dynamo_spells_it(reversed_read):
    torch.manual_seed(0)
    block, x = SplitByCounts(reversed_read), torch.randn(16, 8, requires_grad=True)
    tape = recorded_tape(block, x)
    keep = _positions(tape, torch.ops.aten.addmm.default) + _positions(tape, torch.ops.aten.tanh.default)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):  # as torchtitan sets it for MoE
        _, _, grad, warned, _ = compiled_forward(block, x, keep, tape.signature())
    if reversed_read:
        assert len(warned) == 1 and "select.int" in str(warned[0].message)
    else:
        assert not warned, [str(w.message) for w in warned]
    torch.testing.assert_close(grad, torch.autograd.grad(block(x).sum(), x)[0], rtol=1e-5, atol=1e-6)


def _moe_block():
    """One block of the bench's quick ``qwen3_moe`` (``tools/bench.py``, ``model_specs``): qwen3
    attention, 8 experts (top 2, one shared), whose CPU path splits tokens by ``tolist()``
    counts; with the bench's widths halved so it compiles faster."""
    pytest.importorskip("torchtitan")
    pytest.importorskip("torchtitan_ext")  # on CPU: the experts' loop of matmuls, as in the bench
    from torchtitan.models.moe import MoEArgs
    from torchtitan.protocols.train_spec import get_train_spec

    spec = get_train_spec("qwen3")
    moe_args = MoEArgs(num_experts=8, num_shared_experts=1, top_k=2, score_func="softmax", route_norm=True,
                       score_before_experts=False)
    args = dataclasses.replace(spec.model_args["debugmodel_moe"], dim=64, n_layers=1, n_heads=2, n_kv_heads=1,
                               head_dim=32, hidden_dim=192, moe_inter_dim=64, moe_args=moe_args, max_seq_len=32)
    torch.manual_seed(0)
    model = spec.model_cls(args)
    with torch.no_grad():
        model.init_weights()
    return model.layers["0"], model.rope_cache[:16]


def test_the_bench_moe_block_runs_its_plan_compiled_without_falling_back():
    """The MoE block departed at the experts' ``tolist()`` (no op eagerly; a select and a
    ``_local_scalar_dense`` per expert, with ``_assert_scalar`` checks, traced)."""
    block, rope = _moe_block()
    x = torch.randn(2, 16, 64, requires_grad=True)
    handle = tapesac.wrap([block])
    block(x, rope, None).sum().backward()
    tape = handle.tapes()[0]
    handle.remove()
    keep = _positions(tape, torch.ops.aten.mm.default)
    assert keep
    expected = torch.autograd.grad(block(x, rope, None).sum(), x)[0]
    # As torchtitan's compile sets it for MoE, and the bench process with it.
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        handle = tapesac.wrap([block], policy=Policy({0: BlockPolicy(tape.signature(), keep)}), compile=True)
        try:
            block(x, rope, None).sum().backward()  # eager: records the plan's program
            with warnings.catch_warnings():
                warnings.simplefilter("error", MappingWarning)
                out = block(x, rope, None)
                assert handle.stats()[0]["compiled"]
                (grad,) = torch.autograd.grad(out.sum(), x)
                block(x, rope, None)  # the compiled code again, checked again
            key = next(k for k, p in handle.blocks[0].compiled._policies.items() if isinstance(p, TapePolicy))
            assert not handle.blocks[0].compiled.broken
            assert handle.blocks[0].compiled._policies[key].passes >= 2
        finally:
            handle.remove()
    torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-5)


def test_torchtitan_compiled_mode_lets_dynamo_capture_scalar_outputs():
    """torchtitan's apply_compile, which compiled mode leaves out (TapeSAC compiles the blocks),
    turns on ``capture_scalar_outputs`` for MoE; the converter does in its place, or the experts'
    ``tolist()`` breaks the graph and the block's checkpoint runs eagerly."""
    pytest.importorskip("torchtitan_ext")
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import ParallelDims

    from torchtitan_ext.converter import TapeSACConverter

    config = Path(__file__).resolve().parents[1] / "train_configs" / "qwen3_moe_debug_cpu.toml"
    cfg = ConfigManager().parse_args(["--job.config_file", str(config),
                                      "--compile.enable", "--compile.components", "model"])
    # dynamo's own patch, not monkeypatch: monkeypatch's undo deleted the setting from dynamo's
    # config module, and a later test in the same worker failed on its absence
    with torch._dynamo.config.patch(capture_scalar_outputs=False):
        TapeSACConverter(cfg, ParallelDims(dp_shard=1, dp_replicate=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1))
        assert torch._dynamo.config.capture_scalar_outputs


class LiftsAList(torch.nn.Module):
    """``torch.tensor(values)`` of Python ints the block is given, as Qwen3.5's DeltaNet builds
    its CPU document offsets: one ``lift_fresh`` eagerly; traced with symbolic values, one
    ``scalar_tensor`` per value and a ``stack``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, values):
        weights = torch.tensor(values, dtype=x.dtype)
        return torch.tanh(self.lin(x)) * weights.sum()


def _lifting_block_and_tape():
    torch.manual_seed(0)
    block, x = LiftsAList(), torch.randn(4, 8, requires_grad=True)
    handle = tapesac.wrap([block])
    block(x, [1, 2, 3]).sum().backward()
    tape = handle.tapes()[0]
    handle.remove()
    return block, x, tape


def test_a_tensor_of_symbolic_values_maps_as_dynamo_spells_it(monkeypatch):
    """The first compile reads the values as constants (``lift_fresh``, as eagerly); other values
    recompile with symbolic ones (``scalar_tensor`` per value, then ``stack``). Both map."""
    lifts = []
    spell = TapePolicy._lift_on
    monkeypatch.setattr(TapePolicy, "_lift_on", lambda self, run, func, *a: lifts.append(func) or spell(
        self, run, func, *a))
    block, x, tape = _lifting_block_and_tape()
    assert _positions(tape, torch.ops.aten.lift_fresh.default)
    keep = _positions(tape, torch.ops.aten.addmm.default) + _positions(tape, torch.ops.aten.tanh.default)
    values = ([1, 2, 3], [2, 5, 7], [3, 1, 4])
    expected = [torch.autograd.grad(block(x, v).sum(), x)[0] for v in values]
    handle = tapesac.wrap([block], policy=Policy({0: BlockPolicy(tape.signature(), keep)}), compile=True)
    try:
        block(x, values[0]).sum().backward()  # eager: records the plan's program
        with warnings.catch_warnings():
            warnings.simplefilter("error", MappingWarning)
            for v, want in zip(values, expected):
                out = block(x, v)
                assert handle.stats()[0]["compiled"]
                torch.testing.assert_close(torch.autograd.grad(out.sum(), x)[0], want, rtol=1e-5, atol=1e-6)
        assert not handle.blocks[0].compiled.broken
    finally:
        handle.remove()
    assert torch.ops.aten.stack.default in lifts, "no trace spelled the values as scalars: nothing shown"


@pytest.mark.parametrize("trace, departs", [
    ([("scalar_tensor", 3), ("stack", 3)], False),
    ([("scalar_tensor", 3), ("stack", 2)], True),  # a stack of other tensors
    ([("scalar_tensor", 2), ("mul", 0)], True),  # another op before the stack
])
def test_the_scalar_spelling_of_a_lift_ends_at_a_stack_of_exactly_its_scalars(trace, departs):
    block, x, tape = _lifting_block_and_tape()
    policy = TapePolicy(0, tape, set())
    policy.context_fn()  # one pass
    run = policy._runs[-1]
    k = policy.expected.index(torch.ops.aten.lift_fresh.default)
    run.step = k
    scalars = []
    for name, n in trace:
        if name == "scalar_tensor":
            for i in range(n):
                scalars.append(torch.scalar_tensor(float(i)))
                policy._decide(run, torch.ops.aten.scalar_tensor.default, (float(i),), {})
        elif name == "stack":
            policy._decide(run, torch.ops.aten.stack.default, (scalars[:n],), {})
        else:
            policy._decide(run, torch.ops.aten.mul.Tensor, (x, x), {})
    assert (run.departure is not None) == departs, run.departure
    if not departs:
        assert run.step == k + 1 and not run.lifted
