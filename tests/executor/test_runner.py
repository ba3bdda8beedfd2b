"""ModelRunner: pool-backed inputs, swap round trips, errors, info, warm-up."""

from __future__ import annotations

import pytest
import torch
from sloserve.sampling_params import SamplingParams
from sloserve.sched.output import ScheduledSequence, SchedulerOutput

from tests.executor.conftest import CPU_AUTO_BACKEND
from tests.executor.driver import generate

GREEDY = SamplingParams(max_tokens=8)
PROMPT = [256, 10, 20, 30, 40, 50, 60, 70, 80, 90]


def _seq(req_id, tokens, start, table, sample=True):
    return ScheduledSequence(req_id, tokens, start, list(table), sample, GREEDY)


@pytest.fixture(scope="module")
def runner(tiny_llama, make_runner):
    return make_runner(tiny_llama)


def test_info_reports_model_and_pool(runner):
    info = runner.info()
    assert (
        info["architecture"] == "LlamaForCausalLM"
        and info["device"] == "cpu"
        and info["dtype"] == "float32"
    )
    assert (
        info["attention_backend"] == CPU_AUTO_BACKEND
        and info["block_size"] == runner.block_size == 4
    )
    # 2 MiB of 4-token pages of 512 B/token
    assert info["num_kv_blocks"] == runner.num_kv_blocks > 256
    assert info["pool"]["carves"]["kv"]["shape"] == [2, 2, runner.num_kv_blocks, 4, 2, 16]
    assert runner.num_host_blocks > 0 and runner.eos_token_ids == [257]
    assert runner.tokenizer.decode(runner.tokenizer.encode("12\n")) == "12\n"


def test_info_reports_the_bytes_of_one_kv_block(runner):
    info = runner.info()
    # 2 layers x (K, V) x 4 tokens x 2 KV heads x head dim 16 x 4 bytes (float32)
    assert info["kv_block_bytes"] == 2 * 2 * 4 * 2 * 16 * 4 == runner.kv[:, :, 1].nbytes
    assert info["kv_block_bytes"] * runner.num_kv_blocks == runner.kv.nbytes
    assert info["kv_block_bytes"] == info["kv_page_bytes"]  # what the memory plan sized the pool by


def test_step_inputs_are_views_into_the_pool(runner):
    step = runner.inputs.build([_seq("a", PROMPT, 0, [1, 2, 3]), _seq("b", [5], 7, [4, 5])])
    base = runner.pool._buffer.untyped_storage().data_ptr()
    for t in (
        step.input_ids,
        step.positions,
        step.meta.slot_mapping,
        step.meta.block_tables,
        step.sample_idx,
    ):
        assert t.untyped_storage().data_ptr() == base
    assert runner.kv.untyped_storage().data_ptr() == base
    assert step.positions.tolist() == list(range(10)) + [7]
    assert step.meta.slot_mapping.tolist()[-1] == 5 * 4 + 3
    assert step.sample_idx.tolist() == [9, 10]


def test_unsampled_chunks_return_no_token(runner):
    out = runner.execute(SchedulerOutput([_seq("a", PROMPT[:4], 0, [1], sample=False)]))
    assert out.tokens == [[]]
    assert runner.execute(SchedulerOutput([])).tokens == []


def test_swap_out_and_back_in_continues_exactly(runner):
    expected = generate(runner, [PROMPT], 6)[0]
    # prefill + 2 decode steps on blocks 7, 8, 9
    table = [7, 8, 9]
    tokens = list(PROMPT)
    tokens += runner.execute(SchedulerOutput([_seq("s", PROMPT, 0, table)])).tokens[0]
    for _ in range(2):
        tokens += runner.execute(
            SchedulerOutput([_seq("s", tokens[-1:], len(tokens) - 1, table)])
        ).tokens[0]
    runner.execute(SchedulerOutput(swap_out=[(7, 0), (8, 1), (9, 2)]))
    runner.kv[:, :, 7:10].fill_(123.0)  # another request reuses the device blocks
    table = [20, 31, 25, 33]  # the swapped blocks, then a fresh one for the tail
    runner.execute(SchedulerOutput(swap_in=[(0, 20), (1, 31), (2, 25)]))
    while len(tokens) < len(PROMPT) + 6:
        tokens += runner.execute(
            SchedulerOutput([_seq("s", tokens[-1:], len(tokens) - 1, table)])
        ).tokens[0]
    assert tokens[len(PROMPT) :] == expected


def test_bad_steps_are_refused_with_what_to_change(runner):
    with pytest.raises(
        ValueError, match=r"token id 999 of request 'b' .* vocabulary of 260 tokens.*\[0, 260\)"
    ):
        runner.execute(
            SchedulerOutput([_seq("a", [5, 6], 0, [1]), _seq("b", [1, 999, 260], 0, [2])])
        )
    with pytest.raises(ValueError, match=r"token id -1 of request 'a' .* vocabulary of 260 tokens"):
        runner.execute(SchedulerOutput([_seq("a", [3, -1], 0, [1])]))
    assert runner.vocab_size == 260
    with pytest.raises(ValueError, match="needs 3 KV blocks"):
        runner.execute(SchedulerOutput([_seq("a", PROMPT, 0, [1, 2])]))
    with pytest.raises(ValueError, match=r"block ids must be in \[0, "):
        runner.execute(SchedulerOutput([_seq("a", [1], 0, [runner.num_kv_blocks])]))
    too_many = [_seq(f"r{i}", [1], 0, [i + 1]) for i in range(9)]
    with pytest.raises(ValueError, match="exceeds the executor's buffers"):
        runner.execute(SchedulerOutput(too_many))


def test_warmup_leaves_results_unchanged(runner):
    before = generate(runner, [PROMPT], 4, seed=1)
    runner.warmup()
    assert generate(runner, [PROMPT], 4, seed=2) == before


def test_pool_too_small_for_one_sequence(tiny_llama, make_runner):
    with pytest.raises(
        ValueError, match=r"fewer than one 1024-token sequence.*raise kv_pool_bytes"
    ):
        make_runner(tiny_llama, kv_pool_bytes=64 * 1024)
    small = make_runner(tiny_llama, kv_pool_bytes=64 * 1024, max_model_len=64)
    assert small.max_model_len == 64


def test_max_model_len_beyond_the_checkpoint(tiny_llama, make_runner):
    with pytest.raises(ValueError, match="exceeds what LlamaForCausalLM"):
        make_runner(tiny_llama, max_model_len=4096)


def test_unknown_or_unavailable_backend(tiny_llama, make_runner):
    from sloserve.layers.attention import BackendUnavailableError

    with pytest.raises(BackendUnavailableError, match="'flash' cannot run"):
        make_runner(tiny_llama, backend="flash")


def test_moe_runner_reports_expert_stats(tiny_mixtral, make_runner):
    runner = make_runner(tiny_mixtral)
    generate(runner, [PROMPT], 2)
    stats = runner.info()["experts"]
    assert stats["num_experts"] == 4 and stats["hits"] > 0 and stats["resident"] == "all"


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_moe_intermediates_come_from_the_pool(make_checkpoint, make_runner, arch, monkeypatch):
    """Every MoE layer of every step (a full prefill batch included) runs in the pool-carved workspace."""
    runner = make_runner(make_checkpoint(arch), max_batched_tokens=32)
    carves = runner.info()["pool"]["carves"]
    rows = 32 * runner.spec.top_k
    assert carves["moe_workspace.rows"]["shape"] == [rows, runner.spec.hidden_size]
    assert carves["moe_workspace.act"]["shape"] == [rows, runner.spec.moe_intermediate_size]
    # resident experts stay where loaded
    assert not any(name.startswith("experts.") for name in carves)
    store, reserved = runner.experts, []
    real = store.reserve_workspace

    def spy(n):
        ws = real(n)
        reserved.append((n, ws is not None))
        return ws

    monkeypatch.setattr(store, "reserve_workspace", spy)
    prompt = [(7 * i) % 250 for i in range(32)]  # 32 tokens: the whole step budget
    runner.execute(SchedulerOutput([_seq("full", prompt, 0, range(1, 9))]))
    generate(runner, [PROMPT, PROMPT[:3]], 2)
    assert reserved and all(ok for _, ok in reserved) and max(n for n, _ in reserved) == rows


def test_partial_expert_residency_matches_full(tiny_mixtral, make_runner, monkeypatch):
    import sloserve.executor.build as build
    from sloserve.config import CacheConfig
    from sloserve.executor import ModelRunner

    from tests.executor.conftest import runner_config

    full = generate(make_runner(tiny_mixtral), [PROMPT, PROMPT[:3]], 5)
    cfg = runner_config(tiny_mixtral)
    cfg.cache = CacheConfig(block_size=4, kv_pool_bytes=2 * 2**20, expert_slots_per_layer=2)
    loads, given = [], []
    real_load, real_store = build.load_checkpoint, build.ExpertStore

    def spy_load(*args, **kw):
        loads.append(kw.get("experts_on_host"))
        return real_load(*args, **kw)

    def spy_store(weights, **kw):
        given.extend(t.device.type for pair in weights.values() for t in pair)
        return real_store(weights, **kw)

    monkeypatch.setattr(build, "load_checkpoint", spy_load)
    monkeypatch.setattr(build, "ExpertStore", spy_store)
    partial = ModelRunner(cfg)
    # The loader is told to keep experts on the host until residency is decided (test_loader checks it
    # does), and the store gets host tensors.
    assert loads == [True] and given and set(given) == {"cpu"}
    assert generate(partial, [PROMPT, PROMPT[:3]], 5) == full
    stats = partial.info()["experts"]
    assert stats["resident"] == "partial" and stats["misses"] > 0 and stats["bytes_copied"] > 0
    assert "expert_slots.w13" in partial.info()["pool"]["carves"]


def test_float_inputs_stay_float32_on_cpu(runner):
    assert runner.dtype == torch.float32 and runner.kv.dtype == torch.float32


def test_staged_inputs_equal_direct_inputs(runner):
    """The CUDA path (pinned staging + copy) builds the same tensors; exercised here on the CPU."""
    from sloserve.executor.inputs import InputBuilder, workspace_bytes
    from sloserve.memory.pool import DevicePool

    size = workspace_bytes(32, 4, 8)
    direct = InputBuilder(DevicePool(size + 4096), None, 32, 4, 8, 4, 260, 32, 64)
    staged = InputBuilder(
        DevicePool(size + 4096), DevicePool(size + 4096), 32, 4, 8, 4, 260, 32, 64
    )
    seqs = [
        _seq("a", PROMPT, 0, [3, 9, 4]),
        _seq("b", [7], 5, [6, 2]),
        _seq("c", [1, 2], 0, [5], sample=False),
    ]
    a, b = direct.build(seqs), staged.build(seqs)
    for x, y in [
        (a.input_ids, b.input_ids),
        (a.positions, b.positions),
        (a.sample_idx, b.sample_idx),
        (a.meta.slot_mapping, b.meta.slot_mapping),
        (a.meta.block_tables, b.meta.block_tables),
        (a.meta.cu_seqlens_q, b.meta.cu_seqlens_q),
        (a.meta.seq_lens, b.meta.seq_lens),
    ]:
        assert x.tolist() == y.tolist()
    assert b.input_ids.data_ptr() != staged._staging["token_ids"].data_ptr()
    assert a.sampled == b.sampled == [0, 1]


def test_small_cpu_steps_run_on_one_thread_and_large_ones_on_all(
    tiny_llama, make_runner, monkeypatch
):
    """Steps under SERIAL_STEP_MACS (tokens x parameters) switch torch to one thread, larger ones
    back to the start-up count; the tokens do not depend on it."""
    from sloserve.executor import runner as runner_module

    threads = torch.get_num_threads()
    r = make_runner(tiny_llama)
    r._cpu_threads = r._threads_now = 2  # as on a 2-core machine, whatever this one has
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    # at most 8 tokens: one thread
    monkeypatch.setattr(runner_module, "SERIAL_STEP_MACS", 8 * r._num_params)
    # the 12-token prefill below goes to the torch path, not the kernel
    if r.decode_step.fused is not None:
        monkeypatch.setattr(r.decode_step.fused, "max_batch", 8)
    greedy = SamplingParams(max_tokens=1)
    r.execute(SchedulerOutput([ScheduledSequence("a", [5], 3, [1], True, greedy)]))
    r.execute(
        SchedulerOutput([ScheduledSequence("b", list(range(1, 13)), 0, [2, 3, 4], True, greedy)])
    )
    r.execute(SchedulerOutput([ScheduledSequence("c", [6], 3, [5], True, greedy)]))
    assert calls == [1, 2, 1]
    assert torch.get_num_threads() == threads  # set_num_threads was only recorded here
