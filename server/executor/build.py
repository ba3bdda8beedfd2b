"""A runner built in stages, each a function returning a small typed value:

load (checkpoint + config) -> choose the attention backend -> plan memory -> allocate the KV pool
-> build the model -> choose the decode path.

ModelRunner runs them in this order on every tensor-parallel rank alike (a rank passes its
shard and all-reduce); the order is part of the contract: the backend fixes the page size the
plan needs, and the pool is carved KV first, then expert slots, then the step's inputs.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from sloserve.config import SloserveConfig
from sloserve.executor.compiled import DecodeStep, decode_path_reason
from sloserve.executor.experts import ExpertPrefetcher
from sloserve.executor.fused import fused_reason
from sloserve.executor.graphs import (
    CudaGraphCapture,
    EagerCapture,
    GraphDecode,
    decode_forward,
    graph_reason,
)
from sloserve.executor.host_memory import keep_freed_memory, return_freed_memory
from sloserve.executor.plan import MemoryPlan
from sloserve.executor.precision import checkpoint_dtype, choose_dtype
from sloserve.executor.residency import mib
from sloserve.layers.attention import (
    AttentionBackend,
    BackendChoice,
    CapturableDecode,
    select_backend,
)
from sloserve.layers.linear import (
    DenseLinear,
    OneDnnBf16Linear,
    OneDnnLinear,
    PackedBf16Linear,
    PackedLinear,
    cpu_gemm_reason,
)
from sloserve.layers.quant import Int8Linear
from sloserve.memory.expert_cache import ExpertStore
from sloserve.memory.pool import DevicePool
from sloserve.models.decoder import DecoderModel
from sloserve.models.loader import load_checkpoint, resolve_model_path
from sloserve.models.quant_formats import CheckpointQuant, read_quant_config
from sloserve.models.shard import Shard
from sloserve.models.spec import ModelSpec
from sloserve.models.weights import ModelWeights
from sloserve.tokenizer import Tokenizer

# NOTE: the start-up lines keep the runner's logger
log = logging.getLogger("sloserve.executor.runner")


def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda when available, else cpu; a CUDA device that is absent -> ValueError."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device {name!r} was requested but CUDA is not available; use --device cpu"
        )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}")
    return device


# ---- 1. load -------------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class Loaded:
    """The checkpoint on its device (routed experts still on the host) and what it fixes."""

    path: Path
    spec: ModelSpec
    weights: ModelWeights
    tokenizer: Tokenizer
    device: torch.device
    dtype: torch.dtype
    dtype_reason: str  # why this dtype (executor/precision.py)
    max_model_len: int
    eos_token_ids: list[int]
    num_parameters: int  # counted before build_model hands the experts to their store
    # what `info` reports: --quantization, or the quantized checkpoint's scheme
    quantization: str = "none"


def load(config: SloserveConfig, shard: Shard) -> Loaded:
    """Resolve device and dtype, read the checkpoint (this rank's shard) and its tokenizer, check max_model_len."""
    mc = config.model
    device = resolve_device(mc.device)
    if mc.quantization != "none" and device.type != "cpu":
        raise ValueError(
            f"--quantization {mc.quantization} runs on a CPU only for now, not on {device.type}: "
            "drop it (or pass --device cpu)"
        )
    path = resolve_model_path(mc.path)
    quant = read_quant_config(path)
    if quant is not None:
        # FP8 weights are dequantized at load (ct_fp8.py): --quantization int8 may requantize them
        if mc.quantization != "none" and not quant.dequantized_at_load():
            raise ValueError(
                f"--quantization {mc.quantization} was given, but {path} is already quantized "
                f"({quant.describe()}): drop --quantization"
            )
        if device.type != "cpu":
            raise ValueError(
                f"{path} is quantized ({quant.describe()}); quantized checkpoints run on a CPU "
                f"only for now, not on {device.type}: pass --device cpu"
            )
        log.info("quantized checkpoint: %s", quant.describe())
        if quant.dequantized_at_load():
            into = "int8 rows" if mc.quantization == "int8" else "the model's dtype"
            log.info("FP8 weights: this CPU has no FP8 arithmetic, converted at load into %s", into)
    # NOTE: tensor-parallel ranks decide by the CPU's units alone: each rank's probe times its own
    # run, and every rank must hold the same dtype.
    choice = choose_dtype(mc.dtype, device, checkpoint_dtype(path), probe=shard.size == 1)
    dtype = choice.dtype
    log.info("dtype %s: %s", str(dtype).removeprefix("torch."), choice.reason)
    if device.type == "cpu" and mc.host_malloc == "keep":
        keep_freed_memory()
    # NOTE: routed experts stay on the host until the residency is decided, which needs the device
    # budget left after the dense weights (executor/residency.py); build_model's ExpertStore places them.
    # int8 quantizes each dense projection as it is read (this rank's slice of it), the embedding
    # and LM head too, so the load never holds the model in `dtype` (docs/design/cpu-decode.md,
    # "int8 on the CPU").
    int8 = mc.quantization == "int8"
    spec, weights = load_checkpoint(
        path,
        device,
        dtype,
        experts_on_host=True,
        shard=shard,
        make_dense=int8_projection if int8 else DenseLinear,
        make_head=int8_projection if int8 else None,
    )
    tokenizer = Tokenizer.from_pretrained(path)
    limit = spec.context_limit
    if mc.max_model_len is not None and mc.max_model_len > limit:
        raise ValueError(
            f"max_model_len {mc.max_model_len} exceeds what {spec.architecture} at "
            f"{path} supports ({limit}); lower it"
        )
    eos = list(spec.eos_token_ids) or (
        [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    )
    return Loaded(
        path,
        spec,
        weights,
        tokenizer,
        device,
        dtype,
        choice.reason,
        mc.max_model_len or limit,
        eos,
        weights.num_parameters(),
        _quantization(mc.quantization, quant),
    )


def _quantization(flag: str, quant: CheckpointQuant | None) -> str:
    """What `info` says of the weights' quantization: the flag, the checkpoint's scheme, or both."""
    if quant is None:
        return flag
    return quant.describe() + ("" if flag == "none" else f"; --quantization {flag}")


def int8_projection(weight: torch.Tensor, bias: torch.Tensor | None) -> Int8Linear:
    """The loader's dense projection under --quantization int8: the weight quantized, the heap's
    free pages handed back."""
    proj = Int8Linear.quantize(weight, bias)
    # NOTE: each weight read in the model's dtype is freed below the int8 rows that follow it; the
    # heap keeps such holes resident (the whole model's worth at a small model's sizes), so they
    # go back to the OS here, one weight behind.
    return_freed_memory()
    return proj


# ---- 2. choose the attention backend ---------------------------------------------------------------
def choose_backend(config: SloserveConfig, loaded: Loaded) -> BackendChoice:
    """The backend and its page size (flash-attn needs 256 when the config sets none).

    Everything after this stage reads the choice's block_size, never config.cache.block_size.
    """
    choice = select_backend(
        config.model.attention_backend,
        loaded.device,
        dtype=loaded.dtype,
        block_size=config.cache.block_size,
        head_dim=loaded.spec.head_dim,
    )
    log.info("attention backend: %s (%s)", choice.name, choice.reason)
    return choice


# ---- 3. plan memory: executor/plan.py's plan_memory -> MemoryPlan -----------------------------------


# ---- 4. allocate the KV pool ---------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class KVCache:
    """The one device pool with the KV pages carved first, and the optional host swap pages."""

    pool: DevicePool
    # [layers, 2, pages, block, kv heads, head dim]; int8 pages: head dim + 4, each row's scale
    # after its values (layers/attention/kv_int8.py)
    kv: torch.Tensor
    host_pool: DevicePool | None
    host_kv: torch.Tensor | None  # the same shape with the host's pages
    num_pages: int
    num_host_pages: int
    page_bytes: int
    block_bytes: int  # one block, all layers, K and V


def allocate(plan: MemoryPlan, loaded: Loaded, block_size: int) -> KVCache:
    """The device pool of plan.pool_bytes, its KV carve, and the host swap pool when swap is on."""
    spec, device = loaded.spec, loaded.device
    dtype = plan.kv_dtype or loaded.dtype
    row = plan.kv_row or spec.head_dim
    # NOTE: KV first, at offset 0; the small carves follow it, so arena alignment wastes little.
    pool = DevicePool(plan.pool_bytes, plan.arena_bytes, device)
    kv_shape = (spec.num_layers, 2, plan.num_pages, block_size, spec.num_kv_heads, row)
    kv = pool.carve("kv", kv_shape, dtype)
    layers, pair, _, *page = kv.shape  # one block: every dim but the pages one, K and V
    block_bytes = layers * pair * math.prod(page) * kv.element_size()
    host_pages = plan.num_host_pages
    host_pool = host_kv = None
    if host_pages > 0:
        host_pool = DevicePool(
            host_pages * plan.page_bytes, None, "cpu", pin_memory=device.type == "cuda", zero=False
        )
        host_kv = host_pool.carve("swap_kv", (*kv_shape[:2], host_pages, *kv_shape[3:]), dtype)
    log.info(
        "KV pages: %s, %d pages of %d tokens (%d tokens, %.0f tokens per GiB)",
        "int8 with a bf16 scale per token and KV head" if dtype == torch.int8 else _name(dtype),
        plan.num_pages - 1,
        block_size,
        (plan.num_pages - 1) * block_size,
        plan.tokens_per_gib(block_size),
    )
    return KVCache(
        pool, kv, host_pool, host_kv, plan.num_pages, host_pages, plan.page_bytes, block_bytes
    )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---- 5. build the model --------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class BuiltModel:
    """The decoder, and for a MoE model the store placing its experts and the prefetcher feeding it."""

    model: DecoderModel
    experts: ExpertStore | None
    prefetcher: ExpertPrefetcher | None


def build_model(
    config: SloserveConfig,
    loaded: Loaded,
    backend: AttentionBackend,
    plan: MemoryPlan,
    cache: KVCache,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None,
) -> BuiltModel:
    """Place the experts (their slots and workspace carved after the KV), pack the dense
    projections, build the decoder."""
    cc, spec, weights = config.cache, loaded.spec, loaded.weights
    experts = prefetcher = None
    if spec.moe_layers:
        automatic = cc.expert_slots_per_layer is None and cc.expert_memory_bytes is None
        (log.warning if plan.residency.partial and automatic else log.info)(
            "experts: %s", plan.residency.reason
        )
        # The pool backs the slots and the per-layer workspace (reused by every MoE layer of a
        # step); all-resident experts are moved to the device as tensors of their own.
        experts = ExpertStore(
            weights.experts,
            device=loaded.device,
            dtype=loaded.dtype,
            slots_per_layer=plan.expert_slots,
            pool=cache.pool,
            workspace_rows=plan.moe_workspace_rows,
            resident_in_pool=False,
            max_seqs=plan.max_seqs,
            quantization=config.model.quantization,
        )
        weights.experts.clear()  # the store holds its own (resident or host) copies
        prefetcher = ExpertPrefetcher(experts, cc.expert_preload)
    model = DecoderModel(
        spec, weights, backend, experts, loaded.max_model_len, loaded.device, loaded.dtype, reduce
    )
    # the fused C step and torch.compile read the plain weights: oneDNN then reads them in place
    reads_plain = config.model.enforce_eager is False or (
        decode_path_reason(model, cache.kv) is None and fused_reason(model, cache.kv) is None
    )
    prepare_projections(
        config.model.cpu_gemm,
        weights,
        loaded.device,
        loaded.dtype,
        reads_plain,
        config.model.quantization,
    )
    if loaded.device.type == "cpu":
        return_freed_memory()  # the loader's temporaries, and plain weights replaced by packed ones
    return BuiltModel(model, experts, prefetcher)


def prepare_projections(
    choice: str,
    weights: ModelWeights,
    device: torch.device,
    dtype: torch.dtype,
    reads_plain: bool,
    quantization: str = "none",
) -> None:
    """Each layer's dense projections in the kind their kernel reads (layers/linear.py), each
    weight held once: on oneDNN in place when something else reads the plain weight
    (`reads_plain`), else packed for it with the plain copy released; torch's F.linear when
    oneDNN cannot run. `quantization` int8: the loader quantized them, the embedding and the LM
    head as it read them (`load`); one still in the model's dtype is quantized here, an int8 one
    is kept as it is."""
    why_not = cpu_gemm_reason(choice, device, dtype)
    if why_not and choice == "onednn":
        raise ValueError(
            f"--cpu-gemm onednn cannot run here: {why_not}; use --cpu-gemm auto or blas"
        )
    started = time.monotonic()
    if quantization == "int8":
        count = weights.replace_dense(
            lambda proj: (
                proj
                if isinstance(proj, Int8Linear)
                else Int8Linear.quantize(proj.weight, proj.bias)
            )
        )
        quantize_head(weights)
        log.info(
            "dense projections, embedding and LM head in int8: %d weights, held once, quantized "
            "as they loaded; weights resident: %s",
            count,
            mib(weights.nbytes()),
        )
        return
    if why_not:
        log.debug("dense projections on F.linear: %s", why_not)
        return
    if dtype == torch.bfloat16:
        # NOTE: where the fused step reads the plain bf16 weights, oneDNN reads them in place too:
        # its prefill products lose ~5-15 % to the packed copy at 128-512 rows (more below;
        # docs/design/cpu-decode.md, "bf16 on the CPU"), where small decode batches run ×1.3-1.5
        # faster on the fused step's dot products.
        kind, how = (
            (OneDnnBf16Linear, "read in place in bf16 (the fused step reads them too)")
            if reads_plain
            else (PackedBf16Linear, "packed in bf16")
        )
        if not weights.tied:  # a tied head reads the embedding itself
            weights.lm_head = kind(weights.lm_head.weight, weights.lm_head.bias)
    elif reads_plain:
        kind, how = OneDnnLinear, "read in place (the fused step reads them too)"
    else:
        kind, how = PackedLinear, "packed"
    # a quantized checkpoint's projections keep the kind the loader built (layers/int4.py, w8a16.py)
    count = weights.replace_dense(
        lambda proj: kind(proj.weight, proj.bias) if isinstance(proj, DenseLinear) else proj
    )
    log.info(
        "dense projections on oneDNN: %d weights %s, held once, in %.2fs",
        count,
        how,
        time.monotonic() - started,
    )


def quantize_head(weights: ModelWeights) -> None:
    """The embedding and the LM head in int8 where the loader left them in the model's dtype (a
    tied head stays the embedding's own Int8Linear)."""
    tied = weights.tied
    if not isinstance(weights.embed, Int8Linear):
        weights.embed = Int8Linear.quantize(weights.embed)
    if tied:
        weights.lm_head = weights.embed
    elif not isinstance(weights.lm_head, Int8Linear):
        weights.lm_head = Int8Linear.quantize(weights.lm_head.weight, weights.lm_head.bias)


# ---- 6. choose the decode path -------------------------------------------------------------------
def choose_decode_path(
    model: DecoderModel,
    backend: AttentionBackend,
    kv: torch.Tensor,
    device: torch.device,
    max_seqs: int,
    enforce_eager: bool | None,
    shard: Shard,
    threads: int,
) -> DecodeStep | GraphDecode | None:
    """The decode-only step's path: on a CPU the in-place kernel (eager, or compiled when asked);
    on a GPU the step captured per batch bucket in CUDA graphs (eager when --enforce-eager).
    None: decode steps take the general path."""
    if device.type == "cuda":
        why_not = graph_reason(model, isinstance(backend, CapturableDecode))
        if why_not:
            log.info("decode steps run the general path: %s", why_not)
            return None
        capture = EagerCapture() if enforce_eager else CudaGraphCapture(device)
        return GraphDecode(model, kv, max_seqs, decode_forward(model, backend), capture)
    # Decode-only steps of a float32 model on a CPU take the in-place fast path; compiled
    # only when asked (enforce_eager False): eager is the CPU default (see executor/compiled.py).
    why_not = decode_path_reason(model, kv)
    compiled = enforce_eager is False
    if compiled and shard.size > 1:
        raise ValueError(
            "the compiled decode step (--compile) does not run with tensor parallelism yet: "
            "drop --compile (or pass --enforce-eager)"
        )
    if compiled and why_not:
        raise ValueError(
            f"the compiled decode step (--compile) cannot run here: {why_not}; "
            "drop --compile (or pass --enforce-eager)"
        )
    return None if why_not else DecodeStep(model, kv, max_seqs, compiled, threads=threads)
