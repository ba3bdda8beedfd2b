"""The goodput search on synthetic servers with a known capacity (no real timing)."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
from sloserve.bench.goodput_search import SearchSettings, format_search, search_goodput

CAPACITY = 7.3  # requests/s the synthetic servers serve


def overload_attainment(rate: float, _repeat: int = 0) -> float:
    """A server that meets every request up to its capacity and none of the excess."""
    return min(1.0, CAPACITY / rate)


def queue_attainment(rate: float, repeat: int = 0, n: int = 2000, slo_s: float = 1.0) -> float:
    """A FIFO server of one request at a time, service 1/CAPACITY s each, Poisson arrivals (seeded):
    the share of requests whose end-to-end time (wait + service) is within slo_s."""
    rng = np.random.default_rng(1000 + repeat)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
    service, free, met = 1.0 / CAPACITY, 0.0, 0
    for t in arrivals:
        free = max(free, t) + service
        met += free - t <= slo_s
    return met / n


def search(measure, start, **kw):
    async def measured(rate, repeat):
        return measure(rate, repeat)

    return asyncio.run(search_goodput(measured, start, **kw))


@pytest.mark.parametrize("start", [0.5, 3.0, 50.0])
def test_lands_within_5_percent_of_the_true_rate(start):
    true_rate = CAPACITY / 0.9  # where min(1, C / r) = 0.9
    found = search(overload_attainment, start, settings=SearchSettings(0.9, 1, 0.05))
    assert found.converged and abs(found.rate - true_rate) / true_rate <= 0.05
    low, high = found.bracket
    assert low <= true_rate <= high and high / low - 1 <= 0.05
    assert all(p["attainment"] >= 0.9 for p in found.points if p["rate"] <= low)


def test_lands_within_5_percent_on_a_queueing_server():
    settings = SearchSettings(0.9, 2, 0.02)
    grid = np.linspace(1.0, CAPACITY, 400)  # the true rate, from a fine scan of the same model
    mean = [np.mean([queue_attainment(r, k) for k in range(2)]) for r in grid]
    true_rate = max(r for r, a in zip(grid, mean, strict=True) if a >= 0.9)
    found = search(queue_attainment, 1.0, settings=settings)
    assert found.converged and abs(found.rate - true_rate) / true_rate <= 0.05
    assert len(found.points) <= 12 and all(len(p["attainments"]) == 2 for p in found.points)


def test_a_known_bracket_is_bisected_and_a_target_never_met_gives_none():
    found = search(
        overload_attainment, 1.0, settings=SearchSettings(0.9, 1, 0.05), low=4.0, high=16.0
    )
    assert found.points[0]["rate"] == pytest.approx(8.0) and found.converged
    never = search(lambda rate, k: 0.0, 1.0, settings=SearchSettings(0.9, 1, 0.05))
    assert (
        never.rate is None
        and not never.converged
        and "no rate measured met" in format_search(never)
    )
    assert "bracket [" in format_search(search(overload_attainment, 1.0))


def test_noisy_repeats_are_averaged():
    noise = random.Random(0)
    found = search(
        lambda r, k: min(1.0, overload_attainment(r) + noise.uniform(-0.02, 0.02)),
        2.0,
        settings=SearchSettings(0.9, 3, 0.05),
    )
    assert abs(found.rate - CAPACITY / 0.9) / (CAPACITY / 0.9) <= 0.05


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"attainment": 0.0}, "--attainment"),
        ({"repeats": 0}, "--search-repeats"),
        ({"tolerance": 1.5}, "--search-tolerance"),
    ],
)
def test_bad_settings(kw, message):
    with pytest.raises(ValueError, match=message):
        SearchSettings(**kw)


def test_an_infinite_start_is_refused():
    with pytest.raises(ValueError, match="finite starting rate"):
        search(overload_attainment, float("inf"))
