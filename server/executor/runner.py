"""ModelRunner: loads a checkpoint, carves the KV pool once, and turns SchedulerOutputs into tokens."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable

import torch
from sloserve.config import SloserveConfig
from sloserve.executor.compiled import DecodeStep, decode_path_reason
from sloserve.executor.graphs import (
    CudaGraphCapture,
    EagerCapture,
    GraphDecode,
    decode_forward,
    graph_reason,
)
from sloserve.executor.host_memory import keep_freed_memory
from sloserve.executor.inputs import DecodeInputs, InputBuilder, StepInputs, TokenRows
from sloserve.executor.plan import plan_memory
from sloserve.executor.swap import copy_blocks
from sloserve.layers.attention import CapturableDecode, select_backend
from sloserve.layers.grammar import GrammarMasks, PendingMask
from sloserve.layers.linear import PackedLinears, cpu_gemm_reason
from sloserve.layers.logprobs import gather_logprobs
from sloserve.layers.penalties import process_logits
from sloserve.layers.sampler import Sampler
from sloserve.logprobs import Logprob, StepLogprobs
from sloserve.memory.pool import DevicePool
from sloserve.models.decoder import DecoderModel
from sloserve.models.loader import load_checkpoint, resolve_model_path
from sloserve.models.shard import Shard
from sloserve.models.weights import ModelWeights
from sloserve.sampling_params import SamplingParams
from sloserve.sched.output import ScheduledSequence, SchedulerOutput
from sloserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# A CPU step whose matmuls do fewer multiply-adds than this (tokens x parameters) runs on one
# thread: in each of its ~10 parallel ops per layer, waking OpenMP workers costs more than the
# split saves. Under a flood of small requests it matters most: with the CLI's bounded spin
# (GOMP_SPINCOUNT=10000, sloserve/openmp.py), tests/reliability/test_overload.py completed 8,835 and 8,576
# requests in 15 s with this rule against 3,198 and 2,741 without. With that spin, mixed steps of
# 4-12 decodes and a 32-token chunk ran 10-40% faster on two threads in process, but finer rules
# tried since (attention counted, a lower threshold, a per-size measured choice) gained nothing
# served and cost the flood (benchmarks/README.md, stop 32). Measured on 2 cores, OMP_WAIT_POLICY=PASSIVE,
# 800-token contexts: a 3M-parameter Llama's decode step of 4 sequences took
# 2.4 ms on one thread against 3.9 ms on two (equal at 1 and 16 sequences); a 40M one's of 1 and 4
# sequences 11.3 / 19.9 ms against 11.5 / 22.9 ms. Decode steps through the fused kernel
# (executor/fused.py) run on every thread whatever their size: its barriers spin, not sleep.
SERIAL_STEP_MACS = 1 << 28

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _dense_linear(choice: str, weights: ModelWeights, device: torch.device,
                  dtype: torch.dtype) -> PackedLinears | None:
    """The dense projections' oneDNN-packed weights (layers/linear.py), None for torch's F.linear."""
    why_not = cpu_gemm_reason(choice, device, dtype)
    if why_not:
        if choice == "onednn":
            raise ValueError(f"--cpu-gemm onednn cannot run here: {why_not}; use --cpu-gemm auto or blas")
        log.debug("dense projections on F.linear: %s", why_not)
        return None
    started = time.monotonic()
    packed = PackedLinears(w for layer in weights.layers
                           for w in (layer.qkv_w, layer.o_w, layer.gate_up_w, layer.down_w) if w is not None)
    log.info("dense projections on oneDNN: %d weights packed (%.1f MiB held twice) in %.2fs", len(packed),
             packed.nbytes() / 2**20, time.monotonic() - started)
    return packed


def _decodes(seq: ScheduledSequence) -> bool:
    """Does the sequence decode (one token, sampled)?"""
    return len(seq.token_ids) == 1 and seq.sample


def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda when available, else cpu; a CUDA device that is absent -> ValueError."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was requested but CUDA is not available; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' -> float32 on a CPU (bf16 matmuls are ~100x slower there), bfloat16 on a GPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


class ModelRunner:
    """Executes one SchedulerOutput per call: swaps, one batched forward, sampling (or a run of
    decode steps, each a forward and a sampling)."""

    runs_steps = True  # execute() takes runs of decode steps (out.num_steps > 1)

    def __init__(self, config: SloserveConfig, shard: Shard = Shard(),
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Load and carve. A tensor-parallel rank passes its `shard` and the all-reduce that completes
        its partial sums (sloserve.parallel builds both); the default is the whole model."""
        mc = config.model
        started = time.monotonic()
        self.device = resolve_device(mc.device)
        self.dtype = resolve_dtype(mc.dtype, self.device)
        if self.device.type == "cpu" and mc.host_malloc == "keep":
            keep_freed_memory()
        self.model_path = resolve_model_path(mc.path)
        # NOTE: routed experts stay on the host until the residency is decided, which needs the device
        # budget left after the dense weights (executor/residency.py); the ExpertStore then places them.
        self.spec, weights = load_checkpoint(self.model_path, self.device, self.dtype, experts_on_host=True,
                                             shard=shard)
        self.shard = shard
        spec = self.spec
        self.tokenizer = Tokenizer.from_pretrained(self.model_path)
        limit = spec.context_limit
        if mc.max_model_len is not None and mc.max_model_len > limit:
            raise ValueError(f"max_model_len {mc.max_model_len} exceeds what {spec.architecture} at "
                             f"{self.model_path} supports ({limit}); lower it")
        self.max_model_len = mc.max_model_len or limit
        # The backend decides the page size when the config sets none (flash-attn needs 256): choose it
        # before the pool is planned, and let everything below (pool, inputs, scheduler) read
        # self.block_size, never config.cache.block_size.
        choice = select_backend(mc.attention_backend, self.device, dtype=self.dtype,
                                block_size=config.cache.block_size, head_dim=spec.head_dim)
        log.info("attention backend: %s (%s)", choice.name, choice.reason)
        self.backend = choice.backend
        self.block_size = choice.block_size
        self.eos_token_ids = list(spec.eos_token_ids) or (
            [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else [])
        self._eos = frozenset(self.eos_token_ids)
        plan = plan_memory(config, spec, self.max_model_len, self.device, self.dtype, self.block_size)
        self.page_bytes = plan.page_bytes
        # NOTE: KV first, at offset 0; the small carves follow it, so arena alignment wastes little.
        self.pool = DevicePool(plan.pool_bytes, plan.arena_bytes, self.device)
        kv_shape = (spec.num_layers, 2, plan.num_pages, self.block_size, spec.num_kv_heads, spec.head_dim)
        self.kv = self.pool.carve("kv", kv_shape, self.dtype)
        self.num_kv_blocks = plan.num_pages
        layers, kv, _, *page = self.kv.shape  # one block: every dim but the pages one, K and V
        self.kv_block_bytes = layers * kv * math.prod(page) * self.kv.element_size()
        self._num_params = weights.num_parameters()
        # CPU, whole model: small steps run on one thread (see SERIAL_STEP_MACS); 0: never switch.
        self._cpu_threads = torch.get_num_threads() if self.device.type == "cpu" and shard.size == 1 else 0
        self._threads_now = self._cpu_threads
        self.experts = None
        self.prefetcher = None
        self.residency = plan.residency
        if spec.moe_layers:
            from sloserve.executor.experts import ExpertPrefetcher
            from sloserve.layers.moe import ExpertStore

            automatic = config.cache.expert_slots_per_layer is None and config.cache.expert_memory_bytes is None
            (log.warning if plan.residency.partial and automatic else log.info)("experts: %s", plan.residency.reason)
            # The pool backs the slots and the per-layer workspace (reused by every MoE layer of a
            # step); all-resident experts are moved to the device as tensors of their own.
            self.experts = ExpertStore(weights.experts, device=self.device, dtype=self.dtype,
                                       slots_per_layer=plan.expert_slots, pool=self.pool,
                                       workspace_rows=plan.moe_workspace_rows, resident_in_pool=False,
                                       max_seqs=plan.max_seqs)
            weights.experts.clear()  # the store holds its own (resident or host) copies
            self.prefetcher = ExpertPrefetcher(self.experts, config.cache.expert_preload)
        staging = None
        if self.device.type == "cuda":
            staging = DevicePool(plan.workspace_bytes, None, "cpu", pin_memory=True)
        self.inputs = InputBuilder(self.pool, staging, plan.max_tokens, plan.max_seqs, plan.max_blocks,
                                   self.block_size, spec.vocab_size, self.max_model_len, plan.num_pages)
        host_pages = plan.num_host_pages
        self.host_pool = None
        self.host_kv = None
        if host_pages > 0:
            self.host_pool = DevicePool(host_pages * self.page_bytes, None, "cpu",
                                        pin_memory=self.device.type == "cuda", zero=False)
            self.host_kv = self.host_pool.carve("swap_kv", (*kv_shape[:2], host_pages, *kv_shape[3:]), self.dtype)
        self.num_host_blocks = host_pages
        self.model = DecoderModel(spec, weights, self.backend, self.experts, self.max_model_len,
                                  self.device, self.dtype, reduce, _dense_linear(mc.cpu_gemm, weights,
                                                                                 self.device, self.dtype))
        self.sampler = Sampler(self.device)
        self.grammar = GrammarMasks(self.tokenizer.to_json(), spec.vocab_size, self.eos_token_ids, self.device,
                                    mc.grammar_cache)
        self.decode_step = self._decode_step(mc.enforce_eager, plan.max_seqs, shard)
        self._logprobs: dict[str, list[Logprob]] = {}  # kept by sample() until take_logprobs
        self._prompt_logprobs: dict[str, list[tuple[int, list[Logprob]]]] = {}
        self.split_mixed_steps = True  # see split_mixed (benchmarks and tests turn it off to compare)
        self.warmup_time_s = 0.0
        self.load_time_s = time.monotonic() - started
        log.info("loaded %s (%s) on %s/%s: %d KV pages of %d tokens, backend %s, %.1fs", self.model_path,
                 spec.architecture, self.device, self.dtype, plan.num_pages, self.block_size, self.backend.name,
                 self.load_time_s)

    def _decode_step(self, enforce_eager: bool | None, max_seqs: int, shard: Shard) -> DecodeStep | GraphDecode | None:
        """The decode-only step's path: on a CPU the in-place kernel (eager, or compiled when asked);
        on a GPU the step captured per batch bucket in CUDA graphs (eager when --enforce-eager).
        None: decode steps take the general path."""
        if self.device.type == "cuda":
            why_not = graph_reason(self.model, isinstance(self.backend, CapturableDecode))
            if why_not:
                log.info("decode steps run the general path: %s", why_not)
                return None
            capture = EagerCapture() if enforce_eager else CudaGraphCapture(self.device)
            return GraphDecode(self.model, self.kv, max_seqs, decode_forward(self.model, self.backend), capture)
        # Decode-only steps of a float32 model on a CPU take the in-place fast path; compiled
        # only when asked (enforce_eager False): eager is the CPU default (see executor/compiled.py).
        why_not = decode_path_reason(self.model, self.kv)
        compiled = enforce_eager is False
        if compiled and shard.size > 1:
            raise ValueError("the compiled decode step (--compile) does not run with tensor parallelism yet: "
                             "drop --compile (or pass --enforce-eager)")
        if compiled and why_not:
            raise ValueError(f"the compiled decode step (--compile) cannot run here: {why_not}; "
                             "drop --compile (or pass --enforce-eager)")
        return None if why_not else DecodeStep(self.model, self.kv, max_seqs, compiled,
                                               threads=max(1, self._cpu_threads))

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    def execute(self, out: SchedulerOutput) -> list[int] | list[list[int]]:
        """Swap blocks, run one forward over every scheduled sequence, sample where asked (a run
        of decode steps: each sequence's list of tokens)."""
        split = self.split_mixed(out) if self.split_mixed_steps else None
        if split is not None:
            chunks, decodes = split
            from_chunks, from_decodes = iter(self._execute(chunks)), iter(self._execute(decodes))
            return [next(from_decodes) if _decodes(s) else next(from_chunks) for s in out.sequences if s.sample]
        return self._execute(out)

    def split_mixed(self, out: SchedulerOutput) -> tuple[SchedulerOutput, SchedulerOutput] | None:
        """A mixed step too large for the fused kernel's rows, whose decodes alone it takes, as two
        passes: (its prefill chunks, with the step's swaps and drops; its decodes). None: one pass.

        On the flat path a step's decodes cost far more than in the kernel (a step under
        SERIAL_STEP_MACS runs on one thread): at 700 tokens of context, 48 decodes beside a
        32-token chunk took 43.1 ms in one flat pass and 25.2 ms as two
        (benchmarks/split_mixed.py, results/split_mixed.json). Chunks go first: the swaps land before anything reads, and a decode sees
        whatever a chunk writes, as in one pass; a decode writes only into its own last block,
        which is never shared, so no chunk reads it. Each sequence computes what one pass gives.
        """
        fused = self.decode_step.fused if self.decode_step is not None else None
        if fused is None or out.num_steps > 1 or out.num_tokens <= fused.max_batch:
            return None
        decodes = [s for s in out.sequences if _decodes(s)]
        if not decodes or len(decodes) == len(out.sequences) or len(decodes) > fused.max_batch:
            return None
        chunks = [s for s in out.sequences if not _decodes(s)]
        return dataclasses.replace(out, sequences=chunks), SchedulerOutput(sequences=decodes)

    def _execute(self, out: SchedulerOutput) -> list[int] | list[list[int]]:
        step = self.prepare(out)
        if step is None:
            return []
        if out.num_steps > 1:
            return self._run_steps(out, step)
        return self._step(out, step)

    def _step(self, out: SchedulerOutput, step: StepInputs | DecodeInputs | TokenRows) -> list[int]:
        masks = None
        sampled = self._sampled(out, step)
        if any(s.sampling.grammar is not None for s in sampled):  # filled beside the forward
            # NOTE: every rank masks: in a run of steps each rank feeds its own sampled tokens to the next step
            masks = self.grammar.begin([s.sampling for s in sampled], [s.req_id for s in sampled])
        if self.prefetcher is None:
            return self.sample(out, step, self.forward(step), masks)
        sampled_ids = [s.req_id for s in sampled]
        if isinstance(step, StepInputs | TokenRows):
            rows = step.sample_idx[:len(step.sampled)]
        else:  # a decode step samples every row, in order, unpadded (MoE steps are never padded)
            rows = torch.arange(step.num_seqs, device=self.device)
        self.prefetcher.begin([s.req_id for s in out.sequences], sampled_ids, rows)
        try:
            return self.sample(out, step, self.forward(step), masks)
        finally:
            self.prefetcher.end(sampled_ids)

    def _run_steps(self, out: SchedulerOutput, step: StepInputs | DecodeInputs | TokenRows) -> list[list[int]]:
        """out.num_steps decode steps back to back, each step's tokens the next one's inputs (the
        decode fast path advances its buffers in place; another step is rebuilt); stops early once
        every sequence has sampled a stop token (what follows one is never used)."""
        if any(len(s.token_ids) != 1 or not s.sample for s in out.sequences):
            raise ValueError("a run of decode steps needs every sequence to decode one token: the "
                             "scheduler must not ask for it here")
        runs: list[list[int]] = [[] for _ in out.sequences]
        stopped = [False] * len(runs)
        tokens: list[int] = []  # the last step's, fed to the next
        for i in range(out.num_steps):
            if i and isinstance(step, DecodeInputs):
                self.inputs.advance_decode(step, tokens)
            elif i:
                out = SchedulerOutput(sequences=[
                    dataclasses.replace(s, token_ids=[t], start_pos=s.start_pos + 1, kv_present=0,
                                        num_generated=s.num_generated + 1)
                    for s, t in zip(out.sequences, tokens, strict=True)])
                step = self.inputs.build(out.sequences)
            tokens = self._step(out, step)
            for j, token in enumerate(tokens):
                runs[j].append(token)
                stopped[j] = stopped[j] or out.sequences[j].sampling.stops_on(token, self._eos)
            if all(stopped):
                break
        return runs

    def prepare(self, out: SchedulerOutput) -> StepInputs | DecodeInputs | TokenRows | None:
        """Swaps, dropped requests, and the step's inputs (None: no work): the decode fast path's for a
        decode-only step, the fused kernel's rows for a mixed step of at most its batch in tokens,
        else the flat path's."""
        if out.swap_out or out.swap_in:
            if self.host_kv is None:
                raise ValueError("swap requested but the runner has no host swap pool (swap_bytes is 0)")
            copy_blocks(self.kv, self.host_kv, out.swap_out)
            copy_blocks(self.host_kv, self.kv, out.swap_in)
        if out.finished_req_ids:
            self.sampler.drop(out.finished_req_ids)
            self.grammar.drop(out.finished_req_ids)
            if self.prefetcher is not None:
                self.prefetcher.forget(out.finished_req_ids)
        seqs = out.sequences
        if not seqs:
            return None
        decode = self.decode_step
        if decode is not None and all(len(s.token_ids) == 1 and s.sample for s in seqs):
            return self.inputs.build_decode(seqs, decode.bucket(len(seqs)))
        fused = decode.fused if decode is not None else None
        if fused is not None and sum(len(s.token_ids) for s in seqs) <= fused.max_batch:
            return self.inputs.build_rows(seqs)  # a small mixed step: one row per token, one C call
        return self.inputs.build(seqs)

    def forward(self, step: StepInputs | DecodeInputs | TokenRows) -> torch.Tensor:
        """Logits [S', V] of the step's sampled rows (a decode step: of every row, padding included)."""
        if isinstance(step, DecodeInputs):
            self._fit_threads(step.num_seqs)
            return self.decode_step(step)
        if isinstance(step, TokenRows):
            return self.decode_step.fused.rows(step)
        self._fit_threads(step.input_ids.shape[0])
        return self.model.forward(step.input_ids, step.positions, step.meta, self.kv, step.sample_idx)

    def _fit_threads(self, num_tokens: int) -> None:
        """One CPU thread for a step with less arithmetic than SERIAL_STEP_MACS, else all of them."""
        if self._cpu_threads > 1:
            want = 1 if num_tokens * self._num_params <= SERIAL_STEP_MACS else self._cpu_threads
            if want != self._threads_now:
                torch.set_num_threads(want)
                self._threads_now = want

    def sample(self, out: SchedulerOutput, step: StepInputs | DecodeInputs | TokenRows,
               logits: torch.Tensor, masks: PendingMask | None = None) -> list[int]:
        """One token id per sampled sequence, in the order of out.sequences (grammar rows masked first);
        the logprobs asked for are kept for take_logprobs (from the raw logits, before any processing)."""
        seqs = out.sequences
        if isinstance(step, DecodeInputs):
            rows, logits = seqs, logits[: step.num_seqs]
        else:
            rows = [seqs[i] for i in step.sampled]
            if step.prompt_rows:
                self._keep_prompt_logprobs(seqs, step.prompt_rows, logits[len(rows):])
                logits = logits[: len(rows)]
        params = [s.sampling for s in rows]
        wanted = [i for i, s in enumerate(rows) if s.sampling.logprobs is not None]
        raw = logits.clone() if wanted and masks is not None else logits  # the mask writes in place
        if masks is not None:
            self.grammar.apply(masks, logits)
        # NOTE: attribute reads only: a step where nobody asks pays no call per row
        if any(s.context is not None or s.sampling.logit_bias or s.sampling.min_tokens > s.num_generated
               for s in rows):
            logits = process_logits(logits, params, [s.context for s in rows], [s.num_generated for s in rows],
                                    self._eos)
        tokens = self.sampler.sample(logits, params, [s.req_id for s in rows])
        if masks is not None:
            self.grammar.accept(masks, tokens)
        if wanted:
            picked = raw if len(wanted) == len(rows) else raw[wanted]
            found = gather_logprobs(picked, [tokens[i] for i in wanted], [params[i].logprobs for i in wanted])
            for i, entry in zip(wanted, found, strict=True):
                self._logprobs.setdefault(rows[i].req_id, []).append(entry)
        return tokens

    def _keep_prompt_logprobs(self, seqs: list[ScheduledSequence], prompt_rows: list[tuple[int, range]],
                              logits: torch.Tensor) -> None:
        """Each prompt row's logprob of the prompt token after it, kept as (first position, entries)."""
        targets, tops = [], []
        for i, positions in prompt_rows:
            seq = seqs[i]
            targets += seq.context[positions.start + 1:positions.stop + 1]
            tops += [seq.sampling.prompt_logprobs] * len(positions)
        found = iter(gather_logprobs(logits, targets, tops))
        for i, positions in prompt_rows:
            entries = [next(found) for _ in positions]
            self._prompt_logprobs.setdefault(seqs[i].req_id, []).append((positions.start + 1, entries))

    def take_logprobs(self) -> StepLogprobs:
        """The logprobs kept since the last call: per request, its sampled tokens' in order; and its
        prompt tokens' as (position of the first, entries) runs. Empty when nobody asked."""
        taken = self._logprobs, self._prompt_logprobs
        if taken[0] or taken[1]:
            self._logprobs, self._prompt_logprobs = {}, {}
        return taken

    @staticmethod
    def _sampled(out: SchedulerOutput, step: StepInputs | DecodeInputs | TokenRows) -> list[ScheduledSequence]:
        """The sequences that sample this step, in the order of the logits' rows."""
        if isinstance(step, DecodeInputs):
            return out.sequences
        return [out.sequences[i] for i in step.sampled]

    def warmup(self) -> None:
        """Capture (or compile) the decode step's buckets, then one prefill and one decode step on the
        null page (block 0), so first requests run warm."""
        greedy = SamplingParams(max_tokens=1)
        if self.decode_step is not None:
            null = [ScheduledSequence("warmup", [0], 0, [0], True, greedy)]
            self.warmup_time_s = self.decode_step.warm_up(lambda n: self.inputs.build_decode(null, n))
        prefill = min(self.inputs.max_tokens, 4 * self.block_size, self.max_model_len)
        blocks = [0] * math.ceil(prefill / self.block_size)
        self.execute(SchedulerOutput([ScheduledSequence("warmup", [0] * prefill, 0, blocks, True, greedy)]))
        batch = min(self.inputs.max_seqs, 8)
        seqs = [ScheduledSequence(f"warmup{i}", [0], prefill - 1, blocks, True, greedy) for i in range(batch)]
        self.execute(SchedulerOutput(seqs))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.prefetcher is not None:
            self.prefetcher.reset()

    def time_steps(self, shapes: list[tuple[int, int]], rounds: int = 4) -> list[tuple[int, int, float]]:
        """(sequences, tokens each, seconds) of steps of the given (sequences, tokens each) shapes,
        each capped to what a step holds, on an empty pool.

        Each shape runs `rounds` times; its time is the fastest run after the first (the first
        may allocate or compile; the minimum ignores a busy machine's stalls). Each sequence
        writes pages of its own (as real ones do: many writes to one page serialise), so this
        must run before any request holds a page.
        """
        greedy = SamplingParams(max_tokens=1)
        timings = []
        for seqs, tokens in shapes:
            seqs = min(seqs, self.inputs.max_seqs)
            tokens = min(tokens, self.inputs.max_tokens, self.max_model_len - 1)
            # decode at a short context, as long as every sequence gets pages of its own
            pages = max(1, min(4, (self.num_kv_blocks - 1) // seqs))
            start = 0 if tokens > 1 else min(pages * self.block_size, self.max_model_len) - 1
            n = math.ceil((start + tokens) / self.block_size)
            if seqs * n > self.num_kv_blocks - 1:
                continue  # a pool too small for this shape: it is not timed
            out = SchedulerOutput([
                ScheduledSequence(f"prime{i}", [0] * tokens, start, list(range(1 + i * n, 1 + (i + 1) * n)),
                                  True, greedy)
                for i in range(seqs)])
            times = []
            for _ in range(rounds):
                began = time.perf_counter()
                self.execute(out)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                times.append(time.perf_counter() - began)
            timings.append((seqs, tokens, min(times[1:] or times)))
        if self.prefetcher is not None:
            self.prefetcher.reset()
        return timings

    def probe(self) -> None:
        """One greedy decode token on the null page: raises only when the runner itself is broken."""
        seq = ScheduledSequence("__probe__", [0], 0, [0], True, SamplingParams(max_tokens=1))
        self.execute(SchedulerOutput([seq]))
        if self.prefetcher is not None:
            self.prefetcher.forget([seq.req_id])

    def info(self) -> dict:
        """What is loaded and how memory is laid out."""
        spec = self.spec
        info = {
            "model": str(self.model_path),
            "architecture": spec.architecture,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "attention_backend": self.backend.name,
            "parameters": self._num_params,
            "max_model_len": self.max_model_len,
            "block_size": self.block_size,
            "num_kv_blocks": self.num_kv_blocks,
            "num_host_blocks": self.num_host_blocks,
            "kv_page_bytes": self.page_bytes,
            "kv_block_bytes": self.kv_block_bytes,  # one block, all layers, K and V (InfoResponse)
            "pool": self.pool.report(),
            "load_time_s": round(self.load_time_s, 3),
            "decode_step": _decode_mode(self.decode_step),
            "warmup_time_s": round(self.warmup_time_s, 3),
        }
        info.update(self.expert_info())
        if self.experts is not None:
            info["experts"] = self.experts.stats()
        return info

    def expert_info(self) -> dict:
        """What stays fixed about the experts (InfoResponse): residency, experts, slots, device bytes."""
        store = self.experts
        if store is None:
            return {"expert_residency": "none", "num_experts": 0, "expert_slots_per_layer": 0,
                    "expert_device_bytes": 0}
        return {"expert_residency": "partial" if store.partial else "all", "num_experts": store.num_experts,
                "expert_slots_per_layer": store.slots_per_layer, "expert_device_bytes": store.device_bytes}

    def expert_stats(self) -> dict:
        """The EngineStats expert fields (cheap: host counters only, no device read)."""
        store = self.experts
        if store is None:
            return {}
        c = store.counters.as_dict()
        return {"expert_resident_per_layer": store.resident(), "expert_hits_total": c["hits"],
                "expert_misses_total": c["misses"], "expert_hit_rate": c["hit_rate"],
                "expert_prefetches_total": c["prefetches"], "expert_prefetch_accuracy": c["prefetch_accuracy"],
                "expert_prediction_recall": c["prediction_recall"],
                "expert_bytes_copied_total": c["bytes_copied"] + c["preload_bytes"],
                "expert_bytes_per_step": c["bytes_per_step"], "expert_miss_stall_s_total": c["miss_stall_s"]}


def _decode_mode(step: DecodeStep | GraphDecode | None) -> str:
    """none, compiled, eager (CPU) or the capture of a GPU's bucketed step: cuda-graph or eager."""
    if step is None:
        return "none"
    if isinstance(step, GraphDecode):
        return step.mode
    return "compiled" if step.compiled else "eager"
