"""int4 (W4A16) projections in the fused decode step: the kernel reads Int4Linear's packed weight
and scales in place, and its logits match the torch int4 path (`DecoderModel.decode`, torch's
`_weight_int4pack_mm_for_cpu`) within a stated tolerance, on AVX-512 and on the scalar loop, the
same bits on one thread and two; greedy tokens through the runner, with the kernel taking the
decode steps, equal compressed-tensors' fake-quantized model. Shapes it cannot split keep the
torch path and say why."""

from __future__ import annotations

import random

import pytest
import torch
from sloserve.executor import fused
from sloserve.layers.int4 import Int4Linear
from sloserve.sampling_params import SamplingParams
from sloserve.sched.output import ScheduledSequence

from tests.checkpoints import hf_greedy
from tests.executor.driver import generate
from tests.executor.test_fused_decode import _Counting
from tests.quant.checkpoints import Scheme, fake_quantized_model, quantized_checkpoint

pytest.importorskip("compressed_tensors")
pytestmark = pytest.mark.skipif(
    fused.DecodeKernel is None, reason="the fused decode extension is not built"
)
_step = pytest.importorskip("sloserve.hotpath._decode_step")
bf16_dot_products, int4_avx512 = _step.bf16_dot_products, _step.int4_avx512

_RNG = random.Random(1)
PROMPTS = [[256] + [_RNG.randrange(256) for _ in range(_RNG.randrange(1, 60))] for _ in range(6)]
NEW_TOKENS = 24
GREEDY = SamplingParams(max_tokens=8)
LENGTHS = (1, 3, 4, 5, 8, 9, 33, 40)

# scheme, and the tiny model's shape where the defaults (hidden 64) cannot hold its groups
CASES = {
    "g32-asym": (Scheme(4, 32, False), {}),
    "g64-sym": (Scheme(4, 64, True), {}),
    "g128-asym": (Scheme(4, 128, False), {"hidden_size": 128, "intermediate_size": 256}),
    "channel-asym": (Scheme(4, None, False), {}),
}
# NOTE: the kernel keeps activations in float32 and sums each group's products in float32 in
# input order; torch's int4 kernel sums in its own order (float32 at --dtype float32), so the two
# agree to float32 rounding there. At bf16 the torch path rounds every activation to bf16 and the
# kernel does not, so they part by bf16 rounding, the tolerance the bf16 step is held to.
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-1)}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, root):
    scheme, shape = CASES[request.param]
    return quantized_checkpoint("llama", root, scheme, **shape)


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def runner(request, case, make_runner):
    """A runner of the int4 checkpoint at `dtype`, its KV pool filled with random values."""
    runner = make_runner(case, dtype=str(request.param).removeprefix("torch."), max_batch=8)
    torch.manual_seed(0)
    runner.kv.normal_()
    return runner


def _step(runner, lengths: list[int]):
    seqs, next_page = [], 1
    for i, n in enumerate(lengths):
        pages = -(-n // runner.block_size)
        pages_of = list(range(next_page, next_page + pages))
        seqs.append(ScheduledSequence(f"s{i}", [40 + 7 * i], n - 1, pages_of, True, GREEDY))
        next_page += pages
    return runner.inputs.build_decode(seqs, len(seqs))


def _twin(runner, step) -> torch.Tensor:
    with torch.inference_mode():
        return runner.model.decode(
            step.input_ids,
            step.positions,
            step.slot_mapping,
            step.block_tables,
            step.seq_lens,
            runner.kv,
        )


def test_int4_models_take_the_kernel(runner):
    assert isinstance(runner.model.weights.layers[0].gate_up, Int4Linear)
    assert fused.fused_reason(runner.model, runner.kv) is None
    assert runner.decode_step.fused is not None


# (AVX-512, AVX512-BF16 dot products): a bf16 model's products on dot products where the CPU has
# them, else (and a float32 model's) on float32 multiply-adds; the scalar loop without AVX-512
PATHS = {"avx512": (True, True), "float32-activations": (True, False), "scalar": (False, True)}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("batch", [1, 3, 5, 8])
def test_logits_match_the_torch_int4_path(runner, batch, path):
    rtol, atol = TOLERANCE[runner.model.dtype]
    was = int4_avx512(), bf16_dot_products()
    try:
        int4_avx512(PATHS[path][0])
        bf16_dot_products(PATHS[path][1])
        for first in range(0, len(LENGTHS), batch):
            lengths = [LENGTHS[(first + j) % len(LENGTHS)] for j in range(batch)]
            step = _step(runner, lengths)
            want = _twin(runner, step).float()
            got = runner.decode_step.fused(step)
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=f"lengths {lengths}")
    finally:
        int4_avx512(was[0])
        bf16_dot_products(was[1])


def test_one_thread_and_two_give_the_same_bits(runner):
    step = _step(runner, [33, 9, 4, 40, 1])
    kernel = runner.decode_step.fused
    before = kernel.threads
    try:
        got = []
        for threads in (1, 2):
            kernel.threads = threads
            got.append(kernel(step))
    finally:
        kernel.threads = before
    assert torch.equal(got[0], got[1])


@pytest.mark.parametrize("name", ["g32-asym", "channel-asym"])
def test_greedy_through_the_kernel_equals_the_fake_quantized_model(
    root, make_runner, monkeypatch, name
):
    scheme, shape = CASES[name]
    folder = quantized_checkpoint("llama", root, scheme, **shape)
    runner = make_runner(folder, dtype="float32")
    counting = _Counting(runner.decode_step.fused)
    monkeypatch.setattr(runner.decode_step, "fused", counting)
    want = hf_greedy(fake_quantized_model(folder, "llama", root, **shape), PROMPTS, NEW_TOKENS)
    assert generate(runner, PROMPTS, NEW_TOKENS) == want
    assert counting.calls, "no decode step ran through the kernel"


def test_rows_the_kernel_cannot_split_keep_the_torch_path_and_say_why(root, make_runner):
    # hidden 96: the o and down projections' 96 rows are not whole blocks of 64
    shape = {"hidden_size": 96, "intermediate_size": 128}
    folder = quantized_checkpoint("llama", root, Scheme(4, 32, False), **shape)
    runner = make_runner(folder, dtype="float32")
    assert runner.decode_step.fused is None
    assert "blocks of 64 rows, not 96" in fused.fused_reason(runner.model, runner.kv)
