"""A small transformer and the training loops trainers run, shared by the planned-mode tests
and ``tools/bench_loops.py``: each loop does one step's forwards and backwards; ``train`` runs
steps with a real optimizer (steps end at ``optimizer.step()``) and measures each one."""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tapesac.meter import AllocatorPeak, StorageCounter


class Block(nn.Module):
    """A small pre-norm transformer block, activation-heavy (tokens >> parameters)."""

    def __init__(self, d: int = 32, heads: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.dropout = dropout

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + F.dropout(self.proj(a), self.dropout, self.training)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Model(nn.Module):
    """Embedding, blocks applied in ``order`` (a block may appear twice: weight sharing), head."""

    def __init__(self, blocks: int = 3, order: list[int] | None = None, dropout: float = 0.0,
                 vocab: int = 64, d: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d, dropout=dropout) for _ in range(blocks))
        self.head = nn.Linear(d, vocab)
        self.order = order or list(range(blocks))

    def forward(self, tokens):
        h = self.emb(tokens)
        for i in self.order:
            h = self.layers[i](h)
        return F.cross_entropy(self.head(h).flatten(0, 1), tokens.roll(-1, 1).flatten())


def tokens(step: int, micro: int, seq: int, batch: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randint(0, 64, (batch, seq), generator=g)


Loop = Callable[[Model, int, int], list[torch.Tensor]]


def forwards_first(micro: int) -> Loop:
    """Gradient accumulation: every micro-batch's forward, then every backward."""
    def run(model: Model, step: int, seq: int) -> list[torch.Tensor]:
        losses = [model(tokens(step, m, seq)) / micro for m in range(micro)]
        for loss in losses:
            loss.backward()
        return losses
    return run


def interleaved(micro: int) -> Loop:
    def run(model: Model, step: int, seq: int) -> list[torch.Tensor]:
        losses = []
        for m in range(micro):
            losses.append(model(tokens(step, m, seq)) / micro)
            losses[-1].backward()
        return losses
    return run


def retained(model: Model, step: int, seq: int) -> list[torch.Tensor]:
    """Two backwards through one retained graph (e.g. two losses on one forward)."""
    loss = model(tokens(step, 0, seq))
    loss.backward(retain_graph=True)
    (loss * 0.5).backward()
    return [loss]


def _tracked(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
    out += [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return out


def train(model: Model, loop: Loop, seqs: list[int], handle=None, allocator: bool = False):
    """Per step: (losses, gradients, peak bytes, allocator peak bytes or None).

    The peak is a storage counter's, entered around the whole step (forwards, backwards and the
    optimizer step; parameters, gradients and optimizer state count from the start). With
    ``allocator`` the step also runs under the PyTorch profiler, whose ``[memory]`` events are an
    independent meter: the highest running total of the CPU allocator's bytes, plus the bytes of
    the storages alive when the step starts."""
    return list(steps(model, loop, seqs, allocator))


def steps(model: Model, loop: Loop, seqs: list[int], allocator: bool = False):
    """:func:`train`'s steps, one at a time (a step that raises ends it there)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step, seq in enumerate(seqs):
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(step)  # dropout draws the same numbers in both runs
        counter = StorageCounter()
        live = _tracked(model, opt)
        counter.track(live)
        start_bytes = sum({id(t.untyped_storage()): t.untyped_storage().nbytes() for t in live}.values())
        with AllocatorPeak() if allocator else contextlib.nullcontext() as events, counter:
            losses = loop(model, step, seq)
            opt.step()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        peak = start_bytes + events.peak_bytes if allocator else None
        yield [loss.detach() for loss in losses], grads, counter.peak_bytes, peak


LOOPS = {
    "accumulate_forwards_first": (forwards_first(3), lambda: Model()),
    "accumulate_interleaved": (interleaved(2), lambda: Model()),
    "block_applied_twice": (forwards_first(1), lambda: Model(blocks=2, order=[0, 1, 0, 1])),
    "retain_graph": (retained, lambda: Model()),
    "dropout": (forwards_first(2), lambda: Model(dropout=0.2)),
}
