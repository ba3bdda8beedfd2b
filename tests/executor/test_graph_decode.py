"""The GPU decode path's bookkeeping on a CPU: batch buckets, padding, in-place buffers, capture.

`GraphDecode` replays one captured step per batch bucket. On a CPU `EagerCapture` stands in for the
CUDA graph: it replays the same callable over the same buffers and refuses a step whose inputs moved,
so the contract a CUDA graph relies on (inputs written in place, padding to the null page) is tested
here, and the tokens must still equal transformers'.
"""

from __future__ import annotations

import functools

import pytest
import torch
from sloserve.executor.graphs import EagerCapture, GraphDecode, graph_buckets, graph_reason
from sloserve.executor.inputs import DecodeInputs
from sloserve.layers.attention import paged
from sloserve.sampling_params import SamplingParams
from sloserve.sched.output import ScheduledSequence, SchedulerOutput

from tests.checkpoints import hf_greedy, load_hf_model
from tests.executor.driver import generate

GREEDY = SamplingParams(max_tokens=8)
PROMPTS = [
    [256, 72, 101, 108, 108, 111],
    [256] + list(range(48, 66)),
    [256] + [(i * 37) % 250 for i in range(37)],
]
NEW_TOKENS = 6


class CountingCapture(EagerCapture):
    """EagerCapture that records each captured step's batch and counts the replays."""

    def __init__(self) -> None:
        self.captured: list[int] = []
        self.replays = 0

    def capture(self, step):
        self.captured.append(step().shape[0])  # an eager run: it writes what the step writes anyway

        def replay():
            self.replays += 1
            return step()

        return replay


def eager_forward(runner):
    """The CPU's decode forward (the in-place paged kernel) in place of a GPU's capture-safe one."""
    return functools.partial(runner.model.decode, attend=paged.write_and_attend)


def graph_runner(make_runner, folder, max_batch=6):
    runner = make_runner(folder, max_batch=max_batch, backend="sdpa")
    capture = CountingCapture()
    runner.decode_step = GraphDecode(
        runner.model, runner.kv, max_batch, eager_forward(runner), capture
    )
    runner.warmup()
    return runner, capture


def test_buckets_grow_by_powers_then_by_half_powers():
    assert graph_buckets(1) == [1]
    assert graph_buckets(8) == [1, 2, 4, 8]
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert graph_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100]
    assert graph_buckets(256)[-4:] == [96, 128, 192, 256]
    with pytest.raises(ValueError, match="max_seqs"):
        graph_buckets(0)


@pytest.mark.skipif(not paged.AVAILABLE, reason="the paged kernel extension is not built")
def test_every_bucket_is_captured_at_warmup_largest_first(tiny_llama, make_runner):
    runner, capture = graph_runner(make_runner, tiny_llama)
    assert capture.captured == [6, 4, 2, 1]
    assert runner.info()["decode_step"] == "eager"


@pytest.mark.skipif(not paged.AVAILABLE, reason="the paged kernel extension is not built")
def test_a_batch_is_padded_to_its_bucket_and_padding_writes_the_null_page(tiny_llama, make_runner):
    runner, _ = graph_runner(make_runner, tiny_llama)
    seqs = [
        ScheduledSequence(f"r{i}", [5 + i], 5 + i, [1 + 2 * i, 2 + 2 * i], True, GREEDY)
        for i in range(3)
    ]
    step = runner.prepare(SchedulerOutput(seqs))
    assert isinstance(step, DecodeInputs) and step.num_seqs == 3 and step.input_ids.shape[0] == 4
    assert step.input_ids.tolist() == [5, 6, 7, 0]
    assert step.positions.tolist()[3] == 0 and step.seq_lens.tolist()[3] == 1
    assert step.slot_mapping.tolist()[3] == 0 and step.block_tables[3, 0].item() == 0
    again = runner.prepare(SchedulerOutput(seqs[:2]))
    assert again.input_ids.data_ptr() == step.input_ids.data_ptr()  # in place: what a graph replays


@pytest.mark.skipif(not paged.AVAILABLE, reason="the paged kernel extension is not built")
def test_replayed_decode_equals_transformers_and_the_eager_path(tiny_llama, make_runner):
    runner, capture = graph_runner(make_runner, tiny_llama)
    before = capture.replays
    got = generate(runner, PROMPTS, NEW_TOKENS, stagger=True)
    assert capture.replays > before  # decode steps went through the replayed step
    assert got == hf_greedy(load_hf_model(tiny_llama), PROMPTS, NEW_TOKENS)
    assert got == generate(
        make_runner(tiny_llama, max_batch=6, backend="sdpa"), PROMPTS, NEW_TOKENS, stagger=True
    )


@pytest.mark.skipif(not paged.AVAILABLE, reason="the paged kernel extension is not built")
def test_a_run_of_decode_steps_replays_in_place(tiny_llama, make_runner):
    """ModelRunner._run_steps advances the same buffers between replays."""
    runner, _ = graph_runner(make_runner, tiny_llama)
    single = make_runner(tiny_llama, max_batch=6, backend="sdpa")
    prompt = PROMPTS[1]
    blocks = list(range(1, 10))
    outs = []
    for r in (runner, single):
        first = r.execute(
            SchedulerOutput([ScheduledSequence("a", prompt, 0, blocks, True, GREEDY)])
        ).tokens[0]
        seq = ScheduledSequence("a", first, len(prompt), blocks, True, GREEDY)
        outs.append(first + r.execute(SchedulerOutput([seq], num_steps=4)).tokens[0])
    assert outs[0] == outs[1]


@pytest.mark.skipif(not paged.AVAILABLE, reason="the paged kernel extension is not built")
def test_inputs_that_moved_are_refused_and_a_bucket_never_captured_is_captured_on_use(
    tiny_llama, make_runner
):
    runner, _ = graph_runner(make_runner, tiny_llama)
    seq = ScheduledSequence("a", [5], 3, [1], True, GREEDY)
    step = runner.prepare(SchedulerOutput([seq]))
    moved = DecodeInputs(
        step.input_ids.clone(),
        step.positions,
        step.slot_mapping,
        step.block_tables,
        step.seq_lens,
        step.num_seqs,
    )
    with pytest.raises(RuntimeError, match="moved"):
        runner.decode_step(moved)
    capture = CountingCapture()
    fresh = GraphDecode(runner.model, runner.kv, 6, eager_forward(runner), capture)
    assert torch.equal(fresh(step), runner.decode_step(step))
    assert capture.captured == [1]
    with pytest.raises(ValueError, match="exceed the largest decode bucket"):
        fresh.bucket(7)


def test_models_that_cannot_be_captured_say_why(tiny_llama, tiny_mixtral, make_runner):
    moe = make_runner(tiny_mixtral, backend="sdpa")
    assert "MoE" in graph_reason(moe.model, True)
    dense = make_runner(tiny_llama, backend="reference")
    assert "capture-safe" in graph_reason(dense.model, False)
    with pytest.raises(ValueError, match="cannot be captured"):
        GraphDecode(moe.model, moe.kv, 4, eager_forward(moe), EagerCapture())


def test_cpu_runners_keep_their_decode_path(tiny_llama, make_runner):
    """Graph capture is the GPU's path; a CPU runner keeps the in-place kernel (or none)."""
    runner = make_runner(tiny_llama, backend="sdpa")
    assert not isinstance(runner.decode_step, GraphDecode)
    assert torch.device("cpu") == runner.device


def test_graph_memory_comes_out_of_the_budget_and_grows_with_the_batch(tiny_llama, make_runner):
    from sloserve.executor.plan import graph_memory_bytes

    spec = make_runner(tiny_llama, backend="sdpa").spec
    small, large = graph_memory_bytes(spec, 8, 2), graph_memory_bytes(spec, 256, 2)
    assert 64 * 2**20 < small < large
