"""The decode step of a small batch as one C call (`sloserve.hotpath._decode_step`).

At a few sequences a decode step's arithmetic is matrix-vector products that stream the weights
once; eager torch spends longer than that dispatching the ~20 ops per layer around them (on a
small model, most of the step). The kernel runs the same
step, layer by layer, in one nogil call over the weights and the paged KV cache in place.

A small mixed step (prefill chunks beside decodes, at most max_batch tokens in all) runs the same
call one row per token (`rows`): a chunk token is a row with its own position and its sequence's
block table, and only the sampled rows get logits. Every row's K/V is written before any row
attends, so each token sees exactly its causal prefix; the oracle there is the flat torch path
(`DecoderModel.forward`).

It serves dense float32 and bf16 models (their projections int8 too; KV pages in the model's dtype
or int8, each row quantized as the torch path's `write_kv` does) on a CPU, one rank, batches up
to FUSED_MAX_BATCH. Its matrix-vector products read each weight row once per two sequences
and need no FMA to run at the core's multiply-add rate, so on the CPUs measured it beat the
torch path up to the largest batch it takes. Its pure-torch twin is
`DecoderModel.decode` (eager), which runs everything else, and SLOSERVE_NO_EXTENSIONS=1.
Tokens equal the twin's except where two logits tie to the last bits (the dot products sum in
another order than the BLAS); tests hold it to transformers' greedy tokens like every path.

A bf16 model's step reads the plain bf16 weights and bf16 KV pages in place (half the bytes of
float32). Where the CPU has AVX512-BF16 its matrix-vector products round each product's
activation rows to bf16 once and run `vdpbf16ps` (32 multiply-adds an instruction, float32
sums in a fixed order: a row's bits do not depend on its batch or the threads, but differ from
the widened path's); elsewhere they widen the weights to float32 in registers (the float32
step's arithmetic on the widened weights). Norms, rotary, attention, softmax and the residual
stream stay float32; tests hold both paths to the bf16 twin (which rounds every activation)
within bf16 rounding. On the 494M Llama (Qwen2.5-0.5B's shape, 600-token contexts, 2 threads)
the dot-product step took 28.0 / 32.1 / 43.1 / 49.0 / 72.8 ms at 1 / 2 / 4 / 8 / 16 sequences
against 38.2 / 40.0 / 42.8 / 50.7 / 63.8 on oneDNN's packed bf16 copies (the widened path: 39.4
/ 38.4 / 72.4 / 96.8 / 161.8), batch 1 at 76 % of the read-bandwidth ceiling
(docs/design/cpu-decode.md, "bf16 on the CPU"). The projections then keep the plain weights,
whose prefill products on oneDNN cost ~5-15 % more than on its packed copies. Norms, biases and
the rotary tables are read as float32 copies (a few MiB).

Int8Linear projections (--quantization int8), the embedding and LM head included, are read as
their int8 rows and per-row scales (an embedding row as its weights times its scale):
W8A8 with per-token activation scales at every batch, as Int8Linear's one-row product computes
it, on AVX512-VNNI where the CPU has it (exact int32 sums: the same bits on every path; 22.7 ms
a step at one sequence of that model against 34.6 on the torch int8 path; "int8 on the CPU"
there).

Int4Linear projections (compressed-tensors W4A16) are read as Int4Linear holds them, torch's CPU
int4 layout and its scales and zeros (_decode_step_int4.h): a bf16 model's products on AVX512-BF16
dot products (activations rounded to bf16 once per product), a float32 model's on float32
multiply-adds; the logits stay within rounding of the torch int4 path's
(docs/design/cpu-decode.md, "int4 (W4A16) in the decode step").
"""

from __future__ import annotations

import time

import torch
from sloserve.executor.inputs import DecodeInputs, TokenRows
from sloserve.executor.team import TeamSize
from sloserve.hotpath import USING_EXTENSIONS
from sloserve.layers.int4 import Int4Linear, layout_known
from sloserve.layers.linear import MIN_PACKED_ROWS, Linear, on_onednn
from sloserve.layers.quant import Int8Linear
from sloserve.layers.w8a8 import TokenW8A8Linear
from sloserve.layers.w8a16 import W8A16Linear
from sloserve.models.decoder import DecoderModel
from sloserve.models.weights import LayerWeights, ModelWeights

try:
    if not USING_EXTENSIONS:
        raise ImportError("SLOSERVE_NO_EXTENSIONS forces the torch path")
    from sloserve.hotpath._decode_step import DecodeKernel, bf16_dot_products
except ImportError:  # not built, or forced off: DecoderModel.decode runs every step
    DecodeKernel = bf16_dot_products = None

# Largest decode batch the kernel takes (its workspace limit, SLOSERVE_MAX_BATCH); it beats the
# torch path up to here (docs/design/cpu-decode.md). A larger batch runs the torch path.
FUSED_MAX_BATCH = 64
# With the dense projections on oneDNN (layers/linear.py) the torch path's products of 16 rows and
# more run ~2x faster than on MKL, so on larger models it wins from there (docs/design/cpu-decode.md):
# a batch of at least MIN_PACKED_ROWS whose arithmetic (sequences x parameters) exceeds this goes
# to the torch path.
FUSED_MAX_MACS_PACKED = 1 << 28
# bf16: a batch whose sequences x parameters exceed this goes to the torch path (oneDNN's bf16
# products), below 16 rows too. The 494M Llama against oneDNN's packed bf16 copies: the kernel's
# dot products ×1.36 / ×1.25 faster at 1 / 2 sequences, even at 4 and 8 (×0.99 / ×1.03), ×0.88
# at 16 (docs/design/cpu-decode.md): up to 8 sequences of that model.
FUSED_MAX_MACS_BF16 = 1 << 32
# NOTE: which bf16 models take the kernel, where its products run on AVX512-BF16 dot products (the
# projections then keep the plain weights, OneDnnBf16Linear): True (the default) every one, "tied"
# those whose LM head is the embedding, False none (oneDNN's packed bf16 copies). The kernel wins
# every decode up to 8 sequences; the plain weights it reads cost prefill and larger batches, so
# "tied" suits batch-heavy serving of untied models. The widened path (no dot products) lost to the
# packed copies everywhere. Measurements: docs/design/cpu-decode.md, "bf16 on the CPU".
BF16_DECODE: bool | str = True

# The projections the kernel reads, by the name of their weight's field in its layer struct
# (the bias's is the same with _b); it reads the plain weight each projection object holds.
_PROJECTIONS = ("qkv", "o", "gate_up", "down")
# The dtypes the kernel reads weights in (the model's), and KV pages in: the model's, or int8 rows
# with their scales (layers/attention/kv_int8.py).
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
KV_DTYPES = (*KERNEL_DTYPES, torch.int8)
# Rows of a block of torch's CPU int4 layout, the unit the kernel's int4 products split by: an
# int4 projection's rows (a gate_up's gate rows) must be a multiple (_decode_step_int4.h).
INT4_BLOCK = 64


def _layer_tensors(layer: LayerWeights) -> dict[str, torch.Tensor | None]:
    """The tensors of one layer the kernel reads, by its field names (a plain weight may be None):
    an int8 projection's weight is its int8 rows (its scales: `_int8_scales`)."""
    tensors: dict[str, torch.Tensor | None] = {"ln1": layer.ln1, "ln2": layer.ln2}
    for name in _PROJECTIONS:
        proj: Linear = getattr(layer, name)
        weight = proj.qweight if isinstance(proj, Int8Linear) else proj.weight
        if isinstance(proj, Int4Linear):
            weight = proj.packed
        tensors[name + "_w"], tensors[name + "_b"] = weight, proj.bias
    return tensors


def _int8_scales(layer: LayerWeights, keep: list[torch.Tensor]) -> dict[str, int]:
    """The addresses of each int8 projection's per-row scales and weight sums (the sums computed
    here, one int32 a row, kept alive in `keep`): the kernel's VNNI products need them."""
    addresses = {}
    for name in _PROJECTIONS:
        proj = getattr(layer, name)
        if isinstance(proj, Int8Linear):
            rowsum = proj.qweight.sum(dim=1, dtype=torch.int32)
            keep += [rowsum, proj.scale]
            addresses[name + "_scale"] = proj.scale.data_ptr()
            addresses[name + "_rowsum"] = rowsum.data_ptr()
    return addresses


def _int4_fields(layer: LayerWeights) -> dict[str, int | str]:
    """Each int4 projection's scales_zeros address, rows, group size and scale dtype by the
    kernel's names for them (it reads the packed weight and these in place)."""
    fields: dict[str, int | str] = {}
    for name in _PROJECTIONS:
        proj = getattr(layer, name)
        if isinstance(proj, Int4Linear):
            fields[name + "_scales_zeros"] = proj.scales_zeros.data_ptr()
            fields[name + "_rows"] = proj.out_features
            fields[name + "_group"] = proj.group_size
            fields[name + "_scale_dtype"] = _name(proj.scales_zeros.dtype)
    return fields


def _int4_reason(layer: LayerWeights) -> str | None:
    """Why the kernel cannot read this layer's int4 projections (None when it can)."""
    for name in _PROJECTIONS:
        proj = getattr(layer, name)
        if not isinstance(proj, Int4Linear):
            continue
        rows = proj.out_features // 2 if name == "gate_up" else proj.out_features
        if rows % INT4_BLOCK:
            return f"the kernel reads int4 weights in blocks of {INT4_BLOCK} rows, not {rows}"
        if not layout_known():
            return "this torch lays int4 weights out otherwise than the kernel reads them"
        sz = proj.scales_zeros
        if (
            sz.dtype not in KERNEL_DTYPES
            or not sz.is_contiguous()
            or not proj.packed.is_contiguous()
        ):
            return "the kernel reads contiguous int4 weights and float32 or bf16 scales"
    return None


def fused_reason(model: DecoderModel, kv: torch.Tensor) -> str | None:
    """Why this model's decode steps cannot take the kernel (None when they can)."""
    spec, w = model.spec, model.weights
    if DecodeKernel is None:
        return "the fused decode extension is not built (or SLOSERVE_NO_EXTENSIONS is set)"
    if spec.moe_layers:
        return "MoE layers route on the host"
    if any(
        isinstance(getattr(layer, name), W8A16Linear | TokenW8A8Linear)
        for layer in w.layers
        for name in _PROJECTIONS
    ):
        return (
            "a quantized checkpoint's W8A16 and W8A8 projections run on torch's kernels "
            "(the kernel reads float32, bf16, int4 and --quantization int8 weights)"
        )
    int4 = next(filter(None, map(_int4_reason, w.layers)), None)
    if int4:
        return int4
    if model.sharded:
        return "tensor parallelism splits the layers"
    if kv.device.type != "cpu" or kv.dtype not in KV_DTYPES or not kv.is_contiguous():
        return "the kernel runs a contiguous float32, bfloat16 or int8 cache on a CPU"
    dtype = model.dtype
    if dtype not in KERNEL_DTYPES or kv.dtype not in (dtype, torch.int8):
        return (
            "the kernel reads float32 or bfloat16 weights and pages in their dtype or int8, not "
            f"{_name(dtype)} weights and {_name(kv.dtype)} pages"
        )
    if dtype == torch.bfloat16 and not BF16_DECODE:
        return "bf16 decode runs on oneDNN's packed bf16 products (fused.BF16_DECODE is off)"
    untied = not w.tied and not isinstance(w.layers[0].qkv, Int8Linear | Int4Linear)
    if dtype == torch.bfloat16 and BF16_DECODE == "tied" and untied:
        return (
            "bf16 decode with an untied LM head runs on oneDNN's packed bf16 products "
            "(as fast at one sequence, faster at many: fused.BF16_DECODE)"
        )
    if dtype == torch.bfloat16 and not bf16_dot_products():
        return (
            "without AVX512-BF16 dot products bf16 decode runs faster on oneDNN's packed bf16 "
            "products than on the kernel's widened weights"
        )
    if any(layer.gate_up is None or layer.down is None for layer in w.layers):
        return "a layer has no dense MLP"
    layers = [_layer_tensors(layer) for layer in w.layers]
    if _matrix(w.lm_head) is None or any(
        t[name + "_w"] is None for t in layers for name in _PROJECTIONS
    ):
        return "the kernel reads plain weights (these projections keep only a packed copy)"
    int8 = [getattr(layer, name) for layer in w.layers for name in _PROJECTIONS]
    int8 = [p for p in (*int8, w.embed, w.lm_head) if isinstance(p, Int8Linear)]
    if any(not p.qweight.is_contiguous() or not p.scale.is_contiguous() for p in int8):
        return "the kernel reads contiguous int8 rows and scales"
    if isinstance(w.lm_head, Int8Linear) and w.lm_head.bias is not None:
        return "the kernel's LM head has no bias"
    tensors = [_matrix(w.embed), w.norm, _matrix(w.lm_head), w.lm_head.bias, model.cos, model.sin]
    packed = (torch.int8, torch.uint8)
    tensors = [t for t in tensors if t is not None and t.dtype not in packed]
    tensors += [t for ts in layers for t in ts.values() if t is not None and t.dtype not in packed]
    if any(t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous() for t in tensors):
        return f"the kernel reads contiguous {_name(dtype)} weights on a CPU, as the model runs"
    return None


def _matrix(weight: torch.Tensor | Linear) -> torch.Tensor | None:
    """The matrix the kernel reads for the embedding or the LM head: int8 rows, or the plain weight."""
    if isinstance(weight, Int8Linear):
        return weight.qweight
    return weight if isinstance(weight, torch.Tensor) else weight.weight


def _int8_head(w: ModelWeights, keep: list[torch.Tensor]) -> dict[str, int]:
    """The int8 embedding's scales and the int8 LM head's scales and row sums (computed here, kept
    alive in `keep`) by the kernel's names for them; {} where both keep the model's dtype."""
    addresses = {}
    if isinstance(w.embed, Int8Linear):
        addresses["embed_scale"] = w.embed.scale.data_ptr()
    if isinstance(w.lm_head, Int8Linear):
        rowsum = w.lm_head.qweight.sum(dim=1, dtype=torch.int32)
        keep += [rowsum, w.lm_head.scale]
        addresses["lm_head_scale"] = w.lm_head.scale.data_ptr()
        addresses["lm_head_rowsum"] = rowsum.data_ptr()
    return addresses


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _vector(t: torch.Tensor | None, keep: list[torch.Tensor]) -> int | None:
    """The address of `t` as float32 (the kernel reads norms, biases, cos and sin so): `t`
    itself, or a float32 copy kept alive in `keep` (exact: a bf16 widens without rounding)."""
    if t is None:
        return None
    if t.dtype != torch.float32:
        t = t.float()
        keep.append(t)
    return t.data_ptr()


class FusedDecode:
    """Runs decode steps of up to FUSED_MAX_BATCH sequences through the kernel."""

    def __init__(self, model: DecoderModel, kv: torch.Tensor, threads: int) -> None:
        """threads: the step's team, whatever the batch (its barriers spin, see _decode_step.h,
        so a second thread pays from one sequence of a 3M-parameter model up), unless other
        processes keep its threads off their cores (`TeamSize`)."""
        why_not = fused_reason(model, kv)
        if why_not:
            raise ValueError(f"the fused decode step cannot run this model: {why_not}")
        spec, w = model.spec, model.weights
        self.model, self.kv = model, kv  # the kernel holds their addresses: keep them alive
        # NOTE: the small float32 copies of a bf16 model's vectors (norms, biases, cos/sin): the
        # kernel keeps activations in float32, and these are a few MiB beside the matrices.
        self._floats: list[torch.Tensor] = []
        dims = {
            "hidden": spec.hidden_size,
            "heads": spec.num_heads,
            "kv_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim,
            "inter": w.layers[0].down.in_features,
            "vocab": w.lm_head.out_features,
            "page": kv.shape[3],
            "num_pages": kv.shape[2],
            "max_positions": model.cos.shape[0],
            "eps": spec.rms_norm_eps,
            "scale": model.scale,
            "weight_dtype": _name(model.dtype),
            "kv_dtype": _name(kv.dtype),
        }
        layers = []
        for i, layer in enumerate(w.layers):
            ptrs = {
                f: t.data_ptr() if f.endswith("_w") else _vector(t, self._floats)
                for f, t in _layer_tensors(layer).items()
            }
            ptrs.update(_int8_scales(layer, self._floats))
            ptrs.update(_int4_fields(layer))
            ptrs["k_cache"], ptrs["v_cache"] = kv[i, 0].data_ptr(), kv[i, 1].data_ptr()
            layers.append(ptrs)
        self.kernel = DecodeKernel(
            dims,
            _matrix(w.embed).data_ptr(),
            _vector(w.norm, self._floats),
            _matrix(w.lm_head).data_ptr(),
            _vector(model.cos, self._floats),
            _vector(model.sin, self._floats),
            layers,
            _int8_head(w, self._floats),
        )
        self.vocab = dims["vocab"]
        self.team = TeamSize(threads)
        # the largest batch it takes: the torch path's when its products run on oneDNN and win
        params = w.num_parameters()
        packed_max = max(MIN_PACKED_ROWS - 1, FUSED_MAX_MACS_PACKED // params)
        self.max_batch = (
            min(FUSED_MAX_BATCH, packed_max) if on_onednn(w.layers[0].qkv) else FUSED_MAX_BATCH
        )
        if isinstance(w.layers[0].qkv, Int8Linear):
            # NOTE: the 494M Llama at int8 (bf16 activations on the torch path): the kernel
            # ×1.96 / ×1.54 / ×1.25 / ×1.31 the torch int8 path at 8 / 16 / 32 / 64 sequences
            self.max_batch = FUSED_MAX_BATCH
        elif isinstance(w.layers[0].qkv, Int4Linear):
            # NOTE: the int4 kernel beat the torch int4 path at every batch measured, up to 32
            # sequences (docs/design/cpu-decode.md, "int4 (W4A16) in the decode step")
            self.max_batch = FUSED_MAX_BATCH
        elif model.dtype == torch.bfloat16:
            self.max_batch = max(1, min(FUSED_MAX_BATCH, FUSED_MAX_MACS_BF16 // params))

    @property
    def threads(self) -> int:
        """The team's size (steps run on fewer while it stalls)."""
        return self.team.threads

    @threads.setter
    def threads(self, threads: int) -> None:
        self.team = TeamSize(threads)

    def takes(self, step: DecodeInputs) -> bool:
        return step.input_ids.shape[0] <= self.max_batch

    def __call__(self, step: DecodeInputs) -> torch.Tensor:  # [B, V] float32
        logits = torch.empty((step.input_ids.shape[0], self.vocab), dtype=torch.float32)
        self._run(step, logits)
        return logits

    def rows(self, step: TokenRows) -> torch.Tensor:  # [S', V] float32, the sampled rows'
        """A step of prefill chunks and decode tokens, one row per token (at most max_batch rows)."""
        sample_idx = step.sample_idx
        logits = torch.empty((sample_idx.shape[0], self.vocab), dtype=torch.float32)
        self._run(step, logits, (sample_idx.data_ptr(), sample_idx.shape[0]))
        return logits

    def _run(
        self,
        step: DecodeInputs | TokenRows,
        logits: torch.Tensor,
        logit_rows: tuple[int, int] | tuple[()] = (),
    ) -> None:
        """One kernel call over the step's rows on the threads TeamSize picks; how it went goes
        back to TeamSize."""
        tables = step.block_tables
        pointers = (
            step.input_ids.data_ptr(),
            step.positions.data_ptr(),
            step.slot_mapping.data_ptr(),
            tables.data_ptr(),
            tables.shape[1],
            step.seq_lens.data_ptr(),
            step.input_ids.shape[0],
            logits.data_ptr(),
        )
        threads = self.team.next()
        started = time.perf_counter_ns()
        stalled = self.kernel(*pointers, threads, *logit_rows)
        self.team.report(threads, time.perf_counter_ns() - started, stalled)
