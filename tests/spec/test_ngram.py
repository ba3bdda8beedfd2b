"""Prompt lookup (vLLM's prompt_lookup_min/max), following a client's prediction, greedy
acceptance and the depth of the next verify step."""

from __future__ import annotations

from sloserve.spec.depth import next_depth
from sloserve.spec.ngram import lookup, nearest_lookup
from sloserve.spec.verify import accept


def test_the_longest_suffix_ngram_wins_and_its_last_occurrence_is_copied():
    #        0  1  2  3  4  5  6  7  8  9 10 11
    text = [1, 2, 3, 9, 2, 3, 8, 7, 1, 2, 3]
    # suffix [1, 2, 3] occurs at 0..2 (then 9); [2, 3] last at 4..5 (then 8): the longer wins
    assert lookup(text, 3, 1, 3) == [9, 2, 3]
    assert lookup(text, 3, 1, 2) == [8, 7, 1]  # max 2: [2, 3], its last occurrence
    assert lookup(text, 2, 4, 5) == []  # no 4-gram recurs
    assert lookup(text, 0, 1, 3) == []


def test_a_match_near_the_end_repeats_with_its_period():
    assert lookup([5, 6, 5], 4, 1, 2) == [6, 5, 6, 5]  # [5] last at 0: period 2
    assert lookup([5, 5, 5, 5], 3, 1, 3) == [5, 5, 5]  # [5, 5, 5] last at 0..2: period 1
    rows = [1, 2, 0, 1, 2, 0, 1]  # grid rows "12\n": the next row continues the pattern
    assert lookup(rows, 5, 1, 3) == [2, 0, 1, 2, 0]
    assert lookup([4], 3, 1, 3) == []


def test_a_prediction_is_followed_while_the_output_follows_it_and_found_again_after_an_edit():
    prediction = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4]
    assert nearest_lookup([], prediction, 3, 3) == [1, 2, 3]
    assert nearest_lookup([1, 2], prediction, 3, 3) == [3, 4, 5]
    # the output changed one cell (9 for 5): its suffix [9, 6]... is not there, [6] is
    assert nearest_lookup([1, 2, 3, 4, 9, 6], prediction, 2, 3) == [7, 8]
    # [2, 3] occurs twice: the one at the output's own place wins
    assert nearest_lookup([1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3], prediction, 2, 3) == [4]
    assert nearest_lookup([0, 2, 3], prediction, 2, 3) == [4, 5]
    assert nearest_lookup([42], prediction, 2, 3) == []


def test_greedy_acceptance_takes_matching_drafts_then_the_models_token():
    assert accept([5, 6, 7], [5, 6, 7], 8) == [5, 6, 7, 8]
    assert accept([5, 6, 7], [5, 0, 7], 8) == [5, 0]
    assert accept([5, 6, 7], [1, 6, 7], 8) == [1]


def test_the_depth_falls_to_what_was_accepted_and_doubles_back_while_drafts_come_true():
    assert next_depth(8, 8, 0, 8) == 1
    assert next_depth(8, 8, 3, 8) == 4
    assert next_depth(1, 1, 1, 8) == 2
    assert next_depth(4, 4, 4, 8) == 8
    assert next_depth(8, 8, 8, 8) == 8  # never past --num-speculative-tokens
    assert next_depth(8, 3, 3, 8) == 8  # fewer proposed than allowed, all kept: no fall
