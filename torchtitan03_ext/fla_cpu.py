"""flash-linear-attention's kernels on CPU, as opaque to the dispatcher as they are on a GPU.

Qwen3.5's gated-DeltaNet layers (``torchtitan.models.qwen3_5``) call two fla Triton kernels: the
chunked gated delta rule, with the L2 norm of q and k inside (``chunk_gated_delta_rule(...,
use_qk_l2norm_in_kernel=True)``), and the causal depthwise conv with per-document resets
(``causal_conv1d(..., activation="silu", cu_seqlens=...)``). Triton needs a driver for them, and
its interpreter does not help (fla's autotuner benchmarks on a device).

On CPU, :func:`install` points both calls at stand-ins that compute the same functions: the delta
rule with fla's own reference code (``fla.ops.gated_delta_rule.naive.naive_chunk_gated_delta_rule``,
documents padded into a batch, each from a zero state), the conv as a per-document depthwise
``conv1d``. They behave toward the dispatcher as the GPU kernels do: each is an autograd Function
whose forward allocates fresh outputs (visible ``empty`` ops) and fills them where no dispatch
mode sees (computed with the modes off, written through numpy), so a CPU run meets the hazard a
GPU run has: nothing on a recorded tape can rebuild those bytes. What the gated delta rule saves
for backward follows fla's ``ChunkGatedDeltaRuleFunction``: the normalized q and k with their
reciprocal norms (written unseen), v, g and beta. Their backward passes recompute the reference
with autograd, also unseen, into fresh gradient buffers; they are exact for these functions, not
fla's Triton numerics, so a CPU job is compared with the same CPU job, never with a GPU run.

Temporaries of the hidden computations are invisible to TapeSAC's CPU storage counter (on a GPU,
a Triton kernel keeps them in registers and shared memory); the outputs are counted.

torch.compile cannot trace these stand-ins, and it cannot trace fla's own call either: fla-core
0.6.0 marks ``chunk_gated_delta_rule`` with ``torch.compiler.disable``, and torchtitan 0.3 compiles
each block with ``fullgraph=True``, so dynamo refuses Qwen3.5's DeltaNet blocks before any kernel
runs, on any device. Users who compile Qwen3.5 wrap fla's kernels as ``torch.library`` custom ops,
which dynamo keeps whole and the partitioner prices by its FLOP formulas (none: one FLOP).
:func:`use_custom_ops` runs the stand-ins that way (``tapesac_fla::*``, each with a backward op),
for the configs that compile Qwen3.5 (``qwen35_debug_cpu_custom_ops``). Then the kernels are ops
the dispatcher sees, like any custom op; the same functions, computed by the same reference.
"""

from __future__ import annotations

import collections
import contextlib
import sys

import numpy as np
import torch
import torch.nn.functional as F

Tensor = torch.Tensor

L2NORM_EPS = 1e-6
"""fla's ``l2norm_fwd`` default: ``y = x / sqrt(sum(x**2) + eps)``."""


def install() -> None:
    """Run Qwen3.5's fla kernels on CPU tensors through the stand-ins (CUDA tensors still go to
    fla). Safe to call more than once; a no-op when fla or torchtitan's qwen3_5 is missing."""
    try:
        from torchtitan.models.qwen3_5 import model as qwen35
    except ImportError:  # fla-core is not installed: qwen3_5 cannot be imported at all
        return
    conv_module = sys.modules["fla.modules.conv.causal_conv1d"]
    if not getattr(conv_module.causal_conv1d, "__tapesac__", False):
        conv_module.causal_conv1d = _on_cpu(conv_module.causal_conv1d, causal_conv1d)
    if not getattr(qwen35._fla_chunk_gated_delta_rule, "__tapesac__", False):
        qwen35._fla_chunk_gated_delta_rule = _on_cpu(qwen35._fla_chunk_gated_delta_rule, chunk_gated_delta_rule)


_CUSTOM_OPS = False

KERNEL_RUNS: collections.Counter = collections.Counter()
"""Forward runs of each kernel (``"chunk_gated_delta_rule"``, ``"causal_conv1d"``) in this process,
stand-in or custom op, recomputations included: how often a policy recomputes a kernel."""


def use_custom_ops(enabled: bool = True) -> None:
    """From now on, CPU calls of the kernels run as the ``tapesac_fla`` custom ops (what
    torch.compile traces) instead of the opaque stand-ins."""
    global _CUSTOM_OPS
    _CUSTOM_OPS = enabled


def _on_cpu(original, stand_in):
    def dispatch(x, *args, **kwargs):
        if x.device.type != "cpu":
            return original(x, *args, **kwargs)
        return (_AS_CUSTOM_OP[stand_in.__name__] if _CUSTOM_OPS else stand_in)(x, *args, **kwargs)

    dispatch.__tapesac__ = True  # type: ignore[attr-defined]
    dispatch.__wrapped__ = original  # type: ignore[attr-defined]
    return dispatch


# What fla's entry points take ---------------------------------------------------------------------


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None = None,
                           initial_state: Tensor | None = None, output_final_state: bool = False,
                           use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Tensor | None = None,
                           cu_seqlens_cpu: Tensor | None = None, **kwargs) -> tuple[Tensor, None]:
    """fla's ``chunk_gated_delta_rule`` on CPU (q, k: [B, T, H, K]; v: [B, T, H, V]; g, beta:
    [B, T, H]); returns ``(o, None)``. Initial and final states are not supported."""
    if initial_state is not None or output_final_state or kwargs:
        raise NotImplementedError(
            "TapeSAC's CPU gated delta rule covers what Qwen3.5 trains with (no initial or final "
            f"state, no {sorted(kwargs)}): run this model on a GPU")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    docs = _documents(q, cu_seqlens, cu_seqlens_cpu)
    return GatedDeltaRule.apply(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, docs), None


def causal_conv1d(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, residual: Tensor | None = None,
                  initial_state: Tensor | None = None, output_final_state: bool | None = False,
                  activation: str | None = None, backend: str | None = "triton", cu_seqlens: Tensor | None = None,
                  cu_seqlens_cpu: Tensor | None = None, **kwargs) -> tuple[Tensor, None]:
    """fla's ``causal_conv1d`` on CPU (x: [B, T, D], weight: [D, W]); returns ``(y, None)``.
    Bias, residual and states are not supported; ``activation`` is None or ``"silu"``."""
    if weight is None or bias is not None or residual is not None or initial_state is not None \
            or output_final_state or activation not in (None, "silu", "swish") or kwargs.get("cp_context"):
        raise NotImplementedError(
            "TapeSAC's CPU causal conv covers what Qwen3.5 trains with (a weight, silu or no "
            "activation; no bias, residual, state or context parallelism): run this model on a GPU")
    docs = _documents(x, cu_seqlens, cu_seqlens_cpu)
    return CausalConv1d.apply(x, weight, activation is not None, docs), None


def _documents(x: Tensor, cu_seqlens: Tensor | None,
               cu_seqlens_cpu: Tensor | None) -> tuple[tuple[int, int], ...] | None:
    """The (start, end) of each document along dim 1 of a [1, T, ...] tensor; None without
    offsets (each row of the batch is one sequence)."""
    if cu_seqlens is None:
        return None
    if x.shape[0] != 1:
        raise ValueError(f"varlen inputs must be flattened to batch size 1, got batch size {x.shape[0]}")
    offsets = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).tolist()
    return tuple((int(s), int(e)) for s, e in zip(offsets[:-1], offsets[1:]) if e > s)


# Documents as a padded batch ----------------------------------------------------------------------


def _to_batch(x: Tensor, docs) -> Tensor:
    """[1, T, ...] (or [B, T, ...]) as [n_docs, longest, ...], each document from position 0 and
    zeros after its end (the functions here are causal: zeros after a document change nothing).
    Without documents, ``x`` itself."""
    if docs is None:
        return x
    longest = max(e - s for s, e in docs)
    out = x.new_zeros((len(docs), longest, *x.shape[2:]))
    for i, (s, e) in enumerate(docs):
        out[i, :e - s] = x[0, s:e]
    return out


def _from_batch(y: Tensor, docs, total: int) -> Tensor:
    if docs is None:
        return y
    return torch.cat([y[i, :e - s] for i, (s, e) in enumerate(docs)], dim=0).reshape(1, total, *y.shape[2:])


# The functions, in plain torch --------------------------------------------------------------------


def _slices(q: Tensor, docs):
    """(row, start, end, head) of every sequence and head the delta rule runs on alone: per
    document of a flattened batch (or per row without documents), per head."""
    spans = [(0, s, e) for s, e in docs] if docs is not None else [(b, 0, q.shape[1]) for b in range(q.shape[0])]
    return [(b, s, e, h) for b, s, e in spans for h in range(q.shape[2])]


def _delta_rule_slice(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, where) -> Tensor:
    from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule

    b, s, e, h = where
    pieces = (t[b:b + 1, s:e, h:h + 1] for t in (q, k, v, g, beta))
    return naive_chunk_gated_delta_rule(*pieces, scale=scale)[0].to(v.dtype)


def _delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, docs) -> Tensor:
    """The delta rule (no grad), one document and head at a time, as a kernel's working memory is
    one tile's: the reference's temporaries for a whole batch would be a CPU artefact that an
    allocator-level meter sees (tens of MiB on the debug model)."""
    o = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    with torch.no_grad():
        for where in _slices(q, docs):
            b, s, e, h = where
            o[b:b + 1, s:e, h:h + 1] = _delta_rule_slice(q, k, v, g, beta, scale, where)
    return o


def _delta_rule_grads(do: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                      docs) -> list[Tensor]:
    """Gradients of :func:`_delta_rule` for ``do`` (dq, dk, dv, dg, dbeta of the normalized q and
    k), each document and head differentiated alone and freed before the next."""
    inputs = (q, k, v, g, beta)
    grads = [torch.zeros_like(t) for t in inputs]
    for where in _slices(q, docs):
        b, s, e, h = where
        leaves = [t[b:b + 1, s:e, h:h + 1].detach().requires_grad_() for t in inputs]
        with torch.enable_grad():
            out = _delta_rule_slice(*leaves, scale, (0, 0, e - s, 0))
            parts = torch.autograd.grad(out, leaves, do[b:b + 1, s:e, h:h + 1])
        with torch.no_grad():
            for grad, part in zip(grads, parts):
                grad[b:b + 1, s:e, h:h + 1] = part
    return grads


def _conv(x: Tensor, weight: Tensor, silu: bool, docs) -> Tensor:
    xb = _to_batch(x, docs).transpose(1, 2)  # [n, D, L]
    width = weight.shape[-1]
    y = F.conv1d(F.pad(xb, [width - 1, 0]), weight.unsqueeze(1), groups=weight.shape[0])
    y = F.silu(y) if silu else y
    return _from_batch(y.transpose(1, 2), docs, x.shape[1]).to(x.dtype)


def _l2norm(x: Tensor) -> tuple[Tensor, Tensor]:
    rstd = torch.rsqrt(x.float().pow(2).sum(-1) + L2NORM_EPS)
    return (x.float() * rstd.unsqueeze(-1)).to(x.dtype), rstd


def _l2norm_backward(y: Tensor, rstd: Tensor, dy: Tensor) -> Tensor:
    """d/dx of ``y = x * rstd(x)``: ``rstd * (dy - y * sum(dy * y))``."""
    y32, dy32 = y.float(), dy.float()
    return (rstd.unsqueeze(-1) * (dy32 - y32 * (dy32 * y32).sum(-1, keepdim=True))).to(dy.dtype)


# Opaque forwards ----------------------------------------------------------------------------------


def _unseen(fn, *args):
    """``fn(*args)`` computed where no dispatch mode sees it (as a kernel's registers would)."""
    with torch._C._DisableTorchDispatch():
        return fn(*args)


def _fill(out: Tensor, value: Tensor) -> Tensor:
    """Write ``value``'s bytes into the fresh contiguous ``out`` through numpy: no op is dispatched
    and no version counter moves, as when a Triton kernel writes its output."""
    with torch._C._DisableTorchDispatch():
        src = value.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        np.copyto(out.detach().reshape(-1).view(torch.uint8).numpy(), src)
    return out


def _opaque_grads(grads, like: tuple[Tensor, ...]) -> list[Tensor]:
    """A backward kernel's gradients: fresh buffers (visible allocations) filled unseen with
    ``grads()``, computed where no dispatch mode sees it. Its working memory is then what a
    Triton backward keeps on chip, not the reference's autograd graph, whose size would depend
    on how the batch splits into documents."""
    out = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in like]
    for buf, grad in zip(out, _unseen(grads)):
        _fill(buf, grad.to(buf.dtype))
    return out


class GatedDeltaRule(torch.autograd.Function):
    """o = gated delta rule(l2norm(q), l2norm(k), v, g, beta) per document; forward opaque."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale: float, l2norm: bool, docs):
        KERNEL_RUNS["chunk_gated_delta_rule"] += 1
        if l2norm:
            q_n, k_n = torch.empty_like(q), torch.empty_like(k)
            q_rstd = q.new_empty(q.shape[:-1], dtype=torch.float32)
            k_rstd = k.new_empty(k.shape[:-1], dtype=torch.float32)
            for out, rstd, (y, r) in ((q_n, q_rstd, _unseen(_l2norm, q)), (k_n, k_rstd, _unseen(_l2norm, k))):
                _fill(out, y)
                _fill(rstd, r)
        else:
            q_n, k_n, q_rstd, k_rstd = q, k, None, None
        o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        _fill(o, _unseen(_delta_rule, q_n, k_n, v, g, beta, scale, docs))
        ctx.save_for_backward(q_n, q_rstd, k_n, k_rstd, v, g, beta)
        ctx.scale, ctx.docs = scale, docs
        return o

    @staticmethod
    def backward(ctx, do):
        q_n, q_rstd, k_n, k_rstd, v, g, beta = ctx.saved_tensors

        def grads():
            dq, dk, dv, dg, dbeta = _delta_rule_grads(do, q_n, k_n, v, g, beta, ctx.scale, ctx.docs)
            if q_rstd is not None:
                dq, dk = _l2norm_backward(q_n, q_rstd, dq), _l2norm_backward(k_n, k_rstd, dk)
            return dq, dk, dv, dg, dbeta

        return (*_opaque_grads(grads, (q_n, k_n, v, g, beta)), None, None, None)


class CausalConv1d(torch.autograd.Function):
    """y = silu(causal depthwise conv1d(x, weight)) per document; forward opaque."""

    @staticmethod
    def forward(ctx, x, weight, silu: bool, docs):
        KERNEL_RUNS["causal_conv1d"] += 1
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        _fill(y, _unseen(_conv, x, weight, silu, docs))
        ctx.save_for_backward(x, weight)
        ctx.silu, ctx.docs = silu, docs
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors

        def grads():
            inputs = [x.detach().requires_grad_(), weight.detach().requires_grad_()]
            with torch.enable_grad():
                y = _conv(*inputs, ctx.silu, ctx.docs)
                return torch.autograd.grad(y, inputs, dy)

        return (*_opaque_grads(grads, (x, weight)), None, None)


# The same kernels as custom ops (use_custom_ops) ---------------------------------------------------


def _offsets(cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None) -> Tensor | None:
    return cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens


def chunk_gated_delta_rule_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None = None,
                              initial_state: Tensor | None = None, output_final_state: bool = False,
                              use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Tensor | None = None,
                              cu_seqlens_cpu: Tensor | None = None, **kwargs) -> tuple[Tensor, None]:
    """:func:`chunk_gated_delta_rule` as the custom op ``tapesac_fla::chunk_gated_delta_rule``."""
    if initial_state is not None or output_final_state or kwargs or not use_qk_l2norm_in_kernel:
        raise NotImplementedError(
            "TapeSAC's CPU gated delta rule as a custom op covers what Qwen3.5 trains with (q and k "
            f"normalized in the kernel; no initial or final state, no {sorted(kwargs)}): run this model on a GPU")
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"varlen inputs must be flattened to batch size 1, got batch size {q.shape[0]}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o, *_saved = torch.ops.tapesac_fla.chunk_gated_delta_rule(q, k, v, g, beta, scale,
                                                              _offsets(cu_seqlens, cu_seqlens_cpu))
    return o, None


def causal_conv1d_op(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None,
                     residual: Tensor | None = None, initial_state: Tensor | None = None,
                     output_final_state: bool | None = False, activation: str | None = None,
                     backend: str | None = "triton", cu_seqlens: Tensor | None = None,
                     cu_seqlens_cpu: Tensor | None = None, **kwargs) -> tuple[Tensor, None]:
    """:func:`causal_conv1d` as the custom op ``tapesac_fla::causal_conv1d``."""
    if weight is None or bias is not None or residual is not None or initial_state is not None \
            or output_final_state or activation not in (None, "silu", "swish") or kwargs.get("cp_context"):
        raise NotImplementedError(
            "TapeSAC's CPU causal conv covers what Qwen3.5 trains with (a weight, silu or no "
            "activation; no bias, residual, state or context parallelism): run this model on a GPU")
    if cu_seqlens is not None and x.shape[0] != 1:
        raise ValueError(f"varlen inputs must be flattened to batch size 1, got batch size {x.shape[0]}")
    return torch.ops.tapesac_fla.causal_conv1d(x, weight, activation is not None,
                                               _offsets(cu_seqlens, cu_seqlens_cpu)), None


_AS_CUSTOM_OP = {chunk_gated_delta_rule.__name__: chunk_gated_delta_rule_op, causal_conv1d.__name__: causal_conv1d_op}


def _docs_of(x: Tensor, offsets: Tensor | None):
    return _documents(x, offsets, None)


_PLAIN_KEYS = (torch._C._dispatch_tls_local_include_set(),
               torch._C._dispatch_tls_local_exclude_set()
               | torch._C.DispatchKeySet(torch._C.DispatchKey.Python)
               | torch._C.DispatchKeySet(torch._C.DispatchKey.PythonTLSSnapshot))
"""The dispatcher's thread-local keys of plain eager code (read at import), with the Python keys
excluded: no dispatch mode or tensor subclass sees what runs under them."""


@contextlib.contextmanager
def _as_a_kernel():
    """Run a custom op's body as a kernel runs: unseen by dispatch modes, and as plain eager
    code otherwise. Inside an op's kernel the dispatcher has excluded every key above the
    backend's (autograd among them; inside a mode's handler, also functionalization and
    functorch's); the backward ops differentiate the reference with autograd on leaves of
    their own, as the opaque stand-ins' backward passes do. The keys are restored after."""
    with torch._C._ForceDispatchKeyGuard(*_PLAIN_KEYS), torch.enable_grad():
        yield


@torch.library.custom_op("tapesac_fla::chunk_gated_delta_rule", mutates_args=())
def _delta_rule_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                   offsets: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(o, q normalized, q's reciprocal norms, k normalized, k's): the last four are what the
    backward reads, as fla's ``ChunkGatedDeltaRuleFunction`` saves them. A dispatch mode sees
    the op, not its insides."""
    KERNEL_RUNS["chunk_gated_delta_rule"] += 1
    with _as_a_kernel(), torch.no_grad():
        (q_n, q_rstd), (k_n, k_rstd) = _l2norm(q), _l2norm(k)
        o = _delta_rule(q_n, k_n, v, g, beta, scale, _docs_of(q, offsets))
        return tuple(t.contiguous() for t in (o, q_n, q_rstd, k_n, k_rstd))  # all fresh, none an input


@_delta_rule_op.register_fake
def _(q, k, v, g, beta, scale, offsets):
    return (torch.empty_like(v, memory_format=torch.contiguous_format),
            torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape[:-1], dtype=torch.float32),
            torch.empty_like(k, memory_format=torch.contiguous_format), k.new_empty(k.shape[:-1], dtype=torch.float32))


@torch.library.custom_op("tapesac_fla::chunk_gated_delta_rule_backward", mutates_args=())
def _delta_rule_backward_op(do: Tensor, q_n: Tensor, q_rstd: Tensor, k_n: Tensor, k_rstd: Tensor, v: Tensor, g: Tensor,
                            beta: Tensor, scale: float, offsets: Tensor | None
                            ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dg, dbeta) of :func:`_delta_rule_op`'s ``o``, through the l2 norms."""
    docs = _docs_of(q_n, offsets)
    inputs = (q_n, k_n, v, g, beta)

    with _as_a_kernel():
        dq, dk, dv, dg, dbeta = _delta_rule_grads(do, *inputs, scale, docs)
        with torch.no_grad():
            dq, dk = _l2norm_backward(q_n, q_rstd, dq), _l2norm_backward(k_n, k_rstd, dk)
            return tuple(d.to(t.dtype).contiguous() for d, t in zip((dq, dk, dv, dg, dbeta), inputs))


@_delta_rule_backward_op.register_fake
def _(do, q_n, q_rstd, k_n, k_rstd, v, g, beta, scale, offsets):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q_n, k_n, v, g, beta))


def _delta_rule_setup(ctx, inputs, output):
    _q, _k, v, g, beta, scale, offsets = inputs
    _o, q_n, q_rstd, k_n, k_rstd = output
    ctx.save_for_backward(q_n, q_rstd, k_n, k_rstd, v, g, beta, offsets)
    ctx.scale = scale


def _delta_rule_backward(ctx, do, *_saved_grads):
    q_n, q_rstd, k_n, k_rstd, v, g, beta, offsets = ctx.saved_tensors
    grads = torch.ops.tapesac_fla.chunk_gated_delta_rule_backward(do, q_n, q_rstd, k_n, k_rstd, v, g, beta,
                                                                  ctx.scale, offsets)
    return (*grads, None, None)


_delta_rule_op.register_autograd(_delta_rule_backward, setup_context=_delta_rule_setup)


@torch.library.custom_op("tapesac_fla::causal_conv1d", mutates_args=())
def _conv_op(x: Tensor, weight: Tensor, silu: bool, offsets: Tensor | None) -> Tensor:
    KERNEL_RUNS["causal_conv1d"] += 1
    with _as_a_kernel(), torch.no_grad():
        return _conv(x, weight, silu, _docs_of(x, offsets)).contiguous()


@_conv_op.register_fake
def _(x, weight, silu, offsets):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("tapesac_fla::causal_conv1d_backward", mutates_args=())
def _conv_backward_op(dy: Tensor, x: Tensor, weight: Tensor, silu: bool, offsets: Tensor | None
                      ) -> tuple[Tensor, Tensor]:
    docs = _docs_of(x, offsets)

    with _as_a_kernel():
        leaves = [x.detach().requires_grad_(), weight.detach().requires_grad_()]
        return tuple(d.contiguous() for d in torch.autograd.grad(_conv(*leaves, silu, docs), leaves, dy))


@_conv_backward_op.register_fake
def _(dy, x, weight, silu, offsets):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(weight, memory_format=torch.contiguous_format))


def _conv_setup(ctx, inputs, output):
    x, weight, silu, offsets = inputs
    ctx.save_for_backward(x, weight, offsets)
    ctx.silu = silu


def _conv_backward(ctx, dy):
    x, weight, offsets = ctx.saved_tensors
    return (*torch.ops.tapesac_fla.causal_conv1d_backward(dy, x, weight, ctx.silu, offsets), None, None)


_conv_op.register_autograd(_conv_backward, setup_context=_conv_setup)
