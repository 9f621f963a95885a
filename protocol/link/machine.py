"""What the link sender and receiver share: transition tables and the error state.

A machine's transitions are a dict keyed by (state, input).  A missing key is a
protocol error: ``LocalProtocolError`` when the input came from our caller,
``RemoteProtocolError`` (code ``UNEXPECTED_FRAME``) when it was a frame from
the peer.  Once a ``RemoteProtocolError`` came out, the machine stays in its
``ERROR`` state and every further input raises a ``RemoteProtocolError`` with
the same code, so a caller that ignores the first one cannot go on by accident.
"""

from __future__ import annotations

import enum
from typing import Generic, TypeVar

from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.link.frames import LinkErrorCode, remote_error

S = TypeVar("S", bound=enum.Enum)
I = TypeVar("I", bound=enum.Enum)  # noqa: E741


class TransitionTable(Generic[S, I]):
    """(state, input) -> next state; frame inputs are those in ``remote_inputs``."""

    __slots__ = ("remote_inputs", "table")

    def __init__(self, table: dict[tuple[S, I], S], remote_inputs: frozenset[I]) -> None:
        self.table = table
        self.remote_inputs = remote_inputs

    def next_state(self, state: S, what: I, role: str) -> S:
        try:
            return self.table[(state, what)]
        except KeyError:
            pass
        if what in self.remote_inputs:
            raise remote_error(
                LinkErrorCode.UNEXPECTED_FRAME,
                f"link {role}: peer sent {what.name} while {state.name}",
            )
        raise LocalProtocolError(
            f"link {role}: {what.name.lower()} is not allowed while {state.name}",
            code=int(LinkErrorCode.UNEXPECTED_FRAME),
        )


class Failure:
    """Remembers the first remote error so later inputs repeat it."""

    __slots__ = ("error",)

    def __init__(self) -> None:
        self.error: RemoteProtocolError | None = None

    def check(self, role: str) -> None:
        if self.error is not None:
            raise RemoteProtocolError(
                f"link {role} already failed: {self.error}",
                code=self.error.code,
                retriable=self.error.retriable,
            )
