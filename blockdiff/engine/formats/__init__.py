"""The ``.bdiff`` file formats behind one registry: CognitionAI's ``BDIFFv1``
(``v1``) and our ``BDIFFv2`` (``v2``, minor versions 2.0 and 2.1).

Each version is one module defining a ``DiffFormat`` (``common``): its data
layout, writer and reader, and what its diffs can record. The registry below
lists them, keyed by the magic bytes a file begins with (``read_header``
picks the reader from a file's first bytes), by version number and by the
name ``create_diff(format=...)`` takes. Adding a version is a module beside
``v1`` and ``v2`` and its ``FORMAT`` in ``FORMATS``; create, apply and view
ask the format, not the version number (docs/format.md, "Adding a version").

The modules encode and decode headers and range tables and validate
everything they read; they transfer no data. Readers raise ``InvalidDiff``
(or ``ChecksumMismatch``) with a message naming the file and the problem.
"""

from __future__ import annotations

import os

import numpy as np

from blockdiff.engine.extents import RangeSet
from blockdiff.engine.formats import v1, v2
from blockdiff.engine.formats.common import (
    BASE_DIGEST_SIZE,
    MAGIC_PREFIX,
    MAGIC_SIZE,
    MAX_FILE_SIZE,
    NO_DATA,
    NO_ID,
    DiffFormat,
    DiffHeader,
)
from blockdiff.errors import InvalidDiff, UsageError

# Every version this blockdiff reads and writes, oldest first.
FORMATS: tuple[DiffFormat, ...] = (v1.FORMAT, v2.FORMAT)
_BY_MAGIC = {f.magic: f for f in FORMATS}
_BY_VERSION = {f.version: f for f in FORMATS}
_BY_NAME = {f.name: f for f in FORMATS}
assert len(_BY_MAGIC) == len(_BY_VERSION) == len(_BY_NAME) == len(FORMATS)
assert all(len(f.magic) == MAGIC_SIZE and f.magic.startswith(MAGIC_PREFIX) for f in FORMATS)


def names() -> list[str]:
    """The format names ``named`` takes, oldest first."""
    return list(_BY_NAME)


def named(name: str) -> DiffFormat:
    """The format to write for ``name`` ("v1", "v2"); ``UsageError`` for
    one this blockdiff does not write."""
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise UsageError(f"unknown diff format {name!r}; use one of "
                         f"{', '.join(names())}") from None


def of(header: DiffHeader) -> DiffFormat:
    """The format of a diff ``read_header`` returned (or one built to be written)."""
    return _BY_VERSION[header.version]


def read_header(fd: int, path: str | os.PathLike) -> DiffHeader:
    """Read and validate a diff's header and range table, of whichever version
    its magic bytes name.

    Checks magic, version, sizes, checksums of the header and table (v2),
    order and bounds of the ranges, and that the data region is all there.
    Every count, offset and length is checked against the file's size before
    anything is allocated or read for it. It does not read the data itself.
    """
    path = os.fspath(path)
    file_size = os.fstat(fd).st_size
    magic = os.pread(fd, MAGIC_SIZE, 0)
    form = _BY_MAGIC.get(magic)
    if form is not None:
        return form.read(fd, path, file_size)
    if len(magic) < MAGIC_SIZE:
        raise InvalidDiff(f"{path} is not a blockdiff file: it is only {len(magic)} bytes long")
    if magic.startswith(MAGIC_PREFIX):
        raise InvalidDiff(f"{path} is a blockdiff file of an unknown version "
                          f"{magic.rstrip(bytes(1)).decode('ascii', 'replace')!r}; "
                          f"upgrade blockdiff to read it")
    raise InvalidDiff(f"{path} is not a blockdiff file (wrong magic bytes {magic!r})")


def layout_data(ranges: RangeSet, *, version: int) -> np.ndarray:
    """Where each range's data goes in the data region of a diff of ``version``."""
    return _BY_VERSION[version].layout_data(ranges)


def data_region_length(ranges: RangeSet, data_pos: np.ndarray, *, version: int) -> int:
    """Bytes in the data region of a diff of ``version``."""
    return _BY_VERSION[version].data_region_length(ranges, data_pos)


# The names of each version's parts that callers used before the registry.
V1_MAGIC, V1_ALIGN, V1_RANGE, encode_v1 = v1.V1_MAGIC, v1.V1_ALIGN, v1.V1_RANGE, v1.encode_v1
V2_MAGIC, V2_VERSION, V2_HEADER_SIZE, V2_RANGE = (v2.V2_MAGIC, v2.V2_VERSION, v2.V2_HEADER_SIZE,
                                                  v2.V2_RANGE)
V2_FLAG_HAS_BASE, V2_FLAG_BASE_DIGEST = v2.V2_FLAG_HAS_BASE, v2.V2_FLAG_BASE_DIGEST
encode_v2, v2_data_offset = v2.FORMAT.encode, v2.FORMAT.data_offset

__all__ = ["BASE_DIGEST_SIZE", "FORMATS", "MAGIC_PREFIX", "MAGIC_SIZE", "MAX_FILE_SIZE",
           "NO_DATA", "NO_ID", "V1_ALIGN", "V1_MAGIC", "V1_RANGE", "V2_FLAG_BASE_DIGEST",
           "V2_FLAG_HAS_BASE", "V2_HEADER_SIZE", "V2_MAGIC", "V2_RANGE", "V2_VERSION",
           "DiffFormat", "DiffHeader", "data_region_length", "encode_v1", "encode_v2",
           "layout_data", "named", "names", "of", "read_header", "v2_data_offset"]
