"""What every ``.bdiff`` version shares: the header a reader returns, the
interface a version implements, and the bounds checks every reader applies.

Nothing here knows a particular version; ``v1`` and ``v2`` build on it and
the package's registry (``blockdiff.engine.formats``) picks between them.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from blockdiff.engine.extents import RangeSet
from blockdiff.errors import InvalidDiff

# Every version begins with 8 bytes of magic, "BDIFF" and then its own.
MAGIC_SIZE = 8
MAGIC_PREFIX = b"BDIFF"
NO_DATA = 0xFFFFFFFFFFFFFFFF     # the data position of a range without stored data
NO_ID = bytes(16)                # a snapshot id nobody knows
BASE_DIGEST_SIZE = 32            # BLAKE2b-256 of the whole base (engine.diff.whole_base_digest)
# No file can be larger than this (off_t is signed 64 bits), so no size,
# offset or end read from a header may exceed it.
MAX_FILE_SIZE = (1 << 63) - 1


@dataclass(frozen=True)
class DiffHeader:
    """Everything a diff says about itself, whatever its version.

    ``ranges`` gives each range's kind; ``data_pos`` where its data starts,
    relative to ``data_offset`` (``NO_DATA`` for ZERO ranges); ``crc`` the
    CRC32C of its data (None for a version without data checksums). Fields a
    version cannot record keep their defaults.
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
    base_digest: bytes | None = None   # BLAKE2b-256 of the whole base, if recorded


class DiffFormat(ABC):
    """One version of the ``.bdiff`` format: its data layout, its writer and
    its reader, and what a diff of it can record.

    A version module defines one subclass, an instance of it as ``FORMAT``,
    and the registry lists it. Create and apply ask it instead of testing
    version numbers.
    """

    name: str                      # as create_diff(format=...) takes it: "v1"
    version: int                   # DiffHeader.version of the diffs it reads and writes
    magic: bytes                   # a file's first MAGIC_SIZE bytes
    # What a diff of this version records besides its ranges and their data.
    records_has_base: bool         # whether it was made against a base at all
    records_base_identity: bool    # the base's fingerprint and snapshot id
    records_target_id: bool        # the snapshot id of the target it rebuilds
    records_base_digest: bool      # a digest of the whole base (on request)
    checksums_data: bool           # a CRC32C of each DATA range's data

    @property
    def label(self) -> str:
        """The version as a diff names itself, e.g. "BDIFFv2"."""
        return self.magic.rstrip(b"\0").decode("ascii")

    @abstractmethod
    def range_table(self, ranges: RangeSet) -> RangeSet:
        """The table to write for the changed ``ranges`` (what the version
        cannot record is expressed with what it can)."""

    @abstractmethod
    def layout_data(self, table: RangeSet) -> np.ndarray:
        """Where each range's data goes, relative to the data offset
        (``NO_DATA`` for a range without stored data)."""

    @abstractmethod
    def data_region_length(self, table: RangeSet, data_pos: np.ndarray) -> int:
        """Bytes in the data region, up to the end of the last range's data."""

    @abstractmethod
    def data_offset(self, range_count: int) -> int:
        """Where the data region starts after a table of ``range_count`` ranges."""

    @abstractmethod
    def encode(self, header: DiffHeader) -> bytes:
        """The header and range table, padded to ``header.data_offset``."""

    @abstractmethod
    def read(self, fd: int, path: str, file_size: int) -> DiffHeader:
        """Read and validate the header and table of a file with this magic,
        with the bounds checks below (``InvalidDiff`` or ``ChecksumMismatch``)."""


def round_up(value: int, align: int) -> int:
    """``value`` rounded up to a multiple of ``align``."""
    return (value + align - 1) // align * align


# ---------------------------------------------------------------- reading


def read_exact(fd: int, offset: int, length: int, what: str, path: str,
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


def check_size(path: str, what: str, value: int) -> None:
    """Refuse a size no file can have."""
    if value > MAX_FILE_SIZE:
        raise InvalidDiff(f"{path} is corrupt: its {what} {value:#x} is larger than any "
                          f"file can be (2^63-1 bytes)")


def check_ranges(path: str, offset: np.ndarray, length: np.ndarray, target_size: int) -> None:
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


def check_data_region(path: str, data_offset: int, data_length: int, file_size: int) -> None:
    """Refuse a data region that does not lie within the file."""
    end = data_offset + data_length
    if end > file_size:
        raise InvalidDiff(f"{path} is truncated: its data region ends at byte {end} but the "
                          f"file has only {file_size} bytes; copy the diff again")


def check_table_in_file(path: str, count: int, table_offset: int, entry_size: int,
                        file_size: int) -> None:
    """Refuse a range table that does not lie within the file, before it is
    allocated or read."""
    table_end = table_offset + count * entry_size
    if table_end > file_size:
        raise InvalidDiff(f"{path} is truncated or corrupt: it claims a range table of {count} "
                          f"ranges at byte {table_offset}, ending at byte {table_end}, but the "
                          f"file has only {file_size} bytes")
