"""The byte protocol between the server process and one worker process, over a socket pair.

Every message, either way, is one frame::

    offset  size  field
    0       4     payload length L, uint32 little-endian
    4       4     job number, uint32 little-endian (the server's; a reply carries its job's)
    8       1     kind (below)
    9       L     payload

A worker answers the jobs on its socket one at a time, in the order they came: the oldest job
without a reply is the one it is running. Only a SHARE comes before a job's reply (carrying that
job's number); the job still runs until its reply. That is how the server knows which job a dead or
stalled worker held, with no bookkeeping in the worker.

Pure logic: building frames and cutting a byte stream into frames. Both sides use it.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

HEADER = struct.Struct("<IIB")
HEADER_SIZE = HEADER.size

# Server to worker
REQUEST = 1  # a raw HTTP body to parse, check and answer, or to split into chunks
CHUNK = 2  # part of a split request (pickled by the worker that split it)
FINISH = 3  # the parts of a split /v1/pack request, to pack and answer
PING = 4  # a round trip: the worker has loaded its models
POISON = 5  # remember a text that killed workers (no reply)
FALLBACK = 6  # encode this model with its reference library from now on (no reply)
PROMOTE = 7  # encode this model with fastokens from now on: its gate passed in the background (no reply)

# Worker to server
DONE = 11  # the whole answer: meta + body bytes
SPLIT = 12  # the request is large: here are its chunks (seeded: all of them, for the sampler)
PART = 13  # one chunk's result
FAILED = 14  # the request is refused: an error body (JSON)
PONG = 15
SHARE = 16  # before a job's reply: chunks of a large request for other workers; the job's own chunk follows
VERIFIED = 17  # unsolicited (job 0), after a reply: shadow verification's count, and a mismatch if one was found


def frame(job: int, kind: int, payload: bytes | bytearray | memoryview = b"") -> list[bytes | bytearray | memoryview]:
    """A frame as buffers to write one after the other (no copy of the payload)."""
    return [HEADER.pack(len(payload), job, kind), payload]


def frame_parts(
    job: int, kind: int, parts: Sequence[bytes | bytearray | memoryview]
) -> list[bytes | bytearray | memoryview]:
    """A frame whose payload is the concatenation of `parts`."""
    size = sum(len(part) for part in parts)
    return [HEADER.pack(size, job, kind), *parts]


BLOB_COUNT = struct.Struct("<I")


def join_blobs(blobs: Sequence[bytes | bytearray | memoryview]) -> list[bytes | bytearray | memoryview]:
    """Several byte strings as one payload: a count, their lengths (uint64), then each in turn."""
    head = BLOB_COUNT.pack(len(blobs)) + struct.pack(f"<{len(blobs)}Q", *(len(blob) for blob in blobs))
    return [head, *blobs]


def split_blobs(payload: bytes | bytearray | memoryview, start: int = 0) -> list[memoryview]:
    """The byte strings `join_blobs` put into `payload[start:]`, as views (no copy)."""
    view = memoryview(payload)
    (count,) = BLOB_COUNT.unpack_from(view, start)
    lengths = struct.unpack_from(f"<{count}Q", view, start + BLOB_COUNT.size)
    position = start + BLOB_COUNT.size + 8 * count
    blobs = []
    for length in lengths:
        blobs.append(view[position : position + length])
        position += length
    if position != len(view):
        raise ValueError("blob payload length does not add up")
    return blobs


class FrameReader:
    """Cuts a byte stream into (job, kind, payload) frames, copying each payload at most once.

    Small frames are cut out of a scratch buffer; a large payload gets a buffer of its own that
    the socket is read into directly (`buffer()` / `advance()`, asyncio's BufferedProtocol shape).
    """

    SCRATCH = 256 * 1024

    def __init__(self) -> None:
        self._scratch = bytearray(self.SCRATCH)
        self._view = memoryview(self._scratch)
        self._start = 0  # first unconsumed byte in scratch
        self._end = 0  # one past the last byte received into scratch
        self._large: bytearray | None = None  # payload being received directly
        self._large_view: memoryview | None = None
        self._large_filled = 0
        self._large_header: tuple[int, int] = (0, 0)

    def buffer(self) -> memoryview:
        """Where the next bytes from the socket go."""
        if self._large_view is not None:
            return self._large_view[self._large_filled :]
        if self._end == len(self._scratch):
            self._compact()
        return self._view[self._end :]

    def _compact(self) -> None:
        pending = self._end - self._start
        self._view[:pending] = self._view[self._start : self._end]
        self._start, self._end = 0, pending

    def advance(self, received: int) -> list[tuple[int, int, bytes | bytearray]]:
        """`received` bytes were written into `buffer()`: the frames now complete, in order."""
        frames: list[tuple[int, int, bytes | bytearray]] = []
        if self._large is not None:
            self._large_filled += received
            if self._large_filled < len(self._large):
                return frames
            job, kind = self._large_header
            frames.append((job, kind, self._large))
            self._large = self._large_view = None
            return frames
        self._end += received
        while True:
            available = self._end - self._start
            if available < HEADER_SIZE:
                break
            length, job, kind = HEADER.unpack_from(self._scratch, self._start)
            if available - HEADER_SIZE >= length:
                begin = self._start + HEADER_SIZE
                frames.append((job, kind, self._scratch[begin : begin + length]))
                self._start = begin + length
                continue
            if HEADER_SIZE + length > self.SCRATCH // 2:
                # Large: give it a buffer of its own, seeded with what already arrived.
                self._large = bytearray(length)
                self._large_view = memoryview(self._large)
                have = available - HEADER_SIZE
                begin = self._start + HEADER_SIZE
                self._large_view[:have] = self._view[begin : begin + have]
                self._large_filled = have
                self._large_header = (job, kind)
                self._start = self._end = 0
                return frames
            if self._start:  # room for the rest of a small frame
                self._compact()
            break
        if self._start == self._end:
            self._start = self._end = 0
        return frames

    def feed(self, data: bytes | bytearray | memoryview) -> list[tuple[int, int, bytes | bytearray]]:
        """Push `data` through `buffer()`/`advance()`: for tests and blocking readers."""
        frames: list[tuple[int, int, bytes | bytearray]] = []
        view = memoryview(data)
        while len(view):
            target = self.buffer()
            count = min(len(target), len(view))
            target[:count] = view[:count]
            view = view[count:]
            frames.extend(self.advance(count))
        return frames
