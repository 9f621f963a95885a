"""Bus commands and frames (protocol/cluster): round trips, golden vectors, robustness."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol import cluster as c
from protocol import snapshotrecords as sr
from protocol.errors import RemoteProtocolError
from protocol.modes import Mode, Role
from tests.support.mutate import NO_SHRINK, Reach, mutated

VECTORS = Path(__file__).parent.parent / "vectors" / "cluster"
REGENERATE = os.environ.get("DRGATE_REGENERATE_VECTORS") == "1"

# ---------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------

names = st.text(max_size=20)
u64 = st.integers(0, 2**64 - 1)
u32 = st.integers(0, 2**32 - 1)
values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=10),
    st.binary(max_size=10),
)
value_maps = st.dictionaries(st.text(max_size=8), values, max_size=4)
positions = st.lists(u64, max_size=5).map(tuple)
bodies = st.binary(max_size=64)

simple_commands = st.one_of(
    st.builds(c.QueueDeclare, names, value_maps),
    st.builds(c.QueueDelete, names),
    st.builds(c.ExchangeDeclare, names, st.sampled_from(c.ExchangeType), value_maps),
    st.builds(c.ExchangeDelete, names),
    st.builds(c.Bind, names, names, names, value_maps),
    st.builds(c.Unbind, names, names, names),
    st.builds(c.Publish, names, names, bodies, names, value_maps, u64),
    st.builds(c.Acquire, names, u64, u32, u32),
    st.builds(c.AcquireMatching, names, u64, u32, u32, names),
    st.builds(c.Withdraw, names, u64, u32),
    st.builds(c.Accept, names, u64, positions),
    st.builds(c.Release, names, u64, positions, st.booleans()),
    st.builds(c.Modify, names, u64, u32, positions, st.booleans(), st.booleans(), bodies),
    st.builds(c.Purge, names),
    st.builds(c.SessionOpen, u64),
    st.builds(c.SessionClose, u64),
    st.builds(c.StateChunk, u32, u32, u32, u32, st.booleans(), bodies),
    st.builds(c.RulesSwitch, bodies),
    st.builds(c.Enqueue, names, u64, bodies, names, value_maps, st.booleans()),
    st.builds(c.Dequeue, names, positions),
    st.builds(c.Promote, names, u32, u64),
    st.builds(c.AcceptIncarnation, names, u64),
    st.builds(c.AckWatermark, names, u64, u64, u64),
    st.builds(c.MemberReady, st.sampled_from(Role), u32, u32),
    st.builds(c.Genesis, names, u64),
    st.builds(c.ResyncApply, names, u64, u64, u32, u64, bodies),
    st.builds(c.ResyncCommit, names, u64, u64, u32, u64, u32),
    st.builds(c.AcceptPrimary, names, u32),
    st.builds(c.SetEpoch, u32),
    st.builds(c.Superseded, names, u64, value_maps),
    st.builds(c.Durable, u32, u64),
    st.builds(c.JoinHave, u32, u32, u64, u64, bodies),
    st.builds(c.Recovering, names, u32, u32, u32, u64, u64, u64),
    st.builds(c.RecoveryChunk, u32, st.booleans(), bodies),
    st.builds(c.ForceRecovery, names, u64),
    st.builds(c.ResyncStage, names, u64, u64, u32, u32, bodies),
    st.builds(c.VerifyPoint, u64),
    st.builds(c.Verify, names, u64, u64, u64, names),
    st.builds(c.Keep, names, u64, u64, u32, st.booleans(), u64, bodies),
)


@st.composite
def replicated(draw: st.DrawFn) -> c.Replicated:
    inner = draw(st.lists(simple_commands, max_size=3))
    modes = draw(st.lists(st.sampled_from(Mode), min_size=len(inner), max_size=len(inner)))
    return c.Replicated(
        draw(names), draw(u64), draw(u64), draw(u32), draw(u64), tuple(modes), tuple(inner)
    )


commands = st.one_of(simple_commands, replicated())


def test_every_kind_has_a_strategy_and_a_sample() -> None:
    covered = {type(cmd).KIND for cmd in SAMPLES.values()}
    assert covered == set(c.Kind)


@given(st.lists(commands, max_size=8))
def test_frame_round_trip(cmds: list[c.Command]) -> None:
    frame = c.encode_frame(cmds)
    assert c.decode_frame_untrusted(frame) == cmds
    refs = c.scan_frame_untrusted(frame)
    assert [(kind, key) for kind, key, _size, _offset in refs] == [
        (int(cmd.KIND), cmd.key) for cmd in cmds
    ]
    assert [c.decode_ref_untrusted(frame, ref) for ref in refs] == cmds


def test_bodies_are_views_of_the_frame_not_copies() -> None:
    frame = c.encode_frame([c.Publish("", "q", b"payload" * 10)])
    (cmd,) = c.decode_frame_untrusted(frame)
    assert isinstance(cmd, c.Publish)
    assert isinstance(cmd.body, memoryview)
    assert cmd.body.obj is frame


# ---------------------------------------------------------------------------
# Golden vectors: one per kind, both ways.
# ---------------------------------------------------------------------------

SAMPLES: dict[str, c.Command] = {
    "queue_declare": c.QueueDeclare(
        "orders", {"qpid.replicate": "all", "qpid.queue_event_generation": 2, "durable": True}
    ),
    "queue_delete": c.QueueDelete("orders"),
    "exchange_declare": c.ExchangeDeclare("events", c.ExchangeType.TOPIC, {"ratio": 0.5}),
    "exchange_delete": c.ExchangeDelete("events"),
    "bind": c.Bind("events", "orders", "eu.#", {"x": None}),
    "unbind": c.Unbind("events", "orders", "eu.#"),
    "publish": c.Publish(
        "events", "eu.fr", b"hello", "msg-1", {"region": "eu", "blob": b"\x00\x01"}, 42
    ),
    "acquire": c.Acquire("orders", 0x0000010000020001, 3, 10),
    "acquire_matching": c.AcquireMatching(
        "orders", 0x0000010000020001, 3, 10, "color = 'red' AND weight > 2"
    ),
    "withdraw": c.Withdraw("orders", 0x0000010000020001, 3),
    "accept": c.Accept("orders", 0x0000010000020001, (1, 2, 5)),
    "release": c.Release("orders", 0x0000010000020001, (3,), True),
    "modify": c.Modify(
        "orders", 0x0000010000020001, 7, (3, 4), True, True, b"\xc1\x06\x02\xa3\x01a\x52\x02"
    ),
    "purge": c.Purge("orders"),
    "session_open": c.SessionOpen(0x0000010000020001),
    "session_close": c.SessionClose(0x0000010000020001),
    "state_chunk": c.StateChunk(2, 4711, 1, 0, True, b"snapshot-bytes"),
    "rules_switch": c.RulesSwitch(b"rules-payload"),
    "replicated": c.Replicated(
        "site-p",
        0x1122334455667788,
        1000,
        1,
        1_700_000_000_000_000,
        (Mode.FULL, Mode.ENQUEUE),
        (c.Enqueue("orders", 7, b"body", "m-7", {}, False), c.Dequeue("audit", (3,))),
    ),
    "enqueue": c.Enqueue("orders", 7, b"body", "m-7", {"k": "v"}, True),
    "dequeue": c.Dequeue("orders", (7, 8)),
    "promote": c.Promote("site-p", 2, 1_700_000_000_000_000),
    "accept_incarnation": c.AcceptIncarnation("site-p", 0x99),
    "ack_watermark": c.AckWatermark("site-p", 0x1122334455667788, 999, 1_700_000_000_000_000),
    "member_ready": c.MemberReady(Role.SIDECAR, 3, 4711),
    "genesis": c.Genesis("site-p", 0x1122334455667788),
    "resync_apply": c.ResyncApply(
        "site-p",
        0x1122334455667788,
        1000,
        1,
        1_700_000_000_000_000,
        sr.encode_snapshot_record(
            [
                c.Replicated(
                    "site-p",
                    0x1122334455667788,
                    1000,
                    1,
                    1_700_000_000_000_000,
                    (Mode.FULL, Mode.FULL),
                    (c.QueueDeclare("orders", {}), c.Enqueue("orders", 7, b"body", "m-7", {})),
                )
            ]
        ),
    ),
    "resync_stage": c.ResyncStage(
        "site-p",
        0x1122334455667788,
        1000,
        1,
        3,
        sr.encode_snapshot_record(
            [
                c.Replicated(
                    "site-p",
                    0x1122334455667788,
                    1000,
                    1,
                    1_700_000_000_000_000,
                    (Mode.ENQUEUE,),
                    (c.Enqueue("orders", 8, b"body", "m-8", {}),),
                )
            ]
        ),
    ),
    "resync_commit": c.ResyncCommit(
        "site-p", 0x1122334455667788, 1000, 1, 1_700_000_000_000_000, 4
    ),
    "accept_primary": c.AcceptPrimary("site-p", 3),
    "set_epoch": c.SetEpoch(3),
    "superseded": c.Superseded("site-d", 1_700_000_000_000_000, {"orders": None, "q-full": None}),
    "durable": c.Durable(2, 4711),
    "recovering": c.Recovering("site-p", 2, 4242, 3, 4711, 0x1122334455667788, 0x99),
    "recovery_chunk": c.RecoveryChunk(0, True, b"DRGS..."),
    "force_recovery": c.ForceRecovery("site-p", 1_700_000_000_000_000),
    "join_have": c.JoinHave(
        2, 4711, 0x1122334455667788, 9000, c.pack_have_ranges({"orders": (3, 10_002)})
    ),
    "verify_point": c.VerifyPoint(1_700_000_000_000_000),
    "verify": c.Verify("orders", 2, 10_001, 10_002, "9f86d081884c7d659a2feaa0c55ad015"),
    "switchover": c.Switchover(
        "site-d", c.SwitchoverPhase.QUIESCE, 1_700_000_000_000_000, {"orders": None}
    ),
    "keep": c.Keep("orders", 10_001, 17, 250, False, 31_250, bytes.fromhex("9f86d081884c7d65")),
}


def _describe(cmd: c.Command) -> str:
    return repr(cmd)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_golden_vector(name: str) -> None:
    path = VECTORS / f"{name}.hex"
    frame = c.encode_frame([SAMPLES[name]])
    if REGENERATE:
        path.write_text(frame.hex() + "\n")
        (VECTORS / f"{name}.json").write_text(
            json.dumps({"command": _describe(SAMPLES[name])}, indent=1) + "\n"
        )
    golden = bytes.fromhex(path.read_text().strip())
    assert frame == golden, f"the encoding of {name} changed: a wire format change needs a version"
    assert c.decode_frame_untrusted(golden) == [SAMPLES[name]]


def test_golden_batched_frame() -> None:
    path = VECTORS / "batch.hex"
    frame = c.encode_frame(list(SAMPLES.values()))
    if REGENERATE:
        path.write_text(frame.hex() + "\n")
    assert frame == bytes.fromhex(path.read_text().strip())


# ---------------------------------------------------------------------------
# Robustness: only RemoteProtocolError comes out of the decoders.
# ---------------------------------------------------------------------------

VALID_FRAME = c.encode_frame(list(SAMPLES.values()))


def _decode_or_protocol_error(data: bytes) -> None:
    with contextlib.suppress(RemoteProtocolError):
        c.decode_frame_untrusted(data)


def _frame_of(parts: list[tuple[int, bytes, bytes]]) -> bytes:
    """A bus frame of ``(kind, key, rest)`` parts, its header and index made right."""
    index = [c.INDEX_ENTRY.pack(kind, 0, len(key), len(rest)) for kind, key, rest in parts]
    data = [piece for _, key, rest in parts for piece in (key, rest)]
    return b"".join([c.FRAME_HEADER.pack(c.VERSION, 0, len(parts)), *index, *data])


@st.composite
def damaged_frames(draw: st.DrawFn) -> bytes:
    """Valid commands, one of them damaged (its body, now and then its name
    or kind), framed again with the version, count and lengths right, so
    the command decoders run; one in ten is damaged anywhere and left as it
    is, one in twenty is left whole."""
    cmds = draw(st.lists(commands, min_size=1, max_size=4))
    good = c.encode_frame(cmds)
    how = draw(st.integers(0, 19))
    if how == 0:
        return good
    if how <= 2:
        return mutated(draw, good, fields=((2, 2), (8, 4)))
    parts = [c.encode_command(cmd) for cmd in cmds]
    i = draw(st.integers(0, len(parts) - 1))
    kind, key, rest = parts[i]
    if how == 3:
        kind = draw(st.sampled_from(sorted(c.Kind)))
    elif how == 4:
        key = mutated(draw, key)
    else:
        rest = mutated(draw, rest)
    parts[i] = (kind, key, rest)
    return _frame_of(parts)


def test_damaged_frames_raise_only_protocol_errors() -> None:
    reach = Reach("bus command")

    @NO_SHRINK
    @given(damaged_frames())
    def decode(data: bytes) -> None:
        try:
            refs = c.scan_frame_untrusted(data)
        except RemoteProtocolError:
            refs = []
        reach.note(bool(refs))  # the command decoders run on what the index located
        with contextlib.suppress(RemoteProtocolError):
            c.decode_frame_untrusted(data)
        for ref in refs:
            with contextlib.suppress(RemoteProtocolError):
                c.decode_head_untrusted(data, ref)

    decode()
    reach.check()


@given(st.integers(0, len(VALID_FRAME) - 1))
def test_every_truncation_is_refused(cut: int) -> None:
    with pytest.raises(RemoteProtocolError):
        c.decode_frame_untrusted(VALID_FRAME[:cut])


@given(st.integers(0, len(VALID_FRAME) * 8 - 1))
def test_bit_flips_raise_only_protocol_errors(bit: int) -> None:
    data = bytearray(VALID_FRAME)
    data[bit // 8] ^= 1 << (bit % 8)
    _decode_or_protocol_error(bytes(data))


@pytest.mark.parametrize(
    ("frame", "words"),
    [
        (b"", "truncated"),
        (bytes([9, 0, 0, 0]), "version 9 is not supported"),
        (bytes([1, 0, 0, 1]), "truncated"),
        (bytes([1, 0, 0, 1, 200, 0, 0, 0, 0, 0, 0, 0]), "unknown bus command kind 200"),
        (bytes([1, 0x80, 0, 0]), "unknown flags"),
        (c.encode_frame([]) + b"x", "trailing"),
    ],
)
def test_errors_say_what_was_wrong(frame: bytes, words: str) -> None:
    with pytest.raises(RemoteProtocolError, match=words):
        c.decode_frame_untrusted(frame)


def one_command_frame(kind: int, key: bytes, rest: bytes) -> bytes:
    """A frame of one command whose rest is ``rest``, as given (well formed or not)."""
    return (
        c.FRAME_HEADER.pack(c.VERSION, 0, 1)
        + c.INDEX_ENTRY.pack(kind, 0, len(key), len(rest))
        + key
    ) + rest


def test_trailing_meta_bytes_are_refused() -> None:
    kind, key, rest = c.encode_command(c.QueueDelete("q"))
    bad_rest = c.META_LEN.pack(1) + b"\x00"
    frame = one_command_frame(kind, key, bad_rest)
    assert rest != bad_rest
    with pytest.raises(RemoteProtocolError, match="QUEUE_DELETE"):
        c.decode_frame_untrusted(frame)


@pytest.mark.parametrize("short", [1, 4, 9])
def test_a_meta_field_that_runs_into_the_tail_is_refused(short: int) -> None:
    """The meta is read in place, in the frame: a field that the declared
    meta length cuts must not be completed from the tail's bytes."""
    cmd = c.Enqueue("q", 7, b"x" * 64, "id", {"k": "v"}, redelivered=False)
    kind, key, rest = c.encode_command(cmd)
    (meta_len,) = c.META_LEN.unpack_from(rest)
    bad_rest = c.META_LEN.pack(meta_len - short) + rest[c.META_LEN.size :]
    frame = one_command_frame(kind, key, bad_rest)
    with pytest.raises(RemoteProtocolError, match="ENQUEUE"):
        c.decode_frame_untrusted(frame)
    with pytest.raises(RemoteProtocolError, match="ENQUEUE"):
        c.decode_head_untrusted(frame, c.scan_frame_untrusted(frame)[0])


def test_a_replicated_inside_a_replicated_is_refused() -> None:
    inner = c.Replicated("site-p", 1, 1, 1, 1, (Mode.FULL,), (c.QueueDeclare("q"),))
    outer = c.Replicated("site-p", 1, 2, 1, 1, (Mode.FULL,), (c.QueueDeclare("q"),))
    kind, key, rest = c.encode_command(outer)
    (meta_len,) = c.META_LEN.unpack_from(rest)
    nested = rest[: c.META_LEN.size + meta_len] + c.encode_frame([inner])
    frame = one_command_frame(kind, key, nested)
    with pytest.raises(RemoteProtocolError, match="nested Replicated"):
        c.decode_frame_untrusted(frame)


def test_unknown_enum_values_are_refused() -> None:
    frame = bytearray(c.encode_frame([c.MemberReady(Role.BROKER, 1, 1)]))
    # The role byte is the first meta byte after the 4-byte meta length.
    role_at = len(frame) - 9
    assert frame[role_at] == Role.BROKER
    frame[role_at] = 77
    with pytest.raises(RemoteProtocolError, match="MEMBER_READY"):
        c.decode_frame_untrusted(bytes(frame))


def test_a_named_session_command_is_refused() -> None:
    kind, _key, rest = c.encode_command(c.SessionOpen(1))
    frame = (
        c.FRAME_HEADER.pack(c.VERSION, 0, 1) + c.INDEX_ENTRY.pack(kind, 0, 1, len(rest)) + b"x"
    ) + rest
    with pytest.raises(RemoteProtocolError, match="empty name"):
        c.decode_frame_untrusted(frame)


def test_snapshot_records_round_trip_and_refuse_damage() -> None:
    inner = c.Replicated("site-p", 1, 5, 1, 0, (Mode.WIRING,), (c.QueueDeclare("q", {"a": 1}),))
    snapshot = sr.encode_snapshot_record([inner]) + sr.encode_snapshot_record([inner, inner])
    assert list(sr.iter_snapshot_untrusted(snapshot)) == [inner, inner, inner]
    with pytest.raises(RemoteProtocolError, match="goes past the end"):
        list(sr.iter_snapshot_untrusted(snapshot[:-1]))
    frame = c.encode_frame([c.Purge("q")])
    with pytest.raises(RemoteProtocolError, match="only Replicated"):
        list(sr.iter_snapshot_untrusted(sr.SNAPSHOT_RECORD.pack(len(frame)) + frame))


# ---------------------------------------------------------------------------
# Relaying frames without decoding them (D's ingress)
# ---------------------------------------------------------------------------


@given(st.lists(st.lists(commands, max_size=4), max_size=8), st.integers(1, 6))
def test_joined_frames_hold_the_same_commands_in_order(
    groups: list[list[c.Command]], max_commands: int
) -> None:
    frames = [c.encode_frame(g) for g in groups]
    joined = c.join_frames(frames, max_commands=max_commands)
    assert [cmd for f in joined for cmd in c.decode_frame_untrusted(f)] == [
        cmd for g in groups for cmd in g
    ]
    for frame in joined:  # over the cap only where one frame alone is
        count = len(c.scan_frame_untrusted(frame))
        assert count <= max(max_commands, *(len(g) for g in groups))


def test_join_frames_keeps_to_the_byte_cap() -> None:
    frames = [c.encode_frame([c.Publish("", "q", b"x" * 1000, f"m-{i}")]) for i in range(10)]
    joined = c.join_frames(frames, max_bytes=3500)
    assert [len(c.scan_frame_untrusted(f)) for f in joined] == [3, 3, 3, 1]
    assert c.join_frames([]) == []


def test_a_head_is_read_without_decoding_the_inner_commands() -> None:
    inner = c.encode_frame([c.QueueDeclare("q")])
    # Damage the inner declare's meta: decoding the whole command fails ...
    inner = inner[:-1] + b"\xff"
    cmd = c.Replicated("site-p", 5, 42, 3, 7, (Mode.FULL,), (c.QueueDeclare("q"),))
    kind, key, rest = c.encode_command(cmd)
    rest = rest[: len(rest) - len(c.encode_frame(cmd.commands))] + inner
    frame = one_command_frame(kind, key, rest)
    with pytest.raises(RemoteProtocolError):
        c.decode_frame_untrusted(frame)
    # ... while its head reads, typed, and the tail is the inner frame as sent.
    (ref,) = c.scan_frame_untrusted(frame)
    meta, tail = c.decode_head_untrusted(frame, ref)
    assert (ref[1], meta["incarnation"], meta["origin_cseq"], meta["epoch"]) == ("site-p", 5, 42, 3)
    assert meta["modes"] == (Mode.FULL,)
    assert bytes(tail) == inner


@pytest.mark.parametrize("cut", [0, 3, 6, 9])
def test_a_cut_head_is_refused(cut: int) -> None:
    cmd = c.Replicated("site-p", 5, 42, 3, 7, (Mode.FULL,), (c.QueueDeclare("q"),))
    frame = c.encode_frame([cmd])
    (ref,) = c.scan_frame_untrusted(frame)
    kind, key, _size, offset = ref
    short = frame[: offset + cut]
    with pytest.raises(RemoteProtocolError):
        c.decode_head_untrusted(short, (kind, key, cut, offset))


@given(commands)
def test_the_meta_fast_path_agrees_with_the_construct_declaration(cmd: c.Command) -> None:
    """Meta structs are built and parsed by a plan derived from their
    construct declaration (several times faster); both give the same bytes
    and the same typed fields."""
    codec = c._CODEC_OF[type(cmd)]
    packed = codec.plan.pack(cmd)
    assert packed == codec.meta.build(codec.meta_out(cmd))
    fast = codec.meta_in(codec.plan.unpack_untrusted(packed))
    assert fast == codec.meta_in(codec.meta.parse(packed)) == codec.meta_out(cmd)


@given(st.dictionaries(names, st.tuples(u64, u64).map(sorted).map(tuple), max_size=5))
def test_join_have_ranges_round_trip(ranges: dict[str, tuple[int, int]]) -> None:
    assert c.have_ranges_untrusted(c.pack_have_ranges(ranges)) == ranges


@given(st.binary(max_size=80))
def test_join_have_ranges_refuse_only_with_protocol_errors(data: bytes) -> None:
    with contextlib.suppress(RemoteProtocolError):
        c.have_ranges_untrusted(data)
