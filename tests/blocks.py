"""Small models whose blocks exercise every engine semantic, shared by the tests.

Each case builds ``(model, blocks, run)``: ``run(model)`` does one forward and returns the
scalar loss; ``blocks`` are the modules to wrap. Seeds are fixed so that two builds are equal.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass
class Case:
    model: nn.Module
    blocks: list[nn.Module]
    run: Callable[[nn.Module], torch.Tensor]
    inputs: list[torch.Tensor]
    """Leaf inputs whose gradients are compared too."""


# torchtitan models -----------------------------------------------------------------------------

def _torchtitan_case(model: nn.Module, vocab: int, seq: int = 16, batch: int = 2) -> Case:
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    tokens = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))

    def run(m: nn.Module) -> torch.Tensor:
        return m(tokens.to(next(m.parameters()).device)).float().pow(2).mean()

    return Case(model, list(model.layers.values()), run, [])


def llama3(layers: int = 2, seq: int = 16, batch: int = 2) -> Case:
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs

    torch.manual_seed(0)
    args = TransformerModelArgs(dim=64, n_layers=layers, n_heads=4, n_kv_heads=2, vocab_size=128,
                                max_seq_len=seq)
    return _torchtitan_case(Transformer(args), 128, seq, batch)


def qwen3(layers: int = 2, seq: int = 16, batch: int = 2) -> Case:
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
    from torchtitan.models.qwen3.model.model import Qwen3Model

    torch.manual_seed(0)
    args = Qwen3ModelArgs(dim=64, n_layers=layers, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128,
                          vocab_size=128, max_seq_len=seq)
    return _torchtitan_case(Qwen3Model(args), 128, seq, batch)


def qwen3_moe(layers: int = 2, seq: int = 16, batch: int = 2) -> Case:
    from torchtitan.models.moe import MoEArgs
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
    from torchtitan.models.qwen3.model.model import Qwen3Model
    from torchtitan_ext.cpu_shim import patch_ops

    patch_ops()
    torch.manual_seed(0)
    moe = MoEArgs(num_experts=4, num_shared_experts=1, top_k=2, score_func="softmax", route_norm=True,
                  score_before_experts=False, use_grouped_mm=False)
    args = Qwen3ModelArgs(dim=64, n_layers=layers, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128,
                          vocab_size=128, max_seq_len=seq, moe_enabled=True, moe_inter_dim=32, moe_args=moe)
    return _torchtitan_case(Qwen3Model(args), 128, seq, batch)


# Handmade blocks -----------------------------------------------------------------------------

def _stack_case(blocks: list[nn.Module], x: torch.Tensor, loss=None, **kwargs) -> Case:
    model = nn.ModuleList(blocks)
    inputs = [x.requires_grad_()]

    def run(m: nn.Module) -> torch.Tensor:
        h = inputs[0]
        for b in m:
            h = b(h, **kwargs)
        return loss(h) if loss else h.pow(2).sum()

    return Case(model, list(model), run, inputs)


def encoder_dropout() -> Case:
    """torch.nn.TransformerEncoderLayer in train mode: dropout is a random op inside the block."""
    torch.manual_seed(0)
    blocks = [nn.TransformerEncoderLayer(32, 4, 64, dropout=0.2, batch_first=True) for _ in range(2)]
    return _stack_case(blocks, torch.randn(2, 8, 32))


class LoRALinear(nn.Module):
    def __init__(self, d_in: int, d_out: int, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, d_in) * 0.1)
        self.b = nn.Parameter(torch.randn(d_out, rank) * 0.1)

    def forward(self, x):
        return self.base(x) + F.linear(F.linear(x, self.a), self.b)


class FrozenBlock(nn.Module):
    """Frozen base weights with trainable low-rank adapters (fine-tuning)."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = LoRALinear(d, 2 * d)
        self.down = LoRALinear(2 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def frozen_lora() -> Case:
    torch.manual_seed(0)
    return _stack_case([FrozenBlock() for _ in range(2)], torch.randn(2, 8, 32))


class RouterStatsBlock(nn.Module):
    """A router whose statistics are gathered under no_grad: those ops must never be replayed."""

    def __init__(self, d: int = 32, experts: int = 4) -> None:
        super().__init__()
        self.gate = nn.Linear(d, experts)
        self.ff = nn.Linear(d, d)
        self.register_buffer("load", torch.zeros(experts))
        self.register_buffer("entropy", torch.zeros(()))

    def forward(self, x):
        probs = self.gate(x).softmax(-1)
        with torch.no_grad():
            counts = torch.bincount(probs.argmax(-1).flatten(), minlength=probs.shape[-1])
            self.load.add_(counts.float())
            self.entropy.copy_(-(probs * probs.clamp_min(1e-9).log()).sum(-1).mean())
        return x + self.ff(x) * probs.max(-1, keepdim=True).values


def nograd_branch() -> Case:
    torch.manual_seed(0)
    return _stack_case([RouterStatsBlock() for _ in range(2)], torch.randn(2, 8, 32))


class InPlaceBlock(nn.Module):
    """In-place ops of every kind: on fresh values, through views, with written args that are not
    output 0 (``out=``, batch-norm running stats), and an accumulator updated in a loop with
    indices from ``nonzero`` (MoE-style dispatch)."""

    def __init__(self, d: int = 16, experts: int = 3) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(experts))
        self.router = nn.Linear(d, experts)

    def forward(self, x):
        b, s, d = x.shape
        h = self.lin(x)
        h = h * 1.0
        h.add_(0.5)  # in place on a fresh value
        h.relu_()  # in place, and saves its own output
        h = h * 2.0
        h = self.bn(h.reshape(b * s, d)).reshape(b, s, d)  # writes running stats (args 3 and 4)
        buf = torch.zeros_like(h)
        buf[:, :, : d // 2].copy_(h[:, :, : d // 2])  # write through a view, then read the base
        buf.add_(h.sin())
        with torch.no_grad():  # out= ops have no autograd: their results enter as constants
            gate = torch.empty_like(h)
            torch.sigmoid(buf, out=gate)  # the written argument is a keyword, not positional 0
            vals, order = torch.empty_like(h), torch.empty(h.shape, dtype=torch.long)
            torch.sort(h, dim=-1, out=(vals, order))  # two written arguments, both returned
        out = buf * gate + h.gather(-1, order) * vals
        flat = out.reshape(b * s, d)
        choice = self.router(flat).argmax(-1)
        acc = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            idx = torch.nonzero(choice == e).squeeze(-1)
            acc.index_add_(0, idx, torch.tanh(expert(flat[idx])))
        return x + acc.reshape(b, s, d) * out


def inplace() -> Case:
    torch.manual_seed(0)
    return _stack_case([InPlaceBlock() for _ in range(2)], torch.randn(2, 6, 16))


class ParamViewBlock(nn.Module):
    """Parameters used through views and transposes (slices, .T, .view, .t())."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(2 * d, d) * 0.1)
        self.u = nn.Parameter(torch.randn(d, d) * 0.1)

    def forward(self, x):
        d = x.shape[-1]
        a = x @ self.w[:d].T
        b = torch.tanh(x @ self.w[d:].t())
        c = (a * b) @ self.u.view(d, d)
        return x + c @ self.u.transpose(0, 1).contiguous()


def param_views() -> Case:
    torch.manual_seed(0)
    return _stack_case([ParamViewBlock() for _ in range(2)], torch.randn(2, 5, 16))


class MultiIOBlock(nn.Module):
    """Takes kwargs and non-tensor args, returns several tensors."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)

    def forward(self, x, *, scale: float, mode: str = "sum", extra: torch.Tensor | None = None):
        h = torch.sigmoid(self.a(x)) * scale
        if extra is not None:
            h = h + extra
        g = self.b(h).exp() if mode == "exp" else self.b(h)
        return h, g


def multi_io() -> Case:
    torch.manual_seed(0)
    model = nn.ModuleList([MultiIOBlock(), MultiIOBlock()])
    inputs = [torch.randn(3, 16, requires_grad=True), torch.randn(3, 16, requires_grad=True)]

    def run(m: nn.Module) -> torch.Tensor:
        x, extra = inputs
        h, g = m[0](x, scale=0.5, mode="exp", extra=extra)
        h2, g2 = m[1](g, scale=2.0)
        return (h * g).sum() + (h2 - g2).pow(2).sum()

    return Case(model, list(model), run, inputs)


class SquareBlock(nn.Module):
    """``h * h``: autograd packs the same tensor twice."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        h = self.lin(x)
        return x + h * h


def square() -> Case:
    torch.manual_seed(0)
    return _stack_case([SquareBlock() for _ in range(2)], torch.randn(4, 16))


class ScaleFn(torch.autograd.Function):
    """A custom autograd Function that saves an intermediate with ctx.save_for_backward."""

    @staticmethod
    def forward(ctx, x, w):
        y = torch.tanh(x * w)
        ctx.save_for_backward(y, w, x)
        return y

    @staticmethod
    def backward(ctx, g):
        y, w, x = ctx.saved_tensors
        gy = g * (1 - y * y)
        return gy * w, (gy * x).sum(0)


class CustomFnBlock(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.rand(d) + 0.5)
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return x + ScaleFn.apply(self.lin(x), self.w)


def custom_function() -> Case:
    torch.manual_seed(0)
    return _stack_case([CustomFnBlock() for _ in range(2)], torch.randn(4, 16))


# Activation-heavy variants: more blocks and tokens than parameters warrant, so that keeping
# values raises the step peak and planning has a real trade-off.
DEEP: dict[str, Callable[[], Case]] = {
    "llama3": lambda: llama3(layers=4, seq=64, batch=4),
    "qwen3": lambda: qwen3(layers=4, seq=64, batch=4),
    "qwen3_moe": lambda: qwen3_moe(layers=3, seq=32, batch=4),
}

CASES: dict[str, Callable[[], Case]] = {
    "llama3": llama3,
    "qwen3": qwen3,
    "qwen3_moe": qwen3_moe,
    "encoder_dropout": encoder_dropout,
    "frozen_lora": frozen_lora,
    "nograd_branch": nograd_branch,
    "inplace": inplace,
    "param_views": param_views,
    "multi_io": multi_io,
    "square": square,
    "custom_function": custom_function,
}


def to_device(case: Case, device: str) -> Case:
    """Move a case's model and leaf inputs to ``device`` (in place)."""
    case.model.to(device)
    for i, x in enumerate(case.inputs):
        case.inputs[i] = x.detach().to(device).requires_grad_()
    return case


def grads(case: Case, *, wrap=None, seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One forward+backward: (gradients by name, buffers by name). ``wrap(case)`` may wrap blocks."""
    torch.manual_seed(seed)  # random ops draw the same numbers with and without TapeSAC
    if wrap is not None:
        wrap(case)
    for x in case.inputs:
        x.grad = None
    case.model.zero_grad(set_to_none=True)
    loss = case.run(case.model)
    loss.backward()
    out = {f"param:{n}": p.grad for n, p in case.model.named_parameters() if p.grad is not None}
    out.update({f"input:{i}": x.grad for i, x in enumerate(case.inputs)})
    return out, {n: b.clone() for n, b in case.model.named_buffers()}


def assert_identical(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == actual.keys()
    for name in expected:
        e, a = expected[name], actual[name]
        assert a is not None and e.dtype == a.dtype and e.shape == a.shape, name
        assert torch.equal(e, a), f"{name} differs: max abs diff {(e.float() - a.float()).abs().max().item()}"
