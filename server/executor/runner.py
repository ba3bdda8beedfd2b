"""ModelRunner: built in stages (executor/build.py), turns SchedulerOutputs into tokens."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable

import torch
from sloserve.config import SloserveConfig
from sloserve.executor.build import allocate, build_model, choose_backend, choose_decode_path, load
from sloserve.executor.inputs import DecodeInputs, InputBuilder, StepInputs, TokenRows
from sloserve.executor.kept_logprobs import KeptLogprobs
from sloserve.executor.plan import plan_memory
from sloserve.executor.report import decode_mode, expert_info, expert_stats, weight_bytes
from sloserve.executor.swap import copy_blocks
from sloserve.layers.grammar import GrammarMasks, PendingMask
from sloserve.layers.penalties import process_logits
from sloserve.layers.sampler import Sampler
from sloserve.lora import BaseHead, LoraBatch, LoraRegistry
from sloserve.memory.pool import DevicePool
from sloserve.models.shard import Shard
from sloserve.models.weights import ModelWeights
from sloserve.sampling_params import SamplingParams
from sloserve.sched.output import ScheduledSequence, SchedulerOutput, StepResult
from sloserve.spec.verify import accept

log = logging.getLogger(__name__)

# A CPU step whose matmuls do fewer multiply-adds than this (tokens x parameters) runs on one
# thread: waking OpenMP workers for each of its ~10 parallel ops per layer costs more than the
# split saves, most of all under a flood of small requests (docs/design/cpu-decode.md). Decode
# steps through the fused kernel (executor/fused.py) run on every thread whatever their size:
# its barriers spin, not sleep.
SERIAL_STEP_MACS = 1 << 28


def _by_adapter(seqs: list[ScheduledSequence]) -> list[int] | None:
    """The order that puts each adapter's sequences side by side (base model first, stable), or
    None when no sequence has an adapter or they already are."""
    if all(s.sampling.adapter is None for s in seqs):
        return None
    order = sorted(range(len(seqs)), key=lambda i: seqs[i].sampling.adapter or "")
    first_seen: dict[str | None, int] = {}
    for i in range(len(seqs)):
        first_seen.setdefault(seqs[i].sampling.adapter, i)
    grouped = all(
        seqs[i].sampling.adapter == seqs[i - 1].sampling.adapter
        or first_seen[seqs[i].sampling.adapter] == i
        for i in range(1, len(seqs))
    )
    return None if grouped else order


def _decodes(seq: ScheduledSequence) -> bool:
    """Does the sequence decode (one token, sampled)?"""
    return len(seq.token_ids) == 1 and seq.sample


class ModelRunner:
    """Executes one SchedulerOutput per call: swaps, one batched forward, sampling (or a run of
    decode steps, each a forward and a sampling)."""

    runs_steps = True  # execute() takes runs of decode steps (out.num_steps > 1)

    def __init__(
        self,
        config: SloserveConfig,
        shard: Shard = Shard(),
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """Build in stages (executor/build.py). A tensor-parallel rank passes its `shard` and the
        all-reduce that completes its partial sums (sloserve.parallel builds both); the default is
        the whole model."""
        mc = config.model
        started = time.monotonic()
        loaded = load(config, shard)
        choice = choose_backend(config, loaded)
        plan = plan_memory(
            config,
            loaded.spec,
            loaded.max_model_len,
            loaded.device,
            loaded.dtype,
            choice.block_size,
        )
        cache = allocate(plan, loaded, choice.block_size)
        built = build_model(config, loaded, choice.backend, plan, cache, reduce)
        self.shard, self.model_path, self.spec, self.tokenizer = (
            shard,
            loaded.path,
            loaded.spec,
            loaded.tokenizer,
        )
        self.device, self.dtype, self.max_model_len = (
            loaded.device,
            loaded.dtype,
            loaded.max_model_len,
        )
        self.dtype_reason = loaded.dtype_reason
        self.quantization = loaded.quantization
        self.backend, self.block_size = choice.backend, choice.block_size
        self.eos_token_ids = loaded.eos_token_ids
        self._eos = frozenset(self.eos_token_ids)
        self.pool, self.kv, self.host_pool, self.host_kv = (
            cache.pool,
            cache.kv,
            cache.host_pool,
            cache.host_kv,
        )
        self.num_kv_blocks, self.num_host_blocks = cache.num_pages, cache.num_host_pages
        self.page_bytes, self.kv_block_bytes = cache.page_bytes, cache.block_bytes
        self.model, self.experts, self.prefetcher = built.model, built.experts, built.prefetcher
        self.residency = plan.residency
        self.weight_bytes = weight_bytes(built.model.weights, built.experts)
        self._num_params = loaded.num_parameters
        # CPU, whole model: small steps run on one thread (see SERIAL_STEP_MACS); 0: never switch.
        self._cpu_threads = (
            torch.get_num_threads() if self.device.type == "cpu" and shard.size == 1 else 0
        )
        self._threads_now = self._cpu_threads
        # NOTE: the step's inputs are carved after the expert slots, as the plan sized them
        cuda = self.device.type == "cuda"
        staging = DevicePool(plan.workspace_bytes, None, "cpu", pin_memory=True) if cuda else None
        self.inputs = InputBuilder(
            self.pool,
            staging,
            plan.max_step_tokens,
            plan.max_seqs,
            plan.max_blocks,
            self.block_size,
            self.spec.vocab_size,
            self.max_model_len,
            plan.num_pages,
        )
        self.sampler = Sampler(self.device)
        self.grammar = GrammarMasks(
            self.tokenizer.to_json(),
            self.spec.vocab_size,
            self.eos_token_ids,
            self.device,
            mc.grammar_cache,
        )
        self.decode_step = choose_decode_path(
            self.model,
            self.backend,
            self.kv,
            self.device,
            plan.max_seqs,
            mc.enforce_eager,
            shard,
            max(1, self._cpu_threads),
        )
        self.kept = KeptLogprobs()  # by sample(), until execute() returns them
        self.lora = LoraRegistry(
            self.spec,
            self.dtype,
            self.device,
            config.lora.max_lora_rank,
            config.lora.lora_dir,
            _base_head(self.model.weights),
        )
        self._lora_path_logged = False
        if config.lora.modules and shard.size > 1:
            raise ValueError(
                "--lora-modules with --tensor-parallel-size > 1 is not supported yet: serve "
                "adapters on one rank"
            )
        for name, path in config.lora.modules:
            self.lora.load(name, path, trusted=True)
        # see split_mixed (benchmarks and tests turn it off to compare)
        self.split_mixed_steps = True
        self.warmup_time_s = 0.0
        self.load_time_s = time.monotonic() - started
        log.info(
            "loaded %s (%s) on %s/%s: weights %.1f MiB resident, %d KV pages of %d tokens, "
            "backend %s, %.1fs",
            self.model_path,
            self.spec.architecture,
            self.device,
            self.dtype,
            self.weight_bytes / 2**20,
            plan.num_pages,
            self.block_size,
            self.backend.name,
            self.load_time_s,
        )

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    def execute(self, out: SchedulerOutput) -> StepResult:
        """Swap blocks, run one forward over every scheduled sequence, sample where asked (a run
        of decode steps: each sequence's tokens), with the logprobs kept for those that asked."""
        self.kept.clear()  # NOTE: what a failed step kept: its sequences run again, alone
        order = _by_adapter(out.sequences)
        if order is None:
            return self.kept.result(self._tokens(out))
        # NOTE: one adapter's rows side by side, so each adapter's deltas run on a slice of them
        tokens = self._tokens(dataclasses.replace(out, sequences=[out.sequences[i] for i in order]))
        unsorted: list[list[int]] = [[] for _ in order]
        for position, i in enumerate(order):
            unsorted[i] = tokens[position]
        return self.kept.result(unsorted)

    def _tokens(self, out: SchedulerOutput) -> list[list[int]]:
        """Each sequence's tokens, in one pass or split (see split_mixed)."""
        split = self.split_mixed(out) if self.split_mixed_steps else None
        if split is None:
            return self._execute(out)
        chunks, decodes = split
        from_chunks, from_decodes = iter(self._execute(chunks)), iter(self._execute(decodes))
        return [next(from_decodes) if _decodes(s) else next(from_chunks) for s in out.sequences]

    def split_mixed(self, out: SchedulerOutput) -> tuple[SchedulerOutput, SchedulerOutput] | None:
        """A mixed step too large for the fused kernel's rows, whose decodes alone it takes, as two
        passes: (its prefill chunks, with the step's swaps and drops; its decodes). None: one pass.

        On the flat path a step's decodes cost far more than in the kernel (a step under
        SERIAL_STEP_MACS runs on one thread), so two passes beat one (docs/design/cpu-decode.md;
        benchmarks/split_mixed.py). Chunks go first: the swaps land before anything reads, and a decode sees
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

    def _execute(self, out: SchedulerOutput) -> list[list[int]]:
        """Each sequence's tokens: one where it samples, none where it does not, or a run."""
        step = self.prepare(out)
        if step is None:
            return []
        if out.num_steps > 1:
            return self._run_steps(out, step)
        scored: list[torch.Tensor] = []
        sampled = iter(self._step(out, step, scored))
        runs = [[next(sampled)] if s.sample else [] for s in out.sequences]
        if scored:
            self._verify(out, step, runs, scored[0])
        return runs

    def _verify(
        self,
        out: SchedulerOutput,
        step: StepInputs | TokenRows,
        runs: list[list[int]],
        rows: torch.Tensor,
    ) -> None:
        """Replace each drafting sequence's run (its last row's token) by the tokens its drafts
        yield: greedy verification for a greedy request, rejection sampling for a sampled one
        (`rows`: the draft rows' logits, in step.draft_rows order)."""
        guesses = rows.argmax(dim=-1).tolist()
        at = 0
        for i, k in step.draft_rows:
            seq = out.sequences[i]
            drafts = seq.token_ids[-k:]
            if seq.sampling.greedy:
                runs[i] = accept(drafts, guesses[at : at + k], runs[i][0])
            else:
                runs[i] = self.sampler.verify(
                    rows[at : at + k], seq.sampling, seq.req_id, drafts, runs[i][0]
                )
            at += k

    def _step(
        self,
        out: SchedulerOutput,
        step: StepInputs | DecodeInputs | TokenRows,
        scored: list[torch.Tensor] | None = None,
    ) -> list[int]:
        """One token per sampled sequence; a step that verifies drafts (ScheduledSequence.num_drafts)
        appends its draft rows' logits to `scored`."""
        masks = None
        sampled = self._sampled(out, step)
        if any(s.sampling.grammar is not None for s in sampled):  # filled beside the forward
            # NOTE: every rank masks: in a run of steps each rank feeds its own sampled tokens to the next step
            masks = self.grammar.begin([s.sampling for s in sampled], [s.req_id for s in sampled])
        if self.prefetcher is None:
            return self.sample(out, step, self._scored(step, scored), masks)
        sampled_ids = [s.req_id for s in sampled]
        if isinstance(step, StepInputs | TokenRows):
            rows = step.sample_idx[: len(step.sampled)]
        else:  # a decode step samples every row, in order, unpadded (MoE steps are never padded)
            rows = torch.arange(step.num_seqs, device=self.device)
        self.prefetcher.begin([s.req_id for s in out.sequences], sampled_ids, rows)
        try:
            return self.sample(out, step, self._scored(step, scored), masks)
        finally:
            self.prefetcher.end(sampled_ids)

    def _run_steps(
        self, out: SchedulerOutput, step: StepInputs | DecodeInputs | TokenRows
    ) -> list[list[int]]:
        """out.num_steps decode steps back to back, each step's tokens the next one's inputs (the
        decode fast path advances its buffers in place; another step is rebuilt); stops early once
        every sequence has sampled a stop token (what follows one is never used)."""
        if any(len(s.token_ids) != 1 or not s.sample for s in out.sequences):
            raise ValueError(
                "a run of decode steps needs every sequence to decode one token: the "
                "scheduler must not ask for it here"
            )
        runs: list[list[int]] = [[] for _ in out.sequences]
        stopped = [False] * len(runs)
        tokens: list[int] = []  # the last step's, fed to the next
        for i in range(out.num_steps):
            if i and isinstance(step, DecodeInputs):
                self.inputs.advance_decode(step, tokens)
            elif i:
                out = SchedulerOutput(
                    sequences=[
                        dataclasses.replace(
                            s,
                            token_ids=[t],
                            start_pos=s.start_pos + 1,
                            kv_present=0,
                            num_generated=s.num_generated + 1,
                        )
                        for s, t in zip(out.sequences, tokens, strict=True)
                    ]
                )
                step = self.inputs.build(out.sequences)
            tokens = self._step(out, step)
            for j, token in enumerate(tokens):
                runs[j].append(token)
                stopped[j] = stopped[j] or out.sequences[j].sampling.stops_on(token, self._eos)
            if all(stopped):
                break
        return runs

    def _scored(
        self, step: StepInputs | DecodeInputs | TokenRows, scored: list[torch.Tensor] | None
    ) -> torch.Tensor:
        """The step's logits less its draft rows, which go to `scored` (drafts are only scheduled
        for requests whose logits nothing processes: no penalty, bias, grammar or logprobs)."""
        logits = self.forward(step)
        drafts = 0 if isinstance(step, DecodeInputs) else sum(k for _, k in step.draft_rows)
        if not drafts:
            return logits
        if scored is None:
            raise ValueError("a step with drafts to verify runs alone, not in a run of steps")
        scored.append(logits[-drafts:])
        return logits[:-drafts]

    def prepare(self, out: SchedulerOutput) -> StepInputs | DecodeInputs | TokenRows | None:
        """Swaps, dropped requests, and the step's inputs (None: no work): the decode fast path's for a
        decode-only step, the fused kernel's rows for a mixed step of at most its batch in tokens,
        else the flat path's."""
        if out.swap_out or out.swap_in:
            if self.host_kv is None:
                raise ValueError(
                    "swap requested but the runner has no host swap pool (swap_bytes is 0)"
                )
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
        if any(s.sampling.adapter is not None for s in seqs):
            self._log_lora_path()
            return self.inputs.build(seqs)
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
        lora = None
        if step.adapter_rows:
            lora = LoraBatch([(self.lora.get(name), rows) for name, rows in step.adapter_rows])
        return self.model.forward(
            step.input_ids, step.positions, step.meta, self.kv, step.sample_idx, lora
        )

    def _log_lora_path(self) -> None:
        """Say once why steps with adapters leave the decode fast path."""
        if not self._lora_path_logged:
            self._lora_path_logged = True
            log.info(
                "steps with LoRA adapters run on the batched torch path: the fused C decode step "
                "and the compiled/graph decode step read the base weights only"
            )

    def _fit_threads(self, num_tokens: int) -> None:
        """One CPU thread for a step with less arithmetic than SERIAL_STEP_MACS, else all of them."""
        if self._cpu_threads > 1:
            want = 1 if num_tokens * self._num_params <= SERIAL_STEP_MACS else self._cpu_threads
            if want != self._threads_now:
                torch.set_num_threads(want)
                self._threads_now = want

    def sample(
        self,
        out: SchedulerOutput,
        step: StepInputs | DecodeInputs | TokenRows,
        logits: torch.Tensor,
        masks: PendingMask | None = None,
    ) -> list[int]:
        """One token id per sampled sequence, in the order of out.sequences (grammar rows masked first);
        the logprobs asked for are kept for the step's result (from the raw logits, before any processing)."""
        seqs = out.sequences
        if isinstance(step, DecodeInputs):
            rows, logits = seqs, logits[: step.num_seqs]
        else:
            rows = [seqs[i] for i in step.sampled]
            if step.prompt_rows:
                self.kept.keep_prompt(seqs, step.prompt_rows, logits[len(rows) :])
                logits = logits[: len(rows)]
        params = [s.sampling for s in rows]
        wanted = [i for i, s in enumerate(rows) if s.sampling.logprobs is not None]
        raw = logits.clone() if wanted and masks is not None else logits  # the mask writes in place
        if masks is not None:
            self.grammar.apply(masks, logits)
        # NOTE: attribute reads only: a step where nobody asks pays no call per row
        if any(
            s.context is not None
            or s.sampling.logit_bias
            or s.sampling.min_tokens > s.num_generated
            for s in rows
        ):
            logits = process_logits(
                logits,
                params,
                [s.context for s in rows],
                [s.num_generated for s in rows],
                self._eos,
            )
        tokens = self.sampler.sample(logits, params, [s.req_id for s in rows])
        if masks is not None:
            self.grammar.accept(masks, tokens)
        if wanted:
            picked = raw if len(wanted) == len(rows) else raw[wanted]
            self.kept.keep_sampled(
                [rows[i].req_id for i in wanted],
                picked,
                [tokens[i] for i in wanted],
                [params[i].logprobs for i in wanted],
            )
        return tokens

    @staticmethod
    def _sampled(
        out: SchedulerOutput, step: StepInputs | DecodeInputs | TokenRows
    ) -> list[ScheduledSequence]:
        """The sequences that sample this step, in the order of the logits' rows."""
        if isinstance(step, DecodeInputs):
            return out.sequences
        return [out.sequences[i] for i in step.sampled]

    # ---- steps on itself, and what it reports ---------------------------------------------------
    def warmup(self) -> None:
        """Capture (or compile) the decode step's buckets, then one prefill and one decode step on
        the null page (block 0), so first requests run warm."""
        greedy = SamplingParams(max_tokens=1)
        if self.decode_step is not None:
            null = [ScheduledSequence("warmup", [0], 0, [0], True, greedy)]
            self.warmup_time_s = self.decode_step.warm_up(
                lambda n: self.inputs.build_decode(null, n)
            )
        prefill = min(self.inputs.max_step_tokens, 4 * self.block_size, self.max_model_len)
        blocks = [0] * math.ceil(prefill / self.block_size)
        self.execute(
            SchedulerOutput([ScheduledSequence("warmup", [0] * prefill, 0, blocks, True, greedy)])
        )
        batch = min(self.inputs.max_seqs, 8)
        seqs = [
            ScheduledSequence(f"warmup{i}", [0], prefill - 1, blocks, True, greedy)
            for i in range(batch)
        ]
        self.execute(SchedulerOutput(seqs))
        self._synchronize()
        if self.prefetcher is not None:
            self.prefetcher.reset()

    def time_steps(
        self, shapes: list[tuple[int, int]], rounds: int = 4
    ) -> list[tuple[int, int, float]]:
        """(sequences, tokens each, seconds) of steps of the given (sequences, tokens each) shapes,
        each capped to what a step holds, on an empty pool.

        Each shape runs `rounds` times; its time is the fastest run after the first (the first
        may allocate or compile; the minimum ignores a busy machine's stalls). Each sequence
        writes pages of its own (as real ones do: many writes to one page serialise), so this
        must run before any request holds a page.
        """
        greedy = SamplingParams(max_tokens=1)
        block, max_len, num_blocks = self.block_size, self.max_model_len, self.num_kv_blocks
        timings = []
        for seqs, tokens in shapes:
            seqs = min(seqs, self.inputs.max_seqs)
            tokens = min(tokens, self.inputs.max_step_tokens, max_len - 1)
            # decode at a short context, as long as every sequence gets pages of its own
            pages = max(1, min(4, (num_blocks - 1) // seqs))
            start = 0 if tokens > 1 else min(pages * block, max_len) - 1
            n = math.ceil((start + tokens) / block)
            if seqs * n > num_blocks - 1:
                continue  # a pool too small for this shape: it is not timed
            out = SchedulerOutput(
                [
                    ScheduledSequence(
                        f"prime{i}",
                        [0] * tokens,
                        start,
                        list(range(1 + i * n, 1 + (i + 1) * n)),
                        True,
                        greedy,
                    )
                    for i in range(seqs)
                ]
            )
            times = []
            for _ in range(rounds):
                began = time.perf_counter()
                self.execute(out)
                self._synchronize()
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

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def check_health(self) -> None:
        """Nothing to check: an in-process runner fails in the call that breaks it."""

    def close(self) -> None:
        """Nothing held outside this process."""

    @property
    def num_parameters(self) -> int:
        return self._num_params

    def info(self) -> dict:
        """What is loaded and how memory is laid out."""
        info = {
            "model": str(self.model_path),
            "architecture": self.spec.architecture,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "dtype_reason": self.dtype_reason,
            "quantization": self.quantization,
            "attention_backend": self.backend.name,
            "parameters": self.num_parameters,
            "weight_resident_bytes": self.weight_bytes,
            "max_model_len": self.max_model_len,
            "block_size": self.block_size,
            "num_kv_blocks": self.num_kv_blocks,
            "num_host_blocks": self.num_host_blocks,
            "kv_page_bytes": self.page_bytes,
            "kv_cache_dtype": str(self.kv.dtype).removeprefix("torch."),
            # the pool's tokens, the null page left out
            "kv_tokens": (self.num_kv_blocks - 1) * self.block_size,
            "kv_block_bytes": self.kv_block_bytes,  # one block, all layers, K and V (InfoResponse)
            "pool": self.pool.report(),
            "load_time_s": round(self.load_time_s, 3),
            "decode_step": decode_mode(self.decode_step),
            "warmup_time_s": round(self.warmup_time_s, 3),
        }
        info.update(expert_info(self.experts))
        if self.experts is not None:
            info["experts"] = self.experts.stats()
        return info

    def expert_info(self) -> dict:
        """What stays fixed about the experts (InfoResponse): residency, experts, slots, device bytes."""
        return expert_info(self.experts)

    def expert_stats(self) -> dict:
        """The EngineStats expert fields (cheap: host counters only, no device read); {} for a dense model."""
        return expert_stats(self.experts)


def _base_head(w: ModelWeights) -> BaseHead:
    """The base model's embedding and LM head as adapters on them are checked against (their
    plain matrices; None where the model holds only an int8 or packed form)."""
    embed = w.embed if isinstance(w.embed, torch.Tensor) else None
    head = w.lm_head if isinstance(w.lm_head, torch.Tensor) else w.lm_head.weight
    return BaseHead(w.tied, embed, head)
