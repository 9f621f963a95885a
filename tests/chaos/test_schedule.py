"""The chaos schedule is a function of its seed and keeps one node of a site down at a time."""

from __future__ import annotations

from itertools import pairwise

from tests.chaos.schedule import COROSYNC_WEIGHTS, WEIGHTS, make_schedule, steps


def test_a_seed_gives_one_schedule_and_another_seed_another() -> None:
    assert make_schedule(7, 50) == make_schedule(7, 50)
    assert make_schedule(7, 50) != make_schedule(8, 50)


def test_faults_on_one_resource_never_overlap_and_faults_on_others_do() -> None:
    schedule = make_schedule(3, 300)
    assert len(schedule) == 300
    by_resource: dict[str, list[tuple[float, float]]] = {}
    for fault in schedule:
        for resource in fault.resources(3):
            by_resource.setdefault(resource, []).append((fault.start_s, fault.end_s))
    for resource, spans in by_resource.items():
        for (_, end), (start, _) in pairwise(spans):
            assert start >= end, f"two faults overlap on {resource}"
    overlapping = sum(1 for a, b in pairwise(schedule) if b.start_s < a.end_s)
    assert overlapping > len(schedule) // 3, "faults should overlap in time"
    assert {f.kind for f in schedule} == set(WEIGHTS)


def test_an_end_comes_before_the_next_begin_on_its_resource() -> None:
    schedule = make_schedule(11, 200)
    held: set[str] = set()
    for step in steps(schedule):
        resources = set(step.fault.resources(3))
        if step.action == "begin":
            assert not resources & held, f"fault #{step.fault.index} begins on a busy resource"
            held |= resources
        else:
            held -= resources
    assert not held


def test_the_corosync_schedule_also_crashes_corosync_and_cuts_nodes_off() -> None:
    schedule = make_schedule(5, 300, weights=COROSYNC_WEIGHTS)
    assert {f.kind for f in schedule} == set(COROSYNC_WEIGHTS)
    for fault in schedule:
        if fault.kind in ("kill-corosync", "partition-node", "spool-full"):
            site, _, node = fault.target.partition(":")
            assert site in ("p", "d") and 1 <= int(node) <= 3, fault
            assert fault.resources(3) == [f"{site}-nodes"]


def test_a_switchover_takes_both_sites_and_the_rules_and_wan_faults_overlap_it() -> None:
    schedule = make_schedule(13, 300)
    switchovers = [f for f in schedule if f.kind == "switchover"]
    assert switchovers
    for fault in switchovers:
        assert fault.resources(3) == ["p-nodes", "d-nodes", "rules"]
    during = [
        f for s in switchovers for f in schedule if f is not s and f.start_s < s.end_s < f.end_s
    ]
    assert all(f.kind.startswith("wan-") for f in during)
