"""The decode fast path: persistent, bucket-padded inputs, eager and compiled, against the general path.

Compiling costs tens of seconds on a CPU, so one module fixture compiles one tiny Llama once
(batch buckets 1, 2, 4) and every compiled check reuses it; one more test compiles each other
family: Qwen2 (biases), Mixtral and Qwen2-MoE (their MoE layers run eagerly between compiled
regions, and their batches are not padded), Mixtral also with only some experts resident.
"""

from __future__ import annotations

import pytest
import torch
from sloserve.executor.compiled import batch_buckets
from sloserve.executor.inputs import DecodeInputs
from sloserve.layers.attention import paged
from sloserve.sampling_params import SamplingParams
from sloserve.sched.output import ScheduledSequence, SchedulerOutput

from tests.checkpoints import hf_greedy, load_hf_model
from tests.executor.driver import generate

GREEDY = SamplingParams(max_tokens=8)
PROMPTS = [
    [256],
    [256, 72, 101, 108, 108, 111],
    [256] + list(range(48, 66)),
    [256] + [(i * 37) % 250 for i in range(37)],
]
NEW_TOKENS = 6

pytestmark = pytest.mark.skipif(
    not paged.AVAILABLE, reason="the paged kernel extension is not built"
)


@pytest.fixture(scope="module")
def eager(tiny_llama, make_runner):
    return make_runner(tiny_llama, max_batch=4)


@pytest.fixture(scope="module")
def compiled(tiny_llama, make_runner):
    runner = make_runner(tiny_llama, max_batch=4, enforce_eager=False)
    runner.warmup()
    return runner


def test_buckets_are_powers_of_two_up_to_max_batch():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(48) == [1, 2, 4, 8, 16, 32, 48]


def test_cpu_runners_take_the_fast_path_unless_a_backend_is_named(
    eager, tiny_llama, tiny_mixtral, make_runner
):
    assert eager.info()["decode_step"] == "eager"
    step = eager.prepare(SchedulerOutput([ScheduledSequence("a", [5], 3, [1], True, GREEDY)]))
    assert isinstance(step, DecodeInputs)
    assert make_runner(tiny_mixtral).decode_step is not None
    assert make_runner(tiny_llama, backend="reference").decode_step is None
    with pytest.raises(ValueError, match="compiled decode step"):
        make_runner(tiny_llama, backend="reference", enforce_eager=False)


def test_persistent_block_tables_follow_content_not_just_request_ids(eager):
    """A row keeps its table only while the table is unchanged (a swap-in gives new blocks, same count)."""
    seq = ScheduledSequence("a", [5], 5, [1, 2], True, GREEDY)
    first = eager.inputs.build_decode([seq], 2)
    assert first.block_tables[0, :2].tolist() == [1, 2] and first.slot_mapping.tolist() == [
        2 * 4 + 1,
        0,
    ]
    # padding: null page
    assert first.seq_lens.tolist() == [6, 1] and first.block_tables[1, 0].item() == 0
    seq.block_table = [3, 4]
    again = eager.inputs.build_decode([seq], 1)
    assert again.block_tables[0, :2].tolist() == [3, 4] and again.slot_mapping.tolist() == [
        4 * 4 + 1
    ]
    # general path reuses rows
    eager.inputs.build([ScheduledSequence("b", [1, 2, 3], 0, [7], True, GREEDY)])
    assert eager.inputs.build_decode([seq], 1).block_tables[0, :2].tolist() == [3, 4]


def test_decode_steps_are_refused_with_what_to_change(eager):
    with pytest.raises(ValueError, match="vocabulary"):
        eager.execute(SchedulerOutput([ScheduledSequence("a", [10_000], 3, [1], True, GREEDY)]))
    with pytest.raises(ValueError, match="block table has"):
        eager.execute(SchedulerOutput([ScheduledSequence("a", [5], 9, [1], True, GREEDY)]))
    with pytest.raises(ValueError, match="block ids"):
        eager.execute(
            SchedulerOutput([ScheduledSequence("a", [5], 3, [eager.num_kv_blocks], True, GREEDY)])
        )


def test_compiled_greedy_matches_transformers(compiled, tiny_llama):
    assert compiled.info()["decode_step"] == "compiled"
    expected = hf_greedy(load_hf_model(tiny_llama), PROMPTS, NEW_TOKENS)
    assert generate(compiled, PROMPTS, NEW_TOKENS, chunk=7, stagger=True, seed=1) == expected


def test_compiled_and_eager_give_identical_tokens_batched_and_alone(compiled, eager):
    batched = {
        name: generate(r, PROMPTS, NEW_TOKENS, seed=2)
        for name, r in (("c", compiled), ("e", eager))
    }
    alone = {
        name: [generate(r, [p], NEW_TOKENS, seed=3)[0] for p in PROMPTS]
        for name, r in (("c", compiled), ("e", eager))
    }
    assert batched["c"] == batched["e"] == alone["c"] == alone["e"]


def test_compiled_logits_match_eager_on_padded_buckets(compiled, eager):
    """Three sequences padded to bucket 4: the real rows' logits equal the eager step's."""
    seqs = [
        ScheduledSequence(f"s{i}", [40 + i], 4 + i, [1 + i, 9 + i], True, GREEDY) for i in range(3)
    ]
    step = compiled.prepare(SchedulerOutput(seqs))
    assert step.input_ids.shape[0] == 4 and step.num_seqs == 3
    got = compiled.forward(step)[:3]
    want = eager.forward(eager.prepare(SchedulerOutput(seqs)))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_compiled_qwen2_greedy_matches_transformers(tiny_qwen2, make_runner):
    runner = make_runner(tiny_qwen2, max_batch=4, enforce_eager=False)
    runner.warmup()
    expected = hf_greedy(load_hf_model(tiny_qwen2), PROMPTS, NEW_TOKENS)
    assert generate(runner, PROMPTS, NEW_TOKENS, chunk=7, stagger=True, seed=4) == expected


@pytest.mark.parametrize(
    "family, runner_kw",
    [
        ("tiny_mixtral", {}),
        ("tiny_qwen2_moe", {}),
        ("tiny_mixtral", {"expert_slots_per_layer": 2}),
    ],
    ids=["mixtral", "qwen2_moe", "mixtral-2-slots"],
)
def test_compiled_moe_greedy_matches_transformers_and_eager(
    family, runner_kw, make_runner, request
):
    """Decode steps of MoE models: compiled and eager both equal transformers, batched and staggered."""
    folder = request.getfixturevalue(family)
    compiled = make_runner(folder, max_batch=4, enforce_eager=False, **runner_kw)
    compiled.warmup()
    eager = make_runner(folder, max_batch=4, **runner_kw)
    assert compiled.info()["decode_step"] == "compiled" and eager.info()["decode_step"] == "eager"
    assert compiled.decode_step.bucket(3) == 3  # a padding row would be routed to experts
    expected = hf_greedy(load_hf_model(folder), PROMPTS, NEW_TOKENS)
    assert generate(compiled, PROMPTS, NEW_TOKENS, chunk=7, stagger=True, seed=5) == expected
    assert generate(eager, PROMPTS, NEW_TOKENS, seed=6) == expected
