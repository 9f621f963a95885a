"""Rules switching: the decision, the payload bytes, identical application."""

from __future__ import annotations

import contextlib
import hashlib
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from filters.rules import load_rules
from filters.switch import (
    RulesPayload,
    SwitchAccepted,
    SwitchRefused,
    SwitchUnchanged,
    apply_switch,
    decide_switch,
    payload_of,
)
from protocol.errors import RemoteProtocolError, RulesError
from protocol.modes import Mode
from tests.support.mutate import NO_SHRINK, Reach, mutated

OLD = "version: 1\ndefault: {mode: none}\n"
NEW = (
    "version: 1\nrules:\n  - {name: a, match: {queue: q}, action: {mode: full}}\n"
    "default: {mode: none}\n"
)


def test_valid_change_is_accepted_with_next_version_and_digest() -> None:
    current = load_rules(OLD, "r.yaml")
    decision = decide_switch(current, NEW, "r.yaml")
    assert isinstance(decision, SwitchAccepted)
    assert decision.payload.rules_version == 1
    assert decision.payload.digest == hashlib.sha256(NEW.encode()).digest()
    assert decision.payload.text == NEW


def test_invalid_change_is_refused_with_located_problems_and_old_rules_stay() -> None:
    current = load_rules(OLD, "r.yaml")
    decision = decide_switch(current, "version: 1\ndefault: {mode: ful}\n", "r.yaml")
    assert isinstance(decision, SwitchRefused)
    assert [str(p.location) for p in decision.problems] == ["r.yaml:2:17"]
    assert decision.digest == hashlib.sha256(b"version: 1\ndefault: {mode: ful}\n").hexdigest()
    assert current.decide_queue("q").mode is Mode.NONE


def test_same_text_is_unchanged() -> None:
    current = load_rules(OLD, "r.yaml")
    assert isinstance(decide_switch(current, OLD, "r.yaml"), SwitchUnchanged)


def test_warnings_travel_with_an_accepted_switch() -> None:
    text = (
        "version: 1\nrules:\n  - {name: all, match: {}, action: {mode: full}}\n"
        "default: {mode: none}\n"
    )
    decision = decide_switch(load_rules(OLD, "r.yaml"), text, "r.yaml")
    assert isinstance(decision, SwitchAccepted)
    assert [w.severity for w in decision.warnings] == ["warning"]


def test_every_tap_applies_the_same_rules_at_the_same_cseq() -> None:
    proposer = load_rules(OLD, "r.yaml")
    decision = decide_switch(proposer, NEW, "r.yaml")
    assert isinstance(decision, SwitchAccepted)
    wire = decision.payload.to_bytes()
    taps = [load_rules(OLD, f"node{i}.yaml") for i in range(3)]
    after = [apply_switch(t, RulesPayload.from_bytes(wire), cseq=42) for t in taps]
    assert {(r.digest, r.rules_version, r.cseq) for r in after} == {
        (hashlib.sha256(NEW.encode()).hexdigest(), 1, 42)
    }
    assert all(r.decide_queue("q").mode is Mode.FULL for r in after)


def test_applying_the_rules_in_force_changes_nothing() -> None:
    current = load_rules(OLD, "r.yaml")
    assert apply_switch(current, payload_of(current), cseq=7) is current


def test_two_proposals_with_the_same_number_apply_in_bus_order() -> None:
    base = load_rules(OLD, "r.yaml")
    other = NEW.replace("full", "enqueue")
    p1 = decide_switch(base, NEW, "a")
    p2 = decide_switch(base, other, "b")
    assert isinstance(p1, SwitchAccepted) and isinstance(p2, SwitchAccepted)
    assert p1.payload.rules_version == p2.payload.rules_version == 1
    rs = apply_switch(apply_switch(base, p1.payload, cseq=10), p2.payload, cseq=11)
    assert (rs.rules_version, rs.cseq) == (2, 11)
    assert rs.decide_queue("q").mode is Mode.ENQUEUE


def test_apply_raises_rules_error_if_text_unreadable_here() -> None:
    bad = RulesPayload.for_text("version: 9\ndefault: {mode: none}\n", 1)
    with pytest.raises(RulesError):
        apply_switch(load_rules(OLD, "r.yaml"), bad, cseq=1)


def test_payload_golden_bytes() -> None:
    p = RulesPayload.for_text("ab", 258)
    assert p.to_bytes() == (
        b"DRRS\x01"
        + (258).to_bytes(8, "big")
        + hashlib.sha256(b"ab").digest()
        + b"\x00\x00\x00\x02ab"
    )


@given(st.text(max_size=200), st.integers(0, 2**64 - 1))
def test_payload_round_trip(text: str, version: int) -> None:
    p = RulesPayload.for_text(text, version)
    assert RulesPayload.from_bytes(p.to_bytes()) == p


_HEAD = struct.Struct(">4sBQ32sI")  # magic, format, rules_version, sha256, text length


@st.composite
def damaged_payloads(draw: st.DrawFn) -> bytes:
    """A valid payload whose text is damaged, then given back its magic,
    format, length and sha256, so the text decoding runs; one in ten is
    damaged anywhere and left as it is, one in twenty is left whole."""
    text = draw(st.sampled_from([OLD, NEW]) | st.text(max_size=200))
    good = RulesPayload.for_text(text, draw(st.integers(0, 2**64 - 1))).to_bytes()
    how = draw(st.integers(0, 19))
    if how == 0:
        return good
    if how <= 2:
        return mutated(draw, good, fields=((5, 8), (45, 4)))
    _, _, version, _, _ = _HEAD.unpack_from(good)
    body = mutated(draw, good[_HEAD.size :])
    digest = hashlib.sha256(body).digest()
    return _HEAD.pack(b"DRRS", 1, version, digest, len(body)) + body


def test_payload_decoder_fails_only_with_remote_protocol_error() -> None:
    reach = Reach("rules payload")

    @NO_SHRINK
    @given(damaged_payloads())
    def decode(data: bytes) -> None:
        try:
            payload = RulesPayload.from_bytes_untrusted(data)
        except RemoteProtocolError as exc:
            reach.note("not UTF-8" in str(exc))  # refused by the text decoding
            return
        reach.note(True)
        # What the taps then do with it: load the text (or refuse it, typed).
        assert payload.digest == hashlib.sha256(payload.text.encode()).digest()
        with contextlib.suppress(RulesError):
            apply_switch(load_rules(OLD, "r.yaml"), payload, cseq=1)

    decode()
    reach.check()


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: b[:10], "too short"),
        (lambda b: b"XXXX" + b[4:], "bad magic"),
        (lambda b: b[:4] + b"\x02" + b[5:], "unknown format"),
        (lambda b: b + b"x", "length"),
        (lambda b: b[:-1] + b"X", "sha256"),
    ],
)
def test_payload_decoder_rejects(mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    good = RulesPayload.for_text(NEW, 3).to_bytes()
    with pytest.raises(RemoteProtocolError, match=message):
        RulesPayload.from_bytes_untrusted(mutate(good))


def test_payload_rejects_non_utf8_text_with_matching_digest() -> None:
    body = b"\xff\xfe"
    data = b"DRRS\x01" + bytes(8) + hashlib.sha256(body).digest() + b"\x00\x00\x00\x02" + body
    with pytest.raises(RemoteProtocolError, match="UTF-8"):
        RulesPayload.from_bytes_untrusted(data)
