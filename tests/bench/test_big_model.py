"""benchmarks/big_model.py's pure parts: the 7B shape is Llama-2-7B's, arms parse from NAME=FLAGS."""

from __future__ import annotations

import argparse
import math

import pytest

from benchmarks.big_model import SHAPES, config, parse_arm, tensor_shapes


def test_the_7b_shape_has_llama_2_7bs_parameters():
    count = sum(math.prod(shape) for _, shape in tensor_shapes(config(SHAPES["7b"])))
    assert count == 6_738_415_616


def test_arms_parse_from_name_and_flags():
    assert parse_arm("int8=--quantization int8") == ("int8", ["--quantization", "int8"])
    assert parse_arm("bf16=") == ("bf16", [])
    for bad in ("int8", "=--dtype float32"):
        with pytest.raises(argparse.ArgumentTypeError, match="NAME=FLAGS"):
            parse_arm(bad)
