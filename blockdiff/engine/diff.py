"""The diff engine: create a diff of a target against a base, apply it to a base.

Create maps both files (FIEMAP after fsync), computes the changed ranges with
the extent algebra, and reflinks the changed data into the diff. Apply
reflinks the base into a temporary file, reflinks the diff's data over it,
punches the zero ranges, sets the size, fsyncs and renames. Where reflink is
impossible (another filesystem, no reflink support) both copy instead, and
where the filesystem cannot tell shared extents apart, create compares
content. Results are byte-identical either way; only the speed differs.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
from dataclasses import dataclass, field

import numpy as np

from blockdiff import native
from blockdiff.engine import formats as fmt
from blockdiff.engine import identity
from blockdiff.engine.extents import (
    DATA,
    ZERO,
    ExtentMap,
    RangeSet,
    changed_ranges,
    ranges_from_block_classes,
)
from blockdiff.engine.files import atomic_output, clone_or_copy, open_fd
from blockdiff.engine.units import human_size
from blockdiff.errors import ChecksumMismatch, UsageError, WrongBase
from blockdiff.progress import NO_PROGRESS, Progress

BLOCK = 4096
# Filesystems whose FIEMAP physical addresses identify shared (reflinked) data.
_SHARING_FILESYSTEMS = {native.XFS_MAGIC: "xfs", native.BTRFS_MAGIC: "btrfs"}


@dataclass
class CreateResult:
    """What ``create_diff`` did."""

    path: str
    version: int
    target_size: int
    base_size: int
    ranges: int
    data_bytes: int
    zero_bytes: int
    method: str                # "extents" or "content"
    reflinked: int             # data ranges reflinked rather than copied
    target_id: bytes = fmt.NO_ID
    notes: list[str] = field(default_factory=list)


@dataclass
class ApplyResult:
    """What ``apply_diff`` did."""

    path: str
    version: int
    target_size: int
    ranges: int
    data_bytes: int
    zero_bytes: int
    base_reflinked: bool
    reflinked: int
    notes: list[str] = field(default_factory=list)


def _fs_name(fs_type: int) -> str:
    return native.FS_NAMES.get(fs_type, f"type {fs_type:#x}")


def _refuse_same_file(output: str, what: str, inputs: dict[str, str | None]) -> None:
    """Refuse to write an output over one of the inputs it is made from."""
    for name, path in inputs.items():
        try:
            same = path is not None and os.path.samefile(output, path)
        except FileNotFoundError:
            same = False
        if same:
            raise UsageError(f"{what} {output} is the same file as {name}; "
                             f"choose another {what}")


# ------------------------------------------------------------------ create


def diff_ranges(target_fd: int, target_path: str, base_fd: int | None,
                base_path: str | None) -> tuple[RangeSet, str, list[str]]:
    """The ranges where target differs from base, and how they were found.

    Returns ``(ranges, method, notes)``; method is "extents" (physical
    addresses) or "content" (byte comparison, for filesystems that cannot tell
    shared extents apart, or a base on another filesystem).
    """
    # Flushed once here: the extent maps below need no FIEMAP_FLAG_SYNC.
    native.fsync(target_fd, target_path)
    t_type, _, t_dev = native.fs_info(target_fd, target_path)
    notes: list[str] = []
    reason = None
    if base_fd is None:
        try:
            tmap = ExtentMap.of_file(target_fd, target_path, sync=False)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.ENOTTY):
                raise
            reason = f"{_fs_name(t_type)} has no extent maps"
        else:
            tmap.check_supported(target_path)
            return changed_ranges(tmap, None, BLOCK), "extents", notes
    else:
        native.fsync(base_fd, base_path)
        _, _, b_dev = native.fs_info(base_fd, base_path)
        if t_dev != b_dev:
            reason = "the target and the base are on different filesystems"
        elif t_type not in _SHARING_FILESYSTEMS:
            reason = f"{_fs_name(t_type)} does not share extents between files"
        else:
            tmap = ExtentMap.of_file(target_fd, target_path, sync=False)
            tmap.check_supported(target_path)
            bmap = ExtentMap.of_file(base_fd, base_path, sync=False)
            return changed_ranges(tmap, bmap, BLOCK), "extents", notes
    notes.append(f"{reason}: comparing contents instead (correct, but reads both files in full)")
    return compare_contents(target_fd, target_path, base_fd), "content", notes


def compare_contents(target_fd: int, target_path: str, base_fd: int | None) -> RangeSet:
    """The ranges where two open files differ, found by reading both (for
    filesystems that cannot tell shared extents apart). Without a base: the
    target's non-zero blocks."""
    target_size = os.fstat(target_fd).st_size
    base_size = 0 if base_fd is None else os.fstat(base_fd).st_size
    classes = native.compare_blocks(target_fd, target_size, -1 if base_fd is None else base_fd,
                                    base_size, BLOCK, target_path)
    return ranges_from_block_classes(classes, BLOCK, target_size)


def create_diff(out: str | os.PathLike, target: str | os.PathLike,
                base: str | os.PathLike | None = None, *, format: str = "v2",
                target_id: bytes | None = None, base_digest: bool = False,
                progress: Progress = NO_PROGRESS) -> CreateResult:
    """Write a diff of ``target`` against ``base`` (or of target alone) to ``out``.

    ``format`` is "v2" (default: zero ranges, base identity, checksums) or
    "v1" (CognitionAI's BDIFFv1). Data is reflinked into ``out`` when it is on
    the target's filesystem and copied otherwise. ``out`` appears complete or
    not at all. ``base_digest`` (v2) also records a digest of the whole base,
    read in full, for ``apply_diff(..., verify_base=True)``. Writing the
    data is a phase of ``progress``.
    """
    form = fmt.named(format)
    if base_digest and not form.records_base_digest:
        able = " or ".join(f.name for f in fmt.FORMATS if f.records_base_digest)
        raise UsageError(f"a {form.name} diff cannot record a digest of its whole base; "
                         f"make a {able} diff for --base-digest")
    out, target = os.fspath(out), os.fspath(target)
    base = None if base is None else os.fspath(base)
    _refuse_same_file(out, "OUT", {"TARGET": target, "BASE": base})
    _refuse_same_file(target, "TARGET", {"BASE": base})   # a diff of nothing, by mistake
    with contextlib.ExitStack() as stack:
        target_fd = stack.enter_context(open_fd(target))
        base_fd = None if base is None else stack.enter_context(open_fd(base))
        ranges, method, notes = diff_ranges(target_fd, target, base_fd, base)
        target_size = os.fstat(target_fd).st_size
        base_size = target_size if base_fd is None else os.fstat(base_fd).st_size
        table = form.range_table(ranges)
        data_pos = form.layout_data(table)
        data_length = form.data_region_length(table, data_pos)
        data_offset = form.data_offset(len(table))

        # Only DATA is stored; a ZERO range a format writes as a DATA range
        # (v1) is left a hole in the data region, which reads as zeros
        # wherever the diff goes.
        is_data = ranges.kind == DATA
        src, length = ranges.offset[is_data], ranges.length[is_data]
        containing = np.searchsorted(table.offset, src, side="right") - 1
        dst = np.uint64(data_offset) + data_pos[containing] + (src - table.offset[containing])
        out_fd, out_temp = stack.enter_context(atomic_output(out))
        progress.start(int(length.sum()), "B", "writing the diff")
        crcs, reflinked = native.transfer_ranges(target_fd, out_fd, src, dst, length, out_temp,
                                                 checksums=form.checksums_data, progress=progress)
        crc = None
        if crcs is not None:
            crc = np.zeros(len(table), np.uint32)
            crc[containing] = crcs
        new_id = (target_id or os.urandom(16)) if form.records_target_id else fmt.NO_ID
        header = fmt.DiffHeader(
            version=form.version, target_size=target_size,
            base_size=0 if base_fd is None else base_size, has_base=base_fd is not None,
            ranges=table, data_pos=data_pos, crc=crc,
            data_offset=data_offset, data_length=data_length, target_id=new_id,
            **_base_identity(form, base_fd, base_size, base, base_digest))
        os.pwrite(out_fd, form.encode(header), 0)
        # Sets the size exactly, leaving unwritten parts (v1 zero ranges) as holes.
        native.truncate(out_fd, data_offset + data_length, out_temp)
    if reflinked < len(src) and method == "extents":
        notes.append(f"copied {len(src) - reflinked} of {len(src)} data ranges instead of "
                     f"reflinking them (the output is on another filesystem or reflink is "
                     f"unavailable)")
    return CreateResult(
        path=out, version=form.version, target_size=target_size, base_size=base_size,
        ranges=len(table), data_bytes=ranges.bytes_of(DATA), zero_bytes=ranges.bytes_of(ZERO),
        method=method, reflinked=reflinked, target_id=new_id, notes=notes)


def _base_identity(form: fmt.DiffFormat, base_fd: int | None, base_size: int,
                   base: str | None, digest: bool) -> dict:
    """The header fields naming the base, as far as ``form`` records them
    (each costs reads of the base, so none is computed for a format without
    it); ``digest`` asks for the digest of the whole base too."""
    fields: dict = {}
    if base_fd is None:
        return fields
    if form.records_base_identity:
        fields.update(base_fingerprint=identity.fingerprint(base_fd, base_size, base),
                      fingerprint_samples=identity.FINGERPRINT_SAMPLES,
                      base_id=identity.read_snapshot_id(base_fd) or fmt.NO_ID)
    if digest:   # create_diff refuses it for a format that cannot record it
        fields["base_digest"] = whole_base_digest(base_fd, base_size, base)
    return fields


# ------------------------------------------------------------------- apply


def whole_base_digest(fd: int, size: int, path: str) -> bytes:
    """BLAKE2b-256 (personalisation ``blockdiff-whole``) of the base size as 8
    little-endian bytes and then every byte of the base: what a v2.1 diff
    records with ``create --base-digest`` and ``apply --verify-base`` compares."""
    h = hashlib.blake2b(size.to_bytes(8, "little"), digest_size=fmt.BASE_DIGEST_SIZE,
                        person=b"blockdiff-whole")
    buffer = bytearray(8 << 20)
    view, offset = memoryview(buffer), 0
    while offset < size:
        n = os.preadv(fd, [view[:min(len(buffer), size - offset)]], offset)
        if n == 0:
            raise OSError(errno.EIO, "the base ended before its size while it was read", path)
        h.update(view[:n])
        offset += n
    return h.digest()


def _check_base(header: fmt.DiffHeader, diff: str, base_fd: int | None,
                base: str | None, verify_base: bool = False) -> None:
    """Refuse a base (or its absence) the diff was not made against, checking
    everything the diff's format records about it."""
    form = fmt.of(header)
    if verify_base and not form.records_base_digest:
        raise UsageError(f"{diff} is a {form.name} diff, which records no digest of its "
                         f"whole base; --verify-base needs a diff made with --base-digest")
    if base_fd is None:
        if header.has_base and form.records_has_base:
            raise UsageError(f"{diff} was made against a base of {header.base_size} bytes; "
                             f"pass it with --base")
        return
    if not header.has_base:
        raise UsageError(f"{diff} was made without a base (it holds the whole image); "
                         f"apply it without --base")
    base_size = os.fstat(base_fd).st_size
    if base_size != header.base_size:
        raise WrongBase(f"{base} is not the base of {diff}: it has {base_size} bytes, the diff "
                        f"expects {header.base_size}; pass the base the diff was made from")
    if not form.records_base_identity:
        return
    known = identity.read_snapshot_id(base_fd)
    if known and header.base_id != fmt.NO_ID and known != header.base_id:
        raise WrongBase(f"{base} is snapshot {known.hex()}, but {diff} was made against "
                        f"snapshot {header.base_id.hex()}; pass the right base")
    actual = identity.fingerprint(base_fd, base_size, base, header.fingerprint_samples)
    if actual != header.base_fingerprint:
        raise WrongBase(f"{base} is not the base of {diff}: its content fingerprint differs; "
                        f"pass the base the diff was made from")
    if not verify_base:
        return
    if header.base_digest is None:
        raise UsageError(f"{diff} records no digest of its whole base (it was made without "
                         f"--base-digest), so the base can be checked only by its size, "
                         f"fingerprint and snapshot id; apply it without --verify-base, or "
                         f"make the diff again with: blockdiff create --base-digest")
    if whole_base_digest(base_fd, base_size, base) != header.base_digest:
        raise WrongBase(f"{base} is not the base of {diff}: read in full, its content differs "
                        f"from the base the diff was made from; pass the right base")


def verify_data(diff_fd: int, header: fmt.DiffHeader, diff: str,
                progress: Progress = NO_PROGRESS) -> None:
    """Check every data range against its CRC32C, for a format that records
    them (v1 does not), a phase of ``progress``."""
    if not fmt.of(header).checksums_data:
        return
    is_data = header.ranges.kind == DATA
    progress.start(int(header.ranges.length[is_data].sum()), "B", "checking the diff")
    crcs, _ = native.transfer_ranges(
        diff_fd, -1, np.uint64(header.data_offset) + header.data_pos[is_data], None,
        header.ranges.length[is_data], diff, checksums=True, progress=progress)
    bad = np.flatnonzero(crcs != header.crc[is_data])
    if len(bad):
        i = int(np.flatnonzero(is_data)[bad[0]])
        raise ChecksumMismatch(
            f"{diff} is corrupt: the data of range {i} (offset {int(header.ranges.offset[i]):#x}, "
            f"{int(header.ranges.length[i])} bytes) does not match its checksum; "
            f"{len(bad)} range(s) damaged in all; copy the diff again")


def read_diff(path: str | os.PathLike) -> fmt.DiffHeader:
    """Read and validate a diff's header and range table."""
    path = os.fspath(path)
    with open_fd(path) as fd:
        return fmt.read_header(fd, path)


def _check_capacity(header: fmt.DiffHeader, diff: str, target: str) -> None:
    """Refuse, before anything is read or written, a target larger than the
    whole filesystem it would be written to.

    A target may be sparse, so only the data apply writes has to fit in the
    free space (and running out is an ENOSPC that leaves nothing behind); but
    no file on a filesystem is meant to be larger than the filesystem itself,
    and a small diff claiming a vast target is refused here rather than made
    into a file nothing can read through.
    """
    directory = os.path.dirname(os.path.abspath(target))
    st = os.statvfs(directory)
    capacity = st.f_blocks * st.f_frsize
    if capacity and header.target_size > capacity:   # 0: the filesystem does not say
        raise OSError(errno.ENOSPC,
                      f"No space left on device: {diff} describes a target of "
                      f"{header.target_size} bytes ({human_size(header.target_size)}), larger "
                      f"than the whole filesystem ({human_size(capacity)}) it would be "
                      f"written to", target)


def _check_file_size(fd: int, header: fmt.DiffHeader, diff: str, target: str,
                     temp: str) -> None:
    """Refuse a target larger than the filesystem's largest file, asking the
    kernel: sizing the new, empty file up and back down costs nothing."""
    try:
        native.truncate(fd, header.target_size, temp)
    except OSError as e:
        if e.errno not in (errno.EFBIG, errno.EINVAL):
            raise
        raise OSError(errno.EFBIG, f"File too large: {diff} describes a target of "
                                   f"{header.target_size} bytes, more than this filesystem "
                                   f"allows in one file", target) from None
    native.truncate(fd, 0, temp)


def apply_diff(diff: str | os.PathLike, target: str | os.PathLike,
               base: str | os.PathLike | None = None, *,
               verify_base: bool = False, progress: Progress = NO_PROGRESS) -> ApplyResult:
    """Rebuild the target a diff describes, at ``target``, from ``base``.

    Verifies the diff (header, table, v2 data checksums) and the base before
    writing anything: its size; for v2 its fingerprint (256 sampled blocks, so
    a base that differs only elsewhere passes) and, when both sides know it,
    its snapshot id. ``verify_base`` also reads the whole base and compares it
    with the digest a diff made with ``base_digest=True`` records (refused,
    ``UsageError``, for a diff without one). Never modifies ``base``;
    ``target`` is replaced atomically or left as it was. Checking the data
    is a phase of ``progress``.
    """
    diff, target = os.fspath(diff), os.fspath(target)
    base = None if base is None else os.fspath(base)
    _refuse_same_file(target, "TARGET", {"BASE": base, "the diff": diff})
    notes: list[str] = []
    with contextlib.ExitStack() as stack:
        diff_fd = stack.enter_context(open_fd(diff))
        header = fmt.read_header(diff_fd, diff)
        base_fd = None if base is None else stack.enter_context(open_fd(base))
        _check_base(header, diff, base_fd, base, verify_base)
        _check_capacity(header, diff, target)
        verify_data(diff_fd, header, diff, progress)

        mode = 0o666 if base_fd is None else os.fstat(base_fd).st_mode & 0o7777
        out_fd, temp = stack.enter_context(atomic_output(target, mode))
        _check_file_size(out_fd, header, diff, target, temp)
        base_reflinked = False
        if base_fd is not None:
            base_reflinked = clone_or_copy(base_fd, out_fd, header.base_size, temp)
            if not base_reflinked:
                notes.append("copied the base instead of reflinking it (the target is on "
                             "another filesystem or reflink is unavailable)")
        # Sizing first makes the tail of the base's last block read as zeros when
        # growing, and puts the end of file where a last unaligned range ends,
        # the one place the kernel accepts an unaligned reflink.
        native.truncate(out_fd, header.target_size, temp)

        ranges = header.ranges
        is_data = ranges.kind == DATA
        _, reflinked = native.transfer_ranges(
            diff_fd, out_fd, np.uint64(header.data_offset) + header.data_pos[is_data],
            ranges.offset[is_data], ranges.length[is_data], temp)
        if base_fd is not None:
            # Only the base's bytes need zeroing: past its end the file reads as
            # zeros already, so a ZERO range costs at most the base's size even
            # where holes cannot be punched and zeros are written instead.
            limit = np.uint64(min(header.base_size, header.target_size))
            zero = (ranges.kind == ZERO) & (ranges.offset < limit)
            z_off = ranges.offset[zero]
            native.zero_ranges(out_fd, z_off, np.minimum(ranges.length[zero], limit - z_off),
                               temp)
        native.truncate(out_fd, header.target_size, temp)
        if header.target_id != fmt.NO_ID:   # as it reads where the format records none
            identity.tag_snapshot_id(out_fd, header.target_id)
    return ApplyResult(
        path=target, version=header.version, target_size=header.target_size,
        ranges=len(ranges), data_bytes=ranges.bytes_of(DATA), zero_bytes=ranges.bytes_of(ZERO),
        base_reflinked=base_reflinked, reflinked=reflinked, notes=notes)


def map_file(path: str | os.PathLike, *, sync: bool = False) -> ExtentMap:
    """The extent map of a file (for ``view``)."""
    path = os.fspath(path)
    with open_fd(path) as fd:
        return ExtentMap.of_file(fd, path, sync=sync)
