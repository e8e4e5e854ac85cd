"""Extent algebra: extent maps as arrays and the ranges where two files differ.

All of it is vectorised numpy: a map of a million extents is a few sorts and
searches, never a Python loop over extents.

Terms. An *extent map* lists where a file's bytes live on disk. A *range set*
is what a diff records: sorted, disjoint ranges of the target, each either
DATA (copy these bytes from the target) or ZERO (these bytes read as zeros).
Ranges are block aligned except that the last may end at the target's size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from blockdiff import native
from blockdiff.errors import Unsupported

DATA = 0
ZERO = 1

_U64 = np.uint64

# Flags whose physical address says nothing comparable about the content.
_INCOMPARABLE = (native.EXTENT_NOT_ALIGNED | native.EXTENT_DATA_INLINE
                 | native.EXTENT_DATA_TAIL | native.EXTENT_UNKNOWN
                 | native.EXTENT_ENCODED | native.EXTENT_DATA_ENCRYPTED
                 | native.EXTENT_DELALLOC)

_REFUSED = {
    native.EXTENT_UNKNOWN: "its data location is unknown to the filesystem",
    native.EXTENT_ENCODED: "its data is encoded (compressed) by the filesystem",
    native.EXTENT_DATA_ENCRYPTED: "its data is encrypted by the filesystem",
    native.EXTENT_DELALLOC: "it is still being written (delayed allocation after fsync)",
}


@dataclass(frozen=True)
class ExtentMap:
    """Where a file's bytes live: parallel arrays sorted by logical offset."""

    logical: np.ndarray   # uint64
    physical: np.ndarray  # uint64
    length: np.ndarray    # uint64
    flags: np.ndarray     # uint32
    size: int             # the file's size in bytes

    @classmethod
    def of_file(cls, fd: int, path: str | os.PathLike, *, sync: bool = True) -> "ExtentMap":
        """Map an open file (flushing it first unless ``sync`` is false)."""
        size = os.fstat(fd).st_size
        logical, physical, length, flags = native.fiemap(fd, max(size, 1), path, sync=sync)
        return cls.from_arrays(logical, physical, length, flags, size)

    @classmethod
    def from_arrays(cls, logical, physical, length, flags, size: int) -> "ExtentMap":
        """Build a map from raw arrays, sorting them by logical offset if needed."""
        logical = np.asarray(logical, _U64)
        physical = np.asarray(physical, _U64)
        length = np.asarray(length, _U64)
        flags = np.asarray(flags, np.uint32)
        if len(logical) > 1 and np.any(logical[1:] < logical[:-1]):
            order = np.argsort(logical, kind="stable")
            logical, physical, length, flags = (
                a[order] for a in (logical, physical, length, flags))
        return cls(logical, physical, length, flags, int(size))

    def __len__(self) -> int:
        return len(self.logical)

    def check_supported(self, path: str | os.PathLike) -> None:
        """Refuse extents whose bytes cannot be located and copied safely."""
        for flag, why in _REFUSED.items():
            hit = np.flatnonzero(self.flags & flag)
            if len(hit):
                offset = int(self.logical[hit[0]])
                raise Unsupported(
                    f"cannot diff {os.fspath(path)}: the extent at offset {offset:#x} is refused "
                    f"because {why}; make a plain copy first (cp --reflink=never) on a "
                    f"filesystem without compression or encryption, and pause writers")


@dataclass(frozen=True)
class RangeSet:
    """Sorted, disjoint ranges of a target, each DATA or ZERO."""

    offset: np.ndarray  # uint64
    length: np.ndarray  # uint64
    kind: np.ndarray    # uint8: DATA or ZERO

    @classmethod
    def empty(cls) -> "RangeSet":
        return cls(np.zeros(0, _U64), np.zeros(0, _U64), np.zeros(0, np.uint8))

    def __len__(self) -> int:
        return len(self.offset)

    @property
    def data(self) -> np.ndarray:
        """Boolean mask of the DATA ranges."""
        return self.kind == DATA

    def bytes_of(self, kind: int) -> int:
        """Total length of the ranges of one kind."""
        return int(self.length[self.kind == kind].sum(dtype=_U64))


def _data_intervals(emap: ExtentMap, limit: int):
    """Half-open intervals holding data (not holes or unwritten), clipped to limit.

    Returns ``(start, end, physical, comparable)``.
    """
    start, length, physical, flags = emap.logical, emap.length, emap.physical, emap.flags
    keep = (flags & native.EXTENT_UNWRITTEN) == 0
    keep &= start < _U64(limit)
    if not keep.all():   # the common case (all data, all inside) copies nothing
        start, length, physical, flags = start[keep], length[keep], physical[keep], flags[keep]
    end = np.minimum(start + length, _U64(limit))
    comparable = (flags & _INCOMPARABLE) == 0
    return start, end, physical, comparable


def _boundaries(*interval_sets) -> np.ndarray:
    """Sorted distinct boundaries of several sets of sorted disjoint intervals.

    Each set's starts and ends interleave into one sorted run, so a stable
    sort (timsort) merges the runs in linear time; no hashing, no n log n.
    """
    total = sum(2 * len(start) for start, _ in interval_sets)
    points = np.empty(total, _U64)
    at = 0
    for start, end in interval_sets:
        points[at:at + 2 * len(start):2] = start
        points[at + 1:at + 2 * len(start):2] = end
        at += 2 * len(start)
    points.sort(kind="stable")
    if len(points) < 2:
        return points
    distinct = np.empty(len(points), bool)
    distinct[0] = True
    np.not_equal(points[1:], points[:-1], out=distinct[1:])
    return points[distinct]


def _locate(starts: np.ndarray, ends: np.ndarray, points: np.ndarray):
    """For each point, the index of the interval containing it, and whether one does."""
    index = np.searchsorted(starts, points, side="right").astype(np.int64)
    index -= 1
    inside = index >= 0
    np.maximum(index, 0, out=index)   # a safe index where none contains the point
    if len(starts):
        inside &= ends[index] > points
    else:
        inside[:] = False
    return index, inside


def _round_up(values: np.ndarray, block: np.uint64) -> np.ndarray:
    """Round unsigned values up to a multiple of block."""
    return (values + (block - _U64(1))) // block * block


def _runs(mask: np.ndarray):
    """Index pairs ``(first, last_exclusive)`` of the runs of True in a mask."""
    edges = np.diff(np.concatenate(([0], mask.view(np.int8), [0])))
    return np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)


def union(starts: np.ndarray, ends: np.ndarray):
    """Merge overlapping or touching intervals into sorted disjoint ones."""
    if len(starts) == 0:
        return starts.astype(_U64), ends.astype(_U64)
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    reach = np.maximum.accumulate(e)
    opens = np.ones(len(s), bool)
    opens[1:] = s[1:] > reach[:-1]
    first = np.flatnonzero(opens)
    return s[first], np.maximum.reduceat(e, first)


def subtract(starts, ends, cut_starts, cut_ends):
    """Intervals minus (sorted, disjoint) cut intervals."""
    if len(cut_starts) == 0 or len(starts) == 0:
        return starts, ends
    points = np.unique(np.concatenate((starts, ends, cut_starts, cut_ends)))
    seg_start, seg_end = points[:-1], points[1:]
    _, in_keep = _locate(starts, ends, seg_start)
    _, in_cut = _locate(cut_starts, cut_ends, seg_start)
    first, last = _runs(in_keep & ~in_cut)
    return seg_start[first], seg_end[last - 1]


def _finish(data_start, data_end, zero_start, zero_end, target_size: int, block: int) -> RangeSet:
    """Align, coalesce and merge DATA and ZERO intervals into a RangeSet.

    DATA widens to whole blocks (copying the target's bytes is always right);
    ZERO narrows to whole blocks and the partial blocks it leaves become DATA,
    so no block is ever part ZERO and part untouched.
    """
    b = _U64(block)
    size = _U64(target_size)
    zs = _round_up(zero_start, b)
    ze = zero_end // b * b
    head = zero_start < zs
    tail = ze < zero_end
    remnant_start = np.concatenate((zero_start[head], np.maximum(ze, zero_start)[tail]))
    remnant_end = np.concatenate((np.minimum(zs, zero_end)[head], zero_end[tail]))
    ds = np.concatenate((data_start, remnant_start)) // b * b
    de = np.minimum(_round_up(np.concatenate((data_end, remnant_end)), b), size)
    ds, de = union(ds, de)
    whole = zs < ze
    zs, ze = union(zs[whole], ze[whole])
    # Widened data never reaches into a whole zero block, but stay exact.
    zs, ze = subtract(zs, ze, ds, de)
    offset = np.concatenate((ds, zs))
    length = np.concatenate((de - ds, ze - zs))
    kind = np.concatenate((np.full(len(ds), DATA, np.uint8), np.full(len(zs), ZERO, np.uint8)))
    order = np.argsort(offset, kind="stable")
    return RangeSet(offset[order], length[order], kind[order])


def changed_ranges(target: ExtentMap, base: ExtentMap | None, block: int = 4096) -> RangeSet:
    """The ranges where ``target`` differs from ``base``, by physical address.

    Two files on one filesystem hold the same bytes at a logical offset when
    both map it to the same physical address. Changed, therefore: target data
    at another address than the base's; target data where the base has a
    hole; a hole or unwritten extent in the target where the base has data
    (ZERO); and any target data at or past the base's last whole block when
    the target grew. Without a base, the ranges are the target's data extents
    (compacting a sparse file). Bytes past the base's size need no ZERO range:
    setting the target's size on apply reads them as zeros.
    """
    tsize = target.size
    t_start, t_end, t_phys, t_cmp = _data_intervals(target, tsize)
    empty = np.zeros(0, _U64)
    if base is None:
        return _finish(t_start, t_end, empty, empty, tsize, block)

    bsize = base.size
    b_start, b_end, b_phys, b_cmp = _data_intervals(base, min(bsize, tsize))
    # Past the base's last whole block, nothing in the target counts as shared
    # when it grew: the base's partial last block ends at its size.
    base_limit = bsize // block * block if tsize > bsize else tsize
    cut = np.array([0, min(base_limit, tsize)], _U64)
    points = _boundaries((t_start, t_end), (b_start, b_end), (cut, np.array([tsize, tsize], _U64)))
    points = points[points <= _U64(tsize)]
    seg_start, seg_end = points[:-1], points[1:]

    ti, t_in = _locate(t_start, t_end, seg_start)
    bi, b_in = _locate(b_start, b_end, seg_start)
    same = t_in & b_in & (seg_start < _U64(base_limit))
    if len(t_start) and len(b_start):
        # Physical address of each segment's start in both files, computed in
        # place: with a million extents every temporary array is 16 MB.
        t_at = seg_start - t_start[ti]
        t_at += t_phys[ti]
        b_at = seg_start - b_start[bi]
        b_at += b_phys[bi]
        same &= t_cmp[ti] & b_cmp[bi] & (t_at == b_at)
        del t_at, b_at
    else:
        same[:] = False
    changed_data = t_in & ~same
    zeroed = ~t_in & b_in

    first, last = _runs(changed_data)
    data_start, data_end = seg_start[first], seg_end[last - 1]
    first, last = _runs(zeroed)
    zero_start, zero_end = seg_start[first], seg_end[last - 1]
    return _finish(data_start, data_end, zero_start, zero_end, tsize, block)


def ranges_from_block_classes(classes: np.ndarray, block: int, target_size: int) -> RangeSet:
    """Ranges from a per-block content comparison (0 same, 1 data, 2 zeros)."""
    b = _U64(block)
    first, last = _runs(classes == 1)
    data_start, data_end = first.astype(_U64) * b, last.astype(_U64) * b
    first, last = _runs(classes == 2)
    zero_start, zero_end = first.astype(_U64) * b, last.astype(_U64) * b
    size = _U64(target_size)
    return _finish(data_start, np.minimum(data_end, size), zero_start,
                   np.minimum(zero_end, size), target_size, block)


@dataclass(frozen=True)
class PieceTable:
    """Where every byte of a stored image lives: sorted, disjoint pieces, each
    a run of the image kept at ``pos`` in the data file of layer ``layer``.
    Bytes in no piece read as zeros; ``size`` is the image's size."""

    offset: np.ndarray  # uint64
    length: np.ndarray  # uint64
    layer: np.ndarray   # int64: the layer (snapshot) whose data file holds the piece
    pos: np.ndarray     # uint64: where in that data file
    size: int

    @classmethod
    def empty(cls, size: int = 0) -> "PieceTable":
        return cls(np.zeros(0, _U64), np.zeros(0, _U64), np.zeros(0, np.int64),
                   np.zeros(0, _U64), size)

    def __len__(self) -> int:
        return len(self.offset)


def coalesce(start, length, layer, pos):
    """Merge pieces that continue each other in the image and in one layer."""
    if len(start) < 2:
        return start, length, layer, pos
    joins = ((start[:-1] + length[:-1] == start[1:]) & (layer[:-1] == layer[1:])
             & (pos[:-1] + length[:-1] == pos[1:]))
    first = np.flatnonzero(np.concatenate(([True], ~joins)))
    return start[first], np.add.reduceat(length, first), layer[first], pos[first]


def overlay(parent: PieceTable | None, changes: RangeSet, data_pos: np.ndarray,
            layer: int, size: int) -> PieceTable:
    """The piece table of a child: the parent's pieces, cut to ``size``, with
    each DATA change now held by ``layer`` at ``data_pos`` and each ZERO
    change removed."""
    parent = parent or PieceTable.empty()
    p_end = parent.offset + parent.length
    c_end = changes.offset + changes.length
    points = _boundaries((parent.offset, p_end), (changes.offset, c_end),
                         (np.zeros(1, _U64), np.full(1, size, _U64)))
    points = points[points <= _U64(size)]
    seg_start, seg_end = points[:-1], points[1:]
    ci, c_in = _locate(changes.offset, c_end, seg_start)
    pi, p_in = _locate(parent.offset, p_end, seg_start)
    if len(changes):
        from_change = c_in & (changes.kind[ci] == DATA)
        change_pos = data_pos[ci] + (seg_start - changes.offset[ci])
    else:
        from_change = np.zeros(len(seg_start), bool)
        change_pos = np.zeros(len(seg_start), _U64)
    from_parent = ~c_in & p_in
    keep = from_change | from_parent
    if len(parent):
        parent_layer = parent.layer[pi]
        parent_pos = parent.pos[pi] + (seg_start - parent.offset[pi])
    else:
        parent_layer = np.zeros(len(seg_start), np.int64)
        parent_pos = np.zeros(len(seg_start), _U64)
    piece_layer = np.where(from_change, np.int64(layer), parent_layer)[keep]
    piece_pos = np.where(from_change, change_pos, parent_pos)[keep]
    start = seg_start[keep]
    return PieceTable(*coalesce(start, seg_end[keep] - start, piece_layer, piece_pos), size=size)


def pieces_within(table: PieceTable, starts: np.ndarray, ends: np.ndarray):
    """The parts of ``table`` inside the intervals ``[starts, ends)``.

    Returns ``(pieces, holes)``: a PieceTable of what lies inside, and the
    ``(start, end)`` arrays of the parts inside that no piece covers (zeros).
    """
    t_end = table.offset + table.length
    points = _boundaries((table.offset, t_end), (starts, ends))
    seg_start, seg_end = points[:-1], points[1:]
    _, inside = _locate(starts, ends, seg_start)
    ti, t_in = _locate(table.offset, t_end, seg_start)
    take = inside & t_in
    start = seg_start[take]
    layer = table.layer[ti[take]] if len(table) else np.zeros(0, np.int64)
    pos = (table.pos[ti[take]] + (start - table.offset[ti[take]])) if len(table) else start
    pieces = PieceTable(*coalesce(start, seg_end[take] - start, layer, pos), size=table.size)
    first, last = _runs(inside & ~t_in)
    return pieces, (seg_start[first], seg_end[last - 1])


def normalize_ranges(offset, length, size: int, block: int = 4096):
    """Byte ranges (any order, may overlap) as sorted, disjoint ``(start, end)``
    intervals of whole blocks, clipped to the block holding the last byte of
    ``size`` (extent maps, too, are made of whole blocks)."""
    offset = np.asarray(offset, _U64)
    length = np.asarray(length, _U64)
    keep = (length > 0) & (offset < _U64(size))
    b = _U64(block)
    start = offset[keep] // b * b
    end = np.minimum(_round_up(offset[keep] + length[keep], b), _round_up(_U64(size), b))
    return union(start, end)


def _merge_sorted(a: tuple, b: tuple) -> tuple:
    """Two tuples of parallel arrays, each sorted by its first array and not
    overlapping the other, merged into one sorted tuple in linear time."""
    at = np.searchsorted(a[0], b[0])
    return tuple(np.insert(x, at, y) for x, y in zip(a, b))


def _partition_runs(start, length, moving, carried, starts, ends):
    """Split runs ``[start, start + length)`` by sorted, disjoint intervals.

    ``moving`` arrays are positions that advance with the offset (physical
    addresses, positions in a layer), ``carried`` arrays are copied (flags,
    layers). Returns ``(inside, outside)``, each a tuple ``(start, length,
    *moving, *carried)`` sorted by offset. Only the runs that meet an interval
    are cut; the rest are copied as they are, so a few intervals over a
    million runs cost a copy, not a sort.
    """
    end = start + length
    if len(starts) and len(start):
        k = np.searchsorted(ends, start, side="right")
        meets = k < len(starts)
        meets[meets] = starts[k[meets]] < end[meets]
    else:
        meets = np.zeros(len(start), bool)
    cut = np.flatnonzero(meets)
    whole = ~meets
    untouched = (start[whole], length[whole], *(a[whole] for a in moving),
                 *(a[whole] for a in carried))
    c_start, c_end = start[cut], end[cut]
    points = _boundaries((c_start, c_end), (starts, ends))
    seg_start, seg_end = points[:-1], points[1:]
    ci, c_in = _locate(c_start, c_end, seg_start)
    _, r_in = _locate(starts, ends, seg_start)

    def take(mask):
        i = cut[ci[mask]]
        at = seg_start[mask]
        return (at, seg_end[mask] - at, *(a[i] + (at - start[i]) for a in moving),
                *(a[i] for a in carried))

    return take(c_in & r_in), _merge_sorted(untouched, take(c_in & ~r_in))


def partition(emap: ExtentMap, starts: np.ndarray, ends: np.ndarray):
    """Split an extent map by sorted, disjoint intervals: ``(inside,
    outside)``, each a ``(logical, physical, length, flags)`` tuple."""
    inside, outside = _partition_runs(emap.logical, emap.length, (emap.physical,),
                                      (emap.flags,), starts, ends)

    def order(t):
        logical, length, physical, flags = t
        return logical, physical, length, flags

    return order(inside), order(outside)


def splice_pieces(base: PieceTable, starts: np.ndarray, ends: np.ndarray,
                  inside: PieceTable) -> PieceTable:
    """A piece table that is ``base`` outside the intervals and ``inside``
    (pieces lying within them) inside, of ``inside``'s size."""
    _, outside = _partition_runs(base.offset, base.length, (base.pos,), (base.layer,),
                                 starts, ends)
    offset, length, pos, layer = outside
    merged = _merge_sorted((offset, length, layer, pos),
                           (inside.offset, inside.length, inside.layer, inside.pos))
    return PieceTable(*coalesce(*merged), size=inside.size)


def remap(base: ExtentMap, starts: np.ndarray, ends: np.ndarray, fresh: tuple,
          size: int | None = None):
    """An extent map that is ``base`` outside the intervals and ``fresh`` (the
    file's extents mapped inside them, clipped to them) inside.

    Returns ``(current, previous)``: the spliced whole map (of ``size``,
    default the base's), and ``base`` and ``fresh`` restricted to the
    intervals as two maps, whose differences are exactly the differences of
    the whole maps.
    """
    inside, outside = partition(base, starts, ends)
    current = ExtentMap(*_merge_sorted(outside, fresh),
                        size=base.size if size is None else size)
    return current, (ExtentMap(*fresh, size=base.size), ExtentMap(*inside, size=base.size))


def differing_pieces(a: PieceTable, b: PieceTable) -> RangeSet:
    """The ranges of ``b`` whose bytes are not the same run as ``a``'s there.

    Two pieces hold the same bytes when they are the same run of one layer
    (equal layer and equal ``pos - offset``). DATA where ``b`` has a piece,
    ZERO where only ``a`` has one; past ``a``'s end only ``b``'s pieces count
    (bytes past an end read as nothing, then as zeros once the size is set).
    """
    size = _U64(b.size)
    a_end, b_end = a.offset + a.length, b.offset + b.length
    points = _boundaries((a.offset, a_end), (b.offset, b_end),
                         (np.zeros(1, _U64), np.full(1, size, _U64)))
    points = points[points <= size]
    seg_start, seg_end = points[:-1], points[1:]
    ai, a_in = _locate(a.offset, a_end, seg_start)
    bi, b_in = _locate(b.offset, b_end, seg_start)
    a_in &= seg_start < _U64(a.size)

    def identity(table, index):
        if not len(table):
            return np.zeros(len(index), np.int64), np.zeros(len(index), _U64)
        # pos - offset wraps modulo 2**64, which keeps equality exact.
        return table.layer[index], table.pos[index] - table.offset[index]

    (a_layer, a_shift), (b_layer, b_shift) = identity(a, ai), identity(b, bi)
    same = (a_in == b_in) & (~a_in | ((a_layer == b_layer) & (a_shift == b_shift)))
    differ = ~same
    kind = np.where(b_in, np.uint8(DATA), np.uint8(ZERO))[differ]
    start, end = seg_start[differ], seg_end[differ]
    if len(start) > 1:   # merge touching ranges of one kind
        joins = (end[:-1] == start[1:]) & (kind[:-1] == kind[1:])
        first = np.flatnonzero(np.concatenate(([True], ~joins)))
        last = np.append(first[1:], len(start)) - 1
        start, end, kind = start[first], end[last], kind[first]
    return RangeSet(start, end - start, kind)
