"""Tape signatures identify the program a block ran, not the rank or the moment.

Equal across steps and ranks of one job (float constants, device indices, process-group names and
parameter versions are not in it); different when the ops, their wiring, a dtype or an input
shape differ. ``fast_key`` changes whenever the signature may. Cases that need CUDA or
collectives build the tape by hand.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tapesac
from tapesac.tape import EXTERNAL, PRODUCED, SNAPSHOT, Ref, Tape, TapeOp

from .net import close_group, run_ranks

aten = torch.ops.aten


# Hand-built tapes -----------------------------------------------------------------------------------

class TapeBuilder:
    """Builds a :class:`Tape` op by op, as the recorder would, without running anything."""

    def __init__(self) -> None:
        self.tape = Tape()

    def _sid(self, nbytes: int, external: bool) -> int:
        sid = len(self.tape.storage_nbytes)
        self.tape.storage_nbytes[sid] = nbytes
        if external:
            self.tape.external_sids.add(sid)
        return sid

    def external(self, shape, dtype=torch.float32, version: int = 0) -> Ref:
        t = torch.empty(shape, dtype=dtype, device="meta")
        sid = self._sid(t.numel() * t.element_size(), True)
        return Ref(self.tape.add_value(-1, -1, EXTERNAL, t, version, sid))

    def op(self, func, *args, outs=((2, 3),), dtype=torch.float32, **kwargs) -> list[Ref]:
        deps: list[int] = []

        def collect(a):
            if isinstance(a, Ref):
                deps.append(a.vid)
            elif isinstance(a, (list, tuple)):
                for x in a:
                    collect(x)

        collect(args)
        collect(list(kwargs.values()))
        idx = len(self.tape.ops)
        op = TapeOp(func, tuple(args), dict(kwargs), tuple(dict.fromkeys(deps)))
        self.tape.ops.append(op)
        for slot, shape in enumerate(outs):
            t = torch.empty(shape, dtype=dtype, device="meta")
            op.outs.append(self.tape.add_value(idx, slot, PRODUCED, t, 0, self._sid(t.numel() * t.element_size(), False)))
        op.n_returned = len(op.outs)
        return [Ref(v) for v in op.outs]


def _mlp(scale=0.5, device=torch.device("cpu"), act=aten.gelu.default, approximate="none", x_shape=(2, 3),
         x_dtype=torch.float32, swap=False, w_version=0, cat_last=0) -> Tape:
    """A small hand-built block: ``act(x @ w.t() * scale + zeros(device)) - x``, then a cat."""
    b = TapeBuilder()
    x, w = b.external(x_shape, x_dtype), b.external((3, 3), version=w_version)
    (wt,) = b.op(aten.t.default, w, outs=[(3, 3)])
    (h,) = b.op(aten.mm.default, x, wt, outs=[(x_shape[0], 3)], dtype=x_dtype)
    (h,) = b.op(aten.mul.Tensor, h, scale, outs=[(x_shape[0], 3)], dtype=x_dtype)
    (z,) = b.op(aten.zeros.default, [x_shape[0], 3], dtype=x_dtype, device=device, pin_memory=False,
                outs=[(x_shape[0], 3)])
    (h,) = b.op(aten.add.Tensor, h, z, outs=[(x_shape[0], 3)], dtype=x_dtype)
    if act is aten.gelu.default:
        (h,) = b.op(act, h, approximate=approximate, outs=[(x_shape[0], 3)], dtype=x_dtype)
    else:
        (h,) = b.op(act, h, outs=[(x_shape[0], 3)], dtype=x_dtype)
    (h,) = b.op(aten.sub.Tensor, *((x, h) if swap else (h, x)), outs=[(x_shape[0], 3)], dtype=x_dtype)
    b.op(aten.cat.default, [h, x, (h, x)[cat_last]], 0, outs=[(3 * x_shape[0], 3)], dtype=x_dtype)
    return b.tape


def _collective(group_name="0", reduce_op="sum", as_kwarg=False) -> Tape:
    b = TapeBuilder()
    x = b.external((4, 8))
    if as_kwarg:
        (g,) = b.op(torch.ops._c10d_functional.all_gather_into_tensor.default, x, 2, group_name=group_name,
                    outs=[(8, 8)])
    else:
        (g,) = b.op(torch.ops._c10d_functional.all_gather_into_tensor.default, x, 2, group_name, outs=[(8, 8)])
    (g,) = b.op(torch.ops._c10d_functional.wait_tensor.default, g, outs=[(8, 8)])
    (r,) = b.op(torch.ops._c10d_functional.all_reduce.default, g, reduce_op, group_name, outs=[(8, 8)])
    b.op(torch.ops._c10d_functional.wait_tensor.default, r, outs=[(8, 8)])
    return b.tape


def _same(a: Tape, b: Tape) -> None:
    assert a.signature() == b.signature()


def _differ(a: Tape, b: Tape) -> None:
    assert a.signature() != b.signature()
    assert a.fast_key() != b.fast_key(), "fast_key must change whenever the signature does"


# Not in the signature -------------------------------------------------------------------------------

def test_hand_built_tape_twice_is_equal():
    _same(_mlp(), _mlp())
    assert _mlp().fast_key() == _mlp().fast_key()


@pytest.mark.parametrize("scale", [0.25, 1e-30, float("nan"), float("inf")])
def test_float_constant_is_not_in_the_signature(scale):
    _same(_mlp(scale=0.5), _mlp(scale=scale))


@pytest.mark.parametrize("device", [torch.device("cuda", 1), torch.device("cuda", 7), torch.device("cuda")])
def test_device_index_is_not_in_the_signature(device):
    _same(_mlp(device=torch.device("cuda", 0)), _mlp(device=device))


def test_device_type_is_in_the_signature():
    _differ(_mlp(device=torch.device("cpu")), _mlp(device=torch.device("cuda", 0)))


@pytest.mark.parametrize("as_kwarg", [False, True])
@pytest.mark.parametrize("name", ["1", "tp", "ptd:17", ""])
def test_process_group_name_is_not_in_the_signature(name, as_kwarg):
    _same(_collective("0", as_kwarg=as_kwarg), _collective(name, as_kwarg=as_kwarg))


def test_collective_reduce_op_is_in_the_signature():
    _differ(_collective(reduce_op="sum"), _collective(reduce_op="max"))


def test_external_version_is_not_in_the_signature():
    _same(_mlp(w_version=0), _mlp(w_version=3))


# In the signature ----------------------------------------------------------------------------------

@pytest.mark.parametrize("change", [
    {"act": aten.relu.default},  # a different op
    {"approximate": "tanh"},  # a string that selects what the op computes
    {"swap": True},  # wiring: sub(h, x) vs sub(x, h)
    {"cat_last": 1},  # wiring with repeats: cat([h, x, h]) vs cat([h, x, x])
    {"x_dtype": torch.float64},  # a dtype
    {"x_shape": (5, 3)},  # an input shape
], ids=lambda c: next(iter(c)))
def test_program_changes_are_in_the_signature(change):
    _differ(_mlp(), _mlp(**change))


def test_int_versus_float_constant_is_in_the_signature():
    _differ(_mlp(scale=2), _mlp(scale=2.0))


def test_bool_and_none_constants_are_in_the_signature():
    def tape(**kwargs):
        b = TapeBuilder()
        x = b.external((2, 3))
        b.op(aten.sum.dim_IntList, x, [1], outs=[(2,)], **kwargs)
        return b.tape

    _differ(tape(keepdim=False), tape(keepdim=True))
    _differ(tape(dtype=None), tape(dtype=torch.float64))


def test_a_string_equal_to_a_marker_is_not_a_marker():
    def tape(approximate):
        b = TapeBuilder()
        b.op(aten.gelu.default, b.external((2, 3)), approximate=approximate)
        return b.tape

    _differ(tape("<float>"), tape(1.5))
    _differ(tape("<int>"), tape(3))


def test_fast_key_changes_whenever_the_signature_does():
    """Random combinations of the knobs above: different signatures imply different fast keys."""
    knobs = {
        "scale": [0.5, 2, 2.0, True, None], "device": [torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)],
        "act": [aten.gelu.default, aten.relu.default], "approximate": ["none", "tanh"], "x_shape": [(2, 3), (4, 3)],
        "x_dtype": [torch.float32, torch.bfloat16], "swap": [False, True], "w_version": [0, 1], "cat_last": [0, 1],
    }
    for seed in range(200):
        rng = random.Random(seed)
        a, b = ({k: rng.choice(v) for k, v in knobs.items()} for _ in range(2))
        ta, tb = _mlp(**a), _mlp(**b)
        if ta.signature() != tb.signature():
            assert ta.fast_key() != tb.fast_key(), f"seed {seed}: {a} vs {b}"


# Recorded blocks --------------------------------------------------------------------------------------

class ItemScaleBlock(nn.Module):
    """Scales by a float read from the data with ``.item()``: a new constant every step."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        scale = x.detach().abs().mean().item()
        return F.gelu(self.lin(x) * scale) + 0.1 * scale


def _record(module: nn.Module, x: torch.Tensor) -> Tape:
    with tapesac.wrap([module]) as handle:
        module(x.requires_grad_()).sum().backward()
        return handle.tapes()[0]


def test_same_block_recorded_twice_gives_the_same_signature():
    torch.manual_seed(0)
    block = ItemScaleBlock()
    a = _record(block, torch.randn(2, 4, 8))
    b = _record(block, torch.randn(2, 4, 8) * 3)  # other data: another .item() float
    assert a.signature() == b.signature()


def test_two_blocks_of_one_architecture_give_the_same_signature():
    torch.manual_seed(0)
    x = torch.randn(2, 4, 8)
    assert _record(ItemScaleBlock(), x).signature() == _record(ItemScaleBlock(), x.clone()).signature()


def test_recorded_input_shape_and_dtype_are_in_the_signature():
    torch.manual_seed(0)
    block = ItemScaleBlock()
    base = _record(block, torch.randn(2, 4, 8))
    _differ(base, _record(block, torch.randn(2, 5, 8)))
    _differ(base, _record(copy.deepcopy(block).double(), torch.randn(2, 4, 8, dtype=torch.float64)))


def _offsets_tape(n_docs: int, offsets_dims: int = 1):
    """A block that reads a float input and a packed batch's document offsets (int32), as
    Qwen3.5's gated-DeltaNet blocks do."""
    b = TapeBuilder()
    x = b.external((1, 64, 8))
    cu = b.external((n_docs + 1,) * offsets_dims, torch.int32)
    (c,) = b.op(aten.clone.default, cu, outs=[(n_docs + 1,) * offsets_dims], dtype=torch.int32)
    (y,) = b.op(aten.mul.Tensor, x, 2.0, outs=[(1, 64, 8)])
    return b.tape


def test_how_many_documents_a_batch_packs_is_not_in_the_signature():
    """The number of documents is data, like tokens per expert: ranks and steps that pack other
    documents run the same program. The offsets' number of dimensions, and float shapes, count."""
    _same(_offsets_tape(3), _offsets_tape(7))
    _differ(_offsets_tape(3), _offsets_tape(3, offsets_dims=2))
    assert "$e0[?]torch.int32" in _offsets_tape(3).signature_lines()[0]


class RoutedUnpermuteBlock(nn.Module):
    """Routes the rows whose first feature is positive (how many is data, as tokens per expert
    are) and un-permutes them into a ``new_empty`` buffer, as an MoE token dispatcher does: the
    buffer is held when the scatter reads it, and snapshotted before the scatter writes it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.lin(x[x[:, 0] > 0])
        out = routed.new_empty(routed.shape)
        out[torch.arange(routed.shape[0]).flip(0), :] = routed
        return (out * out).sum() + x.sum()


def test_a_snapshot_of_a_value_with_a_data_dependent_shape_is_not_in_the_signature():
    """Two ranks that route other numbers of tokens run the same program."""
    block = RoutedUnpermuteBlock()
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    few, many = x.clone(), x.clone()
    few[:, 0], many[:, 0] = -1.0, 1.0
    few[:3, 0] = 1.0  # 3 rows routed against 16
    a, b = _record(block, few), _record(block, many)
    assert a.values[[o for o in a.ops if "index_put" in str(o.func)][0].deps[0]].kind == SNAPSHOT
    assert a.signature() == b.signature(), next(
        (la, lb) for la, lb in zip(a.signature_lines(), b.signature_lines()) if la != lb)


class OwnPieceBlock(nn.Module):
    """Keeps piece ``rank`` of its input cut in equal pieces along the sequence, as a replicated
    tensor redistributed to ``Shard(1)`` is on each rank (sequence parallelism)."""

    def __init__(self, rank: int, pieces: int = 2) -> None:
        super().__init__()
        self.rank, self.pieces = rank, pieces
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mine = torch.chunk(x, self.pieces, dim=1)[self.rank].clone()
        return self.linear(mine).relu()


def test_which_equal_piece_a_rank_keeps_is_not_in_the_signature():
    torch.manual_seed(0)
    x = torch.randn(2, 6, 8)
    blocks = [OwnPieceBlock(rank) for rank in range(2)]
    blocks[1].load_state_dict(blocks[0].state_dict())
    a, b = (_record(block, x.clone()) for block in blocks)
    assert a.signature() == b.signature(), next(
        (la, lb) for la, lb in zip(a.signature_lines(), b.signature_lines()) if la != lb)
    # Unequal pieces are different programs: which one is read stays in.
    c = _record(OwnPieceBlock(0, pieces=4), torch.randn(2, 7, 8))  # pieces of 2, 2, 2 and 1 rows
    d = _record(OwnPieceBlock(3, pieces=4), torch.randn(2, 7, 8))
    assert c.signature() != d.signature()


def test_parameter_version_is_not_in_the_signature():
    torch.manual_seed(0)
    block = copy.deepcopy(ItemScaleBlock())  # deep-copied parameters start at version 0
    x = torch.randn(2, 4, 8)
    before = _record(block, x.clone())
    torch.optim.SGD(block.parameters(), lr=0.1).step()  # bumps every parameter's version
    after = _record(block, x.clone())
    assert before.signature() == after.signature()


# Across ranks ----------------------------------------------------------------------------------------


def _rank_worker(rank: int, world: int, port: int, queue) -> None:
    import os

    import torch.distributed as dist

    from tapesac import distributed as tdist
    from tapesac.errors import PolicyError

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        blocks = [ItemScaleBlock(), ItemScaleBlock()]
        # Block 0 sees the same shape everywhere (other data); block 1 a longer sequence on rank 1.
        tapes = {0: _record(blocks[0], torch.randn(2, 4, 8) * (1 + rank)),
                 1: _record(blocks[1], torch.randn(2, 5 if rank == 1 else 4, 8))}
        signatures = {b: t.signature() for b, t in tapes.items()}
        result = {"signatures": signatures}
        for key, describe in (("plain", None), ("described", lambda b: tapes[b].signature_lines())):
            try:
                tdist.check_signatures(signatures, describe=describe)
            except PolicyError as e:
                result[key] = str(e)
        tdist.check_signatures({0: signatures[0]})  # equal across ranks: no error
        queue.put((rank, result))
    finally:
        close_group()


def test_a_rank_with_another_shape_gets_the_same_error_on_every_rank():
    results = run_ranks(_rank_worker, timeout_s=180)
    assert results[0]["signatures"][0] == results[1]["signatures"][0]  # stable across processes
    assert results[0]["signatures"][1] != results[1]["signatures"][1]
    for key in ("plain", "described"):
        assert results[0][key] == results[1][key]  # the same error on every rank
        message = results[0][key]
        assert "ranks [1] recorded different block tapes than rank 0 (blocks [1])" in message
        assert "rank 1: blocks [1]" in message
    described = results[0]["described"]
    assert "rank 1, block 1: first differs at op 0" in described, described
    assert "[2, 4, 8]" in described and "[2, 5, 8]" in described, described
