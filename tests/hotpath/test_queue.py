"""RequestQueue and target_batch_size: exact orders on hand-made cases, and every bad input."""

from __future__ import annotations

import math

import pytest

INF = math.inf


def order(q) -> list[int]:
    """Handles in pop order, checked against handles_in_order() and peek()."""
    expected = q.handles_in_order()
    popped = []
    while len(q):
        top = q.peek()
        assert q.pop() == top
        popped.append(top)
    assert popped == expected
    return popped


def test_least_slack_first(impl):
    q = impl.RequestQueue(max_wait_s=INF)
    for handle, deadline in ((1, 1.0), (2, 0.5), (3, 2.0), (4, 0.75)):
        q.push(handle, deadline, 0, now=0.0)
    assert order(q) == [2, 4, 1, 3]


def test_length_weight_is_seconds_per_token(impl):
    # 2,000 tokens at the default 1e-4 s/token weigh like 0.2 s of slack: 0.10 + 0.2 > 0.25.
    q = impl.RequestQueue(max_wait_s=INF)
    q.push(1, 0.10, 2000, now=0.0)
    q.push(2, 0.25, 0, now=0.0)
    q.push(3, 0.05, 1000, now=0.0)  # 0.05 + 0.1 = 0.15
    assert order(q) == [3, 2, 1]


def test_equal_keys_served_in_arrival_order(impl):
    q = impl.RequestQueue(max_wait_s=INF)
    for handle in (5, -3, 9, 0, 2**63 - 1, -(2**63)):
        q.push(handle, 1.0, 10, now=0.0)
    assert order(q) == [5, -3, 9, 0, 2**63 - 1, -(2**63)]


def test_aging_makes_a_waiting_request_more_urgent(impl):
    q = impl.RequestQueue(aging=0.95, max_wait_s=INF, length_weight_s=0.0)
    q.push(1, 1.0, 0, now=0.0)
    for _ in range(3):
        q.rekey(0.0)  # key of 1: 1.0 * 0.95**3 = 0.857
    q.push(2, 0.9, 0, now=0.0)  # fresh: key 0.9 although its slack is smaller
    q.push(3, 0.8, 0, now=0.0)
    assert order(q) == [3, 1, 2]


def test_aging_makes_an_overdue_request_more_urgent_too(impl):
    # Overdue by 1 s and aged twice: key -1 / 0.95**2 = -1.108 (a plain product would give -0.9025).
    q = impl.RequestQueue(aging=0.95, max_wait_s=INF, length_weight_s=0.0)
    q.push(1, -1.0, 0, now=0.0)
    q.rekey(0.0)
    q.rekey(0.0)
    q.push(2, -1.05, 0, now=0.0)
    q.push(3, -1.2, 0, now=0.0)
    q.push(4, -0.5, 0, now=0.0)
    assert order(q) == [3, 1, 2, 4]


def test_rekey_recomputes_slack_for_now(impl):
    q = impl.RequestQueue(aging=1.0, max_wait_s=INF, length_weight_s=1e-4)
    q.push(1, 1.0, 0, now=0.0)  # slack 1.0
    q.push(2, 0.5, 6000, now=0.0)  # slack 0.5 + 0.6 = 1.1
    q.push(3, INF, 0, now=0.0)  # no SLO: always last
    assert q.handles_in_order() == [1, 2, 3]
    q.rekey(2.0)  # 1: -1.0; 2: -1.5 + 0.6 = -0.9
    assert order(q) == [1, 2, 3]


def test_starved_requests_go_first_in_arrival_order(impl):
    q = impl.RequestQueue(max_wait_s=0.2)
    q.push(1, 100.0, 0, now=0.0)  # lax, but will have waited 0.3 s
    q.push(2, 50.0, 0, now=0.05)  # waits 0.25 s: starved too, arrived later
    q.push(3, 0.26, 0, now=0.25)  # most urgent, waited only 0.05 s
    q.push(4, 0.30, 0, now=0.1)  # waited exactly 0.2 s: not starved (strictly longer is)
    q.rekey(0.3)
    assert q.handles_in_order() == [1, 2, 3, 4]
    q.push(5, 0.0, 0, now=0.3)  # fresh and overdue: still behind the starved ones
    assert order(q) == [1, 2, 5, 3, 4]


def test_starved_stays_starved(impl):
    q = impl.RequestQueue(max_wait_s=0.2)
    q.push(1, 9.0, 0, now=0.0)
    q.push(2, 1.0, 0, now=0.0)
    q.rekey(0.5)
    q.rekey(0.5)
    q.push(3, -5.0, 0, now=0.5)
    assert q.handles_in_order() == [1, 2, 3]


def test_remove_and_membership(impl):
    q = impl.RequestQueue(max_wait_s=INF)
    for handle in range(10):
        q.push(handle, float(10 - handle), 0, now=0.0)
    q.remove(3)
    q.remove(9)  # the current top
    q.remove(0)  # the current bottom
    assert 3 not in q and 4 in q and "x" not in q and 2**70 not in q
    assert len(q) == 7
    q.push(3, 0.5, 0, now=0.0)  # a removed handle can be queued again
    assert order(q) == [3, 8, 7, 6, 5, 4, 2, 1]


def test_peek_leaves_the_entry(impl):
    q = impl.RequestQueue()
    q.push(7, 1.0, 0, now=0.0)
    assert q.peek() == 7 and len(q) == 1 and 7 in q


def test_grows_past_its_capacity(impl):
    q = impl.RequestQueue(max_wait_s=INF, capacity=1)
    for handle in range(100):
        q.push(handle, float(handle % 7), handle, now=0.0)
    expected = sorted(range(100), key=lambda h: ((h % 7) + 1e-4 * h, h))
    assert order(q) == expected


def test_empty_queue(impl):
    q = impl.RequestQueue()
    with pytest.raises(IndexError, match="empty"):
        q.pop()
    with pytest.raises(IndexError, match="empty"):
        q.peek()
    q.rekey(1.0)
    assert q.handles_in_order() == [] and len(q) == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"aging": 0.0}, "aging must be in"),
        ({"aging": 1.5}, "aging must be in"),
        ({"aging": math.nan}, "aging must be in"),
        ({"max_wait_s": -1.0}, "max_wait_s must be >= 0"),
        ({"max_wait_s": math.nan}, "max_wait_s must be >= 0"),
        ({"length_weight_s": -1e-4}, "length_weight_s must be"),
        ({"length_weight_s": INF}, "length_weight_s must be"),
        ({"capacity": -1}, "capacity must be >= 0"),
    ],
)
def test_bad_constructor_arguments(impl, kwargs, match):
    with pytest.raises(ValueError, match=match):
        impl.RequestQueue(**kwargs)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((1, math.nan, 0, 0.0), "deadline must be"),
        ((1, -INF, 0, 0.0), "deadline must be"),
        ((1, 1.0, -1, 0.0), "prompt_tokens must be >= 0"),
        ((1, 1.0, 0, math.nan), "now must be a finite"),
        ((1, 1.0, 0, INF), "now must be a finite"),
        ((2**63, 1.0, 0, 0.0), "handle must fit in a signed 64-bit int"),
        ((-(2**63) - 1, 1.0, 0, 0.0), "handle must fit in a signed 64-bit int"),
        ((1, 1.0, 2**64, 0.0), "prompt_tokens must be >= 0"),
    ],
)
def test_bad_push_leaves_the_queue_unchanged(impl, args, match):
    q = impl.RequestQueue()
    q.push(1 if args[0] != 1 else 2, 1.0, 0, now=0.0)
    before = q.handles_in_order()
    with pytest.raises(ValueError, match=match):
        q.push(*args)
    assert q.handles_in_order() == before


def test_duplicate_and_unknown_handles(impl):
    q = impl.RequestQueue()
    q.push(1, 1.0, 0, now=0.0)
    with pytest.raises(ValueError, match="handle 1 is already queued"):
        q.push(1, 2.0, 0, now=0.0)
    with pytest.raises(ValueError, match="handle 2 is not in the queue"):
        q.remove(2)
    with pytest.raises(ValueError, match="is not in the queue"):
        q.remove(2**80)
    with pytest.raises(ValueError, match="now must be a finite"):
        q.rekey(math.nan)
    assert q.handles_in_order() == [1]


def test_non_integer_handle_is_a_type_error(impl):
    with pytest.raises(TypeError):
        impl.RequestQueue().push(1.5, 1.0, 0, 0.0)


@pytest.mark.parametrize(
    ("max_batch", "depth", "decay", "expected"),
    [
        (32, 0, 0.9, 0),  # nothing waits
        (32, 1, 0.9, 4),  # ceil(32 * 0.1)
        (32, 10, 0.9, 21),  # ceil(32 * (1 - 0.9**10)) = ceil(20.84)
        (4, 1, 0.95, 1),  # ceil(0.2): at least 1 while anything waits
        (8, 1000, 0.9, 8),  # saturates at max_batch
        (16, 5, 0.85, 9),  # ceil(16 * (1 - 0.85**5)) = ceil(8.90)
    ],
)
def test_target_batch_size(impl, max_batch, depth, decay, expected):
    assert impl.target_batch_size(max_batch, depth, decay) == expected


def test_target_batch_size_default_decay(impl):
    assert impl.target_batch_size(32, 1) == 4


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, 1, 0.9), "max_batch must be >= 1"),
        ((8, -1, 0.9), "queue_depth must be >= 0"),
        ((8, 1, 1.0), "decay must be in"),
        ((8, 1, 0.0), "decay must be in"),
        ((8, 1, math.nan), "decay must be in"),
    ],
)
def test_target_batch_size_bad_input(impl, args, match):
    with pytest.raises(ValueError, match=match):
        impl.target_batch_size(*args)


def test_target_batch_size_wants_integers(impl):
    with pytest.raises(TypeError):
        impl.target_batch_size(8.5, 3)
    with pytest.raises(TypeError):
        impl.target_batch_size(8, 3.0)
