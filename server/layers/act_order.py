"""A projection whose weight's input columns are stored permuted: GPTQ's activation order.

GPTQ with `desc_act` quantizes the inputs in the order of its Hessian's diagonal and records each
input's group in `g_idx`, so one group's inputs lie anywhere along the row. The loader sorts the
columns by group (`perm`, a stable argsort of g_idx), which makes every group contiguous for the
kinds that take groups of consecutive inputs (`Int4Linear`); then W x = W[:, perm] x[perm], so each
call gathers its activation's columns in the same order before the product.
"""

from __future__ import annotations

import torch
from sloserve.layers.linear import Linear


# NOTE: gathering the activation (one copy of x's rows) was chosen over regrouping the weight
# (a scale per input instead of per group), which no kernel here takes; vLLM's GPTQ Marlin path
# sorts g_idx and permutes the activation the same way.
class ActOrderLinear:
    """`inner`, whose weight columns are the inputs in `perm`'s order, called on x[..., perm]."""

    __slots__ = ("inner", "perm")

    def __init__(self, inner: Linear, perm: torch.Tensor) -> None:
        if perm.shape != (inner.in_features,):
            raise ValueError(
                f"a permutation of {tuple(perm.shape)} for a projection of {inner.in_features} inputs"
            )
        self.inner, self.perm = inner, perm.to(torch.int64)

    @property
    def weight(self) -> None:
        return None

    @property
    def bias(self) -> torch.Tensor | None:
        return self.inner.bias

    @property
    def out_features(self) -> int:
        return self.inner.out_features

    @property
    def in_features(self) -> int:
        return self.inner.in_features

    def nbytes(self) -> int:
        return self.inner.nbytes() + self.perm.numel() * self.perm.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        # NOTE: gather with the order repeated a row (a view) copies 2-6x faster than
        # index_select along the last dim from 16 rows on (one thread, 4,864 inputs, measured
        # under load); at one row both take a few microseconds
        ordered = torch.gather(x2, 1, self.perm.expand(x2.shape[0], -1))
        return self.inner(ordered).reshape(*x.shape[:-1], self.out_features)
