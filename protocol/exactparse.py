"""Parse a compiled construct definition without accepting short fields.

A compiled construct parser reads a ``Bytes``, ``PascalString`` or
``Prefixed`` field with a bare ``io.read(n)`` and takes what it gets: a length
prefix that claims more bytes than are left yields a short field, and the
``Terminated`` after it passes, since everything was read.  (The uncompiled
parser checks; the compiled one does not.)  :func:`parse_exact` runs the
compiled parser over a stream whose reads must return what they ask for, so
such a field is a ``StreamError`` like any other truncation.  It costs a
Python call per field: use it where a definition is parsed per frame or per
block, not per bus command.
"""

from __future__ import annotations

import io
from typing import Any

from construct import StreamError


class _ExactStream(io.BytesIO):
    # One read(1) may come back empty: Terminated's end-of-data probe.  A
    # second (a Flag cut off at the end, then Terminated) is a short read.
    probed_end = False

    def read(self, size: int | None = -1, /) -> bytes:
        data = super().read(size)
        if size is not None and 0 <= size != len(data):
            if data or size != 1 or self.probed_end:
                raise StreamError(f"a field needs {size} bytes, {len(data)} are left")
            self.probed_end = True
        return data


def parse_exact(definition: Any, data: bytes) -> Any:
    """``definition.parse(data)``, failing with ``StreamError`` on a short field."""
    return definition.parse_stream(_ExactStream(data))
