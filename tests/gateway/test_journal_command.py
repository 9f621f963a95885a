"""``drgate journal check`` and ``drgate journal reseed`` on a broker's
journal (gateway/commands/journal.py): what they say, and what they refuse."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster import state as st
from cluster.journal import Journal, JournalError
from gateway.cli import main
from protocol import cluster as pc
from protocol import journal as pj


def broker_config(tmp_path: Path, *, journal: bool = True) -> str:
    path = tmp_path / "broker-2.yaml"
    path.write_text(
        "cluster: site-p\nnode: 2\nbus:\n  backend: corosync\n  group: g\n  expect_brokers: 3\n"
        + (f"journal:\n  directory: {tmp_path / 'journal-2'}\n" if journal else "")
    )
    return str(path)


def write_journal(directory: Path) -> int:
    """A journal of genesis and six declares, three to a record; its last cseq."""
    state = st.new_state()
    with Journal.open(directory) as journal:
        frames = [[pc.Genesis("site-p", 7)]] + [
            [pc.QueueDeclare(f"q{i + j}", {}) for j in range(3)] for i in (0, 3)
        ]
        for frame in frames:
            first = state.cseq + 1
            for cmd in frame:
                st.apply(state, cmd)
            journal.append(first, frame)
        journal.commit()
    return state.cseq


def flip_a_middle_byte(directory: Path) -> tuple[Path, int]:
    """Damage the second record of the segment; (file, that record's offset)."""
    (path,) = directory.glob("journal-*.log")
    data = bytearray(path.read_bytes())
    second = pj.next_record_untrusted(bytes(data), pj.SEGMENT_HEADER_SIZE).end
    data[second + pj.RECORD_HEADER_SIZE + 3] ^= 0x40
    path.write_bytes(bytes(data))
    return path, second


def test_check_says_what_a_healthy_journal_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = broker_config(tmp_path)
    last = write_journal(tmp_path / "journal-2")
    assert main(["journal", "check", "--config", config]) == 0
    out = capsys.readouterr().out
    assert f"journal of broker node 2 of site-p: {tmp_path / 'journal-2'}" in out
    assert f"last cseq: {last}" in out and "checkpoint: none" in out
    assert "torn tail: none" in out and "damage: none" in out
    assert "the broker starts on this journal" in out


def test_check_names_the_damage_and_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = broker_config(tmp_path)
    write_journal(tmp_path / "journal-2")
    path, offset = flip_a_middle_byte(tmp_path / "journal-2")
    before = path.read_bytes()
    assert main(["journal", "check", "--config", config]) == 1
    out = capsys.readouterr().out
    assert f"damage: {path}: byte offset {offset}: CRC mismatch" in out
    assert "drgate journal reseed" in out
    assert path.read_bytes() == before  # a check changes nothing


def test_reseed_moves_a_damaged_journal_aside_and_says_what_next(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = broker_config(tmp_path)
    directory = tmp_path / "journal-2"
    write_journal(directory)
    flip_a_middle_byte(directory)
    with pytest.raises(JournalError):
        Journal.open(directory).close()  # what the broker meets at its start
    assert main(["journal", "reseed", "--config", config]) == 0
    out = capsys.readouterr().out
    (aside,) = tmp_path.glob("journal-2.damaged-*")
    assert not directory.exists() and any(aside.glob("journal-*.log"))
    assert f"moved {directory} aside to {aside}" in out
    assert "takes the state from its peers" in out
    assert f"drgate recover --force --config {config}" in out
    with Journal.open(directory) as journal:  # the broker starts afresh
        assert journal.recover() is None


def test_reseed_refuses_while_the_broker_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = broker_config(tmp_path)
    directory = tmp_path / "journal-2"
    write_journal(directory)
    with Journal.open(directory):  # the running broker holds journal.lock
        assert main(["journal", "reseed", "--config", config, "--even-if-healthy"]) == 1
    err = capsys.readouterr().err
    assert "broker node 2 of site-p is running on this journal" in err
    assert "Stop it first" in err
    assert directory.is_dir() and not list(tmp_path.glob("journal-2.damaged-*"))


def test_reseed_leaves_a_healthy_journal_alone_unless_told(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = broker_config(tmp_path)
    directory = tmp_path / "journal-2"
    last = write_journal(directory)
    assert main(["journal", "reseed", "--config", config]) == 1
    err = capsys.readouterr().err
    assert f"the journal is not damaged (last cseq {last}" in err and "--even-if-healthy" in err
    assert directory.is_dir()
    assert main(["journal", "reseed", "--config", config, "--even-if-healthy"]) == 0
    assert not directory.exists() and len(list(tmp_path.glob("journal-2.damaged-*"))) == 1


def test_a_broker_without_a_journal_has_nothing_to_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["journal", "check", "--config", broker_config(tmp_path, journal=False)]) == 1
    assert "keeps no journal (no 'journal:' section)" in capsys.readouterr().err
