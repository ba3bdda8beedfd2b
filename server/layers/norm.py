"""RMSNorm, computed exactly as transformers' LlamaRMSNorm (float32 statistics, weight last)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from sloserve.hotpath import USING_EXTENSIONS

try:
    if not USING_EXTENSIONS:
        raise ImportError("SLOSERVE_NO_EXTENSIONS forces the torch ops")
    from sloserve.hotpath._cpu_ops import rms_norm as _kernel
except ImportError:  # not built, or forced off: the torch ops below
    _kernel = None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)), statistics in float32.

    A contiguous float32 CPU tensor takes the one-call kernel (`sloserve.hotpath._cpu_ops`);
    everything else, and anything torch.compile traces, the torch ops below.
    """
    if _kernel is not None and _fits(x, weight):
        out = torch.empty_like(x)
        _kernel(
            x.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            x.numel() // x.shape[-1],
            x.shape[-1],
            eps,
        )
        return out
    dtype = x.dtype
    if dtype == torch.float32:  # one fused kernel; the same arithmetic when nothing is downcast
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    if x.device.type == "cpu":
        # NOTE: the float32 statistics and scaling as one op, the same bits as the three below
        # (tests/executor/test_rms_norm_bf16.py): a bf16 decode step runs two norms a layer, and on a CPU
        # each op's dispatch costs about what its arithmetic does at a few rows.
        return weight * F.rms_norm(xf, weight.shape, None, eps).to(dtype)
    variance = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(variance + eps)).to(dtype)


def _fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel can run these tensors (and nothing is being traced)."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.is_contiguous()
        and weight.is_contiguous()
        and x.dim() >= 1
        and x.shape[-1] == weight.numel() > 0
        and not torch.compiler.is_compiling()
    )
