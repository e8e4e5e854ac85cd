"""BDIFFv2 (and its minor version 2.1), ours and the default
(docs/format.md, "BDIFFv2").

A 192-byte header with checksums of itself and of the range table, the
base's size, fingerprint and snapshot id, the target's snapshot id and
optionally (2.1) a digest of the whole base; a table of 32-byte entries
with each range's kind, data position and data CRC32C; then the data of
the DATA ranges only, each on a block boundary so it can be reflinked.
"""

from __future__ import annotations

import struct

import numpy as np

from blockdiff import native
from blockdiff.engine.extents import DATA, ZERO, RangeSet
from blockdiff.engine.formats.common import (
    BASE_DIGEST_SIZE,
    NO_DATA,
    DiffFormat,
    DiffHeader,
    check_data_region,
    check_ranges,
    check_size,
    check_table_in_file,
    read_exact,
    round_up,
)
from blockdiff.errors import ChecksumMismatch, InvalidDiff

V2_MAGIC = b"BDIFFv2\0"
V2_VERSION = 2               # the major version; a reader refuses any other
V2_HEADER_SIZE = 192
V2_FLAG_HAS_BASE = 1
V2_FLAG_BASE_DIGEST = 2      # minor 1: a digest of the whole base at header bytes 128-159
BLOCK_SIZE = 4096            # the block size the writer uses
# Largest block size a header may give (the data offset is a multiple of it).
MAX_BLOCK_SIZE = 1 << 20
# Blocks a fingerprint may sample: 16 MiB of reads of the base. Writers use
# identity.FINGERPRINT_SAMPLES (256); more is refused rather than read.
MAX_FINGERPRINT_SAMPLES = 4096

HEADER = struct.Struct("<8sHHIIIQQQQQQ16sII16s16s56sII")
assert HEADER.size == V2_HEADER_SIZE
V2_RANGE = np.dtype([("offset", "<u8"), ("length", "<u8"), ("data_pos", "<u8"),
                     ("kind", "<u4"), ("crc", "<u4")])


class V2Format(DiffFormat):
    """BDIFFv2: zero ranges, the base's identity, checksums, room to grow."""

    name = "v2"
    version = V2_VERSION
    magic = V2_MAGIC
    records_has_base = True
    records_base_identity = True
    records_target_id = True
    records_base_digest = True
    checksums_data = True

    def range_table(self, ranges: RangeSet) -> RangeSet:
        """The ranges as they are: v2 records ZERO ranges."""
        return ranges

    def layout_data(self, table: RangeSet) -> np.ndarray:
        """DATA ranges only, each starting on a block boundary, in table order."""
        block = np.uint64(BLOCK_SIZE)
        is_data = table.kind == DATA
        padded = np.where(is_data, (table.length + block - np.uint64(1)) // block * block,
                          np.uint64(0))
        pos = np.zeros(len(table), np.uint64)
        np.cumsum(padded[:-1], out=pos[1:])
        return np.where(is_data, pos, np.uint64(NO_DATA))

    def data_region_length(self, table: RangeSet, data_pos: np.ndarray) -> int:
        """Up to the end of the last DATA range's data, not padded at the end:
        a last range that stops at an unaligned target size then stops at the
        diff's end of file too, which is where the kernel allows an unaligned
        reflink, on both sides."""
        is_data = table.kind == DATA
        if not is_data.any():
            return 0
        last = np.flatnonzero(is_data)[-1]
        return int(data_pos[last]) + int(table.length[last])

    def data_offset(self, range_count: int) -> int:
        """The table's end rounded up to the block size."""
        return round_up(V2_HEADER_SIZE + range_count * V2_RANGE.itemsize, BLOCK_SIZE)

    def encode(self, header: DiffHeader) -> bytes:
        """The v2 header and range table, padded to the block-aligned data offset.
        A 2.0 header unless it carries a base digest (then 2.1)."""
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
        fixed = HEADER.pack(*fields)
        fields[-1] = native.crc32c(fixed[:-4])
        fixed = HEADER.pack(*fields)
        head = fixed + table_bytes
        return head + bytes(header.data_offset - len(head))

    def read(self, fd: int, path: str, file_size: int) -> DiffHeader:
        """Header checksum, version, a layout that fits the file, the table's
        checksum, kinds, ranges and data positions, in that order."""
        fixed = read_exact(fd, 0, V2_HEADER_SIZE, "header", path, file_size)
        (_, major, minor, header_size, block_size, flags, target_size, base_size, count,
         table_offset, data_offset, data_length, fingerprint, samples, _reserved, base_id,
         target_id, digest_field, table_crc, header_crc) = HEADER.unpack(fixed)
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
        check_table_in_file(path, count, table_offset, V2_RANGE.itemsize, file_size)
        check_data_region(path, data_offset, data_length, file_size)
        check_size(path, "target size", target_size)
        check_size(path, "base size", base_size)
        if samples > MAX_FINGERPRINT_SAMPLES:
            raise InvalidDiff(f"{path} is corrupt: its base fingerprint samples {samples} blocks, "
                              f"more than the {MAX_FINGERPRINT_SAMPLES} a reader accepts")
        table_bytes = read_exact(fd, table_offset, count * V2_RANGE.itemsize, "range table",
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
        check_ranges(path, offset, length, target_size)
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
            version=V2_VERSION, target_size=target_size, base_size=base_size,
            has_base=bool(flags & V2_FLAG_HAS_BASE),
            ranges=RangeSet(offset, length, kind.astype(np.uint8)),
            data_pos=data_pos, crc=table["crc"].astype(np.uint32),
            data_offset=data_offset, data_length=data_length, block_size=block_size,
            base_fingerprint=fingerprint, fingerprint_samples=samples,
            base_id=base_id, target_id=target_id,
            base_digest=digest_field[:BASE_DIGEST_SIZE] if flags & V2_FLAG_BASE_DIGEST else None)


FORMAT = V2Format()
