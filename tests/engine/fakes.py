"""A deterministic toy 'model' over a real paged KV cache, for engine tests without torch.

Each cache slot holds a state int: state(p) = mix(state(p - 1), token(p), p), read back through
the block table. The next token is a function of the last state, so it depends on the whole
history *as stored in the cache*: a wrong block table, a bad prefix hit, a lost swap or a
recompute from the wrong place changes the output (and reading a never-written slot raises).
"""

from __future__ import annotations

import dataclasses

from sloserve.engine.runner import RunnerDefaults
from sloserve.sampling_params import SamplingParams
from sloserve.sched.output import ScheduledSequence, SchedulerOutput, StepResult
from sloserve.spec.verify import accept
from sloserve.testing.tokenizer import ByteTokenizer

EOS = 3


def _mix(state: int, token: int, pos: int) -> int:
    return hash((state, token, pos)) & 0xFFFFFFFF


class FakeRunner(RunnerDefaults):
    """Implements the ModelRunner API (execute, sizes, eos, tokenizer) in pure Python."""

    def __init__(
        self,
        num_blocks: int = 64,
        block_size: int = 4,
        num_host_blocks: int = 16,
        max_model_len: int = 512,
        vocab: tuple[int, int] = (97, 123),
        eos_token_ids: tuple[int, ...] = (EOS,),
    ) -> None:
        self.block_size = block_size
        self.num_kv_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.max_model_len = max_model_len
        self.eos_token_ids = list(eos_token_ids)
        self.tokenizer = ByteTokenizer()
        self.vocab = vocab
        self.eos_every = 0  # >0: emit EOS when state % eos_every == 0
        self.kv: list[int | None] = [None] * (num_blocks * block_size)
        self.host: list[int | None] = [None] * (num_host_blocks * block_size)
        self.fail_when = None  # callable(seq) -> bool: raise for that sequence
        self.steps: list[SchedulerOutput] = []
        self.warmed_up = False
        self.runs_steps = True  # execute() takes runs of decode steps (out.num_steps > 1)

    def info(self) -> dict:
        return {
            "model": "fake",
            "architecture": "FakeForCausalLM",
            "device": "cpu",
            "dtype": "int",
            "attention_backend": "fake",
        }

    def warmup(self) -> None:
        self.warmed_up = True

    def probe(self) -> None:
        """The engine's known-good check: fails only when fail_when fails every sequence."""
        seq = ScheduledSequence("__probe__", [0], 0, [0], True, SamplingParams(max_tokens=1))
        if self.fail_when is not None and self.fail_when(seq):
            raise RuntimeError("injected failure for the probe")

    def _slot(self, table: list[int], pos: int) -> int:
        block = table[pos // self.block_size]
        assert block != 0, "the null block must never be read or written"
        return block * self.block_size + pos % self.block_size

    def next_token(self, state: int) -> int:
        if self.eos_every and state % self.eos_every == 0:
            return self.eos_token_ids[0]
        lo, hi = self.vocab
        return lo + state % (hi - lo)

    def execute(self, out: SchedulerOutput) -> StepResult:
        self.steps.append(out)
        bs = self.block_size
        for dev, host in out.swap_out:
            self.host[host * bs : (host + 1) * bs] = self.kv[dev * bs : (dev + 1) * bs]
        for host, dev in out.swap_in:
            self.kv[dev * bs : (dev + 1) * bs] = self.host[host * bs : (host + 1) * bs]
        if out.num_steps == 1:
            return StepResult(self._compute(out.sequences))
        runs: list[list[int]] = [[] for _ in out.sequences]
        seqs = out.sequences
        for _ in range(out.num_steps):  # each step's tokens are the next one's inputs
            tokens = self._compute(seqs)
            for run, token in zip(runs, tokens, strict=True):
                run += token
            seqs = [
                dataclasses.replace(
                    s,
                    token_ids=t,
                    start_pos=s.start_pos + len(s.token_ids),
                    kv_present=0,
                    num_generated=s.num_generated + 1,
                )
                for s, t in zip(seqs, tokens, strict=True)
            ]
        return StepResult(runs)

    def _compute(self, seqs: list[ScheduledSequence]) -> list[list[int]]:
        sampled = []
        for seq in seqs:
            if self.fail_when is not None and self.fail_when(seq):
                raise RuntimeError(f"injected failure for {seq.req_id}")
            state = 0
            if seq.start_pos > 0:
                state = self.kv[self._slot(seq.block_table, seq.start_pos - 1)]
                if state is None:
                    raise AssertionError(
                        f"{seq.req_id} reads an unwritten slot at {seq.start_pos - 1}"
                    )
            states = []
            for i, token in enumerate(seq.token_ids):
                pos = seq.start_pos + i
                state = _mix(state, token, pos)
                states.append(state)
                slot = self._slot(seq.block_table, pos)
                # a shared block holds it: never written, and it must be right
                if i < seq.kv_present:
                    if self.kv[slot] != state:
                        raise AssertionError(
                            f"{seq.req_id}: position {pos} is marked kv_present but its slot "
                            f"holds {self.kv[slot]}, not {state}"
                        )
                    continue
                self.kv[slot] = state
            if seq.num_drafts:  # greedy verification (sloserve.spec.verify)
                k = seq.num_drafts
                guesses = [self.next_token(x) for x in states[-k - 1 :]]
                sampled.append(accept(seq.token_ids[-k:], guesses[:-1], guesses[-1]))
                continue
            sampled.append([self.next_token(state)] if seq.sample else [])
        return sampled


def reference_tokens(runner: FakeRunner, prompt: list[int], max_tokens: int) -> list[int]:
    """What the toy model generates for `prompt` alone, computed directly (no cache, no scheduler)."""
    state = 0
    for pos, token in enumerate(prompt):
        state = _mix(state, token, pos)
    out = []
    pos = len(prompt)
    for _ in range(max_tokens):
        token = runner.next_token(state)
        out.append(token)
        if token in runner.eos_token_ids:
            break
        state = _mix(state, token, pos)
        pos += 1
    return out
