"""Grammar-constrained sampling in the runner: every path obeys the mask, matchers are freed, specs are checked."""

from __future__ import annotations

import json
import re

import pytest
import torch
from sloserve.errors import InvalidRequestError
from sloserve.layers.grammar import GrammarMasks
from sloserve.llm import LLM
from sloserve.sampling_params import SamplingParams
from sloserve.structured import arc_grid_grammar, grammar_for
from sloserve.tokenizer import Tokenizer, byte_level_tokenizer

pytestmark = pytest.mark.timeout(180)

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 5},
        "days": {"type": "integer", "minimum": 0, "maximum": 30},
        "unit": {"enum": ["c", "f"]},
        "ok": {"type": "boolean"},
    },
    "required": ["city", "days", "unit", "ok"],
    "additionalProperties": False,
}


def _valid(text: str) -> bool:
    jsonschema = pytest.importorskip("jsonschema")
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint):
    return str(make_checkpoint("llama"))


@pytest.mark.parametrize("steps", [1, 4], ids=["single-steps", "runs-of-steps"])
def test_json_schema_answers_parse_and_validate_greedy_and_sampled(checkpoint, steps):
    grammar = grammar_for("json_schema", SCHEMA)
    params = [SamplingParams(max_tokens=120, grammar=grammar)]
    params += [
        SamplingParams(max_tokens=120, temperature=1.0, seed=i, grammar=grammar) for i in range(5)
    ]
    params += [SamplingParams(max_tokens=12, temperature=1.0, seed=9)]  # free text beside them
    with LLM(
        checkpoint, device="cpu", max_model_len=256, block_size=4, num_scheduler_steps=steps
    ) as llm:
        outs = llm.generate([f"prompt {i}" for i in range(len(params))], params)
        runner = llm.engine.runner
        assert runner.grammar.compiled == 1  # one compile for six requests
        assert 0 < len(runner.grammar) <= 6  # the last to finish are dropped with the next step
        # the next step drops the finished requests' matchers
        llm.generate("x", SamplingParams(max_tokens=1))
        assert len(runner.grammar) == 0
    for out in outs[:-1]:
        assert out.finish_reason == "stop" and _valid(out.text), out.text
    assert outs[-1].finish_reason == "length"


def test_regex_and_choice_hold_on_every_decode_path(checkpoint):
    regex = grammar_for("regex", r"[0-9]{3}-[a-z]{2}")
    choice = grammar_for("choice", ["yes", "no", "maybe"])
    params = [
        SamplingParams(max_tokens=30, temperature=t, seed=s, grammar=g)
        for g in (regex, choice)
        for t, s in ((0.0, None), (1.0, 1), (1.5, 2))
    ]
    with LLM(checkpoint, device="cpu", max_model_len=256, block_size=4) as llm:
        outs = llm.generate(["a", "bb", "ccc", "dddd", "e", "ff"], params)
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2}", o.text) for o in outs[:3]), [o.text for o in outs]
    assert all(o.text in ("yes", "no", "maybe") and o.finish_reason == "stop" for o in outs[3:])


@pytest.mark.parametrize(
    ("on_host", "overlap"), [(True, False), (False, True)], ids=["cpu-path", "gpu-path"]
)
def test_mask_comes_before_argmax_and_leaves_other_rows_alone(on_host, overlap):
    tok = Tokenizer(byte_level_tokenizer(), eos_token="</s>")
    masks = GrammarMasks(tok.to_json(), 260, [257], torch.device("cpu"))
    # a GPU's path: filled in a worker thread, the packed words unpacked by torch where the logits are
    masks.unpack_on_host, masks.overlap = on_host, overlap
    free = SamplingParams()
    fixed = SamplingParams(grammar=grammar_for("choice", ["B"]))
    logits = torch.zeros(3, 260)
    logits[:, ord("A")] = 5.0
    pending = masks.begin([free, fixed, free], ["a", "b", "c"])
    masks.apply(pending, logits)
    assert logits.argmax(-1).tolist() == [ord("A"), ord("B"), ord("A")]
    masks.accept(pending, [ord("A"), ord("B"), ord("A")])
    pending = masks.begin([fixed], ["b"])  # the choice is complete: only EOS remains
    row = torch.zeros(1, 260)
    masks.apply(pending, row)
    assert torch.isfinite(row[0]).nonzero().flatten().tolist() == [257]
    masks.drop(["b"])
    assert len(masks) == 0 and masks.begin([free], ["a"]) is None


@pytest.mark.parametrize(
    ("kind", "value", "message"),
    [
        ("json_schema", {"type": "nope"}, "Invalid type"),
        ("json_schema", "{not json", "not valid JSON"),
        (
            "json_schema",
            {
                "type": "object",
                "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 2}},
                "required": ["a"],
            },
            "nsatisfiable",
        ),
        ("regex", "a(", "unclosed group"),
        ("regex", r"[^\s\S]", "can match no text"),
        ("choice", [], "non-empty list"),
        ("grammar", "start: undefined_rule", "undefined_rule"),
        ("xml", "<a/>", "unknown structured output kind"),
    ],
)
def test_bad_specs_are_refused_with_the_reason(kind, value, message):
    with pytest.raises(InvalidRequestError, match=message):
        grammar_for(kind, value)


def test_offline_generate_refuses_a_grammar_that_does_not_compile(checkpoint):
    with LLM(checkpoint, device="cpu", max_model_len=64, block_size=4) as llm:
        with pytest.raises(InvalidRequestError, match="cannot be used"):
            llm.generate(
                "x", SamplingParams(grammar='{"grammars": [{"lark_grammar": "start: nope"}]}')
            )
        assert len(llm.engine.runner.grammar) == 0


def test_arc_grid_grammar_makes_the_built_in_model_write_grids():
    from sloserve.bench.arc import parse_grid_text

    prompts = ["Input:\n12\n34\nOutput:\n", "Input:\n5\nOutput:\n"]
    with LLM(
        "default", device="cpu", max_model_len=1024, kv_pool_bytes=16 * 2**20, swap_bytes=0
    ) as llm:
        # 931 tokens hold a 30x30 grid and its EOS: the grammar ends every answer by then
        outs = llm.generate(
            prompts,
            [
                SamplingParams(max_tokens=931, grammar=arc_grid_grammar()),
                SamplingParams(max_tokens=931, temperature=1.0, seed=3, grammar=arc_grid_grammar()),
            ],
        )
    for out in outs:
        assert out.finish_reason == "stop" and parse_grid_text(out.text) is not None, out.text


def test_compiled_grammars_are_cached_by_text_and_bounded():
    tok = Tokenizer(byte_level_tokenizer(), eos_token="</s>")
    masks = GrammarMasks(tok.to_json(), 260, [257], torch.device("cpu"), cache_size=2)
    specs = [SamplingParams(grammar=grammar_for("choice", [word])) for word in ("a", "b", "c")]
    for i, params in enumerate(specs + specs[:1]):
        masks.begin([params], [f"r{i}"]).filled.result()
    assert masks.compiled == 2 and len(masks) == 4
    masks.drop([f"r{i}" for i in range(4)])
    assert len(masks) == 0
