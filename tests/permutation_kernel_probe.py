"""Run torchtitan's own Triton permutation kernel (under Triton's interpreter) inside a wrapped
MoE-style block and compare several optimizer steps with plain autograd, bit for bit.

Run as a script in a fresh process (``TRITON_INTERPRET=1`` must be set before Triton and
torchtitan are imported, so that the kernel and Triton's library functions are interpretable);
prints one JSON line.
"""

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torchtitan.models.moe.kernels import generate_permute_indices  # noqa: E402

import tapesac  # noqa: E402

E, D, ALIGN = 4, 8, 8


class PermutedExperts(nn.Module):
    """Top-1 routing, tokens regrouped by expert with torchtitan's Triton kernel's indices."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.w = nn.Parameter(torch.randn(E, D, D) * 0.3)

    def forward(self, x):
        tokens = x.reshape(-1, D)
        expert = self.router(tokens).argmax(-1)
        order = torch.argsort(expert, stable=True)
        counts = torch.bincount(expert, minlength=E).to(torch.int32)
        max_len = tokens.shape[0] + E * ALIGN
        idx, sizes, _ = generate_permute_indices(counts, E, 1, max_len, ALIGN)
        grouped = torch.cat([tokens[order], tokens.new_zeros(1, D)])[idx.long()]
        owner = torch.repeat_interleave(torch.arange(E), sizes.long())
        owner = torch.cat([owner, owner.new_zeros(max_len - owner.numel())])
        out = torch.bmm(grouped.unsqueeze(1), self.w[owner]).squeeze(1)
        back = torch.zeros_like(tokens).index_add_(0, order, out[idx >= 0][: tokens.shape[0]])
        return x + torch.tanh(back).reshape(x.shape) * self.router(tokens).softmax(-1).amax(-1, keepdim=True).reshape(*x.shape[:-1], 1)


def train(wrap: str | None, steps: int = 4):
    torch.manual_seed(0)
    net = nn.Sequential(PermutedExperts(), PermutedExperts())
    handle = None
    if wrap == "replay_only":
        handle = tapesac.wrap(list(net))
    elif wrap == "planned":
        handle = tapesac.wrap(list(net), memory_limit_bytes=1 << 40)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    out = []
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        x = torch.randn(2, 12, D, generator=torch.Generator().manual_seed(s))
        loss = net(x).square().mean()
        loss.backward()
        out.append([loss.detach()] + [p.grad.clone() for p in net.parameters()])
        opt.step()
    launches = [s.get("kernel_launches") for s in handle.stats().values()] if handle else []
    replayed = [s["ops_replayed"] for s in handle.stats().values()] if handle else []
    return out, launches, replayed


if __name__ == "__main__":
    expected, _, _ = train(None)
    result = {}
    for mode in sys.argv[1:] or ["replay_only", "planned"]:
        actual, launches, replayed = train(mode)
        same = all(torch.equal(a, b) for e, a_ in zip(expected, actual) for a, b in zip(e, a_))
        result[mode] = {"identical": same, "kernel_launches": launches, "ops_replayed": replayed}
    print(json.dumps(result))
