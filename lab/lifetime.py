"""What every lab object that starts things shares: ``with`` starts it and
always stops it, also when starting failed halfway."""

from __future__ import annotations

from types import TracebackType
from typing import Self


class Started:
    """A context manager over ``start()`` and ``stop()``.

    ``with x:`` calls ``x.start()``; when that raises, ``x.stop()`` undoes
    what was made before the exception goes on (so ``stop`` must cope with a
    half-started object).  Leaving the block calls ``x.stop()``.
    """

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
