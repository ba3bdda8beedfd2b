"""How many threads the fused CPU step runs on: its whole team, unless other processes hold the
team's threads off their cores.

The fused step's threads meet at ~8 spinning barriers per layer (`hotpath/_decode_step.h`). On
cores shared with busy processes one of them is often descheduled mid-step, and its partner
waits at the next barrier for the rest of a timeslice. One thread never waits for a partner.

The kernel reports how long the caller waited past the spin phase (`stalled`). Steps of team
size n that spent a share s of their wall time w stalled would take about (w - s) * n alone, so
the team is worth keeping while s < w * (n - 1) / n (half the time for two threads). That share
is smoothed over the last ~50 team steps (DECAY); above the threshold the next `backoff` steps
run alone, then PROBE_STEPS team steps measure the team again: still stalled doubles the backoff
(up to MAX_BACKOFF_STEPS), clean returns to the team and resets it.
"""

from __future__ import annotations

MIN_BACKOFF_STEPS = 32
MAX_BACKOFF_STEPS = 4096
PROBE_STEPS = 8
DECAY = 0.98  # per team step: a memory of ~50 steps


class TeamSize:
    """The team size of each fused step, from how recent team steps fared (see the module doc)."""

    def __init__(self, threads: int, adaptive: bool = True) -> None:
        """adaptive=False: always the whole team (benchmarks/team_contention.py's other arm)."""
        self.threads = max(1, threads)
        self.adaptive = adaptive
        self.backoff = MIN_BACKOFF_STEPS
        self._alone_left = 0
        self._probe_left = 0
        self._stalled = 0.0  # smoothed (or, while probing, summed) stalled ns of team steps
        self._wall = 0.0  # and their wall ns
        self.alone_steps = 0  # steps run on one thread because the team stalled
        self.team_steps = 0
        self.backoffs = 0

    def next(self) -> int:
        """Threads for the next step."""
        if self._alone_left > 0:
            self._alone_left -= 1
            self.alone_steps += 1
            return 1
        if self.threads > 1:
            self.team_steps += 1
        return self.threads

    def report(self, threads: int, wall_ns: int, stalled_ns: int) -> None:
        """How a step of `threads` threads went: its wall time and its caller's stalls."""
        if threads <= 1 or not self.adaptive:
            return
        if self._probe_left > 0:
            self._stalled += stalled_ns
            self._wall += wall_ns
            self._probe_left -= 1
            if self._probe_left == 0:
                if self._too_stalled():
                    self._back_off()
                else:
                    self.backoff = MIN_BACKOFF_STEPS
            return
        self._stalled = DECAY * self._stalled + stalled_ns
        self._wall = DECAY * self._wall + wall_ns
        if self._too_stalled():
            self._back_off()

    def _too_stalled(self) -> bool:
        return self._stalled * self.threads > self._wall * (self.threads - 1)

    def _back_off(self) -> None:
        self.backoffs += 1
        self._alone_left = self.backoff
        self.backoff = min(2 * self.backoff, MAX_BACKOFF_STEPS)
        self._probe_left = PROBE_STEPS
        self._stalled = self._wall = 0.0
