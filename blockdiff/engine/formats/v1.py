"""BDIFFv1, CognitionAI's format, byte for byte (docs/format.md, "BDIFFv1").

A fixed header, a table of (offset, length) pairs, zero padding to 4 KiB,
then the data of every range back to back. It records no zero ranges, no
base identity and no checksums: a ZERO range is written as a range whose
data is a hole, and a base is checked only by its size.
"""

from __future__ import annotations

import struct

import numpy as np

from blockdiff.engine.extents import DATA, RangeSet, union
from blockdiff.engine.formats.common import (
    DiffFormat,
    DiffHeader,
    check_data_region,
    check_ranges,
    check_size,
    check_table_in_file,
    read_exact,
    round_up,
)

V1_MAGIC = b"BDIFFv1\0"
V1_ALIGN = 4096
V1_RANGE = np.dtype([("offset", "<u8"), ("length", "<u8")])
HEADER = struct.Struct("<8sQQQ")   # magic, target size, base size, range count


def encode_v1(target_size: int, base_size: int, ranges: RangeSet) -> bytes:
    """The v1 header and range table, padded to the 4 KiB data boundary."""
    table = np.empty(len(ranges), V1_RANGE)
    table["offset"] = ranges.offset
    table["length"] = ranges.length
    head = HEADER.pack(V1_MAGIC, target_size, base_size, len(ranges)) + table.tobytes()
    return head + bytes(round_up(len(head), V1_ALIGN) - len(head))


class V1Format(DiffFormat):
    """BDIFFv1: ranges and their data, and the two sizes."""

    name = "v1"
    version = 1
    magic = V1_MAGIC
    records_has_base = False
    records_base_identity = False
    records_target_id = False
    records_base_digest = False
    checksums_data = False

    def range_table(self, ranges: RangeSet) -> RangeSet:
        """ZERO ranges join the table as ranges whose stored data is a hole
        (reading as zeros wherever the diff goes), merged with their neighbours."""
        start, end = union(ranges.offset, ranges.offset + ranges.length)
        return RangeSet(start, end - start, np.full(len(start), DATA, np.uint8))

    def layout_data(self, table: RangeSet) -> np.ndarray:
        """The data of every range packed back to back."""
        pos = np.zeros(len(table), np.uint64)
        np.cumsum(table.length[:-1], out=pos[1:])
        return pos

    def data_region_length(self, table: RangeSet, data_pos: np.ndarray) -> int:
        """The sum of the lengths (every range has data)."""
        return int(table.length.sum(dtype=np.uint64))

    def data_offset(self, range_count: int) -> int:
        """The table's end rounded up to 4 KiB."""
        return round_up(HEADER.size + range_count * V1_RANGE.itemsize, V1_ALIGN)

    def encode(self, header: DiffHeader) -> bytes:
        """v1 has no base flag: a diff made without a base records the target's
        own size as the base size, as CognitionAI's tool does."""
        base_size = header.base_size if header.has_base else header.target_size
        return encode_v1(header.target_size, base_size, header.ranges)

    def read(self, fd: int, path: str, file_size: int) -> DiffHeader:
        """The sizes, then the table once the file is known to hold it and the
        start of the data region."""
        _, target_size, base_size, count = HEADER.unpack(
            read_exact(fd, 0, HEADER.size, "header", path, file_size))
        check_size(path, "target size", target_size)
        check_size(path, "base size", base_size)
        check_table_in_file(path, count, HEADER.size, V1_RANGE.itemsize, file_size)
        data_offset = self.data_offset(count)
        # The data region starts at data_offset: a file that ends before it is
        # refused before its table is read.
        check_data_region(path, data_offset, 0, file_size)
        table = np.frombuffer(read_exact(fd, HEADER.size, count * V1_RANGE.itemsize,
                                         "range table", path, file_size), V1_RANGE)
        offset = table["offset"].astype(np.uint64)
        length = table["length"].astype(np.uint64)
        check_ranges(path, offset, length, target_size)
        ranges = RangeSet(offset, length, np.full(count, DATA, np.uint8))
        data_pos = self.layout_data(ranges)
        # Disjoint ranges within the target: the sum cannot pass the target size.
        data_length = self.data_region_length(ranges, data_pos)
        check_data_region(path, data_offset, data_length, file_size)
        # Whether it was made against a base is unknown: has_base says "maybe".
        return DiffHeader(
            version=self.version, target_size=target_size, base_size=base_size,
            has_base=True, ranges=ranges, data_pos=data_pos, crc=None,
            data_offset=data_offset, data_length=data_length)


FORMAT = V1Format()
