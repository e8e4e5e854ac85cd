"""The .bdiff formats: round trips, the exact v1 byte layout, corrupt input."""

from __future__ import annotations

import os
import struct

import budget
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockdiff import native
from blockdiff.engine import formats as fmt
from blockdiff.engine.extents import DATA, ZERO, RangeSet
from blockdiff.errors import ChecksumMismatch, InvalidDiff, UsageError

BLOCK = 4096


@st.composite
def range_sets(draw):
    """Sorted disjoint block-aligned ranges; the last may end at an unaligned size."""
    gaps_and_lengths = draw(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 6),
                                               st.sampled_from([DATA, ZERO])), max_size=20))
    offset, length, kind = [], [], []
    pos = 0
    for gap, n, k in gaps_and_lengths:
        pos += gap * BLOCK
        offset.append(pos)
        length.append(n * BLOCK)
        kind.append(k)
        pos += n * BLOCK
    tail = draw(st.integers(0, BLOCK - 1))
    if length and tail:
        length[-1] -= tail
        pos -= tail
    size = pos + (0 if tail else draw(st.integers(0, 3)) * BLOCK)
    return RangeSet(np.array(offset, np.uint64), np.array(length, np.uint64),
                    np.array(kind, np.uint8)), size


def _write_v2(path, ranges, size, *, base_size=12345, has_base=True, crc=None):
    data_pos = fmt.layout_data(ranges, version=2)
    data_length = fmt.data_region_length(ranges, data_pos, version=2)
    header = fmt.DiffHeader(
        version=2, target_size=size, base_size=base_size, has_base=has_base, ranges=ranges,
        data_pos=data_pos, crc=np.zeros(len(ranges), np.uint32) if crc is None else crc,
        data_offset=fmt.v2_data_offset(len(ranges)), data_length=data_length,
        base_fingerprint=b"\x11" * 16, fingerprint_samples=1024,
        base_id=b"\x22" * 16, target_id=b"\x33" * 16)
    with open(path, "wb") as f:
        f.write(fmt.encode_v2(header))
        f.truncate(header.data_offset + data_length)
    return header


def _read(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        return fmt.read_header(fd, path)
    finally:
        os.close(fd)


@settings(max_examples=budget.examples(150), deadline=None)
@given(rs=range_sets())
def test_v2_round_trip(tmp_path_factory, rs):
    ranges, size = rs
    path = tmp_path_factory.mktemp("v2") / "d.bdiff"
    written = _write_v2(path, ranges, size)
    got = _read(path)
    assert got.version == 2 and got.target_size == size and got.base_size == 12345
    assert got.has_base and got.base_fingerprint == b"\x11" * 16
    assert got.base_id == b"\x22" * 16 and got.target_id == b"\x33" * 16
    assert got.fingerprint_samples == 1024
    for a, b in ((got.ranges.offset, ranges.offset), (got.ranges.length, ranges.length),
                 (got.ranges.kind, ranges.kind), (got.data_pos, written.data_pos)):
        assert np.array_equal(a, b)
    assert got.data_offset % BLOCK == 0
    data = got.ranges.kind == DATA
    assert np.all(got.data_pos[data] % np.uint64(BLOCK) == 0)


@settings(max_examples=budget.examples(150), deadline=None)
@given(rs=range_sets())
def test_v1_round_trip_and_exact_layout(tmp_path_factory, rs):
    ranges, size = rs
    path = tmp_path_factory.mktemp("v1") / "d.bdiff"
    head = fmt.encode_v1(size, 777, ranges)
    # The layout CognitionAI's tool reads and writes (bincode, little-endian):
    # magic, target size, base size, range count, (offset, length) pairs,
    # zero padding to a 4 KiB boundary.
    expected = b"BDIFFv1\0" + struct.pack("<QQQ", size, 777, len(ranges))
    for off, length in zip(ranges.offset.tolist(), ranges.length.tolist()):
        expected += struct.pack("<QQ", off, length)
    expected += bytes(-len(expected) % 4096)
    assert head == expected
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(len(head) + int(ranges.length.sum()))
    got = _read(path)
    assert got.version == 1 and got.target_size == size and got.base_size == 777
    assert np.array_equal(got.ranges.offset, ranges.offset)
    assert np.array_equal(got.ranges.length, ranges.length)
    assert np.all(got.ranges.kind == DATA)
    assert got.data_offset == len(head)
    # v1 data is packed back to back.
    assert np.array_equal(got.data_pos[1:], np.cumsum(ranges.length)[:-1])


def test_crc32c_known_vectors():
    assert native.crc32c(b"123456789") == 0xE3069283
    assert native.crc32c(b"") == 0
    assert native.crc32c(bytes(32)) == 0x8A9136AA
    # Chaining equals one pass.
    assert native.crc32c(b"6789", native.crc32c(b"12345")) == 0xE3069283


@pytest.fixture
def sample_v2(tmp_path):
    ranges = RangeSet(np.array([0, 8192, 20480], np.uint64),
                      np.array([4096, 8192, 1000], np.uint64),
                      np.array([DATA, ZERO, DATA], np.uint8))
    path = tmp_path / "d.bdiff"
    _write_v2(path, ranges, 21480)
    return path


def _corrupt(path, offset, value: bytes):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(value)


@pytest.mark.parametrize("offset", [8, 24, 40, 72, 100, 150, 186])
def test_v2_header_corruption_is_detected(sample_v2, offset):
    with open(sample_v2, "rb") as f:
        f.seek(offset)
        old = f.read(1)
    _corrupt(sample_v2, offset, bytes([old[0] ^ 0x40]))
    with pytest.raises(ChecksumMismatch, match="header checksum"):
        _read(sample_v2)


def test_v2_table_corruption_is_detected(sample_v2):
    _corrupt(sample_v2, fmt.V2_HEADER_SIZE + 33, b"\x99")
    with pytest.raises(ChecksumMismatch, match="range table checksum"):
        _read(sample_v2)


@pytest.mark.parametrize("keep", [0, 5, 8, 100, 191, 200, 4096, 4096 + 4096 + 500])
def test_truncated_v2_is_refused(sample_v2, keep):
    os.truncate(sample_v2, keep)
    with pytest.raises(InvalidDiff, match="truncated|only"):
        _read(sample_v2)


@pytest.mark.parametrize("keep", [5, 20, 40, 4096, 4096 + 100])
def test_truncated_v1_is_refused(tmp_path, keep):
    ranges = RangeSet(np.array([0, 8192], np.uint64), np.array([4096, 4096], np.uint64),
                      np.array([DATA, DATA], np.uint8))
    path = tmp_path / "d.bdiff"
    head = fmt.encode_v1(12288, 12288, ranges)
    path.write_bytes(head + b"x" * 8192)
    os.truncate(path, keep)
    with pytest.raises(InvalidDiff, match="truncated|only|claims"):
        _read(path)


def test_wrong_magic(tmp_path):
    path = tmp_path / "d.bdiff"
    path.write_bytes(b"NOTADIFF" + bytes(100))
    with pytest.raises(InvalidDiff, match="not a blockdiff file"):
        _read(path)
    path.write_bytes(b"BDIFFv9\0" + bytes(100))
    with pytest.raises(InvalidDiff, match="unknown version"):
        _read(path)


def _v1_file(tmp_path, pairs, target_size):
    head = b"BDIFFv1\0" + struct.pack("<QQQ", target_size, target_size, len(pairs))
    for off, length in pairs:
        head += struct.pack("<QQ", off, length)
    head += bytes(-len(head) % 4096)
    path = tmp_path / "d.bdiff"
    path.write_bytes(head + bytes(sum(n for _, n in pairs)))
    return path


@pytest.mark.parametrize("pairs, message", [
    ([(8192, 4096), (0, 4096)], "out of order"),
    ([(0, 8192), (4096, 4096)], "overlaps"),
    ([(0, 4096), (65536, 4096)], "past the target size"),
    ([(2**64 - 4096, 8192)], "overflows"),
])
def test_bad_v1_ranges(tmp_path, pairs, message):
    with pytest.raises(InvalidDiff, match=message):
        _read(_v1_file(tmp_path, pairs, 16384))


def test_v1_claiming_too_many_ranges(tmp_path):
    path = tmp_path / "d.bdiff"
    path.write_bytes(b"BDIFFv1\0" + struct.pack("<QQQ", 0, 0, 2**40) + bytes(4064))
    with pytest.raises(InvalidDiff, match="claims"):
        _read(path)


def _set_v2_field(path, offset: int, fmt_char: str, value: int) -> None:
    """Set a v2 header field and recompute the header checksum, so the value
    reaches the checks behind it."""
    data = bytearray(path.read_bytes())
    struct.pack_into("<" + fmt_char, data, offset, value)
    struct.pack_into("<I", data, 188, native.crc32c(bytes(data[:188])))
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("fields, message", [
    # A table past the end of any file: once an OverflowError at os.pread.
    ([(48, "Q", 2**63), (56, "Q", 2**63 + 4096)], "range table of 3 ranges at byte"),
    # 2^30 ranges: once a MemoryError reading a 32 GiB table from a 12 KiB file.
    ([(40, "Q", 2**30), (56, "Q", (192 + 32 * 2**30 + 4095) // 4096 * 4096)],
     "claims a range table of 1073741824 ranges"),
    ([(56, "Q", 2**63)], "truncated: its data region ends"),
    ([(64, "Q", 2**64 - 1)], "truncated: its data region ends"),
    ([(24, "Q", 2**63)], "target size 0x8000000000000000 is larger than any file"),
    ([(32, "Q", 2**64 - 1)], "base size 0xffffffffffffffff is larger than any file"),
    ([(88, "I", 2**32 - 1)], "samples 4294967295 blocks"),
    ([(16, "I", 1 << 21)], "block size 2097152"),
    ([(12, "I", 100)], "header size 100"),
])
def test_v2_header_values_beyond_the_file_are_refused(sample_v2, fields, message):
    for offset, fmt_char, value in fields:
        _set_v2_field(sample_v2, offset, fmt_char, value)
    with pytest.raises(InvalidDiff, match=message):
        _read(sample_v2)


@pytest.mark.parametrize("target_size, base_size, pairs, message", [
    (2**63, 4096, [(0, 4096)], "target size 0x8000000000000000"),
    (2**64 - 1, 4096, [(2**63, 4096)], "target size 0xffffffffffffffff"),
    (8192, 2**64 - 1, [(0, 4096)], "base size 0xffffffffffffffff"),
    (2**63 - 1, 4096, [(2**63, 4096)], "past the target size"),
])
def test_v1_sizes_no_file_can_have_are_refused(tmp_path, target_size, base_size, pairs,
                                               message):
    head = b"BDIFFv1\0" + struct.pack("<QQQ", target_size, base_size, len(pairs))
    head += b"".join(struct.pack("<QQ", o, n) for o, n in pairs)
    path = tmp_path / "d.bdiff"
    path.write_bytes(head + bytes(-len(head) % 4096) + bytes(4096))
    with pytest.raises(InvalidDiff, match=message):
        _read(path)


def test_v1_table_is_bounded_by_the_file_before_it_is_read(tmp_path):
    """2^26 ranges claimed by a 4 KiB file: refused without reading 1 GiB."""
    path = tmp_path / "d.bdiff"
    path.write_bytes(b"BDIFFv1\0" + struct.pack("<QQQ", 0, 0, 2**26) + bytes(4064))
    with pytest.raises(InvalidDiff, match="ending at byte 1073741856, but the file has only "
                                          "4096 bytes"):
        _read(path)


@settings(max_examples=budget.examples(150), deadline=None)
@given(rs=range_sets(), form=st.sampled_from(fmt.FORMATS), with_base=st.booleans())
def test_every_registered_format_reads_what_it_writes(tmp_path_factory, rs, form, with_base):
    """Each version's layout, writer and reader agree, and its magic picks it."""
    ranges, size = rs
    table = form.range_table(ranges)
    data_pos = form.layout_data(table)
    data_length = form.data_region_length(table, data_pos)
    header = fmt.DiffHeader(
        version=form.version, target_size=size, base_size=777 if with_base else 0,
        has_base=with_base, ranges=table, data_pos=data_pos,
        crc=np.arange(len(table), dtype=np.uint32) if form.checksums_data else None,
        data_offset=form.data_offset(len(table)), data_length=data_length,
        target_id=b"\x33" * 16 if form.records_target_id else fmt.NO_ID)
    head = form.encode(header)
    assert len(head) == header.data_offset and head[:fmt.MAGIC_SIZE] == form.magic
    path = tmp_path_factory.mktemp(form.name) / "d.bdiff"
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(header.data_offset + data_length)
    got = _read(path)
    assert fmt.of(got) is form and fmt.named(form.name) is form
    assert (got.target_size, got.data_offset, got.data_length) == (size, header.data_offset,
                                                                   data_length)
    for a, b in ((got.ranges.offset, table.offset), (got.ranges.length, table.length),
                 (got.ranges.kind, table.kind), (got.data_pos, data_pos)):
        assert np.array_equal(a, b)
    # Every changed byte is in the table, as data or as zeros.
    assert table.bytes_of(DATA) + table.bytes_of(ZERO) == (ranges.bytes_of(DATA)
                                                          + ranges.bytes_of(ZERO))
    assert got.has_base == with_base or not form.records_has_base
    # Without a base flag (v1), a diff of the target alone gives its own size as the base's.
    assert got.base_size == (777 if with_base else 0 if form.records_has_base else size)
    assert got.target_id == header.target_id
    assert (got.crc is not None) == form.checksums_data
    if form.checksums_data:
        assert np.array_equal(got.crc, header.crc)


def test_unknown_format_names_are_refused_with_the_known_ones():
    with pytest.raises(UsageError, match="unknown diff format 'v9'; use one of v1, v2"):
        fmt.named("v9")
