"""The ``.bdiff`` file formats: CognitionAI's ``BDIFFv1`` and our ``BDIFFv2``.

Both are documented in docs/format.md. This module encodes and decodes
headers and range tables and validates everything it reads; it does no data
transfer. Readers raise ``InvalidDiff`` (or ``ChecksumMismatch``) with a
message naming the file and the problem.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np

from blockdiff import native
from blockdiff.engine.extents import DATA, ZERO, RangeSet
from blockdiff.errors import ChecksumMismatch, InvalidDiff

V1_MAGIC = b"BDIFFv1\0"
V2_MAGIC = b"BDIFFv2\0"
V1_ALIGN = 4096
V2_VERSION = 2
V2_HEADER_SIZE = 192
V2_FLAG_HAS_BASE = 1
V2_FLAG_BASE_DIGEST = 2      # minor 1: a digest of the whole base at header bytes 128-159
BASE_DIGEST_SIZE = 32
NO_DATA = 0xFFFFFFFFFFFFFFFF
NO_ID = bytes(16)

_V1_FIXED = struct.Struct("<8sQQQ")
_V2_FIXED = struct.Struct("<8sHHIIIQQQQQQ16sII16s16s56sII")
assert _V2_FIXED.size == V2_HEADER_SIZE

V1_RANGE = np.dtype([("offset", "<u8"), ("length", "<u8")])
V2_RANGE = np.dtype([("offset", "<u8"), ("length", "<u8"), ("data_pos", "<u8"),
                     ("kind", "<u4"), ("crc", "<u4")])


@dataclass(frozen=True)
class DiffHeader:
    """Everything a diff says about itself, whatever its version.

    ``ranges`` gives each range's kind; ``data_pos`` where its data starts,
    relative to ``data_offset`` (``NO_DATA`` for ZERO ranges); ``crc`` the
    CRC32C of its data (v2 only).
    """

    version: int
    target_size: int
    base_size: int
    has_base: bool
    ranges: RangeSet
    data_pos: np.ndarray
    crc: np.ndarray | None
    data_offset: int
    data_length: int
    block_size: int = 4096
    base_fingerprint: bytes = bytes(16)
    fingerprint_samples: int = 0
    base_id: bytes = NO_ID
    target_id: bytes = NO_ID
    base_digest: bytes | None = None   # v2.1: BLAKE2b-256 of the whole base, if recorded


def _round_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


def layout_data(ranges: RangeSet, *, version: int, block: int = 4096) -> np.ndarray:
    """Where each range's data goes in the data region.

    v1 packs the data of every range back to back (ZERO ranges included: their
    data is left as a hole, which reads as zeros). v2 stores DATA ranges only,
    each starting on a block boundary so it can be reflinked in and out.
    """
    if version == 1:
        pos = np.zeros(len(ranges), np.uint64)
        np.cumsum(ranges.length[:-1], out=pos[1:])
        return pos
    is_data = ranges.kind == DATA
    padded = np.where(is_data, (ranges.length + np.uint64(block - 1)) // np.uint64(block)
                      * np.uint64(block), np.uint64(0))
    pos = np.zeros(len(ranges), np.uint64)
    np.cumsum(padded[:-1], out=pos[1:])
    return np.where(is_data, pos, np.uint64(NO_DATA))


def data_region_length(ranges: RangeSet, data_pos: np.ndarray, *, version: int) -> int:
    """Bytes in the data region: up to the end of the last range's data.

    Not padded at the end: a last range that stops at an unaligned target size
    then stops at the diff's end of file too, which is where the kernel allows
    an unaligned reflink, on both sides.
    """
    if len(ranges) == 0:
        return 0
    if version == 1:
        return int(ranges.length.sum(dtype=np.uint64))
    is_data = ranges.kind == DATA
    if not is_data.any():
        return 0
    last = np.flatnonzero(is_data)[-1]
    return int(data_pos[last]) + int(ranges.length[last])


def encode_v1(target_size: int, base_size: int, ranges: RangeSet) -> bytes:
    """The v1 header and range table, padded to the 4 KiB data boundary."""
    table = np.empty(len(ranges), V1_RANGE)
    table["offset"] = ranges.offset
    table["length"] = ranges.length
    head = _V1_FIXED.pack(V1_MAGIC, target_size, base_size, len(ranges)) + table.tobytes()
    return head + bytes(_round_up(len(head), V1_ALIGN) - len(head))


def encode_v2(header: DiffHeader) -> bytes:
    """The v2 header and range table, padded to the block-aligned data offset."""
    ranges = header.ranges
    table = np.zeros(len(ranges), V2_RANGE)
    table["offset"] = ranges.offset
    table["length"] = ranges.length
    table["data_pos"] = header.data_pos
    table["kind"] = ranges.kind
    if header.crc is not None:
        table["crc"] = header.crc
    table_bytes = table.tobytes()
    digest = header.base_digest
    fields = [V2_MAGIC, V2_VERSION, 0 if digest is None else 1, V2_HEADER_SIZE,
              header.block_size, (V2_FLAG_HAS_BASE if header.has_base else 0)
              | (0 if digest is None else V2_FLAG_BASE_DIGEST),
              header.target_size, header.base_size, len(ranges), V2_HEADER_SIZE,
              header.data_offset, header.data_length,
              header.base_fingerprint, header.fingerprint_samples, 0,
              header.base_id, header.target_id,
              (digest or b"").ljust(56, b"\0"),
              native.crc32c(table_bytes), 0]
    fixed = _V2_FIXED.pack(*fields)
    fields[-1] = native.crc32c(fixed[:-4])
    fixed = _V2_FIXED.pack(*fields)
    head = fixed + table_bytes
    return head + bytes(header.data_offset - len(head))


def v2_data_offset(range_count: int, block: int = 4096) -> int:
    """Where a v2 data region starts for a table of ``range_count`` ranges."""
    return _round_up(V2_HEADER_SIZE + range_count * V2_RANGE.itemsize, block)


# ---------------------------------------------------------------- reading

# No file can be larger than this (off_t is signed 64 bits), so no size,
# offset or end read from a header may exceed it.
MAX_FILE_SIZE = (1 << 63) - 1
# Blocks a v2 fingerprint may sample: 16 MiB of reads of the base. Writers use
# identity.FINGERPRINT_SAMPLES (256); more is refused rather than read.
MAX_FINGERPRINT_SAMPLES = 4096
# Largest block size a v2 header may give (the data offset is a multiple of it).
MAX_BLOCK_SIZE = 1 << 20


def _read_exact(fd: int, offset: int, length: int, what: str, path: str,
                file_size: int) -> bytes:
    """``length`` bytes at ``offset``, after checking the file holds them: nothing
    is allocated or read for a part that lies past the end of the file."""
    if offset + length > file_size:
        raise InvalidDiff(f"{path} is truncated: its {what} ends at byte {offset + length} "
                          f"but the file has only {file_size} bytes; copy the diff again")
    data = os.pread(fd, length, offset)
    if len(data) != length:
        raise InvalidDiff(f"{path} is truncated: its {what} ends at byte {offset + length} "
                          f"but the file has only {offset + len(data)} bytes; "
                          f"copy the diff again")
    return data


def _check_size(path: str, what: str, value: int) -> None:
    if value > MAX_FILE_SIZE:
        raise InvalidDiff(f"{path} is corrupt: its {what} {value:#x} is larger than any "
                          f"file can be (2^63-1 bytes)")


def _check_ranges(path: str, offset: np.ndarray, length: np.ndarray, target_size: int) -> None:
    """Ranges sorted, disjoint, without 64-bit overflow and within the target
    (which is at most ``MAX_FILE_SIZE``, so every end is below 2^63)."""
    end = offset + length
    wrapped = np.flatnonzero(end < offset)
    if len(wrapped):
        i = int(wrapped[0])
        raise InvalidDiff(f"{path} is corrupt: range {i} (offset {int(offset[i]):#x}, length "
                          f"{int(length[i]):#x}) overflows 64 bits")
    if len(offset) > 1:
        bad = np.flatnonzero(offset[1:] < end[:-1])
        if len(bad):
            i = int(bad[0]) + 1
            raise InvalidDiff(f"{path} is corrupt: range {i} at {int(offset[i]):#x} is out of "
                              f"order or overlaps the range before it")
    beyond = np.flatnonzero(end > np.uint64(target_size))
    if len(beyond):
        i = int(beyond[0])
        raise InvalidDiff(f"{path} is corrupt: range {i} ends at {int(end[i]):#x}, past the "
                          f"target size {target_size:#x}")


def read_header(fd: int, path: str | os.PathLike) -> DiffHeader:
    """Read and validate a diff's header and range table (v1 or v2).

    Checks magic, version, sizes, checksums of the header and table, order and
    bounds of the ranges, and that the data region is all there. Every count,
    offset and length is checked against the file's size before anything is
    allocated or read for it. It does not read the data itself.
    """
    path = os.fspath(path)
    file_size = os.fstat(fd).st_size
    magic = os.pread(fd, 8, 0)
    if magic == V1_MAGIC:
        header = _read_v1(fd, path, file_size)
    elif magic == V2_MAGIC:
        header = _read_v2(fd, path, file_size)
    elif len(magic) < 8:
        raise InvalidDiff(f"{path} is not a blockdiff file: it is only {len(magic)} bytes long")
    elif magic[:5] == b"BDIFF":
        raise InvalidDiff(f"{path} is a blockdiff file of an unknown version "
                          f"{magic.rstrip(bytes(1)).decode('ascii', 'replace')!r}; "
                          f"upgrade blockdiff to read it")
    else:
        raise InvalidDiff(f"{path} is not a blockdiff file (wrong magic bytes {magic!r})")
    return header


def _check_data_region(path: str, data_offset: int, data_length: int, file_size: int) -> None:
    end = data_offset + data_length
    if end > file_size:
        raise InvalidDiff(f"{path} is truncated: its data region ends at byte {end} but the "
                          f"file has only {file_size} bytes; copy the diff again")


def _table_past_end(path: str, count: int, table_offset: int, table_end: int,
                    file_size: int) -> None:
    raise InvalidDiff(f"{path} is truncated or corrupt: it claims a range table of {count} "
                      f"ranges at byte {table_offset}, ending at byte {table_end}, but the file "
                      f"has only {file_size} bytes")


def _read_v1(fd: int, path: str, file_size: int) -> DiffHeader:
    magic, target_size, base_size, count = _V1_FIXED.unpack(
        _read_exact(fd, 0, _V1_FIXED.size, "header", path, file_size))
    _check_size(path, "target size", target_size)
    _check_size(path, "base size", base_size)
    table_end = _V1_FIXED.size + count * V1_RANGE.itemsize
    if table_end > file_size:
        _table_past_end(path, count, _V1_FIXED.size, table_end, file_size)
    data_offset = _round_up(table_end, V1_ALIGN)
    # The data region starts at data_offset: a file that ends before it is
    # refused before its table is read.
    _check_data_region(path, data_offset, 0, file_size)
    table = np.frombuffer(_read_exact(fd, _V1_FIXED.size, count * V1_RANGE.itemsize,
                                      "range table", path, file_size), V1_RANGE)
    offset = table["offset"].astype(np.uint64)
    length = table["length"].astype(np.uint64)
    _check_ranges(path, offset, length, target_size)
    ranges = RangeSet(offset, length, np.full(count, DATA, np.uint8))
    data_pos = layout_data(ranges, version=1)
    # Disjoint ranges within the target: the sum cannot pass the target size.
    data_length = data_region_length(ranges, data_pos, version=1)
    _check_data_region(path, data_offset, data_length, file_size)
    return DiffHeader(
        version=1, target_size=target_size, base_size=base_size, has_base=True,
        ranges=ranges, data_pos=data_pos, crc=None,
        data_offset=data_offset, data_length=data_length)


def _read_v2(fd: int, path: str, file_size: int) -> DiffHeader:
    fixed = _read_exact(fd, 0, V2_HEADER_SIZE, "header", path, file_size)
    (magic, major, minor, header_size, block_size, flags, target_size, base_size, count,
     table_offset, data_offset, data_length, fingerprint, samples, _reserved, base_id,
     target_id, _pad, table_crc, header_crc) = _V2_FIXED.unpack(fixed)
    if native.crc32c(fixed[:-4]) != header_crc:
        raise ChecksumMismatch(f"{path} is corrupt: its header checksum does not match")
    if major != V2_VERSION:
        raise InvalidDiff(f"{path} is a v2 diff of format version {major}.{minor}; "
                          f"upgrade blockdiff to read it")
    impossible = f"{path} is corrupt: its header describes an impossible layout"
    if block_size < 512 or block_size > MAX_BLOCK_SIZE or block_size & (block_size - 1):
        raise InvalidDiff(f"{impossible} (block size {block_size}, not a power of two from "
                          f"512 to {MAX_BLOCK_SIZE})")
    if header_size < V2_HEADER_SIZE or table_offset < header_size:
        raise InvalidDiff(f"{impossible} (header size {header_size}, range table at "
                          f"{table_offset:#x})")
    table_end = table_offset + count * V2_RANGE.itemsize
    if data_offset % block_size or data_offset < table_end:
        raise InvalidDiff(f"{impossible} (data offset {data_offset:#x} is not a multiple of "
                          f"the block size {block_size} after a range table of {count} "
                          f"ranges at {table_offset:#x})")
    # The header is self-consistent; now all it describes must be in the file
    # (the table ends before the data offset, so this bounds the table too).
    if table_end > file_size:
        _table_past_end(path, count, table_offset, table_end, file_size)
    _check_data_region(path, data_offset, data_length, file_size)
    _check_size(path, "target size", target_size)
    _check_size(path, "base size", base_size)
    if samples > MAX_FINGERPRINT_SAMPLES:
        raise InvalidDiff(f"{path} is corrupt: its base fingerprint samples {samples} blocks, "
                          f"more than the {MAX_FINGERPRINT_SAMPLES} a reader accepts")
    table_bytes = _read_exact(fd, table_offset, count * V2_RANGE.itemsize, "range table",
                              path, file_size)
    if native.crc32c(table_bytes) != table_crc:
        raise ChecksumMismatch(f"{path} is corrupt: its range table checksum does not match")
    table = np.frombuffer(table_bytes, V2_RANGE)
    offset = table["offset"].astype(np.uint64)
    length = table["length"].astype(np.uint64)
    kind = table["kind"]
    unknown = np.flatnonzero(kind > ZERO)
    if len(unknown):
        i = int(unknown[0])
        raise InvalidDiff(f"{path} is corrupt: range {i} has an unknown kind {int(kind[i])}")
    _check_ranges(path, offset, length, target_size)
    data_pos = table["data_pos"].astype(np.uint64)
    is_data = kind == DATA
    pos, lens = data_pos[is_data], length[is_data]
    # data_length < 2^63 (it is within the file): compared without wrapping.
    region = np.uint64(data_length)
    outside = (pos > region) | (lens > region - np.minimum(pos, region))
    if (np.any(pos % np.uint64(block_size)) or np.any(outside)
            or np.any(pos[1:] < pos[:-1] + lens[:-1])):
        raise InvalidDiff(f"{path} is corrupt: range data positions overlap or fall outside "
                          f"the data region")
    return DiffHeader(
        version=2, target_size=target_size, base_size=base_size,
        has_base=bool(flags & V2_FLAG_HAS_BASE),
        ranges=RangeSet(offset, length, kind.astype(np.uint8)),
        data_pos=data_pos, crc=table["crc"].astype(np.uint32),
        data_offset=data_offset, data_length=data_length, block_size=block_size,
        base_fingerprint=fingerprint, fingerprint_samples=samples,
        base_id=base_id, target_id=target_id,
        base_digest=_pad[:BASE_DIGEST_SIZE] if flags & V2_FLAG_BASE_DIGEST else None)
