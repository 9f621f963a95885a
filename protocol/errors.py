"""The one error tree of drgate.

Stdlib only, so that every layer can import it.  Errors that cross the wire
carry a numeric ``code``; link errors say whether a retry can help
(``retriable``).  A message meant for a person names the thing, the place and
the fix.
"""

from __future__ import annotations


class DrgateError(Exception):
    """Root of every error drgate raises on purpose."""


class ProtocolError(DrgateError):
    """A wire format or protocol state machine was violated.

    ``code`` is the number carried in an ERROR frame; ``retriable`` says whether
    reconnecting can help.
    """

    code: int = 1
    retriable: bool = False

    def __init__(self, message: str, *, code: int | None = None, retriable: bool | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code
        if retriable is not None:
            self.retriable = retriable


class LocalProtocolError(ProtocolError):
    """We were asked to do something the protocol forbids (our own bug or misuse)."""


class RemoteProtocolError(ProtocolError):
    """The peer (or the bytes it sent) violated the protocol.

    Every ``*_untrusted`` decoder fails with this and nothing else.
    """


class Location:
    """Where in a file a mistake is: file, 1-based line and column."""

    __slots__ = ("column", "file", "line")

    def __init__(self, file: str, line: int, column: int) -> None:
        self.file = file
        self.line = line
        self.column = column

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"

    def __repr__(self) -> str:
        return f"Location({self.file!r}, {self.line}, {self.column})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Location) and (self.file, self.line, self.column) == (
            other.file,
            other.line,
            other.column,
        )

    def __hash__(self) -> int:
        return hash((self.file, self.line, self.column))


class Problem:
    """One mistake found in a file: where, what, and a hint for the fix."""

    __slots__ = ("hint", "location", "message", "severity")

    def __init__(
        self, location: Location, message: str, hint: str = "", severity: str = "error"
    ) -> None:
        self.location = location
        self.message = message
        self.hint = hint
        self.severity = severity

    def __str__(self) -> str:
        text = f"{self.location}: {self.severity}: {self.message}"
        if self.hint:
            text += f" (hint: {self.hint})"
        return text

    def __repr__(self) -> str:
        return f"Problem({str(self)!r})"


class FileProblemsError(DrgateError):
    """A file had mistakes; ``problems`` lists every one with its location."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


class ConfigError(FileProblemsError):
    """A broker or sidecar config file is wrong."""


class RulesError(FileProblemsError):
    """A replication rules file is wrong."""


class LinkError(DrgateError):
    """The WAN link failed or was refused.  ``retriable`` says whether to retry."""

    def __init__(self, message: str, *, code: int = 0, retriable: bool = True) -> None:
        super().__init__(message)
        self.code = code
        self.retriable = retriable


class BusError(DrgateError):
    """The site bus failed: lost connection to corosync or the sequencer."""


class ReplicaError(DrgateError):
    """An operation was refused by the queue state (R3 read-only, unknown queue...).

    ``condition`` is the AMQP error condition to send to a client.
    """

    def __init__(self, message: str, *, condition: str = "amqp:internal-error") -> None:
        super().__init__(message)
        self.condition = condition
