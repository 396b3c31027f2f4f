"""Seeded random block programs, run under TapeSAC and under plain autograd, compared bit for bit.

A *program* is a small model built from one integer seed: one or two blocks, each a random
sequence of steps drawn from the vocabulary of real transformer and MoE blocks (linears, views,
in-place writes on internals and on views of them, ``out=`` ops, random ops, norms with running
statistics, attention, top-k expert dispatch into an accumulator, host syncs, custom autograd
Functions, dead branches, extra outputs and keyword arguments). Everything is deterministic given
the seed: the structure comes from ``random.Random(seed)``, the weights from a seeded
``torch.Generator``, and every run reseeds the global generator before it starts.

A *loop* is what the caller does with the model in one step (see :data:`LOOPS`). :func:`check`
runs one (seed, loop) twice, from identical initial state and identical generator seeds: once
plain, once with the blocks wrapped by TapeSAC. It compares losses, gradients of every parameter
and of the input leaves, and every buffer, bit for bit, and returns one of these outcomes
(project promise #1):

* ``MATCH``: both ran and every number is bit-identical;
* ``REFUSED``: plain autograd succeeded and TapeSAC raised a :class:`~tapesac.TapeSACError`
  (allowed; counted by message kind);
* ``BOTH_RAISED``: plain autograd raised and so did TapeSAC (allowed);
* ``MISMATCH``: anything else, a failure: different numbers, a non-TapeSAC exception where plain
  autograd succeeded, or success where plain autograd raised.

``python tools/fuzz.py --seed S --loop L`` reruns one case; tests/test_fuzz.py runs a fixed range.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import random
import re
import traceback
import warnings
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import tapesac
from tapesac.policy import BlockPolicy, Policy
from tapesac.tape import PRODUCED

B, T, D = 2, 4, 8
"""Batch, sequence and hidden size: 64 elements per activation keeps a program under ~50 ms."""
H = 2
"""Attention heads (head size D // H)."""
E, K = 4, 2
"""Experts and experts per token in MoE steps."""

MATCH, REFUSED, BOTH_RAISED, MISMATCH = "MATCH", "REFUSED", "BOTH_RAISED", "MISMATCH"
OUTCOMES = (MATCH, REFUSED, BOTH_RAISED, MISMATCH)


# Custom autograd Functions -------------------------------------------------------------------

class _CubeScale(torch.autograd.Function):
    """x * x * w, saving its inputs with ctx.save_for_backward."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * 2 * x * w, (g * x * x).sum_to_size(w.shape)


class _TanhSavesOutput(torch.autograd.Function):
    """tanh(x), saving its own output (made inside the Function, under no_grad)."""

    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * (1 - y * y)


_ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "identity": lambda t: t,
    "gelu": F.gelu,
    "silu": F.silu,
    "relu": F.relu,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
}


# Step builders -------------------------------------------------------------------------------
#
# A builder runs once at construction: it draws its choices from ``rng``, registers parameters
# and buffers on the block, names the features it exercises, and returns ``fn(h, env) -> h``
# that maps a (B, T, D) activation to another one. ``env["aux"]`` collects values a step wants
# the block to be able to return as an extra output.

Step = Callable[[torch.Tensor, dict], torch.Tensor]


def _linear(blk: "FuzzBlock", k: str, rng: random.Random) -> Step:
    w = blk.param(k + "w", D, D)
    b = blk.param(k + "b", D, scale=0.1) if rng.random() < 0.5 else None
    act = _ACTS[rng.choice(sorted(_ACTS))]
    residual = rng.random() < 0.5
    blk.feature("linear")

    def fn(h, env):
        y = act(F.linear(h, getattr(blk, w), getattr(blk, b) if b else None))
        return h + y if residual else y
    return fn


def _mlp(blk, k, rng):
    w1, w2 = blk.param(k + "w1", D, 2 * D), blk.param(k + "w2", 2 * D, D)
    swiglu = rng.random() < 0.5
    w3 = blk.param(k + "w3", D, 2 * D) if swiglu else None
    blk.feature("matmul:swiglu" if swiglu else "matmul:mlp")

    def fn(h, env):
        up = h @ getattr(blk, w1)
        up = F.silu(up) * (h @ getattr(blk, w3)) if swiglu else F.gelu(up)
        return h + torch.matmul(up, getattr(blk, w2))
    return fn


def _view(blk, k, rng):
    variant = rng.choice(["view", "reshape_transpose", "narrow", "select", "index", "chunk", "unbind",
                          "expand"])
    blk.feature("view:" + variant)
    w = blk.param(k + "w", D, D) if variant == "view" else None
    wt = blk.param(k + "wt", T, T) if variant == "reshape_transpose" else None
    g = blk.param(k + "g", D) if variant in ("narrow", "select", "expand") else None
    perm = [rng.randrange(T) for _ in range(T)]

    def fn(h, env):
        if variant == "view":
            return (h.view(B * T, D) @ getattr(blk, w)).view(B, T, D)
        if variant == "reshape_transpose":
            return h + (h.transpose(1, 2) @ getattr(blk, wt)).transpose(1, 2).reshape(B, T, D)
        if variant == "narrow":
            a, b = h.narrow(-1, 0, D // 2), h.narrow(-1, D // 2, D // 2)
            return torch.cat([a * torch.sigmoid(b), b * getattr(blk, g).narrow(0, 0, D // 2)], -1)
        if variant == "select":
            return h + h.select(1, 0).unsqueeze(1) * getattr(blk, g)
        if variant == "index":
            return h + torch.tanh(h[:, perm])
        if variant == "chunk":
            a, b = h.chunk(2, -1)
            return torch.cat([b * torch.sigmoid(a), a], -1)
        if variant == "unbind":
            return torch.stack([u * (i + 1) / T for i, u in enumerate(h.unbind(1))], 1).exp().tanh()
        return h + h.mean(1, keepdim=True).expand(B, T, D) * getattr(blk, g)
    return fn


_INPLACE_OPS = ["add_", "mul_scalar", "mul_tensor", "relu_", "clamp_", "masked_fill_"]


def _inplace_internal(blk, k, rng):
    w = blk.param(k + "w", D, D)
    # relu_ and clamp_ save their result for backward: a later write would make the block one plain
    # autograd rejects, so at most one of them, last (illegal_inplace covers the rejected kind).
    ops = [rng.choice(_INPLACE_OPS[:3] + ["masked_fill_"]) for _ in range(rng.randint(0, 2))]
    if not ops or rng.random() < 0.5:
        ops.append(rng.choice(["relu_", "clamp_"]))
    for op in ops:
        blk.feature("inplace:" + op)

    def fn(h, env):
        t = h @ getattr(blk, w)  # made inside the block, then written in place
        for op in ops:
            if op == "add_":
                t.add_(h)
            elif op == "mul_scalar":
                t.mul_(0.5)
            elif op == "mul_tensor":
                t.mul_(torch.sigmoid(h))
            elif op == "relu_":
                t.relu_()
            elif op == "clamp_":
                t.clamp_(-1.0, 1.0)
            else:
                t.masked_fill_(h.detach() > 0.5, 0.0)
        return h + t
    return fn


def _inplace_view(blk, k, rng):
    variant = rng.choice(["select_mul_", "narrow_add_", "copy_slice", "transpose_clamp_", "select_relu_",
                          "strided_masked_fill_"])
    blk.feature("inplace_view:" + variant)
    g = blk.param(k + "g", D)

    def fn(h, env):
        t = h * 1.5 + getattr(blk, g)
        if variant == "select_mul_":
            t[:, 0].mul_(2.0)
        elif variant == "narrow_add_":
            t.narrow(-1, 0, D // 2).add_(h.narrow(-1, D // 2, D // 2))
        elif variant == "copy_slice":
            t[..., : D // 2].copy_(torch.tanh(h[..., D // 2:]))
        elif variant == "transpose_clamp_":
            t.transpose(1, 2)[:, 0].clamp_(-0.5, 0.5)
        elif variant == "select_relu_":
            t.select(1, T - 1).relu_()
        else:
            t.view(B * T, D)[::2].masked_fill_(h.detach().view(B * T, D)[::2] < 0, 0.0)
        return t
    return fn


def _out_op(blk, k, rng):
    variant = rng.choice(["add", "mul", "sigmoid", "matmul"])
    blk.feature("out=:" + variant)
    w = blk.param(k + "w", D, D)
    use = rng.choice(["scale_h", "scale_w"])

    def fn(h, env):
        buf = torch.empty_like(h)  # made inside the block; written by out=
        hd, wd = h.detach(), getattr(blk, w).detach()  # out= ops do not support autograd
        if variant == "add":
            torch.add(hd, wd[0], out=buf)
        elif variant == "mul":
            torch.mul(hd, 0.5, out=buf)
        elif variant == "sigmoid":
            torch.sigmoid(hd, out=buf)
        else:
            torch.matmul(hd, wd, out=buf)
        buf = torch.tanh(buf) if variant == "matmul" else buf
        # buf is saved for backward by the mul below
        return h * buf if use == "scale_h" else h + buf * getattr(blk, w)[0]
    return fn


def _random(blk, k, rng):
    variant = rng.choice(["dropout", "dropout_inplace", "rand_like", "randn_like", "bernoulli",
                          "bernoulli_"])
    blk.feature("rng:" + variant)
    p = rng.choice([0.1, 0.5])

    def fn(h, env):
        if variant == "dropout":
            return F.dropout(h, p, training=True)
        if variant == "dropout_inplace":
            return F.dropout(h * 1.0, p, training=True, inplace=True)
        if variant == "rand_like":
            return h * (torch.rand_like(h) + 0.5)
        if variant == "randn_like":
            return h + 0.1 * torch.randn_like(h)
        if variant == "bernoulli":
            return h * torch.bernoulli(torch.full_like(h, 1 - p))
        return h * torch.empty_like(h).bernoulli_(1 - p)
    return fn


def _batchnorm(blk, k, rng):
    bn = nn.BatchNorm1d(D, affine=rng.random() < 0.7, momentum=rng.choice([0.1, 0.5]), dtype=blk.dtype)
    with torch.no_grad():
        if bn.affine:
            bn.weight.copy_(1 + 0.1 * torch.randn(D, generator=blk.gen, dtype=blk.dtype))
            bn.bias.copy_(0.1 * torch.randn(D, generator=blk.gen, dtype=blk.dtype))
    blk.add_module(k + "bn", bn)
    blk.feature("batchnorm1d")

    def fn(h, env):
        return getattr(blk, k + "bn")(h.reshape(B * T, D)).view(B, T, D)
    return fn


def _norm(blk, k, rng):
    variant = rng.choice(["layer_norm", "rms_norm"])
    blk.feature("norm:" + variant)
    w = blk.param(k + "w", D, scale=0.1)
    b = blk.param(k + "b", D, scale=0.1) if variant == "layer_norm" else None

    def fn(h, env):
        weight = 1 + getattr(blk, w)
        if variant == "layer_norm":
            return F.layer_norm(h, (D,), weight, getattr(blk, b))
        return F.rms_norm(h, (D,), weight, eps=1e-6)
    return fn


def _softmax(blk, k, rng):
    variant = rng.choice(["softmax", "log_softmax"])
    blk.feature("softmax:" + variant)
    w = blk.param(k + "w", D)

    def fn(h, env):
        s = F.softmax(h * 2, -1) if variant == "softmax" else F.log_softmax(h, -1)
        return h + s * getattr(blk, w)
    return fn


def _attention(blk, k, rng):
    variant = rng.choice(["sdpa", "sdpa_causal", "sdpa_dropout", "manual"])
    blk.feature("attention:" + variant)
    wqkv, wo = blk.param(k + "wqkv", D, 3 * D), blk.param(k + "wo", D, D)
    split = rng.choice(["split", "chunk", "unbind"])

    def heads(t):
        return t.view(B, T, H, D // H).transpose(1, 2)

    def fn(h, env):
        qkv = h @ getattr(blk, wqkv)
        if split == "split":
            q, kk, v = qkv.split(D, -1)
        elif split == "chunk":
            q, kk, v = qkv.chunk(3, -1)
        else:
            q, kk, v = qkv.view(B, T, 3, D).unbind(2)
        q, kk, v = heads(q), heads(kk), heads(v)
        if variant == "manual":
            att = torch.softmax(q @ kk.transpose(-1, -2) / math.sqrt(D // H), -1)
            o = att @ v
        else:
            o = F.scaled_dot_product_attention(q, kk, v, is_causal=variant == "sdpa_causal",
                                               dropout_p=0.2 if variant == "sdpa_dropout" else 0.0)
        return h + o.transpose(1, 2).reshape(B, T, D) @ getattr(blk, wo)
    return fn


def _moe(blk, k, rng):
    variant = rng.choice(["index_add_", "scatter_add_", "sort_gather"])
    blk.feature("moe:" + variant)
    wr, we = blk.param(k + "wr", D, E), blk.param(k + "we", E, D, D)
    stats = rng.random() < 0.5
    if stats:
        blk.register_buffer(k + "load", torch.zeros(E, dtype=blk.dtype))
        blk.feature("dead:no_grad_router_stats")
    sorter = rng.choice(["argsort", "sort"])

    def fn(h, env):
        flat = h.reshape(B * T, D)
        probs = torch.softmax(flat @ getattr(blk, wr), -1)
        w, idx = torch.topk(probs, K, -1)
        if stats:
            with torch.no_grad():
                getattr(blk, k + "load").add_(torch.bincount(idx.flatten(), minlength=E).to(blk.dtype))
        acc = torch.zeros_like(flat)  # the accumulator, made inside the block
        experts = getattr(blk, we)
        if variant == "sort_gather":
            flat_idx = idx.reshape(-1)
            order = (torch.argsort(flat_idx, stable=True) if sorter == "argsort"
                     else torch.sort(flat_idx, stable=True)[1])
            tok = order // K
            xs = torch.gather(flat, 0, tok[:, None].expand(-1, D))
            counts = torch.bincount(flat_idx, minlength=E).tolist()  # a host sync: split sizes
            ys = torch.cat([F.silu(x @ experts[e]) for e, x in enumerate(xs.split(counts))])
            acc.index_add_(0, tok, ys * w.reshape(-1)[order][:, None])
            return h + acc.view(B, T, D)
        for e in range(E):
            tok, slot = torch.where(idx == e)  # nonzero: data-dependent shapes
            y = F.silu(flat[tok] @ experts[e]) * w[tok, slot, None]
            if variant == "index_add_":
                acc.index_add_(0, tok, y)
            else:
                acc.scatter_add_(0, tok[:, None].expand(-1, D), y)
        return h + acc.view(B, T, D)
    return fn


def _sort_gather(blk, k, rng):
    blk.feature("sort_gather")
    w = blk.param(k + "w", D)

    def fn(h, env):
        order = h.detach().argsort(-1)
        return h + torch.gather(h, -1, order) * getattr(blk, w)
    return fn


def _data_dependent(blk, k, rng):
    variant = rng.choice(["nonzero_index_put", "masked_select", "item_scale", "branch"])
    blk.feature("data_dep:" + variant)

    def fn(h, env):
        if variant == "branch":  # the program itself follows the data: a followed forward departs
            return h.tanh() * h if bool(h.detach().mean() > 0) else h.sigmoid() * h
        if variant == "nonzero_index_put":
            rows = (h.detach().sum(-1) > 0).nonzero(as_tuple=True)
            h2 = h.clone()
            h2[rows] = torch.tanh(h[rows])
            return h2
        if variant == "masked_select":
            vals = torch.masked_select(h, h.detach() > 0)
            return h * (1 + 0.01 * vals.sum())
        s = h.detach().abs().mean().item()  # a Python float read from a tensor, used as a scale
        return h * (1.0 / (1.0 + s))
    return fn


def _custom_function(blk, k, rng):
    variant = rng.choice(["saves_inputs", "saves_output"])
    blk.feature("custom_fn:" + variant)
    w = blk.param(k + "w", D)

    def fn(h, env):
        if variant == "saves_inputs":
            return h + _CubeScale.apply(h, getattr(blk, w))
        return _TanhSavesOutput.apply(h * (1 + getattr(blk, w)))
    return fn


_UNSEEN = ["numpy_fresh", "numpy_view", "ctypes_fresh", "numpy_inplace", "numpy_fn",
           "triton_fresh", "triton_inplace", "triton_fn"]


def _unseen(blk, k, rng):
    """Writes the dispatcher never sees, as GPU kernels make them: numpy and ctypes writes into
    fresh buffers, into views of them and in place into an existing activation, inside and
    outside autograd Functions, and real Triton kernels (Triton's interpreter)."""
    from . import unseen as u

    variants = _UNSEEN if u.triton is not None else [v for v in _UNSEEN if not v.startswith("triton")]
    variant = rng.choice(variants)
    blk.feature("unseen:" + variant)
    w = blk.param(k + "w", D)

    def fn(h, env):
        g = getattr(blk, w)
        if variant == "numpy_fresh":
            buf = torch.empty_like(h)
            np.tanh(u.host(h), out=u.host(buf))
            return h + buf * g
        if variant == "numpy_view":
            buf = torch.empty(B, T, 2 * D, dtype=h.dtype)
            u.host(buf)[..., :D] = np.sin(u.host(h))
            u.host(buf)[..., D:] = 0.5
            return h * buf[..., :D] + buf[..., D:] * g
        if variant == "ctypes_fresh":
            src = torch.sigmoid(h * g).contiguous()
            buf = torch.empty_strided(src.shape, src.stride(), dtype=src.dtype)
            ctypes.memmove(buf.data_ptr(), src.data_ptr(), src.numel() * src.element_size())
            return h + buf * g
        if variant == "numpy_inplace":
            y = h * g
            u.host(y)[...] *= 1.5  # an opaque kernel updating an activation: loud once, or exact
            return h + y * y
        if variant == "numpy_fn":
            return h + u.UnseenTanh.apply(h.contiguous(), g)
        if variant == "triton_fresh":
            return h + u.launch_affine(h.detach().contiguous()) * g
        if variant == "triton_inplace":
            y = (h * g).contiguous()
            n = y.numel()
            u.scale_inplace_kernel[(u.triton.cdiv(n, 64),)](y, n, 0.5, BLOCK=64)
            return h + y * y
        return h + u.TritonAffine.apply(h * g)
    return fn


def _unused_op_output(blk, k, rng):
    variant = rng.choice(["max_indices", "var_mean_var", "sort_values", "aminmax"])
    blk.feature("unused_op_output:" + variant)

    def fn(h, env):
        if variant == "max_indices":
            m, _ = h.max(-1, keepdim=True)
            return h - m
        if variant == "var_mean_var":
            _, mu = torch.var_mean(h, -1, keepdim=True)
            return h - mu
        if variant == "sort_values":
            _, i = h.sort(-1)
            return h * (1 + i.to(h.dtype) / D)
        _, mx = torch.aminmax(h, dim=-1, keepdim=True)
        return h / (1 + mx.abs())
    return fn


def _dead_branch(blk, k, rng):
    variant = rng.choice(["dropped", "no_grad_stats", "to_aux"])
    blk.feature("dead:" + variant)
    w = blk.param(k + "w", D, D)
    if variant == "no_grad_stats":
        blk.register_buffer(k + "stat", torch.zeros(D, dtype=blk.dtype))

    def fn(h, env):
        if variant == "dropped":
            _ = torch.tanh(h @ getattr(blk, w))  # computed, saved for backward, never used
        elif variant == "no_grad_stats":
            with torch.no_grad():
                getattr(blk, k + "stat").mul_(0.9).add_(h.mean((0, 1)), alpha=0.1)
        else:
            env["aux"].append(torch.exp(-torch.tanh(h @ getattr(blk, w))))
        return h
    return fn


def _pointwise(blk, k, rng):
    act = rng.choice(["gelu", "silu", "tanh", "sigmoid", "exp_neg_sq"])
    blk.feature("pointwise")

    def fn(h, env):
        if act == "exp_neg_sq":
            return h * torch.exp(-h * h)
        return h + _ACTS[act](h)
    return fn


def _module(blk, k, rng):
    """A pure module call (nn.Linear, nn.LayerNorm, nn.RMSNorm), which forwards that follow run
    with the dispatch mode off (tapesac.segments); variants change, from call to call with shapes
    unchanged, what its ops depend on: the input's strides, the module's eps, grad mode."""
    kind = rng.choice(["linear", "layer_norm", "rms_norm"])
    variant = rng.choice(["plain", "plain", "strides_alternate", "eps_alternate", "no_grad_alternate"])
    if kind == "linear":
        mod = nn.Linear(D, D, bias=rng.random() < 0.5, dtype=blk.dtype)
    elif kind == "layer_norm":
        mod = nn.LayerNorm(D, dtype=blk.dtype)
    else:
        mod = nn.RMSNorm(D, eps=1e-6, dtype=blk.dtype)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn(p.shape, generator=blk.gen, dtype=blk.dtype) * 0.3 + (p.dim() == 1 and kind != "linear"))
    blk.add_module(k + "mod", mod)
    residual = rng.random() < 0.5 or variant == "no_grad_alternate"  # else nothing requires grad
    blk.feature(f"module:{kind}")
    if variant != "plain":
        blk.feature(f"module:{variant}")
    calls = [0]

    def fn(h, env):
        m = getattr(blk, k + "mod")
        calls[0] += 1
        odd = calls[0] % 2 == 1
        x = h
        if variant == "strides_alternate" and odd:  # same shape and values, other strides
            x = h.transpose(0, 1).contiguous().transpose(0, 1)
        if variant == "eps_alternate" and kind != "linear":
            m.eps = 1e-6 if odd else 1e-2
        if variant == "no_grad_alternate" and odd:
            with torch.no_grad():
                y = m(x)
        else:
            y = m(x)
        return h + y if residual else y
    return fn


_MESH: list = []
"""The one-rank device mesh of the DTensor steps, while a program that uses it runs."""


def _mesh():
    """A one-rank gloo mesh, made by :func:`run_program` for a program with DTensor steps and taken
    down again after it, so no other test in the process sees a process group."""
    if not _MESH:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        _MESH.append(init_device_mesh("cpu", (1,)))
    return _MESH[0]


def _close_mesh() -> None:
    if _MESH:
        import torch.distributed as dist

        _MESH.clear()
        dist.destroy_process_group()


def _dtensor(blk, k, rng):
    """DTensor code that builds and reads DTensors outside the dispatcher (recorder invariant 8)."""
    variant = rng.choice(["to_from_local", "shard_write", "redistribute"])
    blk.feature("dtensor:" + variant)
    w = blk.param(k + "w", D, D)

    def fn(h, env):
        from torch.distributed.tensor import DTensor, Replicate, Shard

        mesh = _mesh()
        if variant == "redistribute":  # Shard(1) -> Replicate: a functional all-gather
            d = DTensor.from_local(h, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()])
            return h + (torch.relu(d) * d).to_local() @ getattr(blk, w)
        d = DTensor.from_local(h @ getattr(blk, w), mesh, [Replicate()], run_check=False)
        if variant == "to_from_local":
            return h + (torch.tanh(d) * d).to_local()
        a = torch.sigmoid(d)  # saves its output
        with torch.no_grad():  # writes d's shard; d's own version counter does not move
            d.to_local().mul_(2.0)
        return (a * d).to_local()  # saves a and d as it is now
    return fn


def _illegal_inplace(blk, k, rng):
    """A block plain autograd rejects: an output saved by exp is then written in place."""
    blk.feature("illegal_inplace")

    def fn(h, env):
        t = torch.exp(h * 0.1)
        t.mul_(2.0)
        return t
    return fn


BUILDERS: dict[str, tuple[Callable, float]] = {
    "linear": (_linear, 1.0),
    "mlp": (_mlp, 0.8),
    "view": (_view, 1.6),
    "inplace_internal": (_inplace_internal, 1.0),
    "inplace_view": (_inplace_view, 1.0),
    "out_op": (_out_op, 0.6),
    "random": (_random, 1.0),
    "batchnorm": (_batchnorm, 0.5),
    "norm": (_norm, 0.8),
    "softmax": (_softmax, 0.5),
    "attention": (_attention, 0.8),
    "moe": (_moe, 0.8),
    "sort_gather": (_sort_gather, 0.3),
    "data_dependent": (_data_dependent, 0.7),
    "custom_function": (_custom_function, 0.6),
    "unused_op_output": (_unused_op_output, 0.6),
    "dead_branch": (_dead_branch, 0.8),
    "pointwise": (_pointwise, 0.8),
    "module": (_module, 1.0),
    "illegal_inplace": (_illegal_inplace, 0.05),
    "dtensor": (_dtensor, 0.4),
    "unseen": (_unseen, 0.6),
}
"""Step kind -> (builder, relative weight of drawing it)."""


class FuzzBlock(nn.Module):
    """One block: a random sequence of steps, optional keyword arguments and an extra output."""

    def __init__(self, rng: random.Random, gen: torch.Generator, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.gen = gen  # only while building
        self.features: set[str] = set()
        self._named: list[str] = []  # features named by the step being built
        kinds = sorted(BUILDERS)
        weights = [BUILDERS[k][1] for k in kinds]
        self.steps: list[tuple[str, Step]] = []
        """(label, fn): the label names the step's features, for repro descriptions."""
        for i in range(rng.randint(3, 7)):
            kind = rng.choices(kinds, weights)[0]
            self._named = []
            fn = BUILDERS[kind][0](self, f"s{i}_", rng)
            self.steps.append(("+".join(self._named) or kind, fn))
        self.returns_aux = rng.random() < 0.35
        if self.returns_aux:
            self.feature("multi_output")
        # The block writes its own input in place, as some blocks do: ``x += bias`` before reading
        # it, or a residual ``x += tanh(x)`` (tanh saves its output, not x: legal in autograd).
        self.writes_input = rng.choice(["bias", "residual"]) if rng.random() < 0.15 else None
        if self.writes_input:
            self.param("in_bias", D, scale=0.1)
            self.feature("inplace_on_block_input:" + self.writes_input)
        del self.gen

    def param(self, name: str, *shape: int, scale: float = 0.3) -> str:
        t = torch.randn(*shape, generator=self.gen, dtype=self.dtype) * scale
        self.register_parameter(name, nn.Parameter(t))
        return name

    def feature(self, name: str) -> None:
        self.features.add(name)
        self._named.append(name)

    def forward(self, x, *, scale: float | None = None, mask: torch.Tensor | None = None):
        env: dict[str, Any] = {"aux": []}
        if self.writes_input == "bias":
            x.add_(self.in_bias)
        elif self.writes_input == "residual":
            x.add_(torch.tanh(x) * self.in_bias)
        h = x
        if mask is not None:
            h = h.masked_fill(~mask[..., None], 0.0)
        for _, fn in self.steps:
            h = fn(h, env)
        if scale is not None:
            h = h * scale
        if self.returns_aux:
            return h, (env["aux"][0] if env["aux"] else torch.tanh(h))
        return h


class FuzzModel(nn.Module):
    """A program: an optional linear before the blocks, 1-2 blocks, a fixed loss head."""

    def __init__(self, seed: int, skip: frozenset[str] = frozenset()) -> None:
        """``skip`` names steps (``"block.step"``) to leave out when shrinking a failing program;
        they are still drawn, so the rest of the program stays exactly as the seed makes it."""
        super().__init__()
        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        self.seed = seed
        self.dtype = torch.float64 if rng.random() < 0.7 else torch.float32
        self.pre = (nn.Parameter(torch.randn(D, D, generator=gen, dtype=self.dtype) * 0.3)
                    if rng.random() < 0.4 else None)
        self.blocks = nn.ModuleList(FuzzBlock(rng, gen, self.dtype) for _ in range(rng.choice([1, 1, 2])))
        for b, blk in enumerate(self.blocks):
            blk.steps = [s for i, s in enumerate(blk.steps) if f"{b}.{i}" not in skip]
        self.block_kwargs: list[dict[str, Any]] = []
        for _ in self.blocks:
            kw: dict[str, Any] = {}
            if rng.random() < 0.25:
                kw["scale"] = rng.choice([0.5, 2.0])
            if rng.random() < 0.25:
                kw["mask"] = True
            self.block_kwargs.append(kw)
        # A leaf input written in place is an error in plain autograd; usually hand over a copy.
        self.copy_input = self.pre is None and self.blocks[0].writes_input and rng.random() < 0.8
        self.loss_uses_aux = rng.random() < 0.5
        self.loss_form = rng.choice(["linear", "square"])
        self.register_buffer("head", torch.randn(D, generator=gen, dtype=self.dtype))
        self.features = set().union(*(b.features for b in self.blocks))
        if any(self.block_kwargs):
            self.features.add("kwargs")
        if any(b.returns_aux for b in self.blocks) and not self.loss_uses_aux:
            self.features.add("unused_block_output")

    def forward(self, x, mask=None, repeat: int = 1):
        h = x @ self.pre if self.pre is not None else (x * 1.0 if self.copy_input else x)
        auxes = []
        for blk, kw in zip(self.blocks, self.block_kwargs):
            for _ in range(repeat):
                kwargs = {"scale": kw["scale"]} if "scale" in kw else {}
                if kw.get("mask"):
                    kwargs["mask"] = mask
                out = blk(h, **kwargs)
                if isinstance(out, tuple):
                    h, aux = out
                    auxes.append(aux)
                else:
                    h = out
        return h, auxes

    def loss(self, h, auxes) -> torch.Tensor:
        loss = (h * self.head).sum() if self.loss_form == "linear" else (h.pow(2) * self.head).sum()
        if self.loss_uses_aux:
            for a in auxes:
                loss = loss + 0.5 * (a * a).mean()
        return loss


def describe(seed: int, skip: frozenset[str] = frozenset()) -> str:
    """The program of ``seed`` in one line: dtype, steps per block, kwargs, loss."""
    m = FuzzModel(seed, skip)
    blocks = " | ".join(
        (f"x+={b.writes_input}; " if b.writes_input else "") + " ".join(k for k, _ in b.steps)
        + (" ->(h,aux)" if b.returns_aux else "")
        for b in m.blocks)
    return (f"{str(m.dtype).replace('torch.', '')}, {'pre-linear, ' if m.pre is not None else ''}blocks [{blocks}], "
            f"kwargs {m.block_kwargs}, loss {m.loss_form}{' + aux' if m.loss_uses_aux else ''}")


def program_size(seed: int, skip: frozenset[str] = frozenset()) -> int:
    """Steps in the program of ``seed``: the smallest failing program is the best repro."""
    return sum(len(b.steps) for b in FuzzModel(seed, skip).blocks)


def step_ids(seed: int) -> list[str]:
    """``"block.step"`` of every step of the program, the names ``skip`` takes."""
    return [f"{b}.{i}" for b, blk in enumerate(FuzzModel(seed).blocks) for i in range(len(blk.steps))]


def features_of(seed: int) -> set[str]:
    """The features a program exercises (built once, not run)."""
    return FuzzModel(seed).features


def all_features() -> list[str]:
    """Every feature name a program can exercise: the generator's vocabulary."""
    names = {"linear", "matmul:mlp", "matmul:swiglu", "batchnorm1d", "sort_gather", "pointwise",
             "illegal_inplace", "multi_output", "inplace_on_block_input:bias",
             "inplace_on_block_input:residual", "kwargs", "unused_block_output",
             "dead:no_grad_router_stats"}
    names |= {"view:" + v for v in ["view", "reshape_transpose", "narrow", "select", "index", "chunk",
                                    "unbind", "expand"]}
    names |= {"inplace:" + v for v in _INPLACE_OPS}
    names |= {"inplace_view:" + v for v in ["select_mul_", "narrow_add_", "copy_slice", "transpose_clamp_",
                                            "select_relu_", "strided_masked_fill_"]}
    names |= {"out=:" + v for v in ["add", "mul", "sigmoid", "matmul"]}
    names |= {"rng:" + v for v in ["dropout", "dropout_inplace", "rand_like", "randn_like", "bernoulli",
                                   "bernoulli_"]}
    names |= {"norm:layer_norm", "norm:rms_norm", "softmax:softmax", "softmax:log_softmax"}
    names |= {"module:" + v for v in ["linear", "layer_norm", "rms_norm", "strides_alternate", "eps_alternate",
                                      "no_grad_alternate"]}
    names |= {"attention:" + v for v in ["sdpa", "sdpa_causal", "sdpa_dropout", "manual"]}
    names |= {"moe:" + v for v in ["index_add_", "scatter_add_", "sort_gather"]}
    names |= {"data_dep:" + v for v in ["nonzero_index_put", "masked_select", "item_scale", "branch"]}
    names |= {"custom_fn:saves_inputs", "custom_fn:saves_output"}
    names |= {"unused_op_output:" + v for v in ["max_indices", "var_mean_var", "sort_values", "aminmax"]}
    names |= {"dead:dropped", "dead:no_grad_stats", "dead:to_aux"}
    names |= {"dtensor:" + v for v in ["to_from_local", "shard_write", "redistribute"]}
    names |= {"unseen:" + v for v in _UNSEEN}
    return sorted(names)


# Loops ---------------------------------------------------------------------------------------

class _Run:
    """One run of a loop on one model: inputs, the results to compare, the TapeSAC handle."""

    def __init__(self, model: FuzzModel, handle, seed: int) -> None:
        self.model = model
        self.handle = handle
        self.seed = seed
        self.rng = random.Random(seed * 7919 + 17)  # the loop's own choices: same in both runs
        self.results: dict[str, torch.Tensor | None] = {}
        self.notes: list[str] = []
        self.opt: torch.optim.Optimizer | None = None

    def leaf(self, i: int, shape=(B, T, D)) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1009 + i)
        return torch.randn(*shape, generator=gen, dtype=self.model.dtype).requires_grad_()

    def mask(self, i: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1013 + i)
        return torch.rand(B, T, generator=gen) > 0.2

    def snapshot(self, tag: str, leaves: list[torch.Tensor], losses: list[torch.Tensor] = ()) -> None:
        r = self.results
        for i, l in enumerate(losses):
            r[f"{tag}loss{i}"] = l.detach().clone()
        for n, p in self.model.named_parameters():
            r[f"{tag}grad:{n}"] = None if p.grad is None else p.grad.clone()
        for i, x in enumerate(leaves):
            r[f"{tag}grad:input{i}"] = None if x.grad is None else x.grad.clone()
        for n, b in self.model.named_buffers():
            r[f"{tag}buffer:{n}"] = b.clone()

    def step(self) -> None:
        """End a training step as a trainer does: the optimizer moves the parameters (and their
        versions) before the next step's forward."""
        if self.opt is None:
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def forward(self, x, i: int = 0, repeat: int = 1):
        h, auxes = self.model(x, self.mask(i), repeat=repeat)
        return h, auxes


def _loop_single(run: _Run, tag: str = "", i: int = 0) -> None:
    x = run.leaf(i)
    loss = run.model.loss(*run.forward(x, i))
    loss.backward()
    run.snapshot(tag, [x], [loss])


def _loop_accum(run: _Run, tag: str = "", i: int = 0) -> None:
    """Micro-batches: all forwards first, then the backwards (in order or reversed)."""
    n = run.rng.choice([2, 3])
    order = run.rng.choice(["forward", "reversed"])
    run.notes.append(f"{n} micro-batches, backwards {order}")
    xs = [run.leaf(i + j) for j in range(n)]
    losses = [run.model.loss(*run.forward(x, i + j)) for j, x in enumerate(xs)]
    for loss in (losses if order == "forward" else losses[::-1]):
        loss.backward()
    run.snapshot(tag, xs, losses)


def _loop_interleaved(run: _Run, tag: str = "", i: int = 0) -> None:
    """Micro-batches: forward, backward, forward, backward."""
    n = run.rng.choice([2, 3])
    xs, losses = [], []
    for j in range(n):
        xs.append(run.leaf(i + j))
        losses.append(run.model.loss(*run.forward(xs[-1], i + j)))
        losses[-1].backward()
    run.snapshot(tag, xs, losses)


def _loop_shared(run: _Run, tag: str = "", i: int = 0) -> None:
    """Each block applied twice in one forward (weight sharing)."""
    x = run.leaf(i)
    loss = run.model.loss(*run.forward(x, i, repeat=2))
    loss.backward()
    run.snapshot(tag, [x], [loss])


def _loop_retain_graph(run: _Run, tag: str = "", i: int = 0) -> None:
    x = run.leaf(i)
    loss = run.model.loss(*run.forward(x, i))
    loss.backward(retain_graph=True)
    run.snapshot(tag + "first:", [x], [loss])
    loss.backward()
    run.snapshot(tag, [x], [loss])


def _mutate(t: torch.Tensor, how: str) -> None:
    if how == "add_":
        t.add_(1.0)
    elif how == "mul_":
        t.mul_(2.0)
    else:
        t.zero_()


def _loop_mutate_output(run: _Run, tag: str = "", i: int = 0) -> None:
    """The caller writes the block's output (or its extra output) in place after forward."""
    x = run.leaf(i)
    h, auxes = run.forward(x, i)
    target = run.rng.choice(["output", "aux"]) if auxes else "output"
    how = run.rng.choice(["add_", "mul_", "zero_"])
    when = run.rng.choice(["before_loss", "after_loss"])
    run.notes.append(f"{target}.{how}() {when}")
    t = h if target == "output" else auxes[-1]
    if when == "before_loss":
        _mutate(t, how)
        loss = run.model.loss(h, auxes)
    else:
        loss = run.model.loss(h, auxes)
        _mutate(t, how)
    loss.backward()
    run.snapshot(tag, [x], [loss])


def _view_of(run: _Run, base: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "narrow":
        return base.narrow(-1, D // 2, D)
    if kind == "select":
        return base.view(B, T, 2, D).select(2, 1)
    return base.transpose(1, 2)  # base is (B, D, T): a non-contiguous view


def _view_input(run: _Run, i: int, kind: str):
    shape = (B, D, T) if kind == "transpose" else (B, T, 2 * D)
    leaf = run.leaf(i, shape)
    base = leaf * 1.0  # not a leaf, so the caller may write it in place
    return leaf, base, _view_of(run, base, kind)


def _loop_mutate_input(run: _Run, tag: str = "", i: int = 0) -> None:
    """The caller writes the block's input (or the base it is a view of) in place after forward."""
    kind = run.rng.choice(["plain", "narrow", "select", "transpose"])
    how = run.rng.choice(["add_", "mul_", "zero_"])
    if kind == "plain":
        leaf = run.leaf(i)
        base = x = leaf * 1.0
    else:
        leaf, base, x = _view_input(run, i, kind)
    target = run.rng.choice(["input", "base"]) if kind != "plain" else "input"
    run.notes.append(f"input {kind}, {target}.{how}()")
    h, auxes = run.forward(x, i)
    _mutate(x if target == "input" else base, how)
    loss = run.model.loss(h, auxes)
    loss.backward()
    run.snapshot(tag, [leaf], [loss])


def _loop_view_input(run: _Run, tag: str = "", i: int = 0) -> None:
    """The block's input is a view of a larger tensor (no mutation)."""
    kind = run.rng.choice(["narrow", "select", "transpose"])
    run.notes.append(f"input is a {kind} view")
    leaf, _, x = _view_input(run, i, kind)
    loss = run.model.loss(*run.forward(x, i))
    loss.backward()
    run.snapshot(tag, [leaf], [loss])


def _loop_double_backward(run: _Run, tag: str = "", i: int = 0) -> None:
    """A gradient penalty: grads with create_graph=True, then backward through them."""
    x = run.leaf(i)
    loss = run.model.loss(*run.forward(x, i))
    wrt = [p for p in run.model.parameters()] + [x]
    gs = torch.autograd.grad(loss, wrt, create_graph=True, allow_unused=True)
    for n, g in enumerate(gs):
        run.results[f"{tag}first_grad{n}"] = None if g is None else g.detach().clone()
    penalty = sum((g * g).sum() for g in gs if g is not None)
    penalty.backward()
    run.snapshot(tag, [x], [loss, penalty])


_STEP2 = {
    "single": _loop_single, "accum": _loop_accum, "interleaved": _loop_interleaved,
    "shared": _loop_shared, "retain_graph": _loop_retain_graph, "mutate_output": _loop_mutate_output,
    "mutate_input": _loop_mutate_input, "view_input": _loop_view_input,
}


def _random_policy(handle, rng: random.Random) -> Policy:
    """Keep a random subset of the values backward read in the last recorded step."""
    p = rng.choice([0.2, 0.5, 0.8, 1.0])
    blocks = {}
    for i, tape in handle.tapes().items():
        read = [tape.position(v.vid) for v in tape.values if v.reads > 0 and v.kind == PRODUCED]
        keep = sorted({pos for pos in read if rng.random() < p})
        blocks[i] = BlockPolicy(tape.signature(), keep)
    return Policy(blocks)


def _loop_keep_set(run: _Run) -> None:
    """Step 1 records; a random keep set from its tapes is applied; step 2 runs another loop."""
    step2 = run.rng.choice(sorted(_STEP2))
    same_input = run.rng.random() < 0.5
    run.notes.append(f"step 2: {step2}, {'same' if same_input else 'new'} inputs")
    _loop_single(run, "s1:", 0)
    run.step()
    if run.handle is not None:
        policy = _random_policy(run.handle, random.Random(run.seed))
        kept = sum(len(b.keep) for b in policy.blocks.values())
        run.notes.append(f"{kept} positions kept")
        run.handle.set_policy(policy)
    torch.manual_seed(run.seed + 1)
    _STEP2[step2](run, "s2:", 0 if same_input else 10)


_REPEATABLE = sorted(set(_STEP2) - {"mutate_output", "mutate_input"})
"""Step loops that do not write saved tensors (those end a program at its first step)."""


def _loop_repeat(run: _Run) -> None:
    """Four steps, each a random loop on new inputs: from a block's third forward on, forwards
    follow its verified tape instead of recording it (``VerifiedTape``)."""
    loops = [run.rng.choice(_REPEATABLE) for _ in range(4)]
    run.notes.append("steps: " + ", ".join(loops))
    for k, name in enumerate(loops):
        torch.manual_seed(run.seed + k)
        _STEP2[name](run, f"s{k}:", 10 * k)
        run.step()


LOOPS: dict[str, Callable[[_Run], None]] = {
    "single": _loop_single,
    "accum": _loop_accum,
    "interleaved": _loop_interleaved,
    "shared": _loop_shared,
    "retain_graph": _loop_retain_graph,
    "mutate_output": _loop_mutate_output,
    "mutate_input": _loop_mutate_input,
    "view_input": _loop_view_input,
    "double_backward": _loop_double_backward,
    "keep_set": _loop_keep_set,
    "repeat": _loop_repeat,
}
"""Loop shape name -> what the caller does in one run. Seed ``s`` runs ``default_loop(s)``."""


def default_loop(seed: int) -> str:
    names = list(LOOPS)
    return names[seed % len(names)]


# Running and comparing -----------------------------------------------------------------------

@dataclasses.dataclass
class Outcome:
    seed: int
    loop: str
    status: str
    """MATCH, REFUSED, BOTH_RAISED or MISMATCH."""
    detail: str = ""
    kind: str = ""
    """For REFUSED, BOTH_RAISED and MISMATCH: a short, number-free description to group by."""
    notes: str = ""
    """The loop's random choices (micro-batches, what was mutated, what step 2 was)."""
    skip: frozenset[str] = frozenset()
    """Steps left out of the program (a shrunk repro)."""

    @property
    def repro(self) -> str:
        skip = f" --skip {','.join(sorted(self.skip))}" if self.skip else ""
        return f"python tools/fuzz.py --seed {self.seed} --loop {self.loop}{skip}"

    def message(self) -> str:
        return (f"{self.status} seed={self.seed} loop={self.loop} ({self.notes}): {self.detail}\n"
                f"  repro: {self.repro}")


def run_program(seed: int, loop: str, wrapped: bool,
                skip: frozenset[str] = frozenset()) -> tuple[dict, list[str]]:
    """Build program ``seed`` and run ``loop`` on it, plain or with TapeSAC: (results, notes)."""
    model = FuzzModel(seed, skip)
    if any(f.startswith("dtensor:") for f in model.features):
        _mesh()  # before the first forward: a mesh made inside it would be on that forward's tape
    handle = tapesac.wrap(list(model.blocks)) if wrapped else None
    run = _Run(model, handle, seed)
    try:
        torch.manual_seed(seed)
        LOOPS[loop](run)
    finally:
        if handle is not None:
            handle.remove()
        _close_mesh()
    return run.results, run.notes


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor, so NaNs compare equal to themselves and -0.0 != 0.0."""
    t = t.detach().contiguous()
    if t.is_floating_point():
        return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])
    return t


def compare(expected: dict, actual: dict) -> str | None:
    """None if every entry is bit-identical, else what differs first."""
    if expected.keys() != actual.keys():
        return f"different result sets: {sorted(set(expected) ^ set(actual))}"
    for name, e in expected.items():
        a = actual[name]
        if e is None or a is None:
            if (e is None) != (a is None):
                return f"{name}: {'no gradient' if a is None else 'a gradient'} under TapeSAC, " \
                       f"{'no gradient' if e is None else 'a gradient'} in plain autograd"
            continue
        if e.dtype != a.dtype or e.shape != a.shape:
            return f"{name}: {a.dtype}{list(a.shape)} under TapeSAC vs {e.dtype}{list(e.shape)}"
        if not torch.equal(_bits(e), _bits(a)):
            diff = (e.double() - a.double()).abs().nan_to_num(nan=float("inf")).max().item()
            return f"{name} differs (max abs diff {diff:.3g})"
    return None


def error_kind(exc: BaseException) -> str:
    """A short, number-free key for grouping exceptions: type and the start of the message."""
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    msg = re.sub(r"\b[0-9a-f]{16}\b", "<signature>", msg)
    msg = re.sub(r"%\d+", "%v", msg)
    msg = re.sub(r"\d+", "#", msg)
    msg = re.sub(r"\[[^\]]*\]", "[..]", msg)
    return f"{type(exc).__name__}: {msg[:90]}"


def _short_trace(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = next((f for f in reversed(frames) if "tapesac" in f.filename), frames[-1] if frames else None)
    return f" at {where.filename.split('/')[-1]}:{where.lineno}" if where else ""


def check(seed: int, loop: str | None = None, skip: frozenset[str] = frozenset()) -> Outcome:
    """Run program ``seed`` under ``loop`` plain and under TapeSAC and classify the result."""
    loop = loop or default_loop(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain_exc = wrapped_exc = None
        notes: list[str] = []
        try:
            expected, notes = run_program(seed, loop, wrapped=False, skip=skip)
        except Exception as e:  # noqa: BLE001 - any error of plain autograd is a legal outcome
            plain_exc = e
        try:
            actual, notes = run_program(seed, loop, wrapped=True, skip=skip)
        except Exception as e:  # noqa: BLE001 - classified below
            wrapped_exc = e
    out = Outcome(seed, loop, MATCH, notes="; ".join(notes) or "-", skip=frozenset(skip))
    if plain_exc is not None and wrapped_exc is not None:
        out.status, out.kind = BOTH_RAISED, error_kind(plain_exc)
        out.detail = f"plain: {error_kind(plain_exc)}; TapeSAC: {error_kind(wrapped_exc)}"
    elif plain_exc is not None:
        out.status, out.kind = MISMATCH, "TapeSAC succeeded where plain autograd raised"
        out.detail = f"plain autograd raised {error_kind(plain_exc)}; TapeSAC raised nothing"
    elif wrapped_exc is not None:
        if isinstance(wrapped_exc, tapesac.TapeSACError):
            out.status, out.kind = REFUSED, error_kind(wrapped_exc)
            out.detail = str(wrapped_exc).splitlines()[0]
        else:
            out.status = MISMATCH
            out.kind = f"non-TapeSAC exception {error_kind(wrapped_exc)}"
            out.detail = f"TapeSAC raised {type(wrapped_exc).__name__}: {wrapped_exc}" + _short_trace(wrapped_exc)
    else:
        diff = compare(expected, actual)
        if diff is not None:
            out.status, out.kind, out.detail = MISMATCH, "silently different numbers", diff
    return out


def shrink(outcome: Outcome) -> Outcome:
    """The smallest program found by leaving steps out that fails with the same status and kind."""
    best = outcome
    for step in step_ids(outcome.seed):
        trial = check(outcome.seed, outcome.loop, best.skip | {step})
        if trial.status == outcome.status and trial.kind == outcome.kind:
            best = trial
    return best
