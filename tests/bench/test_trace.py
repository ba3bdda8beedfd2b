"""Trace replay: the committed Azure sample, CSV and JSONL formats, scaling, and the arrival shape."""

from __future__ import annotations

import asyncio
import math

import pytest
from sloserve.bench.client import LoadSpec, connect, run_load
from sloserve.bench.plan import WorkloadPlan
from sloserve.bench.slo_rules import parse_rule
from sloserve.bench.trace import (
    CONTEXT_MARGIN,
    fit_lengths,
    interarrival_cv,
    load_trace,
    mean_rate,
    read_trace,
    rescale,
    tile,
)

from tests.bench.fake_server import FakeBehaviour, start_fake


def test_the_azure_sample_reads_in_order_from_zero():
    rows = read_trace("azure-conv")
    assert len(rows) == 400
    assert rows[0].arrival_s == 0.0 and (rows[0].prompt_tokens, rows[0].gen_tokens) == (374, 44)
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(rows, rows[1:], strict=False))
    assert 100 < rows[-1].arrival_s < 110  # 18:15:46.68 to 18:17:33.01


def test_items_carry_lengths_arrivals_and_rules():
    rules = (
        parse_rule("gen>250:e2e=20,class=batch,priority=1"),
        parse_rule("default:ttft=0.5,class=interactive"),
    )
    items = load_trace("azure-conv", length_scale=0.1, rules=rules)
    rows = read_trace("azure-conv")
    assert [i.arrival_s for i in items] == [r.arrival_s for r in rows]
    assert (len(items[0].prompt), items[0].max_tokens) == (37, 4)  # 374 and 44 tokens scaled by 0.1
    assert items[0].prompt.isdigit() and all(i.ignore_eos for i in items)
    for item, row in zip(items, rows, strict=True):  # the rules see the trace's own lengths
        assert item.slo_class == ("batch" if row.gen_tokens > 250 else "interactive")
    assert {i.priority for i in items if i.slo_class == "batch"} == {1}


def test_lengths_are_cut_in_proportion_to_fit_the_context():
    assert fit_lengths(4000, 400, 1.0, None) == (4000, 400)
    prompt, gen = fit_lengths(4000, 400, 1.0, 512)
    assert prompt + gen <= 512 - CONTEXT_MARGIN and prompt == pytest.approx(10 * gen, rel=0.05)
    assert fit_lengths(3, 0, 0.01, 512) == (1, 1)  # never below one token
    items = WorkloadPlan("trace:azure-conv").items(max_model_len=256)
    assert max(len(i.prompt) + i.max_tokens for i in items) <= 256 - CONTEXT_MARGIN


def test_rescaling_keeps_the_shape():
    items = load_trace("azure-conv")
    cv = interarrival_cv([i.arrival_s for i in items])
    assert cv > 1.0  # bursty: a Poisson process has 1
    faster = rescale(items, rate=20.0)
    assert mean_rate(faster) == pytest.approx(20.0)
    assert interarrival_cv([i.arrival_s for i in faster]) == pytest.approx(cv)
    slower = rescale(items, time_scale=2.0)
    assert slower[-1].arrival_s == pytest.approx(2 * items[-1].arrival_s)
    with pytest.raises(ValueError, match="not both"):
        rescale(items, rate=1.0, time_scale=2.0)
    with pytest.raises(ValueError, match="--time-scale"):
        rescale(items, time_scale=-1.0)


def test_tiling_repeats_the_trace_after_it_ends():
    items = load_trace("azure-conv", num_requests=1000)
    arrivals = [i.arrival_s for i in items]
    assert len(items) == 1000 and arrivals == sorted(arrivals)
    assert items[400].prompt == items[0].prompt and items[400].arrival_s > items[399].arrival_s
    assert tile(items[:1], 3)[2].arrival_s == 2.0  # a one-request trace: one second apart


def test_jsonl_traces_with_prompts_or_lengths(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"arrival_s": 1.5, "prompt": "hello", "max_tokens": 3, "class": "chat", "priority": 2}\n'
        '\n{"timestamp": 500, "input_length": 20, "output_length": 4, "hash_ids": [1]}\n'
    )
    items = load_trace(str(path))
    assert [(i.arrival_s, i.max_tokens) for i in items] == [
        (0.0, 4),
        (1.0, 3),
    ]  # sorted, shifted to 0
    assert (
        len(items[0].prompt) == 20 and items[1].prompt == "hello" and items[1].slo_class == "chat"
    )


def test_burstgpt_csv(tmp_path):
    path = tmp_path / "burst.csv"
    path.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "5,ChatGPT,100,20,120,Conversation log\n7.5,GPT-4,10,0,10,Conversation log\n"
    )
    items = load_trace(str(path))
    assert [(i.arrival_s, len(i.prompt), i.max_tokens) for i in items] == [
        (0.0, 100, 20),
        (2.5, 10, 1),
    ]


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        (
            "a.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,3,4\nyesterday,3,4\n",
            r"a.csv:3: cannot read the time 'yesterday'",
        ),
        (
            "b.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,-3,4\n",
            r"b.csv:2: ContextTokens",
        ),
        (
            "c.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,3\n",
            r"c.csv:2: expected 3 columns",
        ),
        ("d.csv", "when,prompt,gen\n1,2,3\n", r"d.csv:1: the header must name TIMESTAMP"),
        (
            "e.jsonl",
            '{"arrival_s": 0, "prompt": "x"}\n{"prompt": "y"}\n',
            r"e.jsonl:2: a trace line needs 'arrival_s'",
        ),
        (
            "f.jsonl",
            '{"arrival_s": -1, "prompt": "x"}\n',
            r"f.jsonl:1: the arrival time must be a number >= 0",
        ),
        ("g.jsonl", '{"arrival_s": 0, "prompt": "x"}\n{oops\n', r"g.jsonl:2: not valid JSON"),
        (
            "h.jsonl",
            '{"arrival_s": 0, "input_length": 3}\n',
            r"h.jsonl:1: a trace line needs a 'prompt' or",
        ),
        ("i.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n", r"holds no requests"),
    ],
)
def test_a_malformed_trace_names_its_line(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_trace(str(path))


def test_an_unknown_trace_names_the_samples():
    with pytest.raises(ValueError, match="azure-conv"):
        read_trace("no-such-trace")


@pytest.mark.timeout(60)
def test_a_replay_reproduces_the_arrival_shape():
    """Sent through the driver to the fake server, the gaps' coefficient of variation is within 5%
    of the rescaled trace's."""
    items = rescale(load_trace("azure-conv", length_scale=0.01)[:80], rate=40.0)
    planned = interarrival_cv([i.arrival_s for i in items])

    async def replay():
        server, target = await start_fake(FakeBehaviour(ttft_s=0.001, token_s=0.0))
        channel = await connect(target)
        try:
            return await run_load(channel, items, LoadSpec(rate=40.0, streams=2))
        finally:
            await channel.close()
            await server.stop(0)

    result = asyncio.run(replay())
    assert len(result.records) == 80 and all(r.status == "ok" for r in result.records)
    sent = interarrival_cv([r.send_time for r in result.records])
    assert math.isclose(sent, planned, rel_tol=0.05), (sent, planned)
