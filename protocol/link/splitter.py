"""Cutting the link's byte stream into frames (the frames themselves:
:mod:`protocol.link.frames`)."""

from __future__ import annotations

import zstandard

from protocol.link.frames import (
    DEFAULT_MAX_FRAME_BYTES,
    HEADER_SIZE,
    LINK_MAGIC,
    Frame,
    FrameHeader,
    LinkErrorCode,
    check_crc_untrusted,
    decode_header_untrusted,
    decode_payload_untrusted,
    remote_error,
)

__all__ = ["FrameSplitter"]


class FrameSplitter:
    """Cuts a byte stream into frames.  Checks each header as soon as it is complete,
    so an oversize or garbage frame is refused before its payload is buffered.
    Compressed payloads are decompressed with one zstd context per stream."""

    __slots__ = ("_buf", "_header", "_pos", "_zstd", "max_frame_bytes")

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self._buf = bytearray()
        self._pos = 0  # start of the unconsumed bytes in _buf
        self._header: FrameHeader | None = None
        self._zstd = zstandard.ZstdDecompressor()
        self.max_frame_bytes = max_frame_bytes

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self._pos and self._pos * 2 >= len(self._buf):
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += data

    @property
    def buffered(self) -> int:
        """Bytes received and not yet returned as frames."""
        return len(self._buf) - self._pos

    def next_frame_untrusted(self) -> Frame | None:
        """The next complete frame, or None when more bytes are needed."""
        buf = self._buf
        pos = self._pos
        avail = len(buf) - pos
        if self._header is None:
            if avail >= 2 and buf[pos : pos + 2] != LINK_MAGIC:
                raise remote_error(
                    LinkErrorCode.BAD_MAGIC, f"bad magic {bytes(buf[pos : pos + 2])!r}"
                )
            if avail < HEADER_SIZE:
                return None
            self._header = decode_header_untrusted(
                bytes(buf[pos : pos + HEADER_SIZE]), self.max_frame_bytes
            )
        header = self._header
        total = HEADER_SIZE + header.length
        if avail < total:
            return None
        head = bytes(buf[pos : pos + 9])
        payload = bytes(buf[pos + HEADER_SIZE : pos + total])
        check_crc_untrusted(head, payload, header)
        self._pos = pos + total
        self._header = None
        return decode_payload_untrusted(
            header, payload, max_frame_bytes=self.max_frame_bytes, zstd=self._zstd
        )
