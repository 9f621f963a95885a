"""Statistics snapshots for the tests of the metrics, /status and the alert rules."""

from __future__ import annotations

from typing import Any

from cluster.statistics import BusSection, NodeStatistics, StateTransferSection
from gateway.statistics import (
    DrSection,
    LinkSection,
    ResyncSection,
    RulesSection,
    SidecarStatistics,
    SpoolSection,
    TapStatistics,
)
from gateway.verification import VerifySection


def link(**fields: Any) -> LinkSection:
    """A link section: up to d1.example:7000 unless told otherwise."""
    base: dict[str, Any] = {
        "state": "up",
        "peer": "d1.example:7000",
        "reconnects_total": 1,
        "rtt_seconds": None,
    }
    return LinkSection(**(base | fields))


def sidecar(**fields: Any) -> SidecarStatistics:
    """A sidecar snapshot with empty sections, the given fields replaced."""
    base: dict[str, Any] = {
        "site": "site-p",
        "node": 1,
        "process": "sidecar",
        "cseq": 0,
        "bus": BusSection(view_size=0, quorate=True),
        "merge": {},
        "last_error": "",
        "role": "egress",
        "rules": RulesSection(version=0, failed_reloads_total=0, file_problem="", digest=""),
        "link": link(),
        "resync": ResyncSection(
            active=False, total=0, progress_ratio=0.0, bytes_total=0, messages=0
        ),
        "tap": None,
        "spool": None,
        "dr": None,
    }
    return SidecarStatistics(**(base | fields))


def broker(**fields: Any) -> NodeStatistics:
    base: dict[str, Any] = {
        "site": "site-d",
        "node": 2,
        "process": "broker",
        "cseq": 7,
        "bus": BusSection(view_size=2, quorate=True),
        "merge": {},
        "last_error": "",
    }
    return NodeStatistics(**(base | fields))


def full_snapshot() -> SidecarStatistics:
    return SidecarStatistics(
        site="site-p",
        node=1,
        process="sidecar",
        role="egress",
        cseq=1234,
        bus=BusSection(view_size=3, quorate=True, members=6),
        tap=TapStatistics(
            commands_total={"PUBLISH": 10, "DECLARE": 2},
            forwarded_total={"full": 5, "enqueue": 3, "wiring": 1},
            filtered_total={("none", "drop-temp"): 4, ("none", "default"): 1},
            dropped_total={"size": 1, "header": 2, "spool_overflow": 0},
        ),
        link=LinkSection(
            state="up",
            peer="d1.example:7000",
            bytes_sent_total=1000,
            bytes_sent_wire_total=300,
            batches_sent_total=7,
            bytes_received_total=50,
            bytes_received_wire_total=40,
            batches_received_total=2,
            rtt_seconds=0.05,
            lag_events=12,
            lag_seconds=0.3,
            acked_seq=88,
            last_seq=100,
            reconnects_total=1,
            events_sent_total=100,
            events_received_total=0,
            security="mutual-tls",
            tls_handshake_failures_total=2,
            peer_name_refusals_total=1,
            superseded_by="",
            partitioned=False,
        ),
        spool=SpoolSection(
            bytes=800,
            max_bytes=1000,
            segments=2,
            overflow_total=0,
            needs_resync=False,
            first_seq=80,
            last_seq=100,
            write_errors_total=0,
        ),
        merge={
            "r1_duplicates": 3,
            "r3_refused": 4,
            "r4_dequeues_ignored": 5,
            "r5_conflicts": 6,
            "r6_conflicts": 7,
            "r7_fenced": 8,
            "incarnation_refused": 9,
            "replicated_applied": 10,
            "max_depth_refused": 11,
        },
        resync=ResyncSection(
            active=True, total=2, progress_ratio=0.25, bytes_total=4096, messages=0, chunks_done=3
        ),
        rules=RulesSection(version=3, failed_reloads_total=1, file_problem="", digest="ab12"),
        state_transfer=StateTransferSection(count_total=1, seconds_total=1.5),
        last_error="",
        # A P sidecar has no dr section; set here so every metric is exported once.
        dr=DrSection(
            promoted=False,
            epoch=1,
            origins={},
            rpo_seconds=2.5,
            rpo_events=3,
            verify=VerifySection(
                {"orders": {"ok": False, "origin_cseq": 9, "detail": "2 messages here, 3 at P"}},
                checks_total=4,
                mismatches_total=1,
            ),
        ),
    )
