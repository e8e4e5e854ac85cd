"""Commit and restore from written ranges (a dirty-block tracker's answer)
instead of a whole-image extent map: every result compared byte for byte, and
the spliced extent map checked against a real one."""

from __future__ import annotations

import ctypes
import os
import random

import budget
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockdiff import native
from blockdiff.engine.extents import ExtentMap, changed_ranges, normalize_ranges, partition, remap
from blockdiff.store.store import Store

BLOCK = 4096
SIZE = 2 * 1024 * 1024 + 1234      # not a multiple of the block size

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
PUNCH_HOLE = 0x01 | 0x02          # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
ZERO_RANGE = 0x10                 # leaves unwritten extents on XFS


def fallocate(fd, mode, offset, length):
    if _libc.fallocate(fd, mode, offset, length) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


class TrackedImage:
    """An image whose writes are recorded, as QEMU's dirty bitmap would."""

    def __init__(self, path, seed):
        self.path = path
        self.rng = random.Random(seed)
        with open(path, "wb") as f:
            f.write(self.rng.randbytes(SIZE))
        self.forget()

    def forget(self):
        self.written: list[tuple[int, int]] = []

    def ranges(self):
        if not self.written:
            return np.zeros(0, np.uint64), np.zeros(0, np.uint64)
        offsets, lengths = zip(*self.written)
        return np.array(offsets, np.uint64), np.array(lengths, np.uint64)

    def step(self, operations=4):
        fd = os.open(self.path, os.O_RDWR)
        try:
            for _ in range(operations):
                kind = self.rng.choice(["write", "write", "write", "punch", "zero", "block"])
                offset = self.rng.randrange(SIZE)
                length = min(self.rng.randrange(1, 3 * BLOCK), SIZE - offset)
                if kind == "block":       # a whole block, as a guest writes
                    offset = offset // BLOCK * BLOCK
                    length = min(BLOCK, SIZE - offset)
                if kind in ("write", "block"):
                    os.pwrite(fd, self.rng.randbytes(length), offset)
                else:
                    fallocate(fd, PUNCH_HOLE if kind == "punch" else ZERO_RANGE | 0x01,
                              offset, length)
                self.written.append((offset, length))
        finally:
            os.close(fd)


def read(path):
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture
def store(xfs):
    s = Store.init(xfs / "store")
    yield s
    s.close()


@pytest.fixture
def full_maps(monkeypatch):
    """Counts whole-image extent maps taken by the store."""
    calls = []
    real = ExtentMap.of_file.__func__

    def of_file(cls, fd, path, *, sync=True):
        calls.append(path)
        return real(cls, fd, path, sync=sync)

    monkeypatch.setattr(ExtentMap, "of_file", classmethod(of_file))
    return calls


@pytest.mark.parametrize("seed", range(6))
def test_tracked_commits_and_restores_match_the_bytes(store, xfs, seed, full_maps):
    image = TrackedImage(xfs / "disk.img", seed)
    snaps = [store.commit(image.path)]
    contents = {snaps[0].id: read(image.path)}
    rng = random.Random(seed)
    for step in range(24):
        if rng.random() < 0.3 and len(snaps) > 1:
            target = rng.choice(snaps)
            result = store.restore(target.id, image.path, written=image.ranges())
            assert result.tracked
            assert read(image.path) == contents[target.id], f"step {step}: restore"
        else:
            image.step(rng.randrange(0, 6))
            snap = store.commit(image.path, written=image.ranges(), skip_unchanged=True)
            if snap.id not in contents:
                snaps.append(snap)
                contents[snap.id] = read(image.path)
            assert contents[snap.id] == read(image.path)
        image.forget()
    assert full_maps == [str(image.path)]   # only the first commit mapped the image
    # The spliced maps are true: a whole-map commit now finds nothing to store.
    same = store.commit(image.path, skip_unchanged=True)
    assert same.id in contents
    for snap in snaps:
        assert store.restore(snap.id, xfs / f"fork-{snap.id}.img").forked
        assert read(xfs / f"fork-{snap.id}.img") == contents[snap.id]
    assert store.verify() == {}


def test_tracked_restore_after_whole_map_commits_and_back(store, xfs):
    """Tracked and untracked operations interleave on one line."""
    image = TrackedImage(xfs / "disk.img", 99)
    base = store.commit(image.path)
    image.step(8)
    untracked = store.commit(image.path)
    image.forget()
    image.step(8)
    tracked = store.commit(image.path, written=image.ranges())
    expected = read(image.path)
    image.forget()
    image.step(8)
    base_bytes = read(store.restore(base.id, xfs / "base.img").image)
    assert store.restore(base.id, image.path, written=image.ranges()).tracked
    assert read(image.path) == base_bytes
    assert store.restore(tracked.id, image.path, written=np.zeros((2, 0), np.uint64)).tracked
    assert read(image.path) == expected
    assert store.restore(untracked.id, image.path, written=np.zeros((2, 0))).tracked
    assert read(image.path) == read(store.restore(untracked.id, xfs / "u.img").image)
    assert store.restore(base.id, image.path, written=(np.zeros(0), np.zeros(0))).tracked
    assert read(image.path) == base_bytes


def test_written_ranges_are_ignored_when_they_cannot_describe_the_change(store, xfs, full_maps):
    image = TrackedImage(xfs / "disk.img", 5)
    nothing = (np.zeros(0, np.uint64), np.zeros(0, np.uint64))
    first = store.commit(image.path)
    image.step(3)
    store.commit(image.path)
    image.step(3)
    # Another parent than the image's lineage: mapped whole.
    other = store.commit(image.path, parent=first.id, written=image.ranges())
    assert len(full_maps) == 3 and other.parent == first.id
    # A size change: the tracker knows nothing of it.
    with open(image.path, "r+b") as f:
        f.truncate(SIZE + 3 * BLOCK + 5)
        f.seek(SIZE + 100)
        f.write(b"grown")
    grown = store.commit(image.path, written=nothing)
    assert len(full_maps) == 4 and grown.size == SIZE + 3 * BLOCK + 5
    grown_bytes = read(image.path)
    result = store.restore(first.id, image.path, written=nothing)
    assert not result.tracked and read(image.path) == read(store.restore(
        first.id, xfs / "first.img").image)
    # An image with no lineage in this store.
    os.removexattr(image.path, "user.blockdiff.lineage")
    assert not store.restore(grown.id, image.path, written=nothing).tracked
    assert read(image.path) == grown_bytes


def test_a_superset_of_the_writes_is_fine(store, xfs):
    image = TrackedImage(xfs / "disk.img", 7)
    store.commit(image.path)
    image.step(5)
    everything = (np.array([0], np.uint64), np.array([SIZE], np.uint64))
    snap = store.commit(image.path, written=everything)
    assert read(store.restore(snap.id, xfs / "copy.img").image) == read(image.path)
    # Unchanged blocks are recognised by their addresses even inside the ranges.
    assert snap.changed_bytes <= sum(-(-n // BLOCK) * BLOCK + BLOCK for _, n in image.written)


# ---------------------------------------------------------- the algebra


@st.composite
def maps_and_ranges(draw):
    """A base extent map, intervals, and a file that is the base outside them."""
    blocks = draw(st.integers(1, 64))
    size = blocks * BLOCK - draw(st.integers(0, BLOCK - 1))
    cuts = (sorted(set(draw(st.lists(st.integers(1, blocks - 1), max_size=12))))
            if blocks > 1 else [])
    edges = [0, *cuts, blocks]
    logical, physical, length, flags = [], [], [], []
    for a, b in zip(edges[:-1], edges[1:]):
        kind = draw(st.sampled_from(["data", "data", "hole", "unwritten"]))
        if kind == "hole":
            continue
        logical.append(a * BLOCK)
        physical.append(draw(st.integers(1, 10_000)) * BLOCK)
        length.append((b - a) * BLOCK)
        flags.append(native.EXTENT_UNWRITTEN if kind == "unwritten" else 0)
    base = ExtentMap.from_arrays(logical, physical, length, flags, size)
    offsets = draw(st.lists(st.integers(0, size - 1), max_size=6))
    lengths = [draw(st.integers(1, 3 * BLOCK)) for _ in offsets]
    return base, offsets, lengths


def _per_block(emap: ExtentMap):
    """Per block: physical address, or -1 for a hole, -2 for unwritten."""
    n = -(-emap.size // BLOCK)
    out = np.full(n, -1, np.int64)
    for lo, ph, ln, fl in zip(emap.logical, emap.physical, emap.length, emap.flags):
        for b in range(int(lo) // BLOCK, min(n, -(-(int(lo) + int(ln)) // BLOCK))):
            out[b] = -2 if fl & native.EXTENT_UNWRITTEN else int(ph) + b * BLOCK - int(lo)
    return out


@settings(max_examples=budget.examples(300), deadline=None)
@given(maps_and_ranges(), st.integers(0, 2**20))
def test_remap_splices_fresh_extents_into_the_base(case, seed):
    base, offsets, lengths = case
    starts, ends = normalize_ranges(offsets, lengths, base.size)
    assert np.all(starts % BLOCK == 0) and np.all(ends % BLOCK == 0)
    assert np.all(starts[1:] > ends[:-1])
    # The "file": the base with every block inside the intervals replaced at random.
    rng = np.random.default_rng(seed)
    expected = _per_block(base)
    fresh = ([], [], [], [])
    for s, e in zip(starts.tolist(), ends.tolist()):
        for b in range(s // BLOCK, -(-e // BLOCK)):
            choice = rng.integers(0, 4)
            if choice == 0:
                expected[b] = -1
                continue
            phys = int(rng.integers(20_000, 30_000)) * BLOCK if choice < 3 else 0
            expected[b] = phys if choice < 3 else -2
            for a, v in zip(fresh, (b * BLOCK, phys, min(BLOCK, e - b * BLOCK),
                                    native.EXTENT_UNWRITTEN if choice == 3 else 0)):
                a.append(v)
    fresh = (np.array(fresh[0], np.uint64), np.array(fresh[1], np.uint64),
             np.array(fresh[2], np.uint64), np.array(fresh[3], np.uint32))
    current, (now, before) = remap(base, starts, ends, fresh)
    assert np.all(np.diff(current.logical.astype(np.int64)) > 0)
    assert np.array_equal(_per_block(current), expected)
    # Comparing the restricted maps finds what comparing the whole ones finds.
    whole = changed_ranges(current, base)
    part = changed_ranges(now, before)
    assert np.array_equal(whole.offset, part.offset)
    assert np.array_equal(whole.length, part.length)
    assert np.array_equal(whole.kind, part.kind)
    inside, outside = partition(base, starts, ends)
    assert int(inside[2].sum() + outside[2].sum()) == int(base.length.sum())


def test_cli_written_ranges(store, xfs):
    import subprocess
    import sys

    image = TrackedImage(xfs / "disk.img", 11)
    cli = [sys.executable, "-m", "blockdiff"]
    env = dict(os.environ, BLOCKDIFF_STORE=str(store.root))
    first = subprocess.run([*cli, "commit", str(image.path)], env=env, capture_output=True,
                           text=True, check=True).stdout.split()[-1]
    image.step(4)
    ranges = "".join(f"{o} {n}\n" for o, n in image.written)
    second = subprocess.run([*cli, "commit", str(image.path), "--written", "-"], input=ranges,
                            env=env, capture_output=True, text=True, check=True).stdout.split()[-1]
    expected = read(image.path)
    image.forget()
    image.step(4)
    ranges = "".join(f"{o} {n}\n" for o, n in image.written)
    subprocess.run([*cli, "restore", second, str(image.path), "--written", "-"], input=ranges,
                   env=env, capture_output=True, text=True, check=True)
    assert read(image.path) == expected
    bad = subprocess.run([*cli, "restore", first, str(image.path), "--written", "-"],
                         input="12 x\n", env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "line 1 of <stdin> is not 'OFFSET LENGTH'" in bad.stderr
    assert "Traceback" not in bad.stderr
    assert read(image.path) == expected


def test_fiemap_of_ranges_is_the_whole_map_cut_to_them(xfs):
    path = xfs / "fragmented.img"
    image = TrackedImage(path, 3)
    os.system(f"cp --reflink=always {path} {xfs / 'base.img'}")
    image.step(60)                                  # scattered extents, holes, unwritten
    rng = np.random.default_rng(3)
    fd = os.open(path, os.O_RDONLY)
    try:
        whole = ExtentMap.of_file(fd, path)
        for _ in range(20):
            points = np.unique(rng.integers(0, SIZE // BLOCK + 2, 2 * rng.integers(1, 40)))
            points = points[: len(points) // 2 * 2].astype(np.uint64) * np.uint64(BLOCK)
            starts, ends = points[0::2], points[1::2]
            got = native.fiemap_ranges(fd, starts, ends, path)
            expected, _ = partition(whole, starts, ends)
            for a, b in zip(got[:3], expected[:3]):
                assert np.array_equal(a, b)
            last = np.uint32(native.EXTENT_LAST)   # says which extent ended a query
            assert np.array_equal(got[3] & ~last, expected[3] & ~last)
    finally:
        os.close(fd)
