"""TeamSize: the fused step's team backs off to one thread while its caller stalls for a partner."""

from __future__ import annotations

import pytest
from sloserve.executor.team import MAX_BACKOFF_STEPS, MIN_BACKOFF_STEPS, PROBE_STEPS, TeamSize

MS = 1_000_000


def _steps(team: TeamSize, n: int, wall_ns: int, stalled_ns: int) -> list[int]:
    """n steps, each reported with these times when it ran on the team: the sizes they ran on."""
    sizes = []
    for _ in range(n):
        threads = team.next()
        team.report(threads, wall_ns, stalled_ns if threads > 1 else 0)
        sizes.append(threads)
    return sizes


def _runs(sizes: list[int]) -> list[tuple[int, int]]:
    """(size, how many steps in a row) of a sequence of step sizes."""
    runs: list[list[int]] = []
    for s in sizes:
        if runs and runs[-1][0] == s:
            runs[-1][1] += 1
        else:
            runs.append([s, 1])
    return [(s, n) for s, n in runs]


def test_a_team_that_stalls_under_half_its_time_keeps_every_thread():
    team = TeamSize(2)
    assert _steps(team, 200, wall_ns=MS, stalled_ns=MS // 2 - 1000) == [2] * 200
    assert team.alone_steps == 0 and team.team_steps == 200 and team.backoffs == 0


def test_one_thread_is_never_backed_off_or_judged():
    team = TeamSize(1)
    assert _steps(team, 5, wall_ns=MS, stalled_ns=MS) == [1] * 5
    assert team.alone_steps == 0 and team.backoffs == 0


def test_a_fixed_team_never_backs_off():
    team = TeamSize(2, adaptive=False)
    assert _steps(team, 50, wall_ns=MS, stalled_ns=MS) == [2] * 50


@pytest.mark.parametrize(
    ("threads", "stalled_share", "backs_off"),
    [(2, 0.49, False), (2, 0.51, True), (4, 0.74, False), (4, 0.76, True)],
)
def test_the_threshold_is_what_one_thread_would_save(threads, stalled_share, backs_off):
    """n threads stalled for s of w would take about (w - s) * n alone: back off when s > w (n-1)/n."""
    team = TeamSize(threads)
    sizes = _steps(team, 2, wall_ns=100 * MS, stalled_ns=int(stalled_share * 100 * MS))
    assert sizes == [threads, 1 if backs_off else threads]


def test_one_long_stall_among_clean_steps_is_smoothed_away():
    team = TeamSize(2)
    _steps(team, 20, wall_ns=MS, stalled_ns=MS // 5)
    _steps(team, 1, wall_ns=5 * MS, stalled_ns=9 * MS // 2)  # 90% of one slow step
    assert _steps(team, 5, wall_ns=MS, stalled_ns=MS // 5) == [2] * 5
    assert team.backoffs == 0


def test_stalled_probes_double_the_backoff_and_a_clean_probe_resets_it():
    team = TeamSize(2)
    sizes = _steps(
        team, 1 + sum(MIN_BACKOFF_STEPS << k for k in range(8)) + 8 * PROBE_STEPS, MS, MS
    )
    runs = _runs(sizes)
    assert runs[0] == (2, 1)  # the step that stalled
    alone = [n for s, n in runs if s == 1]
    assert alone[:3] == [MIN_BACKOFF_STEPS, 2 * MIN_BACKOFF_STEPS, 4 * MIN_BACKOFF_STEPS]
    assert max(alone) == MAX_BACKOFF_STEPS
    assert all(n == PROBE_STEPS for s, n in runs[1:-1] if s == 2)  # each probe: PROBE_STEPS steps

    team = TeamSize(2)
    _steps(team, 1, MS, MS)
    runs = _runs(_steps(team, MIN_BACKOFF_STEPS + PROBE_STEPS + 50, wall_ns=MS, stalled_ns=0))
    assert runs == [(1, MIN_BACKOFF_STEPS), (2, PROBE_STEPS + 50)]  # a clean probe: the team again
    assert team.backoff == MIN_BACKOFF_STEPS


def test_counters_add_up():
    team = TeamSize(2)
    _steps(team, 1 + MIN_BACKOFF_STEPS + PROBE_STEPS, MS, MS)
    assert team.backoffs == 2  # the first step, then the stalled probe
    assert team.alone_steps == MIN_BACKOFF_STEPS and team.team_steps == 1 + PROBE_STEPS
