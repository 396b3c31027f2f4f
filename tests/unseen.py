"""Blocks whose kernels write memory the dispatcher never sees, as GPU kernels do.

On CPU every op is an ATen op, so the hazard of a Triton or CUDA-extension kernel (it fills a
buffer without any op the recorder can see) is given to CPU stand-ins on purpose: they write
through numpy or ctypes, which dispatch nothing. Real Triton kernels run under Triton's
interpreter (``TRITON_INTERPRET=1`` at definition time, see :func:`interpreted`).

Every model here trains with an optimizer in :func:`train`; tests compare each step's loss and
gradients bit for bit with the same model unwrapped.
"""

import contextlib
import ctypes
import os
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

Tensor = torch.Tensor


def host(t: Tensor) -> np.ndarray:
    """``t``'s memory as a numpy array, reached without dispatching any op."""
    with torch._C._DisableTorchDispatch():
        return t.detach().numpy()


# Autograd Functions and blocks that write unseen -------------------------------------------------


class UnseenTanh(torch.autograd.Function):
    """``tanh(x * w)``, computed and written into ``empty_like(x)`` where no dispatcher sees it."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor) -> Tensor:
        out = torch.empty_like(x)
        np.tanh(host(x) * host(w), out=host(out))
        ctx.save_for_backward(out, x, w)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        out, x, w = ctx.saved_tensors
        d = grad * (1 - out * out)
        return d * w, (d * x).sum(0).sum(0)


class FunctionBlock(nn.Module):
    """An autograd Function that fills ``empty_like`` unseen, between visible linears."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.lin, self.proj = nn.Linear(d, d), nn.Linear(d, d)
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.proj(UnseenTanh.apply(self.lin(x), self.w))


class EmptyBlock(nn.Module):
    """Plain block code that fills ``torch.empty`` unseen and multiplies it by a parameter."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.g = nn.Parameter(torch.linspace(-1.0, 1.0, d))

    def forward(self, x: Tensor) -> Tensor:
        buf = torch.empty(x.shape)
        np.sin(host(x) * 3.0, out=host(buf))
        return x + self.lin(buf * self.g).relu()


class UnpermuteBlock(nn.Module):
    """An MoE token dispatcher's un-permute (torchtitan 0.3's ``_unpermute``): ``new_empty``
    scattered into by ``index_put_``, then read. The buffer is unwritten when the scatter reads
    it, so it is held there, just before the scatter writes it."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: Tensor) -> Tensor:
        routed = self.lin(x).reshape(-1, x.shape[-1])
        order = torch.arange(routed.shape[0]).flip(0)
        out = routed.new_empty(routed.shape)
        out[order, :] = routed
        return x + (out * out).tanh().reshape(x.shape)


class StridedBlock(nn.Module):
    """An ``empty_strided`` buffer filled through its data pointer (ctypes), read through a view."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(d, 2 * d)
        self.g = nn.Parameter(torch.linspace(0.1, 2.0, d))

    def forward(self, x: Tensor) -> Tensor:
        d = x.shape[-1]
        rows = x.numel() // d
        src = self.lin(x).reshape(rows, 2 * d).exp().contiguous()
        buf = torch.empty_strided((rows, 2 * d), (2 * d, 1))
        ctypes.memmove(buf.data_ptr(), src.data_ptr(), src.numel() * src.element_size())
        left = buf[:, :d]
        return x + (left * self.g).reshape(x.shape) + src[:, d:].reshape(x.shape).tanh()


class ScaleInPlaceBlock(nn.Module):
    """An activation that an opaque kernel scales in place after a visible op made it."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.g = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x: Tensor) -> Tensor:
        h = self.lin(x)
        host(h)[...] *= 1.5  # no op, no version bump: a kernel updating an activation in place
        return x + (h * self.g).tanh()


class ScaleAfterSaveBlock(nn.Module):
    """The block's output, which autograd has saved (tanh saves its output), scaled in place
    afterwards by an opaque kernel: plain autograd reads the scaled bytes in backward."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: Tensor) -> Tensor:
        y = torch.tanh(self.lin(x) + x)
        host(y)[...] *= 0.5
        return y


class RewrittenAliasBlock(nn.Module):
    """A recorded write through one alias, then an unseen one, then a read through another
    alias (a recorder step of its own, not an ATen op, rebuilds that read)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: Tensor) -> Tensor:
        g = self.lin(x) * 1.0
        v = g.view(-1)
        g.detach().add_(1.0)
        host(g)[...] *= 1.5
        return x + (self.lin.weight.sum() * v).view(x.shape)


class DeadSiblingBlock(nn.Module):
    """Views of an ``empty`` buffer, one of them dropped before another is read, the dropped
    one's view overwritten whole by a recorded op and saved."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: Tensor) -> Tensor:
        h = self.lin(x)
        buf = torch.empty(2, *h.shape)
        a, b = buf.unbind(0)
        c = b.view(-1)
        del b
        _ = a.clone()
        c.copy_(h.detach().reshape(-1) * 2)
        return x + h * c.view(h.shape)


# Triton (interpreter) --------------------------------------------------------------------------------


@contextlib.contextmanager
def interpreted():
    """Define Triton kernels under the interpreter (it is chosen when a kernel is decorated)."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the test extras install triton
    triton = None

def elementwise_kernels():
    """``(affine, scale_inplace)``: ``y = x * scale + x * x`` into a buffer, and ``x *= scale``
    in place, as Triton kernels of the mode in force (interpreter or GPU) when called."""

    @triton.jit
    def affine_kernel(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask)
        tl.store(y_ptr + offs, x * scale + x * x, mask=mask)

    @triton.jit
    def scale_inplace_kernel(x_ptr, n, scale, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) * scale, mask=mask)

    return affine_kernel, scale_inplace_kernel


if triton is not None:
    with interpreted():
        affine_kernel, scale_inplace_kernel = elementwise_kernels()

        @triton.jit
        def split_kernel(x_ptr, lo_ptr, hi_ptr, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            x = tl.load(x_ptr + offs, mask=mask)
            tl.store(lo_ptr + offs, tl.minimum(x, 0.0), mask=mask)
            tl.store(hi_ptr + offs, tl.maximum(x, 0.0) * 2.0, mask=mask)

        # Per sequence: the state after each chunk, h_c = decay * h_{c-1} + k_c^T v_c (a small
        # output from a long computation, as in chunked linear attention). Built from Triton's
        # builtins only: its library functions (tl.zeros, ...) are interpretable only when
        # triton itself was imported under TRITON_INTERPRET=1, and docstrings break the
        # interpreter's rewrite.
        @triton.jit
        def chunk_state_kernel(k_ptr, v_ptr, h_ptr, T, decay, C: tl.constexpr, D: tl.constexpr):
            seq = tl.program_id(0)
            rows = tl.arange(0, C)
            cols = tl.arange(0, D)
            square = cols[:, None] * D + cols[None, :]
            at = (seq * T + rows)[:, None] * D + cols[None, :]
            state = tl.dot(tl.trans(tl.load(k_ptr + at)), tl.load(v_ptr + at))
            n_chunks = T // C
            tl.store(h_ptr + seq * n_chunks * D * D + square, state)
            for c in range(1, n_chunks):
                at = (seq * T + c * C + rows)[:, None] * D + cols[None, :]
                state = state * decay + tl.dot(tl.trans(tl.load(k_ptr + at)), tl.load(v_ptr + at))
                tl.store(h_ptr + (seq * n_chunks + c) * D * D + square, state)


def launch_affine(x: Tensor, scale: float = 0.5) -> Tensor:
    out = torch.empty_like(x)
    n = x.numel()
    affine_kernel[(triton.cdiv(n, 64),)](x, out, n, scale, BLOCK=64)
    return out


class TritonAffine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        x = x.contiguous()
        ctx.save_for_backward(x)
        return launch_affine(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (x,) = ctx.saved_tensors
        return grad * (0.5 + 2 * x)


class TritonOutsideBlock(nn.Module):
    """A Triton kernel launched in plain block code (no autograd Function), writing into
    ``empty_like``; its output is read by a visible op that saves it."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.g = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x: Tensor) -> Tensor:
        h = self.lin(x).contiguous()
        lo, hi = torch.empty_like(h), torch.empty_like(h)
        n = h.numel()
        split_kernel[(triton.cdiv(n, 64),)](h.detach(), lo, hi, n, BLOCK=64)
        y = launch_affine(h.detach()) * self.g + lo * hi.sum()
        scale_inplace_kernel[(triton.cdiv(n, 64),)](y, n, 0.5, BLOCK=64)  # in place, unseen
        return x + y * h


class TritonWritesSavedBlock(nn.Module):
    """A Triton kernel scaling, in place, an activation autograd already saved (tanh's output):
    no version counter moves, so plain autograd reads the scaled bytes."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: Tensor) -> Tensor:
        a = torch.tanh(self.lin(x))
        n = a.numel()
        scale_inplace_kernel[(triton.cdiv(n, 64),)](a.detach(), n, 0.5, BLOCK=64)
        return x + a * 2


class TritonFunctionBlock(nn.Module):
    """A Triton kernel inside an autograd Function."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.lin, self.proj = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.proj(TritonAffine.apply(self.lin(x)))


# A block shaped like a gated-DeltaNet layer --------------------------------------------------------


def chunk_states_reference(k: Tensor, v: Tensor, chunk: int, decay: float) -> Tensor:
    """The states after each chunk with torch ops: ``[B, T // chunk, D, D]``."""
    b, t, d = k.shape
    kc = k.reshape(b, t // chunk, chunk, d)
    vc = v.reshape(b, t // chunk, chunk, d)
    states, state = [], k.new_zeros(b, d, d)
    for c in range(t // chunk):
        state = state * decay + kc[:, c].transpose(1, 2) @ vc[:, c]
        states.append(state)
    return torch.stack(states, 1)


class ChunkedStates(torch.autograd.Function):
    """Chunked linear attention's state pass: an expensive kernel with a small output, written
    unseen (numpy on CPU, ``chunk_state_kernel`` under Triton). Backward differentiates the
    torch reference (the states' gradient only needs k, v and the decay)."""

    @staticmethod
    def forward(ctx, k: Tensor, v: Tensor, chunk: int, decay: float, use_triton: bool) -> Tensor:
        b, t, d = k.shape
        h = k.new_empty(b, t // chunk, d, d)
        if use_triton:
            chunk_state_kernel[(b,)](k.contiguous(), v.contiguous(), h, t, decay, C=chunk, D=d)
        else:
            kk, vv, hh = host(k), host(v), host(h)
            for i in range(b):
                state = np.zeros((d, d), dtype=np.float32)
                for c in range(t // chunk):
                    rows = slice(c * chunk, (c + 1) * chunk)
                    state = state * np.float32(decay) + kk[i, rows].T @ vv[i, rows]
                    hh[i, c] = state
        ctx.save_for_backward(k, v)
        ctx.chunk, ctx.decay = chunk, decay
        return h

    @staticmethod
    def backward(ctx, grad: Tensor):
        k, v = ctx.saved_tensors
        with torch.enable_grad():
            k, v = k.detach().requires_grad_(), v.detach().requires_grad_()
            h = chunk_states_reference(k, v, ctx.chunk, ctx.decay)
        gk, gv = torch.autograd.grad(h, (k, v), grad)
        return gk, gv, None, None, None


class DeltaNetLikeBlock(nn.Module):
    """q/k/v projections, a chunked state kernel (expensive, small output), an output read from
    the states, a gate and an output projection: the shape of a gated-DeltaNet layer."""

    def __init__(self, d: int = 16, chunk: int = 16, use_triton: bool = False) -> None:
        super().__init__()
        self.chunk, self.use_triton = chunk, use_triton
        self.norm = nn.RMSNorm(d)
        self.q, self.k, self.v, self.gate, self.out = (nn.Linear(d, d, bias=False) for _ in range(5))

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        h = self.norm(x)
        q, k, v = self.q(h), F.normalize(self.k(h), dim=-1), self.v(h)
        states = ChunkedStates.apply(k, v, self.chunk, 0.9, self.use_triton)
        qc = q.reshape(b, t // self.chunk, self.chunk, d)
        o = (qc @ states).reshape(b, t, d)
        return x + self.out(o * F.silu(self.gate(h)))


# Models and training --------------------------------------------------------------------------------


class Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module], d: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.layers = nn.ModuleList(blocks)
        self.head = nn.Linear(d, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h).square().mean()


BLOCKS: dict[str, Callable[[], nn.Module]] = {
    "function_empty_like": FunctionBlock,
    "plain_empty": EmptyBlock,
    "unpermute_new_empty": UnpermuteBlock,
    "strided_data_ptr_view": StridedBlock,
    "inplace_scale": ScaleInPlaceBlock,
    "scale_after_save": ScaleAfterSaveBlock,
    "rewritten_alias": RewrittenAliasBlock,
    "dead_sibling_view": DeadSiblingBlock,
    "triton_writes_saved": TritonWritesSavedBlock,
    "triton_outside_function": TritonOutsideBlock,
    "triton_in_function": TritonFunctionBlock,
    "deltanet_numpy": lambda: DeltaNetLikeBlock(),
    "deltanet_triton": lambda: DeltaNetLikeBlock(use_triton=True),
}
TRITON_BLOCKS = {"triton_outside_function", "triton_in_function", "deltanet_triton", "triton_writes_saved"}
LOUD_BLOCKS = {"inplace_scale", "scale_after_save", "rewritten_alias"}
"""Unseen writes into tensors that already exist: the first replay of each block fails loudly."""


def model(kind: str, layers: int = 2) -> Stack:
    torch.manual_seed(0)
    return Stack([BLOCKS[kind]() for _ in range(layers)])


def batch(step: int, seq: int = 32) -> Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(2, seq, 16, generator=g)


def train(net: Stack, steps: int, *, skip_errors: bool = False, skip_steps: frozenset = frozenset()):
    """Per step: (loss, gradients by name), or the exception the step raised (``skip_errors``:
    the step's gradients are dropped and the loop goes on, as a trainer that catches would), or
    None for a step in ``skip_steps`` (not run: the reference of a run whose step raised)."""
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    out = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        if step in skip_steps:
            out.append(None)
            continue
        try:
            loss = net(batch(step))
            loss.backward()
        except Exception as e:  # noqa: BLE001
            if not skip_errors:
                raise
            out.append(e)
            continue
        out.append((loss.detach(), {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}))
        opt.step()
    return out
