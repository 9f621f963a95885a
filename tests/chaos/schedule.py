"""The chaos suite's fault schedule: a pure function of a seed.

Theory of operation
-------------------
A fault occupies a *resource* from its start to its end: a site's nodes
(``p-nodes``, ``d-nodes``: a sidecar, broker or corosync killed and
restarted, a node cut off, a sidecar's spool disk full, or the whole site
restarted), one WAN emulator (``wan-N``, or every one for a fault
on the whole WAN), the rules file.  A planned switchover and its switch
back take both sites' nodes and the rules file (its commands join both
buses, and its quiesce names the queues the rules replicate): WAN faults
overlap it.  Two faults on one resource never overlap,
so at most one node of a site is down at a time, the loss drgate claims to
survive; faults on different resources overlap freely (a broker of P killed
during a WAN cut while D's sidecar restarts).  Each fault starts a random gap
after the previous one, on a resource free at that time; the kinds are drawn
by weight.  The same seed gives the same schedule: a run replays from it.

The engine (tests/chaos/engine.py) runs :func:`steps` in order, late when a
restart takes longer than planned: an end step of a resource always comes
before the next begin step on it, whatever the delay.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

# Kinds of faults and their weights in a schedule.  Node faults are what the
# claims are about; the WAN faults are cheap and overlap them.
WEIGHTS: dict[str, int] = {
    "kill-sidecar": 6,  # kill -9 a sidecar, start it again on its spool
    "kill-broker": 5,  # kill -9 a broker, start it again on its journal
    "restart-site": 1,  # kill -9 every process of a site, start them all again
    "wan-cut": 3,  # connections reset
    "wan-blackhole": 2,  # connections held open and silent
    "wan-stall": 2,  # open, nothing forwarded
    "wan-bandwidth": 2,  # a rate cap
    "wan-delay": 2,  # delay and jitter
    "rules-switch": 2,  # the rules file switches q-switch from full to enqueue and back
    "spool-full": 2,  # a sidecar's spool disk (a small tmpfs) filled up, then freed
    # drgate switchover P -> D, then the switch back by drgate failback (D,
    # then P) when it ends; an aborted switchover (the WAN cut) has nothing
    # to switch back.
    "switchover": 1,
}
# On the corosync bus a node can also be cut off from its site's others (its
# bridge port down: a minority of one, its link to the other site gone too),
# and its corosync can crash (kill -9; the node's broker and sidecar lose
# the bus and exit, and are started again after it, as systemd would).
COROSYNC_WEIGHTS: dict[str, int] = {**WEIGHTS, "partition-node": 3, "kill-corosync": 2}
# How long each kind lasts (seconds, uniform in the range).
DURATION_S: dict[str, tuple[float, float]] = {
    "kill-sidecar": (0.5, 4.0),
    "kill-broker": (0.5, 4.0),
    "restart-site": (1.0, 4.0),
    "wan-cut": (0.5, 6.0),
    "wan-blackhole": (1.0, 6.0),
    "wan-stall": (0.5, 5.0),
    "wan-bandwidth": (2.0, 8.0),
    "wan-delay": (2.0, 8.0),
    "rules-switch": (2.0, 8.0),
    "partition-node": (1.0, 6.0),
    "kill-corosync": (0.5, 4.0),
    "spool-full": (1.0, 6.0),
    "switchover": (4.0, 12.0),
}
# Mean gap between the starts of two faults: overlaps are the rule.
MEAN_GAP_S = 1.5
# Faults on one node (``p:2``): they take the site's nodes resource.
NODE_KINDS = frozenset(
    {"kill-sidecar", "kill-broker", "partition-node", "kill-corosync", "spool-full"}
)
SITES = ("p", "d")


@dataclass(frozen=True, slots=True)
class Fault:
    """One fault: ``kind`` on ``target`` from ``start_s`` for ``duration_s``.

    ``target``: ``p:2`` (node 2 of P), ``d`` (site D), ``wan:1``, ``wan:all``,
    ``rules`` or ``sites`` (both, for a switchover); ``setting``: the WAN
    setting (``rate_bps=...``) or empty."""

    index: int
    kind: str
    target: str
    start_s: float
    duration_s: float
    setting: str = ""

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s

    def resources(self, nodes: int) -> list[str]:
        site, _, which = self.target.partition(":")
        if site in SITES:
            return [f"{site}-nodes"]
        if site == "wan":
            return [f"wan-{n}" for n in range(1, nodes + 1)] if which == "all" else [f"wan-{which}"]
        if site == "sites":
            return [f"{s}-nodes" for s in SITES] + ["rules"]
        return [site]

    def describe(self) -> str:
        setting = f" {self.setting}" if self.setting else ""
        return (
            f"#{self.index:<3} {self.start_s:7.2f}s +{self.duration_s:4.1f}s "
            f"{self.kind} {self.target}{setting}"
        )


@dataclass(frozen=True, slots=True)
class Step:
    """A fault's ``begin`` or ``end``, at ``at_s`` after the schedule's start."""

    at_s: float
    action: str  # "begin" | "end"
    fault: Fault


def make_schedule(
    seed: int, faults: int, *, nodes: int = 3, weights: dict[str, int] | None = None
) -> list[Fault]:
    """``faults`` faults drawn from ``random.Random(seed)``, in start order."""
    rng = random.Random(seed)
    weights = weights or WEIGHTS
    kinds = sorted(weights)
    busy: dict[str, float] = {}  # resource -> when it is free again
    schedule: list[Fault] = []
    now = 0.0
    while len(schedule) < faults:
        now += rng.expovariate(1 / MEAN_GAP_S)
        kind = rng.choices(kinds, [weights[k] for k in kinds])[0]
        low, high = DURATION_S[kind]
        fault = Fault(
            len(schedule) + 1,
            kind,
            _target(rng, kind, nodes),
            round(now, 2),
            round(rng.uniform(low, high), 2),
            _setting(rng, kind),
        )
        resources = fault.resources(nodes)
        if any(busy.get(r, 0.0) > fault.start_s for r in resources):
            continue  # its resource is taken then: draw again, a little later
        for r in resources:
            busy[r] = fault.end_s
        schedule.append(fault)
    return schedule


def _target(rng: random.Random, kind: str, nodes: int) -> str:
    if kind in NODE_KINDS:
        return f"{rng.choice(SITES)}:{rng.randint(1, nodes)}"
    if kind == "restart-site":
        return rng.choice(SITES)
    if kind.startswith("wan-"):
        return "wan:all" if rng.random() < 0.3 else f"wan:{rng.randint(1, nodes)}"
    if kind == "switchover":
        return "sites"
    return "rules"


def _setting(rng: random.Random, kind: str) -> str:
    if kind == "wan-bandwidth":
        return f"rate_bps={rng.choice([2_000, 20_000, 200_000])}"
    if kind == "wan-delay":
        return f"delay_ms={rng.choice([5, 25, 100, 400])} jitter_ms={rng.choice([0, 2, 10])}"
    return ""


def steps(schedule: list[Fault]) -> list[Step]:
    """Every fault's begin and end, in time order; at one instant an end
    comes before a begin (a resource is freed before it is taken again)."""
    out = [Step(f.start_s, "begin", f) for f in schedule]
    out += [Step(f.end_s, "end", f) for f in schedule]
    return sorted(out, key=lambda s: (s.at_s, s.action != "end", s.fault.index))


def counts(schedule: list[Fault]) -> dict[str, int]:
    """Faults by kind."""
    return dict(sorted(Counter(f.kind for f in schedule).items()))
