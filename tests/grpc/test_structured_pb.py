"""StructuredOutput on the gRPC wire -> a checked grammar in SamplingParams; a bad one is INVALID_ARGUMENT's error."""

from __future__ import annotations

import pytest
from sloserve.errors import InvalidRequestError
from sloserve.grpc.convert import from_pb
from sloserve.pb import serving_pb2 as pb
from sloserve.structured import arc_grid_lark, grammar_for


def _request(**structured) -> pb.GenerateRequest:
    choice = structured.pop("choice", None)
    spec = pb.StructuredOutput(**structured)
    if choice is not None:
        spec.choice.values.extend(choice)
    return pb.GenerateRequest(request_id="r", text="x", sampling=pb.SamplingParams(structured=spec))


@pytest.mark.parametrize(
    ("fields", "kind", "value"),
    [
        ({"json_schema": '{"type": "object"}'}, "json_schema", {"type": "object"}),
        ({"json_object": True}, "json_object", None),
        ({"regex": "[a-z]+"}, "regex", "[a-z]+"),
        ({"choice": ["a", "b"]}, "choice", ["a", "b"]),
        ({"grammar": arc_grid_lark()}, "grammar", arc_grid_lark()),
    ],
)
def test_each_kind_becomes_the_same_grammar_as_in_process(fields, kind, value):
    parsed = from_pb(_request(**fields), default_max_tokens=8)
    assert parsed.params.grammar == grammar_for(kind, value)


def test_unset_means_free_text():
    assert (
        from_pb(pb.GenerateRequest(request_id="r", text="x"), default_max_tokens=8).params.grammar
        is None
    )
    assert from_pb(_request(json_object=False), default_max_tokens=8).params.grammar is None


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        (
            {"json_schema": '{"type": "nope"}'},
            "sampling.structured.json_schema: the JSON schema cannot be used",
        ),
        ({"regex": r"[^\s\S]"}, "sampling.structured.regex: the regex can match no text"),
        ({"choice": []}, "sampling.structured.choice: choice must be a non-empty list"),
    ],
)
def test_bad_specs_name_the_field(fields, words):
    with pytest.raises(InvalidRequestError, match=words.replace(".", r"\.")):
        from_pb(_request(**fields), default_max_tokens=8)
