"""The binary wire format: named numpy arrays in one buffer, shared by server and client.

A frame is::

    offset  size  field
    0       4     magic b"TKNA"
    4       2     version, uint16 little-endian (currently 1)
    6       2     reserved, zero
    8       4     header length N, uint32 little-endian
    12      N     header: UTF-8 JSON {"meta": {...}, "arrays": [{"name", "dtype", "shape", "offset"}, ...]}
    D             data section, D = 12 + N rounded up to a multiple of 8; zero padding before it
    D + offset    each array's bytes, C order, little-endian ("<i4", "<i8", ...), every offset a
                  multiple of 8 and each array zero-padded to a multiple of 8

Every array is read with ``np.frombuffer(frame, dtype, count, offset)``: no copy, no parsing of ids.
A ragged batch (one id sequence per text) is a flat ``ids`` array plus ``offsets`` (int64, one more
entry than there are sequences): sequence i is ``ids[offsets[i]:offsets[i + 1]]``.
"""

from __future__ import annotations

import itertools
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenizer_client._json import dumps, loads

MEDIA_TYPE = "application/x-tokenizer-arrays"
MAGIC = b"TKNA"
VERSION = 1
ALIGNMENT = 8

_PREFIX = struct.Struct("<4sHHI")
_ALLOWED_DTYPES = frozenset({"<i2", "<u2", "<i4", "<u4", "<i8", "<u8", "<f4", "<f8", "|u1", "|i1", "|b1"})
MAX_DIMENSIONS = 32  # numpy's own limit is 64; no array of the service has more than 2


class WireFormatError(ValueError):
    """A buffer is not a frame of this format, or is truncated or corrupt."""


@dataclass(frozen=True)
class Frame:
    """Decoded frame: metadata plus read-only array views into the original buffer."""

    meta: dict[str, Any]
    arrays: dict[str, np.ndarray] = field(default_factory=dict)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.arrays[name]


def _little_endian(array: np.ndarray) -> np.ndarray:
    array = np.ascontiguousarray(array)
    return array.astype(array.dtype.newbyteorder("<"), copy=False) if array.dtype.itemsize > 1 else array


def _dtype_code(dtype: np.dtype) -> str:
    code: str = dtype.str
    if code not in _ALLOWED_DTYPES:
        raise WireFormatError(f"dtype {dtype} cannot travel in a frame")
    return code


def _aligned(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def encode_parts(
    arrays: Mapping[str, np.ndarray | Sequence[np.ndarray]], meta: Mapping[str, Any] | None = None
) -> list[bytes | memoryview]:
    """Encode to a list of buffers whose concatenation is the frame (lets the caller avoid a copy).

    An entry may also be a sequence of 1-D arrays of one dtype: they travel end to end as one
    array, without being concatenated first.
    """
    prepared: dict[str, list[np.ndarray]] = {}
    descriptors: list[dict[str, Any]] = []
    offset = 0
    for name, value in arrays.items():
        pieces = (
            [_little_endian(np.asarray(value))]
            if isinstance(value, np.ndarray)
            else [_little_endian(np.asarray(piece)) for piece in value]
        )
        if not pieces:
            raise WireFormatError(f"array {name!r} has no pieces")
        if len(pieces) == 1:
            shape = list(pieces[0].shape)
        else:
            if any(piece.ndim != 1 or piece.dtype != pieces[0].dtype for piece in pieces):
                raise WireFormatError(f"pieces of array {name!r} must be 1-D and of one dtype")
            shape = [sum(len(piece) for piece in pieces)]
        nbytes = sum(piece.nbytes for piece in pieces)
        prepared[name] = pieces
        descriptors.append({"name": name, "dtype": _dtype_code(pieces[0].dtype), "shape": shape, "offset": offset})
        offset += _aligned(nbytes)
    header = dumps({"meta": dict(meta or {}), "arrays": descriptors})
    head = _PREFIX.pack(MAGIC, VERSION, 0, len(header)) + header
    parts: list[bytes | memoryview] = [head + b"\0" * (_aligned(len(head)) - len(head))]
    for pieces in prepared.values():
        nbytes = 0
        for piece in pieces:
            if piece.nbytes:
                parts.append(piece.data.cast("B"))
                nbytes += piece.nbytes
        if nbytes % ALIGNMENT:
            parts.append(b"\0" * (ALIGNMENT - nbytes % ALIGNMENT))
    return parts


def encode(arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any] | None = None) -> bytes:
    """Encode named arrays and JSON-able metadata into one frame."""
    return b"".join(encode_parts(arrays, meta))


def decode(buffer: bytes | bytearray | memoryview) -> Frame:
    """Decode a frame without copying array data; raises WireFormatError on anything malformed."""
    view = memoryview(buffer)
    if view.nbytes < _PREFIX.size:
        raise WireFormatError(f"frame of {view.nbytes} bytes is shorter than its {_PREFIX.size}-byte prefix")
    magic, version, _reserved, header_length = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise WireFormatError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise WireFormatError(f"unsupported frame version {version}, this reader knows {VERSION}")
    header_end = _PREFIX.size + header_length
    if header_end > view.nbytes:
        raise WireFormatError("frame is truncated inside its header")
    try:
        header = loads(bytes(view[_PREFIX.size : header_end]))
        descriptors = header["arrays"]
        meta = header["meta"]
    except (ValueError, KeyError, TypeError) as exc:
        raise WireFormatError(f"unreadable frame header: {exc}") from exc
    if not isinstance(descriptors, list):
        raise WireFormatError(f"the frame header's arrays are a {type(descriptors).__name__}, not a list")
    data_start = _aligned(header_end)
    arrays: dict[str, np.ndarray] = {}
    for descriptor in descriptors:
        try:
            name = descriptor["name"]
            code = descriptor["dtype"]
            shape = tuple(descriptor["shape"])
            offset = descriptor["offset"]
        except (KeyError, TypeError, ValueError) as exc:
            raise WireFormatError(f"bad array descriptor {descriptor!r:.200}: {exc}") from exc
        # Shapes and offsets are exact non-negative integers (not 1e30, not true), checked before any arithmetic.
        if (
            not isinstance(name, str)
            or not isinstance(code, str)
            or code not in _ALLOWED_DTYPES
            or len(shape) > MAX_DIMENSIONS
            or not all(type(n) is int and n >= 0 for n in (*shape, offset))
        ):
            raise WireFormatError(f"bad array descriptor {descriptor!r:.200}")
        dtype = np.dtype(code)
        offset += data_start
        count = math.prod(shape)
        if offset + count * dtype.itemsize > view.nbytes:
            raise WireFormatError(f"frame is truncated inside array {name!r}")
        arrays[name] = np.frombuffer(view, dtype=dtype, count=count, offset=offset).reshape(shape)
    return Frame(meta=meta, arrays=arrays)


def ragged_offsets(lengths: np.ndarray) -> np.ndarray:
    """Offsets (int64, len(lengths) + 1 entries, starting at 0) of sequences with these lengths."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def split_ragged(flat: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
    """Views of each sequence in a flat ragged array (no copy)."""
    bounds = offsets.tolist()
    return [flat[start:end] for start, end in itertools.pairwise(bounds)]
