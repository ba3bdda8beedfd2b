"""MoE dispatch against transformers' own sparse MoE blocks, and the expert cache's bookkeeping."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from sloserve.layers.moe import ExpertStore, moe_forward, route
from sloserve.memory.pool import DevicePool
from transformers import MixtralConfig, Qwen2MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

HIDDEN = 32
INTER = 24


def seeded(block: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return block.eval()


def mixtral_block(num_experts: int = 6, top_k: int = 2, seed: int = 0) -> MixtralSparseMoeBlock:
    cfg = MixtralConfig(
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_local_experts=num_experts,
        num_experts_per_tok=top_k,
    )
    return seeded(MixtralSparseMoeBlock(cfg), seed)


def qwen_block(norm_topk_prob: bool, seed: int = 0) -> Qwen2MoeSparseMoeBlock:
    cfg = Qwen2MoeConfig(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTER,
        shared_expert_intermediate_size=40,
        num_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=norm_topk_prob,
    )
    return seeded(Qwen2MoeSparseMoeBlock(cfg), seed)


def store_of(block, **kw) -> ExpertStore:
    return ExpertStore(
        [(block.experts.gate_up_proj.detach(), block.experts.down_proj.detach())], **kw
    )


def ours(
    block, x: torch.Tensor, store: ExpertStore, renormalize: bool = True, logits=None
) -> torch.Tensor:
    logits = F.linear(x, block.gate.weight) if logits is None else logits
    return moe_forward(x, logits, store, 0, block.gate.top_k, renormalize)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_route_matches_transformers_routers():
    block = mixtral_block(num_experts=8, top_k=2)
    x = torch.randn(11, HIDDEN)
    _, ref_w, ref_ids = block.gate(x)
    w, ids = route(F.linear(x, block.gate.weight), 2, renormalize=True)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids, ref_ids) and torch.allclose(w, ref_w)
    assert torch.allclose(w.sum(-1), torch.ones(11))
    raw, _ = route(F.linear(x, block.gate.weight), 2, renormalize=False)
    assert (raw.sum(-1) < 1).all()


def test_route_softmax_runs_in_float32():
    logits = torch.tensor([[0.0, 0.001, 8.0, 8.001]], dtype=torch.bfloat16)
    w, ids = route(logits, 2, renormalize=False)
    assert w.dtype == torch.float32
    assert torch.allclose(w, torch.softmax(logits.float(), -1).topk(2).values)


@pytest.mark.parametrize(
    ("logits", "top_k", "match"),
    [
        (torch.zeros(3, 4), 0, "top_k"),
        (torch.zeros(3, 4), 5, "top_k"),
        (torch.zeros(3, 4, 1), 1, "tokens, experts"),
    ],
)
def test_route_rejects_bad_input(logits, top_k, match):
    with pytest.raises(ValueError, match=match):
        route(logits, top_k, True)


@pytest.mark.parametrize("num_tokens", [1, 2, 7, 64])
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_matches_mixtral_block(num_tokens, top_k):
    block = mixtral_block(top_k=top_k, seed=num_tokens)
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(top_k))
    with torch.no_grad():
        assert close(ours(block, x, store_of(block)), block(x[None])[0])


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_matches_qwen2_moe_block_with_shared_expert(norm_topk_prob):
    block = qwen_block(norm_topk_prob)
    x = torch.randn(9, HIDDEN)
    with torch.no_grad():
        shared = torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
        routed = ours(block, x, store_of(block), renormalize=norm_topk_prob)
        assert close(routed + shared, block(x[None])[0])


def forced_logits(choices: list[list[int]], num_experts: int) -> torch.Tensor:
    """Router logits that make token t pick exactly choices[t] (in that order of preference)."""
    logits = torch.full((len(choices), num_experts), -4.0)
    for t, experts in enumerate(choices):
        for rank, e in enumerate(experts):
            logits[t, e] = 4.0 - rank
    return logits


@pytest.mark.parametrize(
    ("case", "choices"),
    [
        ("expert-without-tokens", [[0, 1], [1, 0], [0, 1]]),
        ("all-on-one-expert", [[3, 5]] * 6),
        ("one-token", [[4, 2]]),
        ("last-expert-only", [[5, 0]] * 3),
    ],
)
def test_edge_cases_match_mixtral_loop(case, choices):
    block = mixtral_block(num_experts=6, top_k=2, seed=3)
    x = torch.randn(len(choices), HIDDEN)
    logits = forced_logits(choices, 6)
    with torch.no_grad():
        block.gate.forward = lambda h, _logits=logits: (_logits, *route(_logits, 2, True))
        assert close(ours(block, x, store_of(block), logits=logits), block(x[None])[0])


def test_top1_with_every_token_on_one_expert():
    block = mixtral_block(num_experts=4, top_k=1, seed=5)
    x = torch.randn(5, HIDDEN)
    logits = forced_logits([[2]] * 5, 4)
    w13, w2 = block.experts.gate_up_proj[2], block.experts.down_proj[2]
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    with torch.no_grad():
        expected = F.linear(F.silu(gate) * up, w2)  # top-1 renormalised weight is exactly 1
        assert close(ours(block, x, store_of(block), logits=logits), expected)


def test_zero_tokens_and_shape_errors():
    block = mixtral_block()
    store = store_of(block)
    assert moe_forward(torch.zeros(0, HIDDEN), torch.zeros(0, 6), store, 0, 2, True).shape == (
        0,
        HIDDEN,
    )
    with pytest.raises(ValueError, match="router logits"):
        moe_forward(torch.zeros(3, HIDDEN), torch.zeros(3, 5), store, 0, 2, True)
    with pytest.raises(ValueError, match="no routed experts"):
        moe_forward(torch.zeros(3, HIDDEN), torch.zeros(3, 6), store, 1, 2, True)
    with pytest.raises(ValueError, match="expected w13"):
        ExpertStore([(torch.zeros(6, 2 * INTER, HIDDEN), torch.zeros(6, INTER, HIDDEN))])


def test_deterministic_across_calls():
    block = mixtral_block(top_k=2)
    store = store_of(block)
    x = torch.randn(33, HIDDEN)
    with torch.no_grad():
        assert torch.equal(ours(block, x, store), ours(block, x, store))


# -- partial residency ----------------------------------------------------------------------


def test_partial_residency_gives_identical_outputs():
    block = mixtral_block(num_experts=6, top_k=2, seed=9)
    full, partial = store_of(block), store_of(block, slots_per_layer=2)
    assert partial.partial and not full.partial
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for steps in (1, 5, 17, 3):
            x = torch.randn(steps, HIDDEN, generator=gen)
            assert torch.equal(ours(block, x, partial), ours(block, x, full))
    stats = partial.stats()
    assert stats["resident"] == "partial" and stats["misses"] > 0
    assert stats["host_pinned"] is False  # page-locked host memory exists only with CUDA
    assert stats["bytes_copied"] == stats["misses"] * (2 * INTER * HIDDEN + HIDDEN * INTER) * 4
    assert full.stats()["misses"] == 0 and full.stats()["hit_rate"] == 1.0


def test_hit_and_miss_counts_follow_lru():
    block = mixtral_block(num_experts=4, top_k=1, seed=2)
    store = store_of(block, slots_per_layer=2)
    x = torch.randn(2, HIDDEN)

    def step(experts: list[int]) -> None:
        with torch.no_grad():
            xs = x[:1].expand(len(experts), -1)
            ours(block, xs, store, logits=forced_logits([[e] for e in experts], 4))

    step([0, 1])  # two misses
    step([1, 0])  # two hits
    step([2])  # miss, evicts 0 (least recently used)
    assert (store.hits, store.misses) == (2, 3)
    step([1])  # still resident
    step([0])  # evicted earlier: miss
    assert (store.hits, store.misses) == (3, 4)
    step([0, 1, 2, 3])  # more experts than slots: chunks of 2; resident {1, 0} -> 2 hits, 2 misses
    assert (store.hits, store.misses) == (5, 6)
    assert store.stats()["hit_rate"] == pytest.approx(5 / 11)


def test_slots_are_carved_from_the_pool():
    block = mixtral_block(num_experts=6, top_k=2)
    pool = DevicePool(4 * 1024**2, 1024**2, "cpu")
    store = store_of(block, slots_per_layer=3, pool=pool)
    carves = pool.report()["carves"]
    assert carves["expert_slots.w13"]["shape"] == [1, 3, 2 * INTER, HIDDEN]
    assert carves["expert_slots.w2"]["shape"] == [1, 3, HIDDEN, INTER]
    x = torch.randn(8, HIDDEN)
    with torch.no_grad():
        assert torch.equal(ours(block, x, store), ours(block, x, store_of(block)))
    resident = store_of(block, pool=pool)  # all resident: every layer's experts carved as well
    assert "experts.0.w13" in pool.report()["carves"]
    with torch.no_grad():
        assert torch.equal(ours(block, x, resident), ours(block, x, store_of(block)))


def test_preload_pins_the_most_routed_experts():
    block = mixtral_block(num_experts=6, top_k=1, seed=4)
    store = store_of(block, slots_per_layer=3)
    x = torch.randn(1, HIDDEN)

    def step(experts: list[int]) -> None:
        with torch.no_grad():
            ours(
                block,
                x.expand(len(experts), -1),
                store,
                logits=forced_logits([[e] for e in experts], 6),
            )

    step([4, 4, 4, 1, 1, 0])
    assert store.routing_counts()[0].tolist() == [1, 2, 0, 0, 3, 0]
    assert store.preload(2) == [[1, 4]]
    store.reset_stats()
    step([2, 3, 5])  # three cold experts through the one unpinned slot: all misses
    step([4, 1])  # pinned: never evicted
    assert (store.hits, store.misses) == (2, 3)
    with pytest.raises(ValueError, match="preload top_k"):
        store.preload(3)


def test_layers_keyed_by_model_layer_index():
    a, b = mixtral_block(seed=1), mixtral_block(seed=2)
    store = ExpertStore(
        {
            1: (a.experts.gate_up_proj.detach(), a.experts.down_proj.detach()),
            3: (b.experts.gate_up_proj.detach(), b.experts.down_proj.detach()),
        },
        slots_per_layer=4,
    )
    x = torch.randn(6, HIDDEN)
    with torch.no_grad():
        for layer, block in ((1, a), (3, b)):
            out = moe_forward(x, F.linear(x, block.gate.weight), store, layer, 2, True)
            assert close(out, block(x[None])[0])
    assert store.layers == (1, 3)


def test_resident_experts_run_before_misses():
    """With more active experts than slots, the resident ones run first and count as hits."""
    block = mixtral_block(num_experts=4, top_k=1, seed=6)
    store = store_of(block, slots_per_layer=2)
    x = torch.randn(4, HIDDEN)
    every = forced_logits([[0], [1], [2], [3]], 4)
    with torch.no_grad():
        ours(block, x[:2], store, logits=every[:2])  # experts 0, 1 resident
        ours(block, x, store, logits=every)  # 0, 1 hit; 2, 3 replace them
        ours(block, x, store, logits=every)  # 2, 3 hit (ascending order would miss all four)
    assert (store.hits, store.misses) == (4, 6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_partial_residency_on_cuda_matches_all_resident(dtype):
    """Side-stream copies from pinned host memory + events give the same outputs as resident experts."""
    block = mixtral_block(num_experts=8, top_k=2, seed=11)
    weights = [(block.experts.gate_up_proj.detach(), block.experts.down_proj.detach())]
    # NOTE: one matmul per expert in both (grouped GEMMs, the CUDA default, round differently).
    full = ExpertStore(weights, device="cuda", dtype=dtype, grouped=False)
    partial = ExpertStore(weights, device="cuda", dtype=dtype, slots_per_layer=3, grouped=False)
    assert partial.stats()["host_pinned"] is True
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):
        x = torch.randn(40, HIDDEN, generator=gen).to("cuda", dtype)
        logits = torch.randn(40, 8, generator=gen).to("cuda")
        expected = moe_forward(x, logits, full, 0, 2, True)
        assert torch.equal(moe_forward(x, logits, partial, 0, 2, True), expected)
    assert partial.stats()["misses"] > 0
    partial.preload(2)
    x = torch.randn(40, HIDDEN, generator=gen).to("cuda", dtype)
    logits = torch.randn(40, 8, generator=gen).to("cuda")
    assert torch.equal(
        moe_forward(x, logits, partial, 0, 2, True), moe_forward(x, logits, full, 0, 2, True)
    )


@pytest.mark.parametrize("slots", [None, 3])
def test_workspace_rows_give_identical_outputs_and_fall_back_when_short(slots):
    block = mixtral_block(num_experts=6, top_k=2, seed=12)
    pool = DevicePool(4 * 1024**2, 1024**2, "cpu")
    store = store_of(block, slots_per_layer=slots, pool=pool, workspace_rows=64)
    carves = pool.report()["carves"]
    assert carves["moe_workspace.rows"]["shape"] == [64, HIDDEN]
    assert carves["moe_workspace.gate_up"]["shape"] == [64, 2 * INTER]
    carved = sum(c["bytes"] for name, c in carves.items() if name.startswith("moe_workspace."))
    assert carved <= ExpertStore.workspace_bytes(64, HIDDEN, INTER, torch.float32)
    plain = store_of(block)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for tokens in (20, 32, 50, 1):  # 40 and 64 rows fit; 100 rows fall back to temporaries
            x = torch.randn(tokens, HIDDEN, generator=gen)
            out = ours(block, x, store)
            assert torch.equal(out, ours(block, x, plain))
            lo = pool._buffer.data_ptr() + carves["moe_workspace.rows"]["offset"]
            hi = (
                pool._buffer.data_ptr()
                + carves["moe_workspace.out"]["offset"]
                + carves["moe_workspace.out"]["bytes"]
            )
            assert not lo <= out.data_ptr() < hi  # the result never aliases the reused workspace
    assert store._alloc.rows_in_use == 0 and store._alloc.peak_rows == 64
    with pytest.raises(ValueError, match="workspace rows"):
        store_of(block, workspace_rows=-1)


@pytest.mark.parametrize("num_tokens", [1, 3, 9, 40])
def test_int8_experts_match_their_dequantized_weights_resident_or_in_slots(num_tokens):
    """--quantization int8: each expert held as int8 rows with a float32 scale per row, all
    resident or in pool slots (the same products, so the same bits), within the int8 activations'
    rounding of the float products on the dequantized weights (W8A8 at 1 and 5+ rows per expert,
    weight-only at 2-4)."""
    from sloserve.memory.expert_cache import quantize_experts

    block = mixtral_block(top_k=2, seed=num_tokens)
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(5))
    w13, w2 = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    (q13, s13), (q2, s2) = quantize_experts(w13), quantize_experts(w2)
    dequantized = ExpertStore([(q13.float() * s13[..., None], q2.float() * s2[..., None])])
    resident = store_of(block, quantization="int8")
    pool = DevicePool(1 << 20, None, "cpu")
    partial = store_of(block, quantization="int8", slots_per_layer=3, pool=pool)
    assert resident.expert_bytes == 3 * INTER * HIDDEN + (2 * INTER + HIDDEN) * 4
    assert resident.device_bytes == 6 * resident.expert_bytes
    assert partial.device_bytes == 3 * resident.expert_bytes
    with torch.no_grad():
        want = ours(block, x, dequantized)
        got = ours(block, x, resident)
        assert torch.equal(ours(block, x, partial), got)
    worst = ((got - want).abs().max() / want.abs().max()).item()
    print(f"int8 experts, {num_tokens} tokens: within {worst:.2e} of the largest output")
    assert worst <= 2e-2


def test_int8_experts_are_refused_off_a_cpu_and_in_grouped_gemms():
    block = mixtral_block()
    with pytest.raises(ValueError, match="int8 experts run per expert"):
        store_of(block, quantization="int8", grouped=True)
    with pytest.raises(ValueError, match="expert quantization must be none or int8"):
        store_of(block, quantization="int4")
