"""The LevelDB-style table that holds a bundle's ``.index`` (TensorFlow's fork of it).

Layout: ``data block(s) | metaindex block | index block | footer (48 bytes)``. Each block is
followed by a 5-byte trailer: a compression type byte (always 0 here) and the masked CRC-32C
of the block bytes plus that type byte. A block holds prefix-compressed entries
(``varint32 shared, varint32 non_shared, varint32 value_len, key delta, value``), then the
restart offsets and their count as little-endian uint32. The index block maps a separator key
(>= every key of the block, < every key of the next) to the block's handle (two varint64s:
offset, size without trailer). The footer holds the metaindex and index handles, zero padding
to 40 bytes, and the magic number.

:class:`TableBuilder` reproduces TensorFlow's writer exactly (block size, restart intervals,
separator shortening), so a table built from the same entries is byte-identical.
"""

from __future__ import annotations

from collections.abc import Iterator

from parallelvars.errors import (
    ChecksumMismatchError,
    CorruptCheckpointError,
    FormatVersionError,
    InvalidEntryError,
    NotACheckpointError,
    TruncatedFileError,
)

from ._crc import crc32c, mask, unmask
from ._proto import DecodeError, decode_varint, encode_varint

__all__ = [
    "BLOCK_SIZE",
    "TABLE_MAGIC",
    "FOOTER_SIZE",
    "find_shortest_separator",
    "find_short_successor",
    "TableBuilder",
    "TableReader",
]

BLOCK_SIZE = 262144  # TensorFlow's table::Options default
DATA_RESTART_INTERVAL = 16
INDEX_RESTART_INTERVAL = 1
OVERLY_LARGE_BLOCK_RATIO = 2
TABLE_MAGIC = 0xDB4775248B80FB57
FOOTER_SIZE = 48
_HANDLES_SIZE = 40  # two BlockHandles at their maximal encoded length (2 x 2 x 10 bytes)
TRAILER_SIZE = 5
_NO_COMPRESSION = 0
_SNAPPY = 1

Handle = tuple[int, int]


def find_shortest_separator(start: bytes, limit: bytes) -> bytes:
    """A short key ``k`` with ``start <= k < limit`` (LevelDB's bytewise comparator rule).

    At the first differing byte ``i``: if ``start[i] < 0xff`` and ``start[i] + 1 < limit[i]``,
    the separator is ``start[:i] + (start[i] + 1)``; otherwise (also when one key is a prefix
    of the other) ``start`` itself.
    """
    n = min(len(start), len(limit))
    i = 0
    while i < n and start[i] == limit[i]:
        i += 1
    if i < n:
        b = start[i]
        if b < 0xFF and b + 1 < limit[i]:
            return start[:i] + bytes([b + 1])
    return start


def find_short_successor(key: bytes) -> bytes:
    """A short key ``>= key``: increment the first byte that is not 0xff and cut after it."""
    for i, b in enumerate(key):
        if b != 0xFF:
            return key[:i] + bytes([b + 1])
    return key


def _common_prefix(a: bytes, b: bytes) -> int:
    """The length of the longest common prefix of ``a`` and ``b`` (slices compared in C,
    halving the range: a few comparisons for keys that share long paths)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class _BlockBuilder:
    def __init__(self, restart_interval: int) -> None:
        self.restart_interval = restart_interval
        self.buf = bytearray()
        self.restarts = [0]
        self.counter = 0
        self.last_key = b""

    def empty(self) -> bool:
        return not self.buf

    def size_estimate(self) -> int:
        return len(self.buf) + 4 * len(self.restarts) + 4

    def add(self, key: bytes, value: bytes) -> None:
        shared = 0
        if self.counter < self.restart_interval:
            shared = _common_prefix(self.last_key, key)
        else:
            self.restarts.append(len(self.buf))
            self.counter = 0
        buf = self.buf
        unshared, size = len(key) - shared, len(value)
        if shared <= 0x7F and unshared <= 0x7F and size <= 0x7F:  # (most entries: one byte each)
            buf += bytes((shared, unshared, size))
        else:
            buf += encode_varint(shared)
            buf += encode_varint(unshared)
            buf += encode_varint(size)
        buf += key[shared:]
        buf += value
        self.last_key = key
        self.counter += 1

    def finish(self) -> bytes:
        tail = b"".join(r.to_bytes(4, "little") for r in self.restarts)
        return bytes(self.buf) + tail + len(self.restarts).to_bytes(4, "little")


def _encode_handle(handle: Handle) -> bytes:
    return encode_varint(handle[0]) + encode_varint(handle[1])


class TableBuilder:
    """Builds a table in memory from keys added in strictly increasing order.

    Example:
        >>> t = TableBuilder()
        >>> t.add(b"a", b"1")
        >>> len(t.finish())
        83
    """

    def __init__(self, block_size: int = BLOCK_SIZE) -> None:
        self.block_size = block_size
        self._out = bytearray()
        self._data = _BlockBuilder(DATA_RESTART_INTERVAL)
        self._index = _BlockBuilder(INDEX_RESTART_INTERVAL)
        self._last_key = b""
        self._num_entries = 0
        self._pending: Handle | None = None
        self.num_data_blocks = 0

    def add(self, key: bytes, value: bytes) -> None:
        if self._num_entries:
            if key <= self._last_key:
                raise InvalidEntryError(
                    f"table keys must increase: {key!r} after {self._last_key!r}"
                )
            if len(key) + len(value) >= OVERLY_LARGE_BLOCK_RATIO * self.block_size:
                self._flush()
        if self._pending is not None:
            sep = find_shortest_separator(self._last_key, key)
            self._index.add(sep, _encode_handle(self._pending))
            self._pending = None
        self._last_key = key
        self._num_entries += 1
        self._data.add(key, value)
        if self._data.size_estimate() >= self.block_size:
            self._flush()

    def _write_block(self, block: _BlockBuilder) -> Handle:
        raw = block.finish()
        handle = (len(self._out), len(raw))
        crc = crc32c(b"\x00", crc32c(raw))
        self._out += raw
        self._out += b"\x00" + mask(crc).to_bytes(4, "little")
        return handle

    def _flush(self) -> None:
        if self._data.empty():
            return
        self._pending = self._write_block(self._data)
        self.num_data_blocks += 1
        self._data = _BlockBuilder(DATA_RESTART_INTERVAL)

    def finish(self) -> bytes:
        """Write the last data block, the metaindex, the index and the footer; the table bytes."""
        self._flush()
        meta = self._write_block(_BlockBuilder(DATA_RESTART_INTERVAL))
        if self._pending is not None:
            succ = find_short_successor(self._last_key)
            self._index.add(succ, _encode_handle(self._pending))
            self._pending = None
        index = self._write_block(self._index)
        handles = _encode_handle(meta) + _encode_handle(index)
        footer = handles.ljust(_HANDLES_SIZE, b"\x00")
        footer += (TABLE_MAGIC & 0xFFFFFFFF).to_bytes(4, "little")
        footer += (TABLE_MAGIC >> 32).to_bytes(4, "little")
        self._out += footer
        return bytes(self._out)


class TableReader:
    """Parses a whole table held in memory, verifying every block checksum.

    Attributes:
        index: ``[(separator_key, (offset, size)), ...]``, one per data block.
        metaindex: the metaindex block's handle.
    """

    def __init__(self, data: bytes, *, file: str) -> None:
        self.data = data
        self.file = file
        if len(data) < FOOTER_SIZE:
            raise TruncatedFileError(
                "index file too short to hold a table footer",
                file=file,
                expected=f">= {FOOTER_SIZE} bytes",
                found=f"{len(data)} bytes",
            )
        footer = data[-FOOTER_SIZE:]
        magic = (
            int.from_bytes(footer[40:44], "little") | int.from_bytes(footer[44:48], "little") << 32
        )
        if magic != TABLE_MAGIC:
            raise NotACheckpointError(
                "not a TensorFlow checkpoint index (bad table magic number)",
                file=file,
                expected=hex(TABLE_MAGIC),
                found=hex(magic),
                hint="the file is not a table index, or it was cut short",
            )
        try:
            off, pos = decode_varint(footer, 0, _HANDLES_SIZE)
            size, pos = decode_varint(footer, pos, _HANDLES_SIZE)
            self.metaindex = (off, size)
            off, pos = decode_varint(footer, pos, _HANDLES_SIZE)
            size, pos = decode_varint(footer, pos, _HANDLES_SIZE)
        except DecodeError as exc:
            raise CorruptCheckpointError(f"bad table footer: {exc}", file=file) from None
        self._index_handle = (off, size)
        self._body_end = len(data) - FOOTER_SIZE
        self.index: list[tuple[bytes, Handle]] = []
        for sep, value in self._block_entries(self._index_handle, "index block"):
            try:
                boff, pos = decode_varint(value, 0, len(value))
                bsize, pos = decode_varint(value, pos, len(value))
            except DecodeError as exc:
                raise CorruptCheckpointError(
                    f"bad block handle in the table index: {exc}",
                    file=file,
                    variable=_key_repr(sep),
                ) from None
            self.index.append((sep, (boff, bsize)))

    def _block(self, handle: Handle, what: str) -> bytes:
        off, size = handle
        if off + size + TRAILER_SIZE > self._body_end:
            raise CorruptCheckpointError(
                f"{what} at offset {off} runs past the table body",
                file=self.file,
                expected=f"end <= {self._body_end}",
                found=off + size + TRAILER_SIZE,
            )
        block = self.data[off : off + size]
        kind = self.data[off + size]
        stored = int.from_bytes(self.data[off + size + 1 : off + size + TRAILER_SIZE], "little")
        actual = crc32c(self.data[off + size : off + size + 1], crc32c(block))
        if unmask(stored) != actual:
            raise ChecksumMismatchError(
                f"{what} at offset {off}: checksum does not match",
                file=self.file,
                expected=hex(unmask(stored)),
                found=hex(actual),
            )
        if kind == _SNAPPY:
            raise FormatVersionError(
                f"{what} at offset {off} is snappy-compressed, which this reader does not support",
                file=self.file,
            )
        if kind != _NO_COMPRESSION:
            raise CorruptCheckpointError(
                f"{what} at offset {off}: unknown block type",
                file=self.file,
                expected=0,
                found=kind,
            )
        return block

    def _block_entries(self, handle: Handle, what: str) -> Iterator[tuple[bytes, bytes]]:
        block = self._block(handle, what)
        n = len(block)
        if n < 4:
            raise CorruptCheckpointError(
                f"{what} of {n} bytes has no restart count", file=self.file
            )
        num_restarts = int.from_bytes(block[n - 4 :], "little")
        if num_restarts > (n - 4) // 4:
            raise CorruptCheckpointError(
                f"{what}: restart count does not fit the block",
                file=self.file,
                expected=f"<= {(n - 4) // 4}",
                found=num_restarts,
            )
        limit = n - 4 - 4 * num_restarts
        pos = 0
        key = b""
        try:
            while pos < limit:
                shared, pos = decode_varint(block, pos, limit, 5)
                non_shared, pos = decode_varint(block, pos, limit, 5)
                value_len, pos = decode_varint(block, pos, limit, 5)
                if shared > len(key) or non_shared + value_len > limit - pos:
                    raise DecodeError("entry overruns the block")
                key = key[:shared] + block[pos : pos + non_shared]
                pos += non_shared
                yield key, block[pos : pos + value_len]
                pos += value_len
        except DecodeError as exc:
            raise CorruptCheckpointError(
                f"{what}: bad entry after key {_key_repr(key)}: {exc}", file=self.file
            ) from None

    def __iter__(self) -> Iterator[tuple[bytes, bytes]]:
        """Every ``(key, value)`` of the data blocks, in order; keys must strictly increase."""
        prev: bytes | None = None
        for i, (sep, handle) in enumerate(self.index):
            for key, value in self._block_entries(handle, f"data block {i}"):
                if prev is not None and key <= prev:
                    raise CorruptCheckpointError(
                        "table keys out of order",
                        file=self.file,
                        variable=_key_repr(key),
                        expected=f"a key after {_key_repr(prev)}",
                        found=_key_repr(key),
                    )
                if key > sep:
                    raise CorruptCheckpointError(
                        f"key beyond its block's separator {_key_repr(sep)}",
                        file=self.file,
                        variable=_key_repr(key),
                    )
                prev = key
                yield key, value


def _key_repr(key: bytes) -> str:
    return key.decode("utf-8", "backslashreplace")
