"""
Framing for the agent link, sans-IO: bytes in, frames out.

A frame is a 4-byte unsigned big-endian length, then that many bytes of one
serialized protobuf message (C{proto/llmgw/v1/agent.proto}; the whole
protocol: docs/architecture.md, "Wire protocol").  A length of zero or over
the maximum is a protocol violation: the connection must be closed.
"""

from __future__ import annotations

import struct

DEFAULT_MAX_FRAME_SIZE = 4 * 1024 * 1024
_LENGTH = struct.Struct(">I")
HEADER_SIZE = _LENGTH.size


class FrameError(Exception):
    """
    A frame's declared length is zero or over the maximum.

    @ivar size: the declared length, bytes.
    @ivar max_frame_size: the maximum in force, bytes.
    """

    def __init__(self, size: int, max_frame_size: int) -> None:
        self.size = size
        self.max_frame_size = max_frame_size
        what = "empty" if size == 0 else f"over the maximum of {max_frame_size}"
        super().__init__(f"frame of {size} bytes: {what}")


def encode_frame(payload: bytes, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> bytes:
    """
    @param payload: one serialized message, 1 to C{max_frame_size} bytes.
    @return: the frame, length prefix included.
    @raise FrameError: C{payload} is empty or too large.
    """
    size = len(payload)
    if size == 0 or size > max_frame_size:
        raise FrameError(size, max_frame_size)
    return _LENGTH.pack(size) + payload


class FrameDecoder:
    """
    Turns a byte stream cut anywhere into whole frame payloads.

    @param max_frame_size: the largest payload accepted, bytes.
    """

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        self._max = max_frame_size
        self._buffer = bytearray()
        self._failed: FrameError | None = None

    def feed(self, data: bytes) -> list[bytes]:
        """
        @param data: the next bytes received, any length.
        @return: the payloads completed by C{data}, in order.
        @raise FrameError: a length prefix is zero or over the maximum; the
            stream cannot be resynchronized, and every later call raises it
            again.
        """
        if self._failed is not None:
            raise self._failed
        buffer = self._buffer
        buffer.extend(data)
        frames: list[bytes] = []
        position = 0
        available = len(buffer)
        while available - position >= HEADER_SIZE:
            (size,) = _LENGTH.unpack_from(buffer, position)
            if size == 0 or size > self._max:
                self._failed = FrameError(size, self._max)
                raise self._failed
            end = position + HEADER_SIZE + size
            if end > available:
                break
            frames.append(bytes(buffer[position + HEADER_SIZE : end]))
            position = end
        if position:
            del buffer[:position]
        return frames

    @property
    def buffered(self) -> int:
        """
        Bytes received that are not yet part of a whole frame.
        """
        return len(self._buffer)
