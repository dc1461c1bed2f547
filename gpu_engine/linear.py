"""The linear map y = x Wᵀ in torch: the twin of `reference_cpu.linear`.

A weight is a `Matrix` handle: the weight itself (a GGUF tensor's raw blocks, `gpu_engine.weights.QTensor`,
dequantized per product; or a dense tensor), the rounding its input gets first (`round_input`: the engine's
act_quant for a quantized weight, None for an exact product) and the dtypes of the product, all as data. The
products are free functions of a handle: `linear` and `grouped_linear` (the block-diagonal output projection's
groups); `expert_of(W, e)` is the handle of one expert of an expert tensor [E, out, in], `exact(W)` W without its
input rounding. `DeviceWeights.weight(name)` hands out the
handles of a model file, `dense_matrix(t)` one over a plain tensor (exact, in t's dtype: tests, the drafter fit).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from gpu_engine.weights import QTensor

Tensor = torch.Tensor
MapOp = Callable[..., Iterator]  # map(fn, items) -> results in item order (builtin map, or a thread pool's map)


@dataclass(frozen=True)
class Matrix:
    """A weight [out, in] (or experts [E, out, in]) as the products see it.

    w: the raw blocks (`QTensor`), a dense tensor, or a dense expert tensor split into its experts (a tuple);
    round_input: applied to the input of every product first (None: exact); act / mm: the activation dtype a
    product returns and the dtype it multiplies in; whole(): the whole matrix in `mm` for one product (memory that
    may be reused by the next dequantization of the tensor's kind); scratch(n): a reusable float32 buffer of n values
    for expert row blocks (None: fresh memory); run / threads: how a CPU-kernel matvec's row ranges are run;
    expert: which expert of an expert tensor the products use (`expert_of`)."""

    name: str
    w: Any   # QTensor | Tensor | tuple[Tensor, ...]
    round_input: Callable[[Tensor], Tensor] | None
    act: torch.dtype
    mm: torch.dtype
    whole: Callable[[], Tensor]
    scratch: Callable[[int], Tensor | None]
    run: MapOp = map
    threads: int = 1
    expert: int | None = None   # an expert tensor's handle for one expert (`expert_of`), else None

    @property
    def blocks(self) -> QTensor | None:
        """The raw quantized blocks (None for a dense weight)."""
        return None if isinstance(self.w, torch.Tensor | tuple) else self.w


def dense_matrix(t: Tensor, name: str = "dense") -> Matrix:
    """An exact handle over a dense tensor [out, in] (or [E, out, in], split once into its experts so that each
    expert's gradient is its own), in t's dtype."""
    w = t.unbind(0) if t.dim() == 3 else t
    return Matrix(name, w, None, t.dtype, t.dtype, lambda: t, lambda n: None)


def expert_of(W: Matrix, e: int) -> Matrix:
    """The handle of expert e [out, in] of an expert tensor's handle W [E, out, in]."""
    return replace(W, expert=e)


def exact(W: Matrix) -> Matrix:
    """W without its input rounding (an input already rounded, and then scaled, by the caller)."""
    return replace(W, round_input=None)


def _rounded(x: Tensor, W: Matrix) -> Tensor:
    return x if W.round_input is None else W.round_input(x)


def linear(x: Tensor, W: Matrix) -> Tensor:
    """y = x Wᵀ (no bias anywhere in V4), x rounded by W's round_input first.  x [n, in] -> [n, out] (W.act).
    An expert's handle (`expert_of`): quantized experts are dequantized a block of rows at a time into W.scratch
    (`QTensor.expert_linear`)."""
    operand, qt = _rounded(x, W).to(W.mm), W.blocks
    if W.expert is not None:
        y = operand @ W.w[W.expert].T if qt is None else qt.expert_linear(W.expert, operand, W.scratch)
        return y.to(W.act)
    if qt is not None and qt.uses_matvec(operand):
        return qt.matvec(qt.raw, operand, W.name, W.run, W.threads).to(W.act)
    return (operand @ W.whole().T).to(W.act)


def grouped_linear(x: Tensor, W: Matrix) -> Tensor:
    """z_g = W[g] x_g per group, W [G·r, w] read as G blocks of r rows.  x [n, G, w] -> [n, G, r] (W.act)."""
    operand, qt = _rounded(x, W).to(W.mm), W.blocks
    _, groups, width = operand.shape
    if qt is not None and qt.uses_matvec(operand):
        raw = qt.raw.view(groups, -1, qt.raw.shape[1])
        z = W.run(lambda g: qt.matvec(raw[g], operand[:, g], W.name), range(groups))
        return torch.stack(list(z), dim=1).to(W.act)
    w = W.whole().reshape(groups, -1, width)
    return torch.einsum("ngw,grw->ngr", operand, w).to(W.act)

