"""Property tests of the extent algebra against a byte-level model.

The model: a file is a sequence of bytes, each either a hole/unwritten byte
(reads 0) or the byte stored at some physical address. Two bytes are equal
exactly when they come from the same physical address (or are both zero).
Applying the computed ranges to the base must give back the target, and the
ranges must be sorted, disjoint, block aligned and not wasteful.
"""

from __future__ import annotations

import budget
import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from blockdiff import native
from blockdiff.engine.extents import (
    DATA,
    ZERO,
    ExtentMap,
    RangeSet,
    changed_ranges,
    ranges_from_block_classes,
    subtract,
    union,
)

BLOCK = 4096
UNIT = 512          # extents in the model start and end on 512-byte units
UNITS_PER_BLOCK = BLOCK // UNIT
HOLE, UNWRITTEN, DATA_EXTENT, INLINE = range(4)


@st.composite
def extent_layouts(draw, max_units=96):
    """A file as runs of (state, length in units), plus its size in bytes."""
    runs = draw(st.lists(st.tuples(st.sampled_from([HOLE, UNWRITTEN, DATA_EXTENT, DATA_EXTENT]),
                                   st.integers(1, 24)), max_size=8))
    mapped = sum(n for _, n in runs) * UNIT
    size = draw(st.integers(0, max_units * UNIT))
    # Sizes often fall inside the last extent, sometimes past everything mapped.
    size = draw(st.sampled_from([size, mapped, max(0, mapped - draw(st.integers(0, 4095)))]))
    return runs, size


def _build(runs, size, physical_of):
    """ExtentMap plus the per-unit content model (-1 = zero, else physical unit)."""
    logical, physical, length, flags = [], [], [], []
    content = np.full(max(size, 1) // UNIT + 2 + sum(n for _, n in runs), -1, np.int64)
    pos = 0
    for state, n in runs:
        if state != HOLE:
            phys = physical_of(pos, n)
            logical.append(pos * UNIT)
            physical.append(phys * UNIT)
            length.append(n * UNIT)
            flag = {UNWRITTEN: native.EXTENT_UNWRITTEN, DATA_EXTENT: 0,
                    INLINE: native.EXTENT_DATA_INLINE | native.EXTENT_NOT_ALIGNED}[state]
            flags.append(flag)
            if state != UNWRITTEN:
                content[pos:pos + n] = np.arange(phys, phys + n)
        pos += n
    content[-(-size // UNIT):] = -1     # past EOF reads as nothing / zeros
    emap = ExtentMap.from_arrays(logical, physical, length, flags, size)
    return emap, content


def _unit_content(content, size):
    """Byte-granular view is overkill: units are 512 bytes and sizes are cut
    to whole units for the comparison, the partial unit counted as whole."""
    return content[: -(-size // UNIT)]


def _apply_model(base_content, base_size, target_size, ranges: RangeSet, target_content):
    n = -(-target_size // UNIT)
    result = np.full(n, -1, np.int64)
    keep = min(n, -(-base_size // UNIT))
    result[:keep] = base_content[:keep]
    if target_size > base_size and base_size % UNIT:
        # Growing zeroes the tail of the base's partial unit: treat it as changed.
        result[base_size // UNIT] = -2
    for off, length, kind in zip(ranges.offset, ranges.length, ranges.kind):
        lo, hi = int(off) // UNIT, -(-int(off + length) // UNIT)
        result[lo:hi] = target_content[lo:hi] if kind == DATA else -1
    return result


def _check_shape(ranges: RangeSet, target_size: int):
    off, length = ranges.offset.astype(np.int64), ranges.length.astype(np.int64)
    assert np.all(length > 0)
    assert np.all(off[1:] >= off[:-1] + length[:-1]), "ranges overlap or are out of order"
    end = off + length
    assert np.all(off % BLOCK == 0)
    assert np.all((end % BLOCK == 0) | (end == target_size))
    assert np.all(end <= target_size)
    # Coalesced: no two ranges of one kind touch.
    touching = (off[1:] == end[:-1]) & (ranges.kind[1:] == ranges.kind[:-1])
    assert not touching.any()


@settings(max_examples=budget.examples(400), deadline=None)
@given(base=extent_layouts(), target=extent_layouts(), data=st.data())
def test_changed_ranges_rebuild_the_target(base, target, data):
    base_runs, base_size = base
    target_runs, target_size = target
    # Base physical units live at 10_000+; the target shares them at the same
    # logical offset (a reflink clone) or has fresh ones (rewritten).
    base_map, base_content = _build(base_runs, base_size, lambda pos, n: 10_000 + pos)
    shared = data.draw(st.lists(st.booleans(), min_size=len(target_runs),
                                max_size=len(target_runs)))
    fresh = iter(range(100_000, 10**9, 1000))
    choice = iter(shared)
    target_map, target_content = _build(
        target_runs, target_size,
        lambda pos, n: 10_000 + pos if next(choice) else next(fresh))
    ranges = changed_ranges(target_map, base_map, BLOCK)
    _check_shape(ranges, target_size)
    expected = _unit_content(target_content, target_size)
    got = _apply_model(base_content, base_size, target_size, ranges, target_content)
    # Units a range covers take the target's content; -2 marks a zeroed tail
    # unit, which is right only if the target is zero there or a range covers it.
    got = np.where(got == -2, -1, got)
    assert np.array_equal(got, expected), (ranges, target_map, base_map)
    # Not wasteful: every DATA block holds at least one unit that differs,
    # or lies at/after the base's last whole block when the target grew.
    differs = np.zeros(-(-target_size // BLOCK), bool)
    base_view = np.full(len(expected), -1, np.int64)
    k = min(len(expected), -(-base_size // UNIT))
    base_view[:k] = base_content[:k]
    unit_diff = base_view != expected
    for i in range(len(differs)):
        differs[i] = unit_diff[i * UNITS_PER_BLOCK:(i + 1) * UNITS_PER_BLOCK].any()
    limit = base_size // BLOCK if target_size > base_size else len(differs)
    for off, length in zip(ranges.offset, ranges.length):
        for blk in range(int(off) // BLOCK, -(-int(off + length) // BLOCK)):
            assert differs[blk] or blk >= limit, f"block {blk} needlessly in a range"


@settings(max_examples=budget.examples(200), deadline=None)
@given(target=extent_layouts())
def test_without_base_ranges_are_the_data(target):
    runs, size = target
    emap, content = _build(runs, size, lambda pos, n: 500 + pos)
    ranges = changed_ranges(emap, None, BLOCK)
    _check_shape(ranges, size)
    assert not (ranges.kind == ZERO).any()
    got = _apply_model(np.full(len(content), -1, np.int64), 0, size, ranges, content)
    assert np.array_equal(got, _unit_content(content, size))


@settings(max_examples=budget.examples(200), deadline=None)
@given(classes=st.lists(st.integers(0, 2), max_size=64), tail=st.integers(0, BLOCK - 1))
def test_ranges_from_block_classes(classes, tail):
    classes = np.array(classes, np.uint8)
    size = max(0, len(classes) * BLOCK - tail) if len(classes) else 0
    assume(len(classes) == -(-size // BLOCK))
    ranges = ranges_from_block_classes(classes, BLOCK, size)
    _check_shape(ranges, size)
    covered = np.zeros(len(classes), np.int8) - 1
    for off, length, kind in zip(ranges.offset, ranges.length, ranges.kind):
        covered[int(off) // BLOCK: -(-int(off + length) // BLOCK)] = kind
    for i, c in enumerate(classes):
        if c == 0:
            assert covered[i] == -1
        elif c == 1:
            assert covered[i] == DATA
        else:  # a zero block is ZERO, or DATA when it is the partial last block
            assert covered[i] == ZERO or (covered[i] == DATA and i == len(classes) - 1 and tail)


@given(st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 50)), max_size=30),
       st.lists(st.tuples(st.integers(0, 1000), st.integers(1, 50)), max_size=30))
def test_union_and_subtract_match_sets(intervals, cuts):
    def as_set(pairs):
        return {p for s, e in pairs for p in range(s, e)}

    s = np.array([a for a, _ in intervals], np.uint64)
    e = np.array([a + n for a, n in intervals], np.uint64)
    us, ue = union(s, e)
    assert as_set(zip(us.tolist(), ue.tolist())) == as_set((a, a + n) for a, n in intervals)
    assert np.all(us[1:] > ue[:-1])  # disjoint and not touching
    cs, ce = union(np.array([a for a, _ in cuts], np.uint64),
                   np.array([a + n for a, n in cuts], np.uint64))
    rs, re_ = subtract(us, ue, cs, ce)
    assert as_set(zip(rs.tolist(), re_.tolist())) == (
        as_set((a, a + n) for a, n in intervals) - as_set((a, a + n) for a, n in cuts))


def _fragmented_pair(n_extents: int, changed_every: int = 2):
    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 8, n_extents).astype(np.uint64) * np.uint64(BLOCK)
    logical = np.zeros(n_extents, np.uint64)
    np.cumsum(lengths[:-1], out=logical[1:])
    physical = rng.permutation(n_extents).astype(np.uint64) * np.uint64(1 << 20)
    size = int(logical[-1] + lengths[-1])
    base = ExtentMap.from_arrays(logical, physical, lengths, np.zeros(n_extents, np.uint32), size)
    tphys = physical.copy()
    tphys[::changed_every] += np.uint64(BLOCK)   # rewritten elsewhere
    target = ExtentMap.from_arrays(logical, tphys, lengths, np.zeros(n_extents, np.uint32), size)
    return target, base


def test_a_large_fragmented_map():
    # Scale check of the vectorised path; its speed is measured in bench/.
    target, base = _fragmented_pair(500_000)
    ranges = changed_ranges(target, base, BLOCK)
    assert len(ranges) == 250_000
    assert np.array_equal(ranges.offset, target.logical[::2])
    assert np.array_equal(ranges.length, target.length[::2])
