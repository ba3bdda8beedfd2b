"""The fused decode step (one C call per step) against its pure-torch twin and transformers.

Its twin is `DecoderModel.decode`, eager; the kernel must give the twin's logits to float32
rounding at every batch size it takes and at the page-edge lengths the paged kernel is tested
at, the same bits on one thread and two, transformers' greedy tokens through the runner, and a
clear ValueError (with the next step unharmed) for inputs it cannot run.
"""

from __future__ import annotations

import pytest
import torch
from sloserve.executor import fused
from sloserve.executor.inputs import DecodeInputs, StepInputs, TokenRows
from sloserve.executor.precision import bf16_units
from sloserve.layers.linear import OneDnnBf16Linear, PackedBf16Linear, onednn_available
from sloserve.layers.quant import Int8Linear
from sloserve.sampling_params import SamplingParams
from sloserve.sched.output import ScheduledSequence, SchedulerOutput

from tests.checkpoints import hf_greedy, load_hf_model
from tests.executor.driver import generate

pytestmark = pytest.mark.skipif(
    fused.DecodeKernel is None, reason="the fused decode extension is not built"
)

GREEDY = SamplingParams(max_tokens=8)
PROMPTS = [
    [256],
    [256, 72, 101, 108, 108, 111],
    [256] + list(range(48, 66)),
    [256] + [(i * 37) % 250 for i in range(37)],
]
LENGTHS = (1, 3, 4, 5, 8, 9, 33, 40)  # block size 4: inside, at and past page edges


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_qwen2"])
def runner(request, make_runner):
    """A runner of a dense family (Qwen2: q/k/v biases), its KV pool filled with random values."""
    runner = make_runner(
        request.getfixturevalue(request.param), max_batch=8, kv_pool_bytes=4 * 2**20
    )
    torch.manual_seed(0)
    runner.kv.normal_()
    return runner


def _step(runner, lengths: list[int]) -> DecodeInputs:
    """A decode step of one sequence per length, each on pages of its own."""
    seqs, next_page = [], 1
    for i, n in enumerate(lengths):
        pages = -(-n // runner.block_size)
        seqs.append(
            ScheduledSequence(
                f"s{i}",
                [40 + 7 * i],
                n - 1,
                list(range(next_page, next_page + pages)),
                True,
                GREEDY,
            )
        )
        next_page += pages
    return runner.inputs.build_decode(seqs, len(seqs))


def _twin(runner, step: DecodeInputs) -> torch.Tensor:
    with torch.inference_mode():
        return runner.model.decode(
            step.input_ids,
            step.positions,
            step.slot_mapping,
            step.block_tables,
            step.seq_lens,
            runner.kv,
        )


def test_dense_cpu_float32_models_take_the_kernel_and_moe_models_do_not(
    runner, tiny_mixtral, make_runner
):
    assert runner.decode_step.fused is not None
    assert fused.fused_reason(runner.model, runner.kv) is None
    moe = make_runner(tiny_mixtral)
    assert moe.decode_step.fused is None and "MoE" in fused.fused_reason(moe.model, moe.kv)
    too_many = DecodeInputs(
        *(torch.zeros(fused.FUSED_MAX_BATCH + 1, dtype=torch.int64),) * 5, num_seqs=1
    )
    assert not runner.decode_step.fused.takes(too_many)  # larger batches stay on the torch path


def test_batches_past_the_onednn_crossover_go_to_the_torch_path(
    runner, make_checkpoint, make_runner, monkeypatch
):
    """With the projections on oneDNN, a batch of MIN_PACKED_ROWS or more whose sequences x
    parameters exceed FUSED_MAX_MACS_PACKED runs the torch path; on BLAS the kernel takes up to
    FUSED_MAX_BATCH."""
    from sloserve.layers.linear import MIN_PACKED_ROWS, on_onednn

    params = runner.model.weights.num_parameters()
    monkeypatch.setattr(fused, "FUSED_MAX_MACS_PACKED", 20 * params)
    blas = make_runner(make_checkpoint("llama"), cpu_gemm="blas")
    assert fused.FusedDecode(blas.model, blas.kv, 1).max_batch == fused.FUSED_MAX_BATCH
    if not on_onednn(runner.model.weights.layers[0].qkv):
        pytest.skip("this torch build has no oneDNN linear operators")
    assert fused.FusedDecode(runner.model, runner.kv, 1).max_batch == 20
    # small batches always stay on the kernel
    monkeypatch.setattr(fused, "FUSED_MAX_MACS_PACKED", params)
    assert fused.FusedDecode(runner.model, runner.kv, 1).max_batch == MIN_PACKED_ROWS - 1


@pytest.mark.parametrize("batch", [1, 2, 3, 8])
def test_logits_match_the_torch_twin_at_page_edges(runner, batch):
    for first in range(0, len(LENGTHS), batch):
        lengths = [LENGTHS[(first + j) % len(LENGTHS)] for j in range(batch)]
        step = _step(runner, lengths)
        # writes the step's K/V first; the kernel rewrites the same slots
        want = _twin(runner, step)
        got = runner.decode_step.fused(step)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"lengths {lengths}")


@pytest.mark.parametrize("batch", [1, 5])
def test_one_thread_two_and_three_give_the_same_bits(runner, batch):
    """Rows split between threads sum the same way; a team larger than the cores still finishes."""
    step = _step(runner, [33, 9, 4, 40, 1][:batch])
    kernel = runner.decode_step.fused
    before = kernel.threads
    try:
        got = []
        for threads in (1, 2, 3):
            kernel.threads = threads
            got.append(kernel(step))
    finally:
        kernel.threads = before
    assert torch.equal(got[0], got[1]) and torch.equal(got[0], got[2])


def test_a_team_woken_from_sleep_and_resized_gives_the_same_bits(runner):
    """The team's workers spin a while after a step, then sleep (hotpath/_team.h): steps after a
    pause longer than the spin, back-to-back steps and a change of team size all finish with the
    one-thread kernel's bits."""
    import time

    step = _step(runner, [33, 9, 4])
    kernel = runner.decode_step.fused
    before = kernel.threads
    try:
        kernel.threads = 1
        want = kernel(step)
        for threads, pause_s in (
            (2, 0.0),
            (2, 0.0),
            (2, 0.003),
            (2, 0.003),
            (3, 0.0),
            (2, 0.002),
            (1, 0.0),
        ):
            time.sleep(pause_s)
            kernel.threads = threads
            assert torch.equal(kernel(step), want), (
                f"{threads} threads after {pause_s * 1e3:.0f} ms"
            )
    finally:
        kernel.threads = before


class _Counting:
    """The runner's FusedDecode, counting the decode steps and the mixed steps it runs."""

    def __init__(self, inner: fused.FusedDecode) -> None:
        self.inner, self.calls, self.mixed = inner, 0, 0
        self.max_batch = inner.max_batch

    def takes(self, step: DecodeInputs) -> bool:
        return self.inner.takes(step)

    def __call__(self, step: DecodeInputs) -> torch.Tensor:
        self.calls += 1
        return self.inner(step)

    def rows(self, step: TokenRows) -> torch.Tensor:
        self.mixed += 1
        return self.inner.rows(step)


def test_greedy_tokens_equal_transformers_through_the_runner(runner, monkeypatch):
    """Staggered prompts in 7-token chunks: decode-only steps and mixed steps (chunks beside
    decodes) both run through the kernel, and the tokens are transformers' greedy ones."""
    counting = _Counting(runner.decode_step.fused)
    monkeypatch.setattr(runner.decode_step, "fused", counting)
    expected = hf_greedy(load_hf_model(runner.model_path), PROMPTS, 6)
    assert generate(runner, PROMPTS, 6, chunk=7, stagger=True, seed=1) == expected
    assert counting.calls, "no decode step ran through the kernel"
    assert counting.mixed, "no mixed step ran through the kernel"


def _mixed(runner) -> list[ScheduledSequence]:
    """Decodes at page edges, a whole prompt, a sampled last chunk and an unsampled middle chunk,
    each sequence on pages of its own (block size 4)."""
    shapes = [(1, 8, True), (1, 32, True), (6, 0, True), (5, 11, True), (7, 2, False), (1, 3, True)]
    seqs, next_page = [], 1
    for i, (n, start, sample) in enumerate(shapes):
        pages = -(-(start + n) // runner.block_size)
        seqs.append(
            ScheduledSequence(
                f"m{i}",
                [(40 + 7 * i + 3 * j) % 250 for j in range(n)],
                start,
                list(range(next_page, next_page + pages)),
                sample,
                GREEDY,
            )
        )
        next_page += pages
    return seqs


def test_a_mixed_step_as_rows_gives_the_flat_paths_logits_and_kv(runner):
    """Each token a row: the sampled rows' logits and every K/V written equal the flat path's
    (DecoderModel.forward) to float32 rounding, on one thread and two alike."""
    seqs = _mixed(runner)
    flat = runner.inputs.build(seqs)
    with torch.inference_mode():
        want = runner.model.forward(
            flat.input_ids, flat.positions, flat.meta, runner.kv, flat.sample_idx
        )
    slots = flat.meta.slot_mapping.clone()
    by_slot = runner.kv.flatten(2, 3)  # [layers, K/V, slots, KV heads, head dim]
    assert by_slot._is_view() and by_slot.data_ptr() == runner.kv.data_ptr()
    want_kv = by_slot[:, :, slots].clone()
    rows = runner.inputs.build_rows(seqs)
    assert rows.sampled == flat.sampled and torch.equal(rows.sample_idx, flat.sample_idx)
    kernel = runner.decode_step.fused
    before = kernel.threads
    try:
        for threads in (1, 2):
            kernel.threads = threads
            by_slot[:, :, slots] = 0
            got = kernel.rows(rows)
            got_kv = by_slot[:, :, slots]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{threads} threads")
            torch.testing.assert_close(
                got_kv, want_kv, rtol=1e-5, atol=1e-5, msg=f"{threads} threads"
            )
    finally:
        kernel.threads = before


def test_the_runner_sends_small_mixed_steps_to_the_kernel_and_larger_ones_to_the_flat_path(
    runner, monkeypatch
):
    seqs = _mixed(runner)
    assert isinstance(runner.prepare(SchedulerOutput(seqs)), TokenRows)
    monkeypatch.setattr(
        runner.decode_step.fused, "max_batch", sum(len(s.token_ids) for s in seqs) - 1
    )
    assert isinstance(runner.prepare(SchedulerOutput(seqs)), StepInputs)


def test_a_step_that_samples_nothing_writes_kv_and_returns_no_logits(runner):
    seqs = [_mixed(runner)[4]]  # one unsampled middle chunk
    rows = runner.inputs.build_rows(seqs)
    logits = runner.decode_step.fused.rows(rows)
    assert logits.shape == (0, runner.vocab_size)


def test_logit_rows_outside_the_step_are_refused(runner):
    rows = runner.inputs.build_rows(_mixed(runner))
    kernel = runner.decode_step.fused
    bad = torch.tensor([0, rows.input_ids.shape[0]], dtype=torch.int64)
    logits = torch.empty((2, runner.vocab_size))
    with pytest.raises(ValueError, match="logit row"):
        kernel.kernel(
            rows.input_ids.data_ptr(),
            rows.positions.data_ptr(),
            rows.slot_mapping.data_ptr(),
            rows.block_tables.data_ptr(),
            rows.block_tables.shape[1],
            rows.seq_lens.data_ptr(),
            rows.input_ids.shape[0],
            logits.data_ptr(),
            1,
            bad.data_ptr(),
            2,
        )


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("input_ids", 10_000, "token id"),
        ("slot_mapping", 1 << 40, "KV slot"),
        ("seq_lens", 0, "length"),
        ("block_tables", 1 << 30, "outside"),
    ],
)
def test_inputs_it_cannot_run_are_refused_and_the_next_step_is_unharmed(
    runner, field, value, message
):
    good = _step(runner, [9, 5])
    want = runner.decode_step.fused(good).clone()
    bad = _step(runner, [9, 5])
    cell = getattr(bad, field).view(-1)
    kept = cell[0].item()
    cell[0] = value
    with pytest.raises(ValueError, match=message):
        runner.decode_step.fused(bad)
    cell[0] = kept  # the persistent batch keeps an unchanged block table: put the real one back
    torch.testing.assert_close(
        runner.decode_step.fused(_step(runner, [9, 5])), want, rtol=0, atol=0
    )


def test_a_mixed_step_past_the_rows_runs_its_decodes_in_the_kernel_and_its_chunks_apart(
    runner, monkeypatch
):
    """Past the kernel's rows, a mixed step whose decodes fit it runs two passes (chunks with the
    swaps first, then the decodes); steps it cannot help stay one pass."""
    seqs = _mixed(runner)  # 3 decodes, chunks of 6, 5 and 7 tokens: 21 rows
    assert runner.split_mixed(SchedulerOutput(seqs)) is None  # the rows take it whole
    monkeypatch.setattr(runner.decode_step.fused, "max_batch", 10)
    out = SchedulerOutput(seqs, swap_in=[(0, 5)], finished_req_ids=["gone"])
    chunks, decodes = runner.split_mixed(out)
    assert [s.req_id for s in decodes.sequences] == ["m0", "m1", "m5"]
    assert [s.req_id for s in chunks.sequences] == ["m2", "m3", "m4"]
    assert (chunks.swap_in, chunks.finished_req_ids) == ([(0, 5)], ["gone"])
    assert not decodes.swap_in and not decodes.finished_req_ids
    # no decodes
    assert runner.split_mixed(SchedulerOutput([s for s in seqs if len(s.token_ids) > 1])) is None
    monkeypatch.setattr(runner.decode_step.fused, "max_batch", 2)
    assert runner.split_mixed(SchedulerOutput(seqs)) is None  # 3 decodes: too many for the kernel


def test_a_split_step_samples_what_one_pass_samples(runner, monkeypatch):
    """The two passes give every sampled sequence the token one flat pass gives it, in step order."""
    seqs = _mixed(runner)
    monkeypatch.setattr(runner.decode_step.fused, "max_batch", 10)
    runner.split_mixed_steps = False
    try:
        want = runner.execute(SchedulerOutput(seqs)).tokens
    finally:
        runner.split_mixed_steps = True
    counting = _Counting(runner.decode_step.fused)
    monkeypatch.setattr(runner.decode_step, "fused", counting)
    assert runner.execute(SchedulerOutput(seqs)).tokens == want
    assert [len(t) for t in want] == [int(s.sample) for s in seqs] and counting.calls == 1


def test_greedy_tokens_equal_transformers_with_split_steps(runner, monkeypatch):
    """Staggered prompts in 7-token chunks with the kernel's rows cut to 3: mixed steps split into
    a chunk pass and a kernel decode pass, and the tokens are transformers' greedy ones."""
    monkeypatch.setattr(runner.decode_step.fused, "max_batch", 3)
    splits = []
    split_mixed = runner.split_mixed
    monkeypatch.setattr(
        runner, "split_mixed", lambda out: splits.append(split_mixed(out)) or splits[-1]
    )
    expected = hf_greedy(load_hf_model(runner.model_path), PROMPTS, 6)
    assert generate(runner, PROMPTS, 6, chunk=7, stagger=True, seed=1) == expected
    assert any(s is not None for s in splits), "no step was split"


def test_each_step_reports_its_team_size_wall_time_and_stalls(runner):
    """The kernel returns its caller's stalls (0 alone); FusedDecode hands them to TeamSize."""
    step = _step(runner, [33, 9, 4])
    kernel = runner.decode_step.fused
    before = kernel.threads
    seen = []
    try:
        for threads in (1, 2):
            kernel.threads = threads
            kernel.team.report = lambda t, wall, stalled: seen.append((t, wall, stalled))
            kernel(step)
    finally:
        kernel.threads = before
    assert [t for t, _, _ in seen] == [1, 2]
    assert seen[0][2] == 0
    assert all(isinstance(s, int) and 0 <= s <= wall for _, wall, s in seen)


# ---- bf16: the same kernel reading bf16 weights and bf16 KV pages --------------------------------
# Two paths: AVX512-BF16 dot products (each product's activation rows rounded to bf16), where the
# CPU has them, and the widened path elsewhere (forced here by bf16_dot_products(False)). The
# widened path's oracle is the float32 kernel on the same (widened) weights, cos/sin and cache:
# the two compute the same float32 arithmetic, and differ only where the bf16 step rounds the K/V
# it writes. Both agree with the bf16 twin (DecoderModel.decode, which rounds every activation to
# bf16) to bf16 rounding, and each gives a row the same bits at any thread count or batch position.
needs_bf16 = pytest.mark.skipif(
    not bf16_units() or not onednn_available(),
    reason="this CPU has no AVX512-BF16 or AMX-BF16 units: --dtype bfloat16 is refused",
)
# Largest |fused - twin| over the twin's largest |logit|: the twin rounds each activation to bf16
# (2^-9 relative) through every layer; measured 0.9-1.3 % on these models.
BF16_TWIN_TOLERANCE = 0.03
# The same against the float32 kernel on the widened weights: only the written K/V differ there
# (rounded to bf16, 2^-9 relative).
BF16_FLOAT32_TOLERANCE = 0.01
# The bf16 products' two paths, by the name tests give them (the dot products where the CPU has them).
BF16_PATHS = ("dot products", "widened")


@pytest.fixture(params=BF16_PATHS)
def bf16_path(request):
    """Runs a test on each path of the bf16 products (skipping the dot products on a CPU without
    AVX512-BF16), restoring the default after it."""
    from sloserve.hotpath._decode_step import bf16_dot_products

    default = bf16_dot_products()
    on = request.param == "dot products"
    if bf16_dot_products(on) != on:
        bf16_dot_products(default)
        pytest.skip("this CPU has no AVX512-BF16 dot products")
    yield request.param
    bf16_dot_products(default)


@pytest.fixture
def widened():
    """The widened bf16 path (float32 arithmetic on the widened weights) for one test."""
    from sloserve.hotpath._decode_step import bf16_dot_products

    default = bf16_dot_products()
    bf16_dot_products(False)
    yield
    bf16_dot_products(default)


@pytest.fixture(autouse=True)
def every_bf16_model_on_the_kernel(monkeypatch):
    """Untied bf16 models on the kernel (the default; "tied" would send them to the packed copies)."""
    monkeypatch.setattr(fused, "BF16_DECODE", True)


# "-odd": an intermediate size of 70, neither a multiple of the dot products' 32 elements (the
# down product's masked last chunk) nor of the 4 rows they take at a time.
@pytest.fixture(scope="module", params=["llama", "qwen2", "llama-tied", "llama-odd"])
def bf16_pair(request, make_checkpoint, make_runner):
    """(bf16 runner, float32 runner) of one bf16 checkpoint; the float32 one holds the bf16 one's
    cos/sin and KV pages widened, so both compute the same float32 arithmetic."""
    if not bf16_units() or not onednn_available():
        pytest.skip("this CPU has no AVX512-BF16 or AMX-BF16 units")
    if not fused.bf16_dot_products():
        pytest.skip("bf16 takes the kernel only where it has AVX512-BF16 dot products")
    arch, variant = request.param.partition("-")[::2]
    overrides = {"tied": {"tie_word_embeddings": True}, "odd": {"intermediate_size": 70}}
    overrides = overrides.get(variant, {})
    folder = make_checkpoint(arch, dtype="bfloat16", **overrides)
    # every bf16 model on the kernel, untied ones too (the default takes only tied ones)
    default, fused.BF16_DECODE = fused.BF16_DECODE, True
    try:
        low = make_runner(folder, dtype="bfloat16", max_batch=8, kv_pool_bytes=4 * 2**20)
    finally:
        fused.BF16_DECODE = default
    high = make_runner(folder, dtype="float32", max_batch=8, kv_pool_bytes=8 * 2**20)
    torch.manual_seed(0)
    low.kv.normal_()
    pages = min(low.kv.shape[2], high.kv.shape[2])
    high.kv[:, :, :pages] = low.kv[:, :, :pages].float()
    high.model.cos.copy_(low.model.cos.float())
    high.model.sin.copy_(low.model.sin.float())
    return low, high


@needs_bf16
def test_bf16_models_take_the_kernel_where_it_has_dot_products(bf16_pair, make_runner, monkeypatch):
    """Where the CPU has AVX512-BF16 dot products a bf16 model decodes on the kernel, reading
    each plain weight once, in place (by default only a model whose LM head is its embedding);
    without them, or with BF16_DECODE off, on oneDNN's packed bf16 copies (measured faster than
    the widened path)."""
    low, _ = bf16_pair
    tied = low.model.weights.tied
    monkeypatch.setattr(fused, "BF16_DECODE", "tied")
    chosen = make_runner(low.model_path, dtype="bfloat16", kv_pool_bytes=4 * 2**20)
    if tied or not fused.bf16_dot_products():
        assert (chosen.decode_step.fused is not None) == fused.bf16_dot_products()
    else:
        assert chosen.decode_step.fused is None
        assert "untied" in fused.fused_reason(chosen.model, chosen.kv)
        w = chosen.model.weights
        assert all(type(p) is PackedBf16Linear for layer in w.layers for p in layer.projections())
    monkeypatch.setattr(fused, "BF16_DECODE", False)
    packed = make_runner(low.model_path, dtype="bfloat16", kv_pool_bytes=4 * 2**20)
    assert packed.decode_step is not None and packed.decode_step.fused is None
    assert "BF16_DECODE" in fused.fused_reason(packed.model, packed.kv)
    monkeypatch.setattr(fused, "BF16_DECODE", True)
    dot_products = fused.bf16_dot_products()
    try:
        fused.bf16_dot_products(False)
        assert "AVX512-BF16" in fused.fused_reason(packed.model, packed.kv)
    finally:
        fused.bf16_dot_products(dot_products)
    if not dot_products:
        pytest.skip("this CPU has no AVX512-BF16 dot products: bf16 decodes on packed copies")
    default = make_runner(low.model_path, dtype="bfloat16", kv_pool_bytes=4 * 2**20)
    assert default.decode_step.fused is not None and default.kv.dtype == torch.bfloat16
    w = default.model.weights
    assert all(type(p) is OneDnnBf16Linear for layer in w.layers for p in layer.projections())
    assert w.nbytes() == w.num_parameters() * 2  # plain bf16, held once: nothing packed beside it
    w = low.model.weights
    assert low.decode_step.fused is not None and low.kv.dtype == torch.bfloat16
    assert all(type(p) is OneDnnBf16Linear for layer in w.layers for p in layer.projections())
    assert w.nbytes() == w.num_parameters() * 2  # plain bf16, held once: nothing packed beside it


@needs_bf16
def test_bf16_batches_past_their_crossover_go_to_the_torch_path(bf16_pair, monkeypatch):
    """A bf16 batch whose sequences x parameters exceed FUSED_MAX_MACS_BF16 runs the torch path
    (oneDNN's bf16 products), below MIN_PACKED_ROWS too; one sequence always takes the kernel."""
    low, _ = bf16_pair
    params = low.model.weights.num_parameters()
    assert fused.FusedDecode(low.model, low.kv, 1).max_batch == min(
        fused.FUSED_MAX_BATCH, fused.FUSED_MAX_MACS_BF16 // params
    )
    monkeypatch.setattr(fused, "FUSED_MAX_MACS_BF16", 3 * params)
    assert fused.FusedDecode(low.model, low.kv, 1).max_batch == 3
    monkeypatch.setattr(fused, "FUSED_MAX_MACS_BF16", params // 2)
    assert fused.FusedDecode(low.model, low.kv, 1).max_batch == 1


@needs_bf16
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_bf16_logits_are_the_float32_kernels_on_the_same_weights(bf16_pair, batch, widened):
    """The widened bf16 step is the float32 step on the widened weights but for the K/V it rounds; the
    first layer's K/V, written before any attention, are the float32 step's rounded exactly as
    torch's `.to(torch.bfloat16)` rounds."""
    low, high = bf16_pair
    for first in range(0, len(LENGTHS), batch):
        lengths = [LENGTHS[(first + j) % len(LENGTHS)] for j in range(batch)]
        got = low.decode_step.fused(_step(low, lengths))
        want = high.decode_step.fused(_step(high, lengths))
        worst = (got - want).abs().max() / want.abs().max()
        assert worst <= BF16_FLOAT32_TOLERANCE, (lengths, worst.item())
        slots = _step(low, lengths).slot_mapping
        for kv in (0, 1):
            written = low.kv[0, kv].flatten(0, 1)[slots]
            rounded = high.kv[0, kv].flatten(0, 1)[slots].to(torch.bfloat16)
            assert torch.equal(written.view(torch.int16), rounded.view(torch.int16)), lengths


@needs_bf16
@pytest.mark.parametrize("batch", [1, 8])
def test_bf16_logits_agree_with_the_bf16_twin(bf16_pair, batch, bf16_path):
    low, _ = bf16_pair
    for first in range(0, len(LENGTHS), batch):
        lengths = [LENGTHS[(first + j) % len(LENGTHS)] for j in range(batch)]
        step = _step(low, lengths)
        want = _twin(low, step)
        got = low.decode_step.fused(step)
        worst = (got - want).abs().max() / want.abs().max()
        assert worst <= BF16_TWIN_TOLERANCE, (lengths, worst.item())


@needs_bf16
@pytest.mark.parametrize("batch", [1, 8])
def test_bf16_dot_products_agree_with_the_float32_kernel_to_bf16_rounding(bf16_pair, batch):
    """The dot products round each product's activations to bf16 (2^-9 relative), as the twin
    does, so against the float32 step on the widened weights they agree as the twin does."""
    from sloserve.hotpath._decode_step import bf16_dot_products

    if not bf16_dot_products():
        pytest.skip("this CPU has no AVX512-BF16 dot products")
    low, high = bf16_pair
    for first in range(0, len(LENGTHS), batch):
        lengths = [LENGTHS[(first + j) % len(LENGTHS)] for j in range(batch)]
        got = low.decode_step.fused(_step(low, lengths))
        want = high.decode_step.fused(_step(high, lengths))
        worst = (got - want).abs().max() / want.abs().max()
        assert worst <= BF16_TWIN_TOLERANCE, (lengths, worst.item())


@needs_bf16
def test_bf16_one_thread_two_and_three_give_the_same_bits(bf16_pair, bf16_path):
    low, _ = bf16_pair
    step = _step(low, [33, 9, 4, 40, 1])
    kernel = low.decode_step.fused
    before = kernel.threads
    try:
        got = []
        for threads in (1, 2, 3):
            kernel.threads = threads
            got.append(kernel(step))
    finally:
        kernel.threads = before
    assert torch.equal(got[0], got[1]) and torch.equal(got[0], got[2])


@needs_bf16
def test_a_bf16_row_gives_the_same_bits_alone_and_at_any_batch_position(bf16_pair, bf16_path):
    """A sequence's logits do not depend on the rows beside it: alone (batch 1, the one-sequence
    products), first or last of a batch (paired with another sequence, or the odd one out)."""
    low, _ = bf16_pair
    step = _step(low, [33, 9, 4, 40, 1])
    kernel = low.decode_step.fused
    batched = kernel(step)
    order = [4, 2, 0, 3, 1]
    permuted = kernel(_rows(step, order))
    for i in range(5):
        alone = kernel(_rows(step, [i]))
        assert torch.equal(alone[0], batched[i]), i
        assert torch.equal(permuted[order.index(i)], batched[i]), i


def _rows(step: DecodeInputs, order: list[int]) -> DecodeInputs:
    """The step's sequences `order` names, in that order."""
    pick = torch.tensor(order)
    return DecodeInputs(
        step.input_ids[pick],
        step.positions[pick],
        step.slot_mapping[pick],
        step.block_tables[pick].contiguous(),
        step.seq_lens[pick],
        len(order),
    )


@needs_bf16
def test_a_bf16_mixed_step_as_rows_agrees_with_the_flat_path(bf16_pair):
    """Chunks beside decodes, one row per token, in bf16: the sampled logits and the K/V written
    agree with the flat bf16 path (DecoderModel.forward) to bf16 rounding."""
    low, _ = bf16_pair
    seqs = _mixed(low)
    flat = low.inputs.build(seqs)
    with torch.inference_mode():
        want = low.model.forward(flat.input_ids, flat.positions, flat.meta, low.kv, flat.sample_idx)
    slots = flat.meta.slot_mapping.clone()
    by_slot = low.kv.flatten(2, 3)
    want_kv = by_slot[:, :, slots].float()
    by_slot[:, :, slots] = 0
    got = low.decode_step.fused.rows(low.inputs.build_rows(seqs))
    got_kv = by_slot[:, :, slots].float()
    assert (got - want).abs().max() <= BF16_TWIN_TOLERANCE * want.abs().max()
    assert (got_kv - want_kv).abs().max() <= BF16_TWIN_TOLERANCE * want_kv.abs().max()


@needs_bf16
def test_bf16_greedy_tokens_agree_with_float32_at_least_as_the_torch_path_does(
    bf16_pair, monkeypatch, bf16_path
):
    """Teacher-forced on transformers' float32 greedy tokens over the same bf16 weights, the
    kernel's top-1 agrees at least as often as the torch path's (DecoderModel.decode, which
    rounds every activation to bf16, where the kernel keeps them in float32) less one token in
    fifty: a near-tie can go either way."""
    low, _ = bf16_pair
    reference = hf_greedy(load_hf_model(low.model_path), PROMPTS, 12)
    kernel = low.decode_step.fused
    monkeypatch.setattr(low.decode_step, "fused", None)
    torch_path = generate(low, PROMPTS, 12, chunk=7, stagger=True, seed=1, forced=reference)
    counting = _Counting(kernel)
    monkeypatch.setattr(low.decode_step, "fused", counting)
    fused_path = generate(low, PROMPTS, 12, chunk=7, stagger=True, seed=1, forced=reference)
    ours, theirs = _agreement(fused_path, reference), _agreement(torch_path, reference)
    print(
        f"top-1 agreement with float32: bf16 kernel ({bf16_path}) {ours:.3f}, "
        f"bf16 torch path {theirs:.3f}"
    )
    assert counting.calls and counting.mixed
    assert ours >= theirs - 0.02, (ours, theirs)


def _agreement(got: list[list[int]], want: list[list[int]]) -> float:
    pairs = [(a, b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True)]
    return sum(a == b for a, b in pairs) / len(pairs)


# ---- int8: the kernel reading Int8Linear's int8 rows and per-row scales ----------------------------
# Its products are W8A8 at every batch, as Int8Linear's one-row product computes them (activations
# quantized per token, exact integer sums, the float32 rescale), so against the twin
# (DecoderModel.decode on the same Int8Linear objects: W8A8 at 1 row and from 5, weight-only at
# 2-4) it agrees to float32 rounding at batch 1 and 8, up to an activation's int8 rounding
# flipped by those last bits (measured 0 on float32 models, whose LM heads are W8A8 on both sides
# too; 1e-7 of the largest logit while the heads were float32). A bf16 model's
# twin also rounds every activation to bf16 before quantizing it and every product after, and an
# int8 step turns those roundings into whole steps of an activation now and then: within 6 %
# there (measured up to 4.9 % with the embedding int8 too, which the kernel reads in float32 and
# the twin rounds to bf16; 3.9 % before; bf16 weights alone stay within 1.3 %).
INT8_TWIN_TOLERANCE = 1e-3
INT8_BF16_TWIN_TOLERANCE = 0.06


@pytest.fixture(scope="module", params=["llama-float32", "qwen2-float32", "llama-bfloat16"])
def int8_runner(request, make_checkpoint, make_runner):
    arch, dtype = request.param.split("-")
    if dtype == "bfloat16" and not (bf16_units() and fused.bf16_dot_products()):
        pytest.skip("bf16 takes the kernel only where it has AVX512-BF16 dot products")
    # the qwen2 one's LM head is its embedding (as Qwen2.5's small models): one Int8Linear that the
    # kernel reads for the lookup and the head; the llamas' heads are Int8Linears of their own
    tied = arch == "qwen2"
    folder = make_checkpoint(arch, dtype=dtype, intermediate_size=70, tie_word_embeddings=tied)
    runner = make_runner(
        folder, dtype=dtype, quantization="int8", max_batch=8, kv_pool_bytes=4 * 2**20
    )
    weights = runner.model.weights
    assert isinstance(weights.embed, Int8Linear) and isinstance(weights.lm_head, Int8Linear)
    assert (weights.lm_head is weights.embed) == tied
    # the kernel beat the torch int8 path at every batch it takes (docs/design/cpu-decode.md)
    assert runner.decode_step.fused.max_batch == fused.FUSED_MAX_BATCH
    torch.manual_seed(0)
    runner.kv.normal_()
    return runner


@pytest.fixture(params=["vnni", "widened"])
def int8_path(request):
    """Runs a test on VNNI (skipped on a CPU without it) and on the widened int32 loop."""
    from sloserve.hotpath._decode_step import int8_vnni

    default = int8_vnni()
    on = request.param == "vnni"
    if int8_vnni(on) != on:
        int8_vnni(default)
        pytest.skip("this CPU has no AVX512-VNNI")
    yield request.param
    int8_vnni(default)


@pytest.mark.parametrize("batch", [1, 8])
def test_int8_logits_agree_with_the_int8_twin(int8_runner, batch, int8_path):
    for first in range(0, len(LENGTHS), batch):
        lengths = [LENGTHS[(first + j) % len(LENGTHS)] for j in range(batch)]
        step = _step(int8_runner, lengths)
        want = _twin(int8_runner, step)
        got = int8_runner.decode_step.fused(step)
        worst = (got - want).abs().max() / want.abs().max()
        print(f"{int8_runner.dtype} int8 {int8_path} {lengths}: {worst.item():.2e}")
        bf16 = int8_runner.dtype == torch.bfloat16
        assert worst <= (INT8_BF16_TWIN_TOLERANCE if bf16 else INT8_TWIN_TOLERANCE), lengths


def test_int8_vnni_and_the_widened_loop_give_the_same_bits(int8_runner):
    """The integer sums are exact, so the two paths agree bit for bit."""
    from sloserve.hotpath._decode_step import int8_vnni

    if not int8_vnni():
        pytest.skip("this CPU has no AVX512-VNNI")
    step = _step(int8_runner, [33, 9, 4, 40, 1])
    vnni = int8_runner.decode_step.fused(step)
    try:
        int8_vnni(False)
        widened = int8_runner.decode_step.fused(step)
    finally:
        int8_vnni(True)
    assert torch.equal(vnni, widened)


def test_int8_rows_give_the_same_bits_at_any_thread_count_and_batch_position(int8_runner):
    step = _step(int8_runner, [33, 9, 4, 40, 1])
    kernel = int8_runner.decode_step.fused
    before = kernel.threads
    try:
        got = []
        for threads in (1, 2, 3):
            kernel.threads = threads
            got.append(kernel(step))
    finally:
        kernel.threads = before
    assert torch.equal(got[0], got[1]) and torch.equal(got[0], got[2])
    for i in range(5):
        assert torch.equal(kernel(_rows(step, [i]))[0], got[0][i]), i
