"""Capture records made from what the sidecar saw: pure functions, no I/O.

Record shapes, per stream (the records' layout is protocol/capture.py's):

* ``tapped``: one record per (command, mode, rule) -- every bus command the
  tap saw, with the queues it touched grouped by the rules' decision (mode
  ``none`` means the rules filtered the queue: the record says by which rule).
  ``kind`` is P's command kind; ``size`` is the event's bytes (0 when nothing
  was forwarded; the body length for a filtered publish).
* ``forwarded``: one record per (event, mode, kind of inner command): the
  event's ``Replicated`` as the egress sent it, ``cseq``/``origin_cseq`` = the
  event's sequence number, ``origin_incarnation`` = P's incarnation;
  ``size`` is the event's encoded bytes and ``wire_size`` its share of the
  compressed link batches sent with it (split across groups).
* ``ingested``: the same grouping, at D, for each ``Replicated`` D applied
  (outcome ``applied``; a refused duplicate is not an application); ``cseq``
  is D's cseq of the application.  Every D sidecar records what its node
  applied, whichever sidecar multicast it, so a sidecar killed with records
  unwritten leaves no hole the others do not cover; one application is one
  D cseq, however many nodes recorded it.  A resync's installation
  (``ResyncCommit``, ``ResyncApply``) is one record of its own
  (:func:`resync_record`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from cluster import state as st
from filters.matcher import Decision, RuleSet
from protocol import cluster as pc
from protocol.capture import NO_RULE, CaptureRecord
from protocol.modes import Mode

__all__ = ["RuleOf", "replicated_records", "resync_record", "tapped_records", "without_payload"]

RuleOf = Callable[[str], Decision | None]


def _split(total: int, parts: int) -> list[int]:
    """``total`` split in ``parts`` integers summing to it (remainder first)."""
    base, rest = divmod(total, parts)
    return [base + (1 if i < rest else 0) for i in range(parts)]


def _rule(decision: Decision | None) -> tuple[int, str]:
    if decision is None or decision.rule_name == "default":
        return NO_RULE, ""
    return min(decision.rule_index, NO_RULE - 1), decision.rule_name


def without_payload(record: CaptureRecord) -> CaptureRecord:
    return replace(record, payload=None)


def replicated_records(
    cmd: pc.Replicated,
    *,
    wall_time_us: int,
    cseq: int,
    size: int,
    wire_size: int,
    rule_of: RuleOf,
    payload: bytes | None,
    origin: bool,
) -> list[CaptureRecord]:
    """One record per (mode, inner command kind) of a ``Replicated`` event.

    ``origin``: the record names the event's origin (``origin_cseq`` and
    ``origin_incarnation``); always so here, both at P and D.
    """
    groups: dict[tuple[Mode, int], list[str]] = {}
    for mode, inner in zip(cmd.modes, cmd.commands, strict=False):
        queues = groups.setdefault((Mode(mode), int(inner.KIND)), [])
        key = inner.key
        if key not in queues:
            queues.append(key)
    if not groups:
        return []
    sizes = _split(size, len(groups))
    wires = _split(wire_size, len(groups))
    records = []
    for i, ((mode, kind), queues) in enumerate(groups.items()):
        rule_id, rule_name = _rule(rule_of(queues[0])) if queues else (NO_RULE, "")
        records.append(
            CaptureRecord(
                wall_time_us=wall_time_us,
                cseq=cseq,
                kind=kind,
                mode=mode,
                queues=tuple(queues[:255]),
                size=sizes[i],
                wire_size=wires[i],
                origin_cseq=cmd.origin_cseq if origin else 0,
                origin_incarnation=cmd.incarnation if origin else 0,
                rule_id=rule_id,
                rule_name=rule_name,
                payload=payload if i == 0 else (b"" if payload is not None else None),
            )
        )
    return records


def resync_record(
    cmd: pc.ResyncCommit | pc.ResyncApply,
    *,
    wall_time_us: int,
    cseq: int,
    size: int,
    payload: bytes | None,
) -> CaptureRecord:
    """The ingested stream's record of a resync installed at D's ``cseq``: the
    origin's state at its cseq ``cut`` replaced D's copy.  No queue (it
    covers every replicated queue of the origin), ``origin_cseq`` = the cut,
    the resync flag set; mode ``full`` (what it does: replace)."""
    return CaptureRecord(
        wall_time_us=wall_time_us,
        cseq=cseq,
        kind=int(cmd.KIND),
        mode=Mode.FULL,
        size=size,
        origin_cseq=cmd.cut,
        origin_incarnation=cmd.incarnation,
        resync=True,
        payload=payload,
    )  # fmt: skip


def tapped_records(
    cmd: pc.Command,
    effects: Sequence[Any],
    event: Any,
    *,
    cseq: int,
    wall_time_us: int,
    rules: RuleSet,
    payloads: bool,
) -> list[CaptureRecord]:
    """The tapped stream's records for one command (see the module docstring).

    ``event`` is the tap's :class:`gateway.tap.ReplEvent` or ``None``.
    """
    size = len(event.payload) if event is not None else 0
    if event is None and isinstance(cmd, pc.Publish):
        size = len(cmd.body)
    payload = bytes(event.payload) if payloads and event is not None else None
    groups = _tapped_groups(cmd, effects, event, rules)
    records = []
    for i, ((mode, rule_id, rule_name), queues) in enumerate(groups.items()):
        records.append(
            CaptureRecord(
                wall_time_us=wall_time_us,
                cseq=cseq,
                kind=int(cmd.KIND),
                mode=mode,
                queues=tuple(queues[:255]),
                size=size if i == 0 else 0,
                rule_id=rule_id,
                rule_name=rule_name,
                payload=(payload if i == 0 else b"") if payload is not None else None,
            )
        )
    return records


def _tapped_groups(
    cmd: pc.Command, effects: Sequence[Any], event: Any, rules: RuleSet
) -> dict[tuple[Mode, int, str], list[str]]:
    """The queues ``cmd`` touched, grouped by (mode, rule id, rule name); never empty."""
    touched: list[str] = []
    for e in effects:
        q = getattr(e, "queue", None)
        if isinstance(q, str) and q not in touched:
            touched.append(q)
    q = getattr(cmd, "queue", None)
    if isinstance(q, str) and q not in touched:
        touched.append(q)
    forwarded_modes: dict[str, Mode] = {}
    if event is not None:
        for mode, name in zip(event.modes, event.queues, strict=False):
            forwarded_modes.setdefault(name, Mode(mode))
    groups: dict[tuple[Mode, int, str], list[str]] = {}
    for name in touched:
        decision = rules.decisions.get(name)
        target = decision.target_name if decision is not None else name
        mode = forwarded_modes.get(target)
        if mode is None:
            if isinstance(cmd, pc.Publish) and any(
                isinstance(e, st.Enqueued) and e.queue == name for e in effects
            ):
                # A message the tap did not forward: filtered (mode none), whatever
                # the queue's mode (a per-message rule or a message-less mode).
                mode = Mode.NONE if decision is None else decision.mode
                if mode in (Mode.FULL, Mode.ENQUEUE):
                    mode = Mode.NONE  # dropped by a per-message rule (size, header)
            else:
                mode = decision.mode if decision is not None else Mode.NONE
        rule_id, rule_name = _rule(decision)
        groups.setdefault((mode, rule_id, rule_name), []).append(name)
    if not groups:
        mode = Mode.WIRING if event is not None else Mode.NONE
        groups[(mode, NO_RULE, "")] = []
    return groups
