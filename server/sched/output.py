"""The plain-data contract between the scheduler and the executor (no torch, no Request objects).

One engine step = one SchedulerOutput, answered by one StepResult. For each scheduled sequence
the executor computes ``token_ids`` at positions ``start_pos .. start_pos + len(token_ids) - 1``,
writing their K/V into the slots named by ``block_table`` (slot of position p =
block_table[p // block_size] * block_size + p % block_size), attending causally to everything
before them in the same block table, and, when ``sample`` is set, samples one next token from
the logits of the last position.

Speculative decoding: the last ``num_drafts`` of ``token_ids`` are proposed tokens, not yet the
request's (sloserve.spec). The executor verifies them greedily: it accepts drafts while each equals
the argmax at the position before it, then appends the model's own token there, so the sequence
returns 1 .. num_drafts + 1 tokens. The K/V of rejected drafts is written but never committed:
the scheduler advances past accepted tokens only and returns the slots past them.

The one exception to writing: the first ``kv_present`` tokens already have their K/V in the
block table (a prefix-cache hit on a block other requests share). They are computed for their
logits only, and their K/V is written nowhere (to the null page), so a shared block is never
modified.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sloserve.logprobs import Logprob
from sloserve.sampling_params import SamplingParams


@dataclass(slots=True)
class ScheduledSequence:
    req_id: str
    token_ids: list[int]  # the tokens to compute this step (a prefill chunk, or one decode token)
    start_pos: int  # position of token_ids[0]; equals the request's num_computed_tokens
    block_table: list[int]  # device KV block ids covering positions [0, start_pos + len(token_ids))
    sample: bool  # True when this chunk ends at the last known token: sample the next one
    sampling: SamplingParams
    num_generated: int = 0  # output tokens produced so far (for repetition-free bookkeeping/seeds)
    # leading tokens whose K/V the block table already holds: not written (see above)
    kv_present: int = 0
    # The request's tokens so far (prompt, then num_generated outputs), only when its sampling needs
    # them (penalties, prompt logprobs: SamplingParams.needs_context); else None.
    context: list[int] | None = None
    # trailing tokens of token_ids that are drafts to verify (see above); 0 for every other step
    num_drafts: int = 0

    @property
    def prompt_logprob_rows(self) -> range:
        """Positions of this chunk whose logits score a prompt token (the one after each), when its
        sampling asks for prompt logprobs, from the row before prompt_logprobs_start on; else empty."""
        if self.sampling.prompt_logprobs is None or self.context is None:
            return range(0)
        num_prompt = len(self.context) - self.num_generated
        first = max(self.start_pos, self.sampling.prompt_logprobs_start - 1)
        end = min(self.start_pos + len(self.token_ids), num_prompt - 1)
        return range(first, max(first, end))


@dataclass(slots=True)
class SchedulerOutput:
    sequences: list[ScheduledSequence] = field(default_factory=list)
    # (device block, host block), before forward
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    # (host block, device block), before forward
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)  # executor may drop per-request state
    # Decode steps to run back to back (> 1 only when every sequence decodes one token and samples):
    # step i computes each sequence's token sampled by step i - 1 at start_pos + i. The block
    # tables cover all of them; the executor returns each sequence's run of sampled tokens.
    num_steps: int = 1

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)

    @property
    def num_decodes(self) -> int:
        """Sequences that compute one token (priced as decoding sequences, see sched/slo/step_model.py)."""
        return sum(1 for s in self.sequences if len(s.token_ids) == 1)

    @property
    def is_empty(self) -> bool:
        return not self.sequences and not self.swap_out and not self.swap_in


@dataclass(slots=True)
class StepResult:
    """What the runner returns for one SchedulerOutput, per scheduled sequence in its order.

    `tokens[i]` is what sequence i sampled, all one shape: one token, a run of decode steps (a
    stop may end it early), the accepted drafts then the model's own token (a sequence with
    drafts), or none (a prefill chunk short of the prompt's end). `errors` names
    the sequences whose computation failed (by index): they alone finish with 'error', and a
    sequence that samples but got no token and no error was not computed.
    """

    tokens: list[list[int]] = field(default_factory=list)
    # per request that asked: its sampled tokens' entries, in order
    logprobs: dict[str, list[Logprob]] = field(default_factory=dict)
    # per request that asked: its prompt tokens' as (position of the first, entries) runs (0 has none)
    prompt_logprobs: dict[str, list[tuple[int, list[Logprob]]]] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
