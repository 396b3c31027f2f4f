"""Small Qwen3.5 models from torchtitan 0.3's own configs, trained in-process on CPU.

The model is torchtitan's ``debugmodel`` (or ``debugmodel_moe``) cut to its first four blocks
(three gated-DeltaNet blocks, then full attention) with a 512-token vocabulary; batches are
packed text whose document boundaries move every step (seeded), so the varlen metadata the
DeltaNet blocks take changes size from step to step, as in real training. Its flash-linear-
attention kernels run as the opaque CPU stand-ins of ``torchtitan03_ext.fla_cpu``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import torchtitan03_ext  # noqa: F401  (the CPU shim: FlexAttention by SDPA, fla's kernels on CPU)
from torchtitan.distributed.utils import get_spmd_backend, set_spmd_backend
from torchtitan.models.qwen3_5 import qwen3_5_configs

from torchtitan03_ext.trainer import TEXT_ONLY_SPECIAL_TOKENS

VOCAB = 512
BLOCKS = 4


def model(flavor: str, seed: int = 0, device: str = "cpu"):
    """torchtitan's ``flavor`` config, cut to :data:`BLOCKS` blocks, built and initialised (on
    CPU, then moved to ``device``)."""
    cfg = qwen3_5_configs[flavor](attn_backend="flex")
    cfg.vocab_size = VOCAB
    cfg.tok_embeddings.num_embeddings = VOCAB
    cfg.lm_head.out_features = VOCAB
    cfg.layers = cfg.layers[:BLOCKS]
    torch.manual_seed(seed)
    net = cfg.build()
    net.init_states()
    return net.to(device)


def batch(step: int, rows: int = 2, seq: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, positions) of packed text: 1 to 3 documents per row, boundaries drawn per step."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (rows, seq), generator=g)
    positions = torch.arange(seq).repeat(rows, 1)
    for r in range(rows):
        n_cuts = int(torch.randint(0, 3, (1,), generator=g))
        for cut in sorted(torch.randint(8, seq - 8, (n_cuts,), generator=g).tolist()):
            positions[r, cut:] -= positions[r, cut].clone()
    return tokens, positions


class _PartialDTensor:
    """torchtitan's model code reads the process-wide SPMD backend; its trainer sets it."""

    def __enter__(self):
        self.before = get_spmd_backend()
        set_spmd_backend("partial_dtensor")

    def __exit__(self, *exc):
        set_spmd_backend(self.before)


def train(net, steps: int, rows: int = 2, seq: int = 64):
    device = next(net.parameters()).device
    """Per step (an AdamW step each): (loss, gradients by name)."""
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    out = []
    with _PartialDTensor():
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            tokens, positions = (t.to(device) for t in batch(step, rows, seq))
            logits = net(tokens, attention_masks=net.get_attention_masks(positions), positions=positions,
                         special_tokens=dict(TEXT_ONLY_SPECIAL_TOKENS))
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens.roll(-1, 1).flatten())
            loss.backward()
            out.append((loss.detach(), {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}))
            opt.step()
    return out


def blocks(net) -> list:
    return list(net.layers.values())
