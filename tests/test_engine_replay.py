"""Replay runs exactly the producer closure of what backward reads, and frees what it made."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import tapesac
from tapesac.meter import StorageCounter
from tapesac.policy import BlockPolicy, Policy

from .blocks import CASES, grads


class DeadBranches(nn.Module):
    """A handmade block whose saved values and dead branches are known exactly.

    op0 a = sin(x)      saves x (a block input: held, not a value of the block)
    op1 b = exp(a)      saves its output b              -> read
    op2 c = cos(a)      saves a                         -> read
    op3 mean(a)         under no_grad (router stats): never read
    op4 stat.copy_()    writes a buffer under no_grad: never read
    op5 d = tanh(a)     saves d, but d never reaches the loss: read, never unpacked
    op6 b + c           saves nothing
    """

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("stat", torch.zeros(()))

    def forward(self, x):
        a = torch.sin(x)
        b = torch.exp(a)
        c = torch.cos(a)
        with torch.no_grad():
            self.stat.copy_(a.mean())
        self.d = torch.tanh(a)
        return b + c


def test_ops_replayed_is_exactly_the_closure_of_unpacked_values():
    block = DeadBranches()
    handle = tapesac.wrap([block])
    x = torch.randn(8, requires_grad=True)
    block(x).sum().backward()
    s = handle.stats()[0]
    assert s["ops_recorded"] == 7
    assert s["values_read"] == 3  # b, a, d
    assert s["ops_in_closure"] == 3  # sin, exp, tanh: the static closure of everything saved
    # Backward unpacks b (reruns sin, exp) and a (cached since exp needed it): tanh's node never
    # runs, so d is never rebuilt; mean and copy_ are dead and never replayed.
    assert s["ops_replayed"] == 2
    assert s["ops_replayed"] < s["ops_recorded"]
    assert torch.equal(x.grad, torch.cos(x) * (torch.exp(torch.sin(x)) - torch.sin(torch.sin(x))))


def test_keeping_a_value_prunes_the_producers_needed_only_for_it():
    block = DeadBranches()
    handle = tapesac.wrap([block])
    x = torch.randn(8, requires_grad=True)
    block(x).sum().backward()
    tape = handle.tapes()[0]
    sig = tape.signature()
    exp_pos = next(tape.position(v) for v in tape.read_vids() if "exp" in tape.op_name(tape.values[v].op))
    handle.set_policy(Policy({0: BlockPolicy(sig, [exp_pos])}))
    block(x).sum().backward()
    # b is kept: only sin is needed (for a); exp is pruned from the closure.
    assert handle.stats()[0]["ops_in_closure"] == 2
    assert handle.stats()[0]["ops_replayed"] == 1


@pytest.mark.parametrize("kind", ["llama3", "nograd_branch", "qwen3_moe"])
def test_dead_branches_are_never_replayed(kind):
    case = CASES[kind]()
    handle = tapesac.wrap(case.blocks)
    grads(case)
    for i, s in handle.stats().items():
        tape = handle.tapes()[i]
        assert s["ops_replayed"] < s["ops_recorded"]
        if kind == "nograd_branch":
            replayable = {tape.op_name(op) for op in range(len(tape.ops))}
            assert "aten.bincount.default" in replayable
            names = [tape.op_name(v) for v in _closure(tape)]
            assert not any("bincount" in n or "copy_" in n or "log" in n for n in names)


def _closure(tape):
    held = {v.vid for v in tape.values if v.kind != 1 or v.free}
    return tape.producer_closure(tape.read_vids(), held)


class _Tracker(TorchDispatchMode):
    """Weak references to every tensor created while active."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(o, torch.Tensor):
                self.refs.append(weakref.ref(o))
        return out


@pytest.mark.parametrize("kind", ["llama3", "inplace", "encoder_dropout"])
def test_nothing_recorded_or_recomputed_survives_backward_without_gc(kind):
    case = CASES[kind]()
    handle = tapesac.wrap(case.blocks)
    gc.collect()
    gc.disable()
    try:
        tracker = _Tracker()
        with tracker:
            loss = case.run(case.model)
            loss.backward()
        del loss
        replayers = [s.last_replayer for s in handle.blocks]
        grads_ = {id(p.grad) for p in case.model.parameters() if p.grad is not None}
        grads_ |= {id(x.grad) for x in case.inputs}
        alive = [r() for r in tracker.refs if r() is not None]
        alive = [t for t in alive if id(t) not in grads_]
        # Only parameters' and buffers' own storages may remain (e.g. views made by optimizers).
        owned = {p.untyped_storage().data_ptr() for p in case.model.parameters()}
        owned |= {b.untyped_storage().data_ptr() for b in case.model.buffers()}
        owned |= {x.untyped_storage().data_ptr() for x in case.inputs}
        leaked = [t for t in alive if t.untyped_storage().data_ptr() not in owned]
        assert not leaked, [(tuple(t.shape), t.dtype) for t in leaked]
        assert all(r is not None and r() is None for r in replayers), "a replayer outlived its graph"
    finally:
        gc.enable()


def _run_counted(case, handle, keep_p: float | None = None):
    """One step with a storage counter: (live bytes after forward, bytes of the blocks' outputs,
    allocated during backward)."""
    case.model.zero_grad(set_to_none=True)
    counter = StorageCounter()
    torch.manual_seed(0)
    outputs: list[torch.Tensor] = []
    hooks = [b.register_forward_hook(lambda m, a, o: outputs.append(o)) for b in case.blocks]
    with counter:
        loss = case.run(case.model)
        after_forward = counter.live_bytes - loss.untyped_storage().nbytes()
        counter.allocated_bytes = 0
        loss.backward()
    for h in hooks:
        h.remove()
    out_bytes = sum({o.untyped_storage().data_ptr(): o.untyped_storage().nbytes() for o in outputs}.values())
    return after_forward, out_bytes, counter.allocated_bytes


def _keep_every_other(handle) -> None:
    handle.set_policy(Policy({i: BlockPolicy(t.signature(), [t.position(v) for j, v in enumerate(t.read_vids())
                                                               if j % 2 == 0])
                              for i, t in handle.tapes().items()}))


def test_kept_and_recomputed_bytes_match_storage_counting():
    def blocks_only():
        case = CASES["llama3"]()
        model = case.model
        tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
        h0 = model.tok_embeddings(tokens).detach().requires_grad_()

        def run(m):
            h = h0
            for layer in m.layers.values():
                h = layer(h, m.freqs_cis, attention_masks=None)
            return h.sum()

        case.run = run
        case.inputs = [h0]
        return case

    live0, out0, alloc0 = _run_counted(blocks_only(), None)
    for keep_p in (None, 0.5):
        case = blocks_only()
        handle = tapesac.wrap(case.blocks)
        if keep_p is not None:
            grads(case)
            _keep_every_other(handle)
        # A program's first forward verifies: it also holds a fingerprint per saved value, and
        # its backward fingerprints what replay rebuilt. Later forwards follow the verified tape.
        for verifying in (True, False):
            live, out_bytes, alloc = _run_counted(case, handle)
            stats = handle.stats()
            assert all(s["verified"] == verifying for s in stats.values()), stats
            kept = sum(s["kept_bytes"] for s in stats.values())
            fingerprints = sum(s["fingerprint_bytes"] for s in stats.values())
            assert (fingerprints > 0) == verifying, stats
            # After forward only block outputs (each the next block's input), kept values and
            # the fingerprints are live.
            assert live == out_bytes + kept + fingerprints
            if keep_p is None:
                assert kept == 0
            else:
                assert kept > 0
            assert live < live0
            if not verifying:
                # Backward allocates what no-AC backward allocates plus exactly what replay rebuilt.
                assert alloc - alloc0 == sum(s["recomputed_bytes"] for s in stats.values())


def test_debug_mode_checks_every_replayed_value():
    case = CASES["encoder_dropout"]()
    tapesac.wrap(case.blocks, debug=True)
    grads(case)  # passes: replay is exact, random ops included


def test_debug_mode_catches_a_nondeterministic_replay(monkeypatch):
    case = CASES["square"]()
    handle = tapesac.wrap(case.blocks, debug=True)
    import tapesac.replay as replay

    real = replay.Replayer._finish_op

    def corrupt(self, op, out, write_out, local, pending, target):
        real(self, op, out, write_out, local, pending, target)
        for vid in op.outs:
            if vid is not None and vid in local:
                local[vid] = local[vid] + 1e-3
                if vid in self.cache:
                    self.cache[vid] = local[vid]

    monkeypatch.setattr(replay.Replayer, "_finish_op", corrupt)
    with pytest.raises(tapesac.ReplayError, match="differs from the forward"):
        grads(case)
    handle.remove()


def test_recording_flows_one_way_and_forms_no_cycles():
    """The recorder is gone once forward returns; what backward needs dies with the graph, no gc."""
    case = CASES["square"]()
    handle = tapesac.wrap(case.blocks)
    recorders: list[weakref.ref] = []
    for s in handle.blocks:
        s.on_record = lambda state, rec, args, kwargs: recorders.append(weakref.ref(rec))
    gc.collect()
    gc.disable()
    try:
        loss = case.run(case.model)
        assert len(recorders) == 2 and all(r() is None for r in recorders), "a Saved handle holds the recorder"
        replayers = [s.last_replayer for s in handle.blocks]
        assert all(r() is not None for r in replayers)
        del loss  # no backward: the graph and everything it saved go at once
        assert all(r() is None for r in replayers), "a reference cycle keeps a replayer alive"
    finally:
        gc.enable()
