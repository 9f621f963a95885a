"""gateway.metrics, gateway.httpserver and `drgate status`: snapshots in, metrics and JSON out."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from typing import Any

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from cluster.state.model import COUNTERS
from cluster.statistics import BusSection, JournalSection, NodeStatistics
from gateway import httpserver
from gateway.commands import status as status_command
from gateway.httpserver import ObservabilityServer, serve_http
from gateway.metrics import (
    MERGE_METRICS,
    RateTracker,
    SnapshotCollector,
    build_registry,
    families_from_snapshot,
    render_metrics,
)
from gateway.statistics import (
    DrSection,
    SidecarStatistics,
    TapStatistics,
)
from gateway.statusdoc import status_document
from tests.support.statistics import broker, full_snapshot, link, sidecar

CONSTANT = {"site": "site-p", "node": "1", "process": "sidecar"}


def parse(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """sample name + labels -> value, for every sample of a text exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples[(name, frozenset({**CONSTANT, **labels}.items()))]


def scrape(snapshot: NodeStatistics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return parse(render_metrics(build_registry(lambda: snapshot, process=False)).decode())


def test_every_snapshot_field_becomes_a_metric_with_constant_labels() -> None:
    s = scrape(full_snapshot())
    expected = {
        ("drgate_role", (("role", "egress"),)): 1,
        ("drgate_role", (("role", "standby"),)): 0,
        ("drgate_role", (("role", "ingress"),)): 0,
        ("drgate_bus_view_size", ()): 3,
        ("drgate_bus_quorate", ()): 1,
        ("drgate_bus_members", ()): 6,
        ("drgate_tap_commands_total", (("kind", "PUBLISH"),)): 10,
        ("drgate_tap_commands_total", (("kind", "DECLARE"),)): 2,
        ("drgate_events_forwarded_total", (("mode", "full"),)): 5,
        ("drgate_events_forwarded_total", (("mode", "enqueue"),)): 3,
        ("drgate_events_forwarded_total", (("mode", "wiring"),)): 1,
        ("drgate_events_filtered_total", (("mode", "none"), ("rule", "drop-temp"))): 4,
        ("drgate_events_filtered_total", (("mode", "none"), ("rule", "default"))): 1,
        ("drgate_events_dropped_total", (("reason", "header"),)): 2,
        ("drgate_events_dropped_total", (("reason", "spool_overflow"),)): 0,
        ("drgate_link_up", ()): 1,
        ("drgate_link_state", (("state", "up"),)): 1,
        ("drgate_link_state", (("state", "down"),)): 0,
        ("drgate_link_peer_info", (("peer", "d1.example:7000"),)): 1,
        ("drgate_link_bytes_sent_total", (("encoding", "raw"),)): 1000,
        ("drgate_link_bytes_sent_total", (("encoding", "wire"),)): 300,
        ("drgate_link_bytes_received_total", (("encoding", "raw"),)): 50,
        ("drgate_link_bytes_received_total", (("encoding", "wire"),)): 40,
        ("drgate_link_batches_sent_total", ()): 7,
        ("drgate_link_batches_received_total", ()): 2,
        ("drgate_link_events_sent_total", ()): 100,
        ("drgate_link_events_received_total", ()): 0,
        ("drgate_link_reconnects_total", ()): 1,
        ("drgate_link_insecure", ()): 0,
        ("drgate_link_tls_refused_total", (("reason", "handshake"),)): 2,
        ("drgate_link_tls_refused_total", (("reason", "peer_name"),)): 1,
        ("drgate_link_rtt_seconds", ()): 0.05,
        ("drgate_lag_events", ()): 12,
        ("drgate_lag_seconds", ()): 0.3,
        ("drgate_link_acked_seq", ()): 88,
        ("drgate_link_last_seq", ()): 100,
        ("drgate_partitioned", ()): 0,
        ("drgate_site_superseded", ()): 0,
        ("drgate_rpo_seconds", ()): 2.5,
        ("drgate_rpo_events", ()): 3,
        ("drgate_verify_checks_total", ()): 4,
        ("drgate_verify_mismatches_total", ()): 1,
        ("drgate_verify_mismatch", (("queue", "orders"),)): 1,
        ("drgate_spool_bytes", ()): 800,
        ("drgate_spool_max_bytes", ()): 1000,
        ("drgate_spool_segments", ()): 2,
        ("drgate_spool_overflow_total", ()): 0,
        ("drgate_spool_first_seq", ()): 80,
        ("drgate_spool_last_seq", ()): 100,
        ("drgate_resync_needed", ()): 0,
        ("drgate_spool_write_errors_total", ()): 0,
        ("drgate_duplicates_dropped_total", ()): 3,
        ("drgate_merge_refused_total", (("rule", "R3"),)): 4,
        ("drgate_merge_ignored_total", (("rule", "R4"),)): 5,
        ("drgate_merge_conflicts_total", (("rule", "R5"),)): 6,
        ("drgate_merge_conflicts_total", (("rule", "R6"),)): 7,
        ("drgate_fenced_total", ()): 8,
        ("drgate_incarnation_refused_total", ()): 9,
        ("drgate_replicated_applied_total", ()): 10,
        ("drgate_state_outcomes_total", (("outcome", "max_depth_refused"),)): 11,
        ("drgate_bus_cseq", ()): 1234,
        ("drgate_resync_active", ()): 1,
        ("drgate_resyncs_total", ()): 2,
        ("drgate_resync_progress_ratio", ()): 0.25,
        ("drgate_resync_bytes_total", ()): 4096,
        ("drgate_resync_chunks_done", ()): 3,
        ("drgate_rules_version", ()): 3,
        ("drgate_rules_reload_failures_total", ()): 1,
        ("drgate_rules_file_invalid", ()): 0,
        ("drgate_rules_info", (("digest", "ab12"),)): 1,
        ("drgate_state_transfers_total", ()): 1,
        ("drgate_state_transfer_seconds_total", ()): 1.5,
        ("drgate_last_error_present", ()): 0,
    }
    for (name, labels), want in expected.items():
        assert value(s, name, **dict(labels)) == pytest.approx(want), (name, labels)
    # Nothing without the constant labels, and nothing unexpected.
    for name, labels in s:
        assert CONSTANT.items() <= dict(labels).items(), name
    got_names = {name for name, _ in s}
    assert got_names == {name for name, _ in expected}


def test_counter_families_are_typed_counters_and_gauges_gauges() -> None:
    text = render_metrics(build_registry(full_snapshot, process=False)).decode()
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert types["drgate_events_forwarded"] == "counter"
    assert types["drgate_link_bytes_sent"] == "counter"
    assert types["drgate_lag_seconds"] == "gauge"
    assert types["drgate_role"] == "gauge"
    assert "# TYPE drgate_events_forwarded_total counter" in text


def test_missing_sections_mean_absent_metrics() -> None:
    s = scrape(broker())
    labels = frozenset({"site": "site-d", "node": "2", "process": "broker"}.items())
    assert s == {
        ("drgate_bus_cseq", labels): 7,
        ("drgate_bus_view_size", labels): 2,
        ("drgate_bus_quorate", labels): 1,
        ("drgate_last_error_present", labels): 0,
    }
    assert [f.name for f in families_from_snapshot(broker())] == [
        "drgate_bus_cseq",
        "drgate_bus_view_size",
        "drgate_bus_quorate",
        "drgate_last_error_present",
    ]


def test_a_sidecar_without_tap_and_spool_has_no_tap_or_spool_metric() -> None:
    names = {name for name, _ in scrape(sidecar(role="ingress"))}
    assert "drgate_role" in names
    assert "drgate_link_up" in names
    assert not {
        n for n in names if n.startswith(("drgate_tap_", "drgate_events_", "drgate_spool_"))
    }
    assert "drgate_resync_needed" not in names


def test_non_numbers_are_skipped_not_fatal() -> None:
    stats = sidecar(link=link(lag_events="many", lag_seconds=None, rtt_seconds=1))
    names = {name for name, _ in scrape(stats)}
    assert "drgate_link_rtt_seconds" in names
    assert not {"drgate_lag_events", "drgate_lag_seconds"} & names


def test_unknown_role_and_state_are_exported_beside_the_known_ones() -> None:
    s = scrape(sidecar(role="promoting", link=link(state="draining")))
    assert value(s, "drgate_role", role="promoting") == 1
    assert value(s, "drgate_role", role="egress") == 0
    assert value(s, "drgate_link_state", state="draining") == 1
    assert value(s, "drgate_link_up") == 0


def test_last_error_sets_the_presence_gauge() -> None:
    s = scrape(sidecar(last_error="link refused: STALE_EPOCH"))
    assert value(s, "drgate_last_error_present") == 1


def test_merge_metrics_name_only_state_counters() -> None:
    assert set(MERGE_METRICS) <= set(COUNTERS)


def test_collector_reads_the_snapshot_at_scrape_time_only() -> None:
    calls = []

    def snapshot() -> SidecarStatistics:
        calls.append(1)
        return sidecar(link=link(lag_events=len(calls)))

    registry = build_registry(snapshot, process=False)
    assert calls == []  # registering does not call it
    first = parse(render_metrics(registry).decode())
    second = parse(render_metrics(registry).decode())
    assert value(first, "drgate_lag_events") == 1
    assert value(second, "drgate_lag_events") == 2
    names = [f.name for f in SnapshotCollector(snapshot).collect()]
    assert "drgate_lag_events" in names
    assert len(calls) == 3


def forwarded(**counts: int) -> SidecarStatistics:
    return sidecar(tap=TapStatistics({}, counts, {}, {}))


def test_rate_tracker_rates_over_the_window_and_restart_on_reset() -> None:
    tracker = RateTracker(window=10.0)
    assert tracker.rates()["events_forwarded_per_second"] is None
    tracker.observe(0.0, forwarded(full=0, enqueue=0))
    tracker.observe(1.0, forwarded(full=10, enqueue=10))
    assert tracker.rates()["events_forwarded_per_second"] == 20.0
    for t in range(2, 30):
        tracker.observe(float(t), forwarded(full=20 * t))
    assert tracker.span <= 10.0 + 1e-9
    assert tracker.rates()["events_forwarded_per_second"] == pytest.approx(20.0)
    # The process restarted: counters went down.
    tracker.observe(30.0, forwarded(full=5))
    assert tracker.rates()["events_forwarded_per_second"] is None
    tracker.observe(32.0, forwarded(full=9))
    assert tracker.rates()["events_forwarded_per_second"] == 2.0


def test_status_document_fields() -> None:
    doc = status_document(full_snapshot(), {"events_sent_per_second": 5.0})
    assert doc["site"] == "site-p"
    assert doc["node"] == 1
    assert doc["role"] == "egress"
    assert doc["peer"] == "d1.example:7000"
    assert doc["link_state"] == "up"
    assert doc["link_security"] == "mutual-tls"
    assert doc["lag_events"] == 12
    assert doc["lag_seconds"] == 0.3
    assert doc["spool"]["used_ratio"] == 0.8
    assert doc["rules_version"] == 3
    assert doc["rates"] == {"events_sent_per_second": 5.0}
    assert doc["last_error"] == ""
    assert (doc["partitioned"], doc["rpo_seconds"], doc["rpo_events"]) == (False, 2.5, 3)
    assert doc["verify"]["mismatched"] == ["orders"]
    assert (doc["verify"]["checks_total"], doc["verify"]["mismatches_total"]) == (4, 1)
    json.dumps(doc, allow_nan=False)  # plain JSON


def test_status_document_of_an_empty_snapshot_is_plain_json() -> None:
    doc = status_document(sidecar(link=link(lag_seconds=float("inf"))))
    assert doc["lag_seconds"] is None
    json.dumps(doc, allow_nan=False)
    doc = status_document(broker())
    assert doc["role"] is None
    assert all(v is None for v in doc["rates"].values())
    json.dumps(doc, allow_nan=False)


def test_status_document_of_a_broker_field_for_field() -> None:
    doc = status_document(broker(bus=BusSection(2, True, members=5), merge={"r7_fenced": 1}))
    nothing = dict.fromkeys(
        ("peer", "link_state", "lag_events", "lag_seconds", "rtt_seconds", "acked_seq")
    )
    assert doc == {
        "site": "site-d",
        "node": 2,
        "process": "broker",
        "role": None,
        **nothing,
        "link_security": None,
        "last_seq": None,
        "link_gaps_total": None,
        "link_refused_total": None,
        "superseded_by": None,
        "failback_wait_cseq": None,
        "partitioned": None,
        "rpo_seconds": None,
        "rpo_events": None,
        "journal": None,
        "transfers": None,
        "rates": dict.fromkeys(doc["rates"]),
        "spool": dict.fromkeys(
            (
                "bytes",
                "max_bytes",
                "used_ratio",
                "segments",
                "overflow_total",
                "needs_resync",
                "write_errors_total",
            )
        ),
        "rules_version": None,
        "rules_digest": None,
        "rules_file_problem": "",
        "rules_reload_failures": None,
        "paused_queues": None,
        "verify": None,
        "bus": {"view_size": 2, "quorate": True, "members": 5},
        "resync": {},
        "merge": {"r7_fenced": 1},
        "last_error": "",
    }
    assert len(doc["rates"]) == 6


def test_status_document_of_an_ingress_keeps_the_compatibility_fields() -> None:
    dr = DrSection(promoted=True, epoch=4, origins={"site-p": {"epoch": 4}})
    doc = status_document(sidecar(role="ingress", dr=dr))
    # The bus section without members, promoted and epoch inside resync: as
    # the Pacemaker agent and `drgate status` read them.
    assert doc["bus"] == {"view_size": 0, "quorate": True}
    assert doc["resync"] == {
        "active": False,
        "total": 0,
        "progress_ratio": 0.0,
        "bytes_total": 0,
        "messages": 0,
        "chunks_done": 0,
        "messages_kept": 0,
        "bytes_kept": 0,
        "promoted": True,
        "epoch": 4,
    }
    assert "origins" not in doc and "dr" not in doc
    assert doc["spool"]["used_ratio"] is None
    assert "promoted" not in status_document(sidecar())["resync"]


# --- the HTTP server -------------------------------------------------------------


def test_respond_answers_errors_without_a_socket() -> None:
    server = ObservabilityServer(broker)
    assert server.respond(b"GET /nope HTTP/1.1").startswith(b"HTTP/1.1 404 ")
    assert server.respond(b"POST /metrics HTTP/1.1").startswith(b"HTTP/1.1 405 ")
    assert server.respond(b"garbage").startswith(b"HTTP/1.1 400 ")
    head = server.respond(b"HEAD /status HTTP/1.1\r\nHost: x")
    assert head.startswith(b"HTTP/1.1 200 ")
    assert head.endswith(b"\r\n\r\n")


def test_a_failing_snapshot_is_a_500_not_a_crash() -> None:
    def broken() -> NodeStatistics:
        raise RuntimeError("boom")

    server = ObservabilityServer(broken)
    assert server.respond(b"GET /metrics HTTP/1.1").startswith(b"HTTP/1.1 500 ")
    assert server.respond(b"GET /status HTTP/1.1").startswith(b"HTTP/1.1 500 ")
    server.sample(0.0)  # logged, not raised


async def http_get(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(request)
        data = bytearray()
        while chunk := await stream.receive_some(65536):
            data += chunk
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    assert int(headers["Content-Length"]) == len(body)
    return int(lines[0].split()[1]), headers, body


class Changing:
    """A snapshot whose counters a test moves on."""

    def __init__(self) -> None:
        self.data = full_snapshot()

    def __call__(self) -> SidecarStatistics:
        return self.data


@pytest.mark.integration
async def test_serve_http_over_loopback_metrics_and_status() -> None:
    snap = Changing()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(
                lambda task_status: serve_http(
                    "127.0.0.1", 0, snapshot=snap, task_status=task_status
                )
            )
            code, headers, body = await http_get(
                port, b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n"
            )
            assert code == 200
            assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
            samples = parse(body.decode())
            assert value(samples, "drgate_events_forwarded_total", mode="full") == 5
            assert value(samples, "drgate_link_up") == 1
            assert any(name == "process_cpu_seconds_total" for name, _ in samples)

            assert snap.data.tap is not None
            tap = replace(
                snap.data.tap, forwarded_total={**snap.data.tap.forwarded_total, "full": 42}
            )
            snap.data = replace(snap.data, tap=tap)
            code, _, body = await http_get(port, b"GET /metrics?x=1 HTTP/1.1\r\n\r\n")
            assert value(parse(body.decode()), "drgate_events_forwarded_total", mode="full") == 42

            code, headers, body = await http_get(port, b"GET /status HTTP/1.1\r\n\r\n")
            assert code == 200
            assert headers["Content-Type"] == "application/json"
            doc = json.loads(body)
            assert (doc["site"], doc["node"], doc["role"]) == ("site-p", 1, "egress")
            assert doc["lag_events"] == 12
            assert doc["peer"] == "d1.example:7000"

            code, _, _ = await http_get(port, b"GET /other HTTP/1.1\r\n\r\n")
            assert code == 404
            code, _, _ = await http_get(port, b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n")
            assert code == 431
            nursery.cancel_scope.cancel()


@pytest.mark.integration
async def test_a_client_that_sends_nothing_is_dropped_after_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(httpserver, "REQUEST_HEAD_TIMEOUT_S", 0.2)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(
                lambda task_status: serve_http(
                    "127.0.0.1", 0, snapshot=broker, task_status=task_status
                )
            )
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(b"GET /metrics HTTP/1.1\r\n")  # never finished
                data = bytearray()
                while chunk := await stream.receive_some(4096):
                    data += chunk
            assert data.startswith(b"HTTP/1.1 408 ")
            nursery.cancel_scope.cancel()


async def test_status_rates_come_from_the_sampler(autojump_clock: trio.abc.Clock) -> None:
    snap = Changing()
    server = ObservabilityServer(snap)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.serve_sampler)
        await trio.sleep(0.5)
        for _ in range(5):
            sent = (snap.data.link.events_sent_total or 0) + 100
            snap.data = replace(snap.data, link=replace(snap.data.link, events_sent_total=sent))
            await trio.sleep(httpserver.RATE_SAMPLE_INTERVAL_S)
        nursery.cancel_scope.cancel()
    body = server.respond(b"GET /status HTTP/1.1").partition(b"\r\n\r\n")[2]
    doc = json.loads(body)
    assert doc["rates"]["events_sent_per_second"] == pytest.approx(100.0)
    assert doc["rate_window_seconds"] == pytest.approx(5.0)


# --- drgate status ---------------------------------------------------------------


def status_args(*urls: str, **options: Any) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    status_command.configure(parser)
    argv = [a for u in urls for a in ("--url", u)]
    for key, val in options.items():
        argv += [f"--{key}"] if val is True else [f"--{key}", str(val)]
    return parser.parse_args(argv)


def unused_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


@pytest.mark.integration
async def test_status_command_against_served_snapshots(capsys: pytest.CaptureFixture[str]) -> None:
    p1 = full_snapshot()
    d1 = replace(
        p1,
        site="site-d",
        role="ingress",
        link=replace(p1.link, peer="p1.example:41000", lag_events=0, lag_seconds=0.0),
    )
    dead = f"127.0.0.1:{unused_port()}"
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            ports = []
            for snap in (p1, d1):
                ports.append(
                    await nursery.start(
                        lambda task_status, s=snap: serve_http(
                            "127.0.0.1", 0, snapshot=lambda: s, task_status=task_status
                        )
                    )
                )
            urls = [f"http://127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}/", dead]

            code = await trio.to_thread.run_sync(
                status_command.run, status_args(*urls, json=True, timeout=2)
            )
            documents = json.loads(capsys.readouterr().out)
            assert code == 2  # one sidecar unreachable
            assert [d.get("role") for d in documents] == ["egress", "ingress", None]
            assert documents[1]["lag_events"] == 0
            assert documents[2]["url"] == f"http://{dead}/status"
            assert documents[2]["error"].startswith("unreachable")

            code = await trio.to_thread.run_sync(
                status_command.run, status_args(*urls[:2], json=True, site="site-d")
            )
            assert code == 0
            assert [d["site"] for d in json.loads(capsys.readouterr().out)] == ["site-d"]

            code = await trio.to_thread.run_sync(status_command.run, status_args(*urls))
            table = capsys.readouterr().out
            assert code == 2
            assert "egress" in table
            assert "ingress" in table
            assert "unreachable" in table
            assert "Traceback" not in table
            nursery.cancel_scope.cancel()


def test_status_command_without_targets_is_a_clear_error() -> None:
    with pytest.raises(status_command.StatusError, match="--url"):
        status_command.run(status_args())


def test_status_targets_file(tmp_path: Any) -> None:
    path = tmp_path / "targets"
    path.write_text("# site P\nhttp://p1:9464\n\n  p2:9464  # standby\n")
    assert status_command.read_targets(str(path)) == ["http://p1:9464", "p2:9464"]
    from protocol.errors import ConfigError

    with pytest.raises(ConfigError, match="cannot read"):
        status_command.read_targets(str(tmp_path / "missing"))


def test_render_shows_errors_in_rows() -> None:
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(
        status_command.render(
            [
                {"url": "http://x/status", "error": "unreachable: refused"},
                status_document(replace(full_snapshot(), last_error="spool full")),
            ]
        )
    )
    text = console.export_text()
    assert "unreachable: refused" in text
    assert "spool full" in text
    assert "800 B (80%)" in text


def test_a_brokers_journal_is_in_the_metrics_and_the_status() -> None:
    journal = JournalSection(
        bytes=4096,
        durable_cseq=77,
        last_checkpoint_cseq=70,
        last_checkpoint_time=1_700_000_000.0,
        commits_total=12,
        fsync_seconds_total=0.25,
        fsync_last_seconds=0.002,
    )
    snapshot = replace(broker(), journal=journal)
    s = scrape(snapshot)
    at = {"process": "broker", "site": "site-d", "node": "2"}
    assert value(s, "drgate_journal_bytes", **at) == 4096
    assert value(s, "drgate_journal_durable_cseq", **at) == 77
    assert value(s, "drgate_journal_commits_total", **at) == 12
    assert value(s, "drgate_journal_fsync_last_seconds", **at) == pytest.approx(0.002)
    assert status_document(snapshot, None)["journal"]["last_checkpoint_cseq"] == 70
    assert not any(name.startswith("drgate_journal") for name, _ in scrape(broker()))
