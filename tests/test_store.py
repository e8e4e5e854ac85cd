"""The snapshot store on real filesystems: every restore compared byte for byte."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import stat
import subprocess
import sys
import time

import numpy as np
import pytest

import filesystems
import scenarios
from blockdiff.engine.extents import PieceTable, RangeSet, overlay, pieces_within
from blockdiff.errors import Damaged, ImageBusy, StoreError, UnknownSnapshot, Unsupported
from blockdiff.store.ids import layer_number
from blockdiff.store.objects import layer_name
from blockdiff.store.store import LINEAGE_XATTR, Store
from scenarios import SCENARIOS, make_base_image

BLOCK = 4096
SIZE = 4 * 1024 * 1024 + 777


def digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def write_blocks(path, count, seed):
    scenarios.random_block_writes(path, count=count, seed=seed)


@pytest.fixture
def store(xfs):
    s = Store.init(xfs / "store")
    yield s
    s.close()


def test_commit_restore_every_step_in_place_and_forked(store, xfs):
    image = xfs / "disk.img"
    make_base_image(image, SIZE, 1)
    snaps, digests = [], []
    ops = ["random_4k_writes", "punched_holes", "grow", "unwritten_extents", "zero_ranges",
           "shrink_unaligned", "sequential_writes", "mixed"]
    for step, op in enumerate([None] + ops):
        if op is not None:
            # Each scenario rebuilds its target from a base: use a copy of the live disk.
            live = xfs / "live.img"
            SCENARIOS[op](image, live, step)
            os.replace(live, image)
            # The lineage xattr went with the old inode; say who the parent is.
            snap = store.commit(image, parent=snaps[-1].id, message=op)
        else:
            snap = store.commit(image, message="boot")
        snaps.append(snap)
        digests.append(digest(image))
    # In place, in a scrambled order, then into new paths (forks).
    order = list(range(len(snaps)))
    random.Random(3).shuffle(order)
    for i in order:
        result = store.restore(snaps[i].id, image)
        assert not result.forked
        assert digest(image) == digests[i], f"in-place restore of step {i}"
    for i in order:
        fork = xfs / f"fork{i}.img"
        assert store.restore(snaps[i].id, fork).forked
        assert digest(fork) == digests[i], f"fork of step {i}"


def test_restore_work_is_proportional_to_what_differs(store, xfs):
    image = xfs / "disk.img"
    make_base_image(image, 16 * 1024 * 1024, 2, sparse_fraction=0.0, zero_fraction=0.0)
    base = store.commit(image)
    expected = digest(image)
    write_blocks(image, 100, seed=5)
    after = store.commit(image)
    assert after.ranges <= 100
    write_blocks(image, 100, seed=6)       # an uncommitted step to throw away
    result = store.restore(base.id, image)
    assert result.ranges <= 200
    assert digest(image) == expected


def test_deep_line_restores_at_any_depth(store, xfs):
    image = xfs / "disk.img"
    make_base_image(image, SIZE, 3)
    snaps, digests = [], []
    for step in range(60):
        if step:
            write_blocks(image, 3, seed=step)
        snaps.append(store.commit(image, message=f"step {step}"))
        digests.append(digest(image))
    for depth in (1, 30, 59, 0):
        result = store.restore(snaps[depth].id, image)
        assert digest(image) == digests[depth]
        assert result.ranges <= 3 * 60
    assert len(store.log(snaps[-1].id)) == 60


def test_forks_change_independently_and_form_a_tree(store, xfs):
    image = xfs / "disk.img"
    make_base_image(image, SIZE, 4)
    root = store.commit(image, message="root")
    forks = {}
    for name in ("a", "b", "c"):
        path = xfs / f"{name}.img"
        store.restore(root.id, path)
        write_blocks(path, 10, seed=ord(name))
        forks[name] = (store.commit(path, message=f"branch {name}"), digest(path))
    for name, (snap, expected) in forks.items():
        assert snap.parent == root.id          # found from the image's lineage
        out = xfs / f"check-{name}.img"
        store.restore(snap.id, out)
        assert digest(out) == expected
    assert {s.id for s in store.log()} == {root.id} | {s.id for s, _ in forks.values()}


def test_skip_unchanged(store, xfs):
    image = xfs / "disk.img"
    make_base_image(image, SIZE, 5)
    first = store.commit(image)
    assert store.commit(image, skip_unchanged=True).id == first.id
    assert store.commit(image).id != first.id   # without the flag: a new node


def test_lineage_follows_the_image_and_ignores_foreign_ones(store, xfs):
    image = xfs / "disk.img"
    make_base_image(image, SIZE, 6)
    snap = store.commit(image)
    moved = xfs / "moved.img"
    os.rename(image, moved)
    write_blocks(moved, 4, seed=1)
    assert store.commit(moved).parent == snap.id
    foreign = xfs / "foreign.img"
    make_base_image(foreign, SIZE, 7)
    assert store.commit(foreign).parent is None
    other = Store.init(xfs / "other-store")
    other_image = xfs / "other.img"
    make_base_image(other_image, SIZE, 8)
    other.commit(other_image)
    assert store.commit(other_image).parent is None   # another store's lineage is not ours
    other.close()


def test_interrupted_restore_is_refused_then_finished(store, xfs):
    image = xfs / "disk.img"
    make_base_image(image, SIZE, 9)
    snap = store.commit(image)
    expected = digest(image)
    write_blocks(image, 20, seed=2)
    record = json.loads(os.getxattr(image, LINEAGE_XATTR))
    record["state"] = "restoring"
    os.setxattr(image, LINEAGE_XATTR, json.dumps(record).encode())
    with pytest.raises(StoreError, match="was being restored"):
        store.commit(image)
    store.restore(snap.id, image)
    assert digest(image) == expected
    store.commit(image)


def test_snapshot_files_are_read_only(store, xfs):
    image = xfs / "disk.img"
    make_base_image(image, SIZE, 10)
    snap = store.commit(image)
    for path in (store.objects / f"{snap.id}.layer", store.map_path(snap)):
        mode = os.stat(path).st_mode
        assert not mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)


def test_tampered_map_is_detected(store, xfs):
    image = xfs / "disk.img"
    make_base_image(image, SIZE, 11)
    snap = store.commit(image)
    path = store.map_path(snap)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))
    with pytest.raises(Damaged, match="damaged"):
        with Store(store.root) as other:     # as another process would
            other.restore(snap.id, xfs / "out.img")
    assert store.verify(snap.id)


def test_busy_image_is_refused(store, xfs):
    image = xfs / "disk.img"
    make_base_image(image, SIZE, 12)
    with open(image, "rb") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        with pytest.raises(ImageBusy, match="another process"):
            store.commit(image)


def test_unknown_snapshot(store, xfs):
    with pytest.raises(UnknownSnapshot, match="no snapshot"):
        store.restore("0123456789abcdef", xfs / "x.img")
    assert not (xfs / "x.img").exists()


def test_store_needs_reflink(ext4):
    with pytest.raises(Unsupported, match="without reflink"):
        Store.init(ext4 / "store")


_COMMITTER = """
import sys
import time
from blockdiff.store.store import Store
store = Store(sys.argv[1])
for i in range(int(sys.argv[3])):
    with open(sys.argv[2], "r+b") as f:
        f.seek(4096 * (i % 64))
        f.write(bytes([i % 251]) * 4096)
    print(store.commit(sys.argv[2], message=f"{sys.argv[2]} {i}").id, flush=True)
"""


def test_parallel_committers(store, xfs):
    procs = []
    for n in range(4):
        image = xfs / f"vm{n}.img"
        make_base_image(image, SIZE, 20 + n)
        procs.append(subprocess.Popen([sys.executable, "-c", _COMMITTER, str(store.root),
                                       str(image), "8"], stdout=subprocess.PIPE, text=True))
    ids = []
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0
        ids += out.split()
    assert len(ids) == 32 and len(set(ids)) == 32
    assert {s.id for s in store.log()} == set(ids)
    for n in range(4):
        last = store.log()[0]
        out = xfs / f"check{n}.img"
        store.restore(last.id, out)


def test_cli_round_trip(xfs):
    env = dict(os.environ, BLOCKDIFF_STORE=str(xfs / "store"))

    def run(*args):
        proc = subprocess.run([sys.executable, "-m", "blockdiff", *map(str, args)],
                              capture_output=True, text=True, env=env)
        return proc

    assert run("init", xfs / "store").returncode == 0
    image = xfs / "disk.img"
    make_base_image(image, SIZE, 30)
    first = run("commit", image, "-m", "boot", "--meta", "step=0").stdout.splitlines()[-1]
    write_blocks(image, 5, seed=1)
    second = run("commit", image, "-m", "edit", "--ttl", "2h").stdout.splitlines()[-1]
    assert run("restore", first, xfs / "fork.img").returncode == 0
    log = json.loads(run("log", second, "--json").stdout)
    assert [e["id"] for e in log] == [second, first]
    assert log[1]["meta"] == {"step": "0"} and log[0]["expires"] is not None
    assert first in run("tree").stdout
    bad = run("restore", "ffffffffffffffff", xfs / "x.img")
    assert bad.returncode == 6 and "no snapshot" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    nostore = subprocess.run([sys.executable, "-m", "blockdiff", "log"], capture_output=True,
                             text=True, env={k: v for k, v in env.items()
                                             if k != "BLOCKDIFF_STORE"})
    assert nostore.returncode == 2 and "--store" in nostore.stderr


# ---------------------------------------------------- piece table algebra


def _model(table: PieceTable):
    """Byte model (in blocks): block -> (layer, pos) or None."""
    out = [None] * (table.size // BLOCK)
    for o, n, layer, pos in zip(table.offset, table.length, table.layer, table.pos):
        for k in range(int(n) // BLOCK):
            out[int(o) // BLOCK + k] = (int(layer), int(pos) + k * BLOCK)
    return out


@pytest.mark.parametrize("seed", range(40))
def test_overlay_and_pieces_within_match_a_model(seed):
    rng = random.Random(seed)
    table, model = None, None
    for layer in range(1, 6):
        size = rng.randint(0, 40) * BLOCK
        starts = sorted(rng.sample(range(0, max(size // BLOCK, 1)), min(5, size // BLOCK)))
        offset, length, kind = [], [], []
        for i, s in enumerate(starts):
            end = starts[i + 1] if i + 1 < len(starts) else size // BLOCK
            n = rng.randint(1, max(1, end - s))
            offset.append(s * BLOCK)
            length.append(n * BLOCK)
            kind.append(rng.choice([0, 0, 1]))
        changes = RangeSet(np.array(offset, np.uint64), np.array(length, np.uint64),
                           np.array(kind, np.uint8))
        pos = np.zeros(len(offset), np.uint64)
        np.cumsum(changes.length[:-1], out=pos[1:])
        new = overlay(table, changes, pos, layer, size)
        expect = (model or []) + [None] * size
        expect = expect[: size // BLOCK]
        for o, n, k, p in zip(offset, length, kind, pos):
            for b in range(n // BLOCK):
                expect[o // BLOCK + b] = (layer, int(p) + b * BLOCK) if k == 0 else None
        assert _model(new) == expect
        table, model = new, expect
        lo, hi = sorted(rng.sample(range(0, size // BLOCK + 1), 2)) if size else (0, 0)
        inside, (hs, he) = pieces_within(table, np.array([lo * BLOCK], np.uint64),
                                         np.array([hi * BLOCK], np.uint64))
        got = _model(PieceTable(inside.offset, inside.length, inside.layer, inside.pos, size))
        assert got[lo:hi] == expect[lo:hi]
        holes = {b for s, e in zip(hs, he) for b in range(int(s) // BLOCK, int(e) // BLOCK)}
        assert holes == {b for b in range(lo, hi) if expect[b] is None}


def test_tree_rendering(store, xfs):
    from blockdiff.engine.view import render_tree

    image = xfs / "disk.img"
    make_base_image(image, SIZE, 40)
    root = store.commit(image, message="root")
    a = store.commit(image, message="a")
    store.restore(root.id, xfs / "b.img")
    b = store.commit(xfs / "b.img", message="b")
    text = render_tree(store.log())
    assert text.splitlines()[0].startswith(root.id)
    assert f"├─ {a.id}  a" in text and f"└─ {b.id}  b" in text


# ------------------------------------------------------ rm, gc, verify, diff


def _line(store, xfs, steps, blocks=5):
    image = xfs / "disk.img"
    make_base_image(image, SIZE, 50)
    snaps, digests = [], []
    for step in range(steps):
        if step:
            write_blocks(image, blocks, seed=100 + step)
        snaps.append(store.commit(image, message=f"step {step}"))
        digests.append(digest(image))
    return image, snaps, digests


def test_rm_keeps_descendants_restorable(store, xfs):
    image, snaps, digests = _line(store, xfs, 6)
    for victim in (snaps[0], snaps[3], snaps[1]):
        result = store.rm(victim.id)
        assert result.removed == [victim.id]
    assert not store.map_path(snaps[3]).exists()
    live = [2, 4, 5]
    assert [s.id for s in store.log(snaps[5].id)] == [snaps[i].id for i in (5, 4, 2)]
    for i in live:
        out = xfs / f"r{i}.img"
        store.restore(snaps[i].id, out)
        assert digest(out) == digests[i]
    assert store.verify() == {}
    # Removing everything frees every layer.
    for i in live:
        store.rm(snaps[i].id)
    assert sorted(p.name for p in store.objects.iterdir()) == []


def test_gc_policy_and_ttl(store, xfs):
    image, snaps, digests = _line(store, xfs, 5)
    expiring = store.commit(image, ttl=0.0, message="scratch")
    from blockdiff.store.retention import Policy

    dry = store.gc(Policy(keep_last=2), dry_run=True)
    assert expiring.id in dry.removed and len(dry.removed) == 4
    assert len(store.log()) == 6        # nothing removed by a dry run
    result = store.gc(Policy(keep_last=2))
    assert result.reasons[expiring.id] == "expired" and result.bytes_freed > 0
    kept = {s.id for s in store.log()}
    assert kept == {snaps[4].id, snaps[3].id}
    for i in (3, 4):
        out = xfs / f"g{i}.img"
        store.restore(snaps[i].id, out)
        assert digest(out) == digests[i]


def test_gc_sweeps_leftovers_of_interrupted_operations(store, xfs):
    image, snaps, _ = _line(store, xfs, 2)
    (store.objects / "00000000000000aa.layer").write_bytes(b"x" * 8192)
    (store.staging / "00000000000000bb.999999999.layer").write_bytes(b"y" * 8192)
    from blockdiff.store.retention import Policy

    assert store.gc(Policy()).bytes_freed >= 16384
    assert not (store.objects / "00000000000000aa.layer").exists()
    assert {s.id for s in store.log()} == {s.id for s in snaps}


def test_verify_names_damaged_snapshots(store, xfs):
    image, snaps, _ = _line(store, xfs, 3, blocks=20)
    assert store.verify() == {}
    layer = store.objects / f"{snaps[1].id}.layer"
    os.chmod(layer, 0o644)
    with open(layer, "r+b") as f:
        f.seek(100)
        f.write(b"tampered")
    problems = store.verify()
    assert snaps[1].id in problems
    assert any("checksum" in p for p in problems[snaps[1].id])
    assert any("writable" in p for p in problems[snaps[1].id])
    # Snapshot 2 uses snapshot 1's layer, but its own data is intact.
    (store.objects / f"{snaps[0].id}.layer").unlink()
    problems = store.verify()
    assert all(any("missing" in p for p in problems[s.id]) for s in snaps)


def test_verify_cli_exit_code(xfs):
    env = dict(os.environ, BLOCKDIFF_STORE=str(xfs / "store"))

    def run(*args):
        return subprocess.run([sys.executable, "-m", "blockdiff", *map(str, args)],
                              capture_output=True, text=True, env=env)

    run("init", xfs / "store")
    image = xfs / "disk.img"
    make_base_image(image, SIZE, 60)
    snap = run("commit", image).stdout.split()[-1]
    assert run("verify").returncode == 0
    (map_file,) = (xfs / "store" / "objects").glob(f"{snap}.*.map")
    os.chmod(map_file, 0o644)
    bad = run("verify")
    assert bad.returncode == 7 and snap in bad.stderr


def test_diff_between_any_two_snapshots(store, xfs):
    image = xfs / "disk.img"
    make_base_image(image, SIZE, 70, sparse_fraction=0.0, zero_fraction=0.0)
    a = store.commit(image)
    scenarios.sequential_write(image, 10 * BLOCK, 3 * BLOCK, 1)
    store.commit(image)
    scenarios.punch_hole(image, 100 * BLOCK, 2 * BLOCK)
    c = store.commit(image)
    ranges = store.diff(a.id, c.id)
    assert [(int(o), int(n)) for o, n in zip(ranges.offset, ranges.length)] == [
        (10 * BLOCK, 3 * BLOCK), (100 * BLOCK, 2 * BLOCK)]
    assert list(ranges.kind) == [0, 1]
    assert len(store.diff(c.id, c.id)) == 0


@pytest.mark.parametrize("case", [
    # (created, expires) of five snapshots at now=1000; policy; expected removed
    ("keep_last", [(100, None), (200, None), (300, None), (400, 500), (900, None)],
     {"keep_last": 2}, {0, 1, 3}),
    ("keep_within", [(100, None), (850, None), (950, None), (990, 995), (999, None)],
     {"keep_within": 200}, {0, 3}),
    ("both", [(100, None), (200, None), (300, None), (850, None), (999, None)],
     {"keep_last": 1, "keep_within": 200}, {0, 1, 2}),
    ("ttl only", [(100, 2000), (200, 999), (300, None), (400, 1000), (500, None)],
     {}, {1, 3}),
])
def test_retention_policy_is_a_pure_function(case):
    from types import SimpleNamespace

    from blockdiff.store.retention import Policy, apply_policy

    _, rows, policy, expected = case
    snaps = [SimpleNamespace(id=str(i), created=c, expires=e) for i, (c, e) in enumerate(rows)]
    keep, remove, reasons = apply_policy(snaps, Policy(**policy), now=1000)
    assert {int(s.id) for s in remove} == expected
    assert {s.id for s in keep} | {s.id for s in remove} == {s.id for s in snaps}
    assert set(reasons) == {s.id for s in snaps}


def test_retention_keeps_and_removes_parts_with_their_owners():
    # A part (meta part-of) takes no place among the last N or the window:
    # it follows the snapshot it belongs to, through parts of parts, unless
    # its own TTL ran out; a part whose owner is not there counts alone.
    from types import SimpleNamespace

    from blockdiff.store.retention import PART_OF, Policy, apply_policy

    def snap(sid, created, part_of=None, expires=None):
        return SimpleNamespace(id=sid, created=created, expires=expires,
                               meta={PART_OF: part_of} if part_of else {})

    snaps = [snap("a", 100), snap("a.mem", 101, "a"), snap("b", 200),
             snap("b.mem", 201, "b"), snap("b.mem.more", 202, "b.mem"),
             snap("c", 300), snap("c.mem", 301, "c", expires=500),
             snap("stray", 50, "gone"), snap("loop1", 40, "loop2"), snap("loop2", 41, "loop1")]
    keep, remove, reasons = apply_policy(snaps, Policy(keep_last=2), now=1000)
    assert {s.id for s in keep} == {"b", "b.mem", "b.mem.more", "c"}
    assert {s.id for s in remove} == {"a", "a.mem", "c.mem", "stray", "loop1", "loop2"}
    assert reasons["b.mem.more"] == "a part of b" and reasons["c.mem"] == "expired"
    assert reasons["a.mem"] == "a part of a, which goes"
    # Without the parts, the same snapshots would have taken the places.
    keep, _, _ = apply_policy(snaps, Policy(keep_last=4), now=1000)
    assert {s.id for s in keep} == {"a", "a.mem", "b", "b.mem", "b.mem.more", "c", "stray"}


def test_rm_removes_the_parts_of_a_snapshot_with_it(store, xfs):
    image, snaps, digests = _line(store, xfs, 3)
    memory = xfs / "memory.img"
    make_base_image(memory, SIZE, 7)
    part = store.commit(memory, message="part", meta={"part-of": snaps[1].id})
    other = store.commit(memory, message="part of another", meta={"part-of": snaps[2].id})
    deeper = store.commit(memory, message="a part of the part", meta={"part-of": part.id})
    removed = store.rm(snaps[1].id)
    assert removed.removed == [deeper.id, part.id, snaps[1].id]
    assert removed.reasons[deeper.id] == removed.reasons[part.id] == f"a part of {snaps[1].id}"
    assert {s.id for s in store.log()} == {snaps[0].id, snaps[2].id, other.id}
    assert store.rm(other.id).removed == [other.id]   # a part alone: only itself
    store.restore(snaps[2].id, xfs / "check.img")
    assert digest(xfs / "check.img") == digests[2]
    assert store.verify() == {}


def test_a_part_committed_beside_the_removal_of_its_owner_goes_with_it(store, xfs,
                                                                     monkeypatch):
    # A part committed once rm has listed the parts (before the owner's row
    # goes) is found after it and removed; one committed after the owner's
    # row went is refused, as a capture whose parent went is.
    from blockdiff.store import removal

    image, snaps, digests = _line(store, xfs, 3)
    memory = xfs / "memory.img"
    make_base_image(memory, SIZE, 7)
    early = store.commit(memory, message="early part", meta={"part-of": snaps[1].id})
    late = []
    real_remove = removal.remove

    def remove(st, doomed, reasons):
        if not late:   # rm has listed the parts: one more comes now
            write_blocks(memory, 3, seed=11)
            late.append(store.commit(memory, message="late part",
                                     meta={"part-of": snaps[1].id}))
        return real_remove(st, doomed, reasons)

    monkeypatch.setattr(removal, "remove", remove)
    result = store.rm(snaps[1].id)
    monkeypatch.undo()
    assert set(result.removed) == {early.id, late[0].id, snaps[1].id}
    assert result.removed[-1] == snaps[1].id
    assert result.reasons[late[0].id] == f"a part of {snaps[1].id}"
    assert {s.id for s in store.log()} == {snaps[0].id, snaps[2].id}
    write_blocks(memory, 3, seed=12)
    with store.capturing(memory) as capture:
        with pytest.raises(StoreError, match="removed meanwhile"):
            capture.finish(message="too late", meta={"part-of": snaps[1].id})
    store.restore(snaps[2].id, xfs / "check.img")
    assert digest(xfs / "check.img") == digests[2]
    assert store.verify() == {}
    assert list((store.root / "staging").iterdir()) == []


def test_a_part_committed_beside_a_gc_that_removes_its_owner_goes_too(store, xfs,
                                                                      monkeypatch):
    from blockdiff.store import removal
    from blockdiff.store.retention import Policy

    image, snaps, digests = _line(store, xfs, 3)
    memory = xfs / "memory.img"
    make_base_image(memory, SIZE, 7)
    late = []
    real_remove = removal.remove

    def remove(st, doomed, reasons):
        if not late:   # gc has decided: a part of a doomed snapshot comes now
            late.append(store.commit(memory, message="late part",
                                     meta={"part-of": snaps[0].id}))
        return real_remove(st, doomed, reasons)

    monkeypatch.setattr(removal, "remove", remove)
    result = store.gc(Policy(keep_last=2))
    monkeypatch.undo()
    assert set(result.removed) == {snaps[0].id, late[0].id}
    assert result.reasons[late[0].id] == f"a part of {snaps[0].id}, which went"
    assert {s.id for s in store.log()} == {snaps[1].id, snaps[2].id}
    assert store.verify() == {}


# ------------------------------------------------------------ export/import


def test_export_import_across_filesystems(store, xfs, btrfs):
    image, snaps, digests = _line(store, xfs, 4, blocks=30)
    full = xfs / "full.bdx"
    store.export(snaps[1].id, full)
    since = xfs / "since.bdx"
    store.export(snaps[3].id, since, since=snaps[1].id)
    assert os.path.getsize(since) < os.path.getsize(full)
    other = Store.init(btrfs / "store")
    for bundle in (full, since):
        moved = btrfs / bundle.name
        moved.write_bytes(bundle.read_bytes())   # another host: a plain byte copy
    assert other.import_(btrfs / "full.bdx").ids == [snaps[1].id]
    assert other.import_(btrfs / "since.bdx").ids == [snaps[3].id]
    assert other.import_(btrfs / "since.bdx").skipped   # twice: no change
    assert other.get(snaps[3].id).parent == snaps[1].id
    assert other.get(snaps[3].id).message == "step 3"
    for i in (1, 3):
        out = btrfs / f"r{i}.img"
        other.restore(snaps[i].id, out)
        assert digest(out) == digests[i]
    assert other.verify() == {}
    other.close()


def test_import_needs_the_ancestor_and_a_sound_file(store, xfs):
    image, snaps, _ = _line(store, xfs, 3)
    store.export(snaps[2].id, xfs / "since.bdx", since=snaps[0].id)
    other = Store.init(xfs / "other")
    with pytest.raises(StoreError, match="import that first"):
        other.import_(xfs / "since.bdx")
    (xfs / "junk.bdx").write_bytes(b"nothing to see" * 10)
    from blockdiff.errors import InvalidDiff

    with pytest.raises(InvalidDiff, match="not a blockdiff export"):
        other.import_(xfs / "junk.bdx")
    store.export(snaps[1].id, xfs / "full.bdx")
    data = bytearray((xfs / "full.bdx").read_bytes())
    data[8192 + 50] ^= 0xFF                         # inside the data region
    (xfs / "bad.bdx").write_bytes(bytes(data))
    with pytest.raises(InvalidDiff):
        other.import_(xfs / "bad.bdx")
    assert other.log() == []
    with pytest.raises(Exception, match="not an ancestor"):
        store.export(snaps[0].id, xfs / "x.bdx", since=snaps[2].id)
    assert not (xfs / "x.bdx").exists()
    other.close()


def test_export_is_a_plain_v2_diff(store, xfs):
    from blockdiff.engine import diff as engine

    image, snaps, digests = _line(store, xfs, 2)
    store.export(snaps[1].id, xfs / "full.bdx")
    engine.apply_diff(xfs / "full.bdx", xfs / "applied.img")
    assert digest(xfs / "applied.img") == digests[1]


def test_compact_keeps_content_and_shrinks_the_piece_table(store, xfs):
    image, snaps, digests = _line(store, xfs, 12, blocks=40)
    tip = snaps[-1]
    before = len(store.load_map(tip).pieces)
    store.compact(tip.id)
    after = len(store.load_map(store.get(tip.id)).pieces)
    # One piece per run of data: the image has holes, so not one piece in all.
    assert after < before / 3
    assert store.verify() == {}
    for i in (0, 5, 11):
        out = xfs / f"c{i}.img"
        store.restore(snaps[i].id, out)
        assert digest(out) == digests[i]
    # An image restored from the compacted snapshot commits small again.
    store.restore(tip.id, image)
    write_blocks(image, 3, seed=99)
    assert store.commit(image).changed_bytes <= 3 * BLOCK
    # Removing everything but the compacted tip frees the old layers.
    for snap in snaps[:-1]:
        store.rm(snap.id)
    layers = list(store.objects.glob("*.layer"))
    assert len(layers) <= 2


def test_restore_onto_another_filesystem_rebuilds_the_image(store, xfs, ext4):
    image, snaps, digests = _line(store, xfs, 3, blocks=10)
    elsewhere = ext4 / "disk.img"
    for i in (2, 0, 1):
        store.restore(snaps[i].id, elsewhere)
        assert digest(elsewhere) == digests[i]
    with pytest.raises(Unsupported, match="not on the store's filesystem"):
        store.commit(elsewhere)


def test_full_disk_loses_nothing(fresh_filesystem):
    root = fresh_filesystem("xfs", size=320 * 1024 * 1024)
    store = Store.init(root / "store")
    image = root / "disk.img"
    make_base_image(image, 64 * 1024 * 1024, 80, sparse_fraction=0.0, zero_fraction=0.0)
    first = store.commit(image)
    expected = digest(image)
    write_blocks(image, 200, seed=3)
    filesystems.fill(root)   # to the last block
    env = dict(os.environ, BLOCKDIFF_STORE=str(root / "store"))
    proc = subprocess.run([sys.executable, "-m", "blockdiff", "commit", str(image)],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 1, proc.stderr
    assert "No space left on device" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert [s.id for s in store.log()] == [first.id]
    assert list(store.staging.iterdir()) == []
    assert store.verify() == {}
    os.unlink(root / "filler")
    out = root / "restored.img"
    store.restore(first.id, out)
    assert digest(out) == expected
    store.close()


@pytest.mark.parametrize("kind", ["ext4", "tmpfs"])
def test_copy_mode_store_without_reflink(kind, ext4, tmpfs):
    root = {"ext4": ext4, "tmpfs": tmpfs}[kind]
    store = Store.init(root / "store", allow_copy=True)
    image = root / "disk.img"
    make_base_image(image, SIZE, 90)
    snaps, digests = [store.commit(image)], [digest(image)]
    for step, op in enumerate(["random_4k_writes", "punched_holes", "grow", "shrink_unaligned"]):
        live = root / "live.img"
        SCENARIOS[op](image, live, step)
        os.replace(live, image)
        snaps.append(store.commit(image, parent=snaps[-1].id))
        digests.append(digest(image))
    assert snaps[1].changed_bytes < SIZE // 4          # contents compared, not copied whole
    for i in (3, 0, 4, 1):
        store.restore(snaps[i].id, image)
        assert digest(image) == digests[i]
        store.restore(snaps[i].id, root / f"fork{i}.img")
        assert digest(root / f"fork{i}.img") == digests[i]
    assert len(store.diff(snaps[0].id, snaps[1].id)) > 0
    assert store.verify() == {}
    store.close()


def test_damaged_catalog_is_one_line(xfs):
    env = dict(os.environ, BLOCKDIFF_STORE=str(xfs / "store"))
    Store.init(xfs / "store").close()
    for name in ("catalog.sqlite-wal", "catalog.sqlite-shm"):
        (xfs / "store" / name).unlink(missing_ok=True)
    (xfs / "store" / "catalog.sqlite").write_bytes(b"this is not a database" * 100)
    proc = subprocess.run([sys.executable, "-m", "blockdiff", "log"], capture_output=True,
                          text=True, env=env)
    assert proc.returncode == 7 and "Traceback" not in proc.stderr
    assert "catalog" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_catalog_migrations_apply_once(store, xfs):
    from blockdiff.store.catalog import MIGRATIONS, Catalog

    assert store.catalog.schema_version == len(MIGRATIONS)
    again = Catalog(str(store.root / "catalog.sqlite"))     # reopening migrates nothing
    assert again.schema_version == len(MIGRATIONS)
    rows = again.db.execute("SELECT COUNT(*) FROM schema_migrations").fetchone()[0]
    assert rows == len(MIGRATIONS)
    again.close()


def test_decoded_maps_are_kept_by_least_recent_use_within_a_budget():
    from blockdiff.store.objects import DecodedCache

    cache = DecodedCache(3, weigh=len, budget=10)
    for key in "abc":
        cache.put(key, "xx")
    assert cache.get("a") == "xx"          # a is now the most recently used
    cache.put("d", "xx")                   # over the count: b, the least, goes
    assert [cache.get(k) for k in "abcd"] == ["xx", None, "xx", "xx"]
    cache.put("e", "xxxxxx")               # over the count again: a, the least, goes
    assert [cache.get(k) for k in "acde"] == [None, "xx", "xx", "xxxxxx"]
    cache.put("e", "x")                    # replaced: its weight with it
    cache.put("f", "xxxxxxxx")             # 2 + 2 + 1 + 8 > 10: c, then d go
    assert [cache.get(k) for k in "cdef"] == [None, None, "x", "xxxxxxxx"]
    cache.put("g", "x" * 50)               # too heavy alone: kept, the rest go
    assert [cache.get(k) for k in "defg"] == [None, None, None, "x" * 50]
    cache.pop("g")
    assert cache.get("g") is None
    cache.put("h", "xxxxxxxxxx")
    assert cache.get("h") == "xxxxxxxxxx"


def test_maps_are_deltas_with_a_whole_one_every_few_commits(store, xfs):
    from blockdiff.store.store import MAP_CHAIN

    image, snaps, digests = _line(store, xfs, 2 * MAP_CHAIN + 3, blocks=20)
    snaps = [store.get(s.id) for s in snaps]
    chains = [store.load_map(s).chain for s in snaps]
    assert chains == [i % MAP_CHAIN for i in range(len(snaps))]
    for snap, chain in zip(snaps, chains):
        assert snap.map_base == (None if chain == 0 else snap.parent)
    whole = store.map_path(snaps[MAP_CHAIN]).stat().st_size
    delta = store.map_path(snaps[MAP_CHAIN + 3]).stat().st_size
    assert delta < whole
    # Read afresh (another process), every map through its chain: forks match.
    other = Store(store.root)
    for i, snap in enumerate(snaps):
        out = xfs / f"d{i}.img"
        other.restore(snap.id, out)
        assert digest(out) == digests[i]
        out.unlink()
    other.close()
    assert store.verify() == {}


@pytest.mark.parametrize("operation", ["rm", "compact"])
def test_removing_or_compacting_a_map_others_build_on(store, xfs, operation):
    image, snaps, digests = _line(store, xfs, 7, blocks=20)
    victim = snaps[2]
    dependents = store.catalog.map_dependents(victim.id)
    assert [d.id for d in dependents] == [snaps[3].id]
    old_map = store.map_path(dependents[0])
    getattr(store, operation)(victim.id)
    assert not old_map.exists()          # the delta was rewritten whole
    assert store.get(snaps[3].id).map_base is None
    assert store.catalog.map_dependents(victim.id) == []
    other = Store(store.root)
    for i, snap in enumerate(snaps):
        if operation == "rm" and i == 2:
            continue
        out = xfs / f"x{i}.img"
        other.restore(snap.id, out)
        assert digest(out) == digests[i], i
        out.unlink()
    other.close()
    assert store.verify() == {}
    # The line goes on as deltas.
    write_blocks(image, 5, seed=7)
    assert store.get(store.commit(image).id).map_base == snaps[-1].id


# Runs rm or compact on a snapshot in a process that dies (as if SIGKILLed)
# between placing its files in objects/ and its catalog switch.
_KILLED_BEFORE_THE_SWITCH = """
import os, sys
from blockdiff.store import Store, compaction, removal
def die(*args, **kwargs):
    os._exit(9)
compaction.upload_rewritten = removal.upload_rewritten = die
getattr(Store(sys.argv[1]), sys.argv[2])(sys.argv[3])
"""


@pytest.mark.parametrize("killed, again", [("rm", "rm"), ("compact", "compact"),
                                           ("compact", "rm"), ("rm", "compact")])
def test_rm_or_compact_again_after_one_killed_before_its_switch(store, xfs, killed, again):
    """The killed operation left the maps it wrote whole for the snapshots
    built on the victim; the same maps written again have the same names.
    The next rm or compact of it sweeps them away and does its work."""
    image, snaps, digests = _line(store, xfs, 4, blocks=20)
    victim = snaps[1]
    branch = xfs / "branch.img"
    store.restore(victim.id, branch)
    write_blocks(branch, 7, seed=9)
    snaps.append(store.commit(branch))
    digests.append(digest(branch))
    assert {d.id for d in store.catalog.map_dependents(victim.id)} == {snaps[2].id,
                                                                        snaps[4].id}
    done = subprocess.run([sys.executable, "-c", _KILLED_BEFORE_THE_SWITCH, str(store.root),
                           killed, victim.id], capture_output=True, text=True, timeout=120)
    assert done.returncode == 9, done.stderr
    assert store.catalog.map_dependents(victim.id) != []      # nothing switched
    with Store(store.root) as other:           # as the next process would write them
        getattr(other, again)(victim.id)
        assert other.catalog.map_dependents(victim.id) == []
        for i, snap in enumerate(snaps):
            if again == "rm" and snap is victim:
                continue
            out = xfs / f"x{i}.img"
            other.restore(snap.id, out)
            assert digest(out) == digests[i], i
            out.unlink()
        assert other.verify() == {}
        named = {other.map_path(s).name for s in other.log()}
        named |= {layer_name(layer) for layer in other.catalog.layer_ids()}
        assert {p.name for p in (store.root / "objects").iterdir()} == named


def test_a_damaged_base_map_is_named(store, xfs):
    image, snaps, _ = _line(store, xfs, 3)
    path = store.map_path(snaps[1])
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))
    with Store(store.root) as other:           # as another process would read them
        problems = other.verify()
        assert snaps[1].id in problems and snaps[2].id in problems
        assert snaps[0].id not in problems
        with pytest.raises(Damaged, match=f"map of snapshot {snaps[1].id} is damaged"):
            other.restore(snaps[2].id, xfs / "out.img")


def _scribble(image, rnd, count, *, mapped):
    """Random 4 KiB-aligned writes of random length, through a shared
    mapping (as a VM's RAM is written) or pwrite."""
    size = os.path.getsize(image)
    with open(image, "r+b") as f:
        if mapped:
            import mmap
            m = mmap.mmap(f.fileno(), size, mmap.MAP_SHARED)
        for _ in range(count):
            off = rnd.randrange(0, size // BLOCK) * BLOCK + rnd.choice([0, 0, 17])
            data = rnd.randbytes(rnd.randint(1, 3 * BLOCK))[:size - off]
            if mapped:
                m[off:off + len(data)] = data
            else:
                os.pwrite(f.fileno(), data, off)
        if mapped:
            m.close()


def _committed_ram_image(store, xfs, seed):
    """A random image committed as the base of a capture test: ``(image,
    its random source)``."""
    image = xfs / "ram.img"
    make_base_image(image, SIZE, seed)
    store.commit(image, message="base")
    return image, random.Random(seed)


@pytest.mark.parametrize("seed", range(4))
def test_a_capture_is_the_image_as_it_was_when_last_taken(store, xfs, seed):
    # Store.capturing: the changes are cloned on entering and topped up by
    # take_more; the image may change after that, and the snapshot is still
    # what it held at the last take, while the next commit sees the rest.
    image, rnd = _committed_ram_image(store, xfs, seed)
    for step in range(4):
        _scribble(image, rnd, 20, mapped=step % 2 == 0)
        with store.capturing(image) as capture:
            _scribble(image, rnd, rnd.randint(0, 6), mapped=True)   # while it still runs
            capture.take_more()
            held = digest(image)
            _scribble(image, rnd, 8, mapped=step % 2 == 1)          # after: not in it
            snap = capture.finish(message=f"step {step}")
        assert snap.parent is not None
        after = digest(image)
        check = xfs / f"check{step}.img"
        store.restore(snap.id, check)
        assert digest(check) == held
        following = store.commit(image, message=f"after {step}")
        store.restore(following.id, check)
        assert digest(check) == after
    assert store.verify() == {}
    # A capture left unfinished commits nothing and leaves nothing staged.
    nodes = len(store.log())
    _scribble(image, rnd, 5, mapped=False)
    with store.capturing(image) as capture:
        capture.take_more()
    assert len(store.log()) == nodes
    assert list((store.root / "staging").iterdir()) == []
    with pytest.raises(StoreError, match="finished or discarded"):
        capture.finish()


def _removing(store, snapshot_id):
    """Another process, started now, removing a snapshot of the store."""
    return subprocess.Popen(
        [sys.executable, "-c", "import sys\n"
         "from blockdiff.store.store import Store\n"
         "with Store(sys.argv[1]) as s:\n"
         "    s.rm(sys.argv[2])\n", str(store.root), snapshot_id],
        stderr=subprocess.PIPE, text=True)


def _removed(store, remover, snapshot_id):
    """Once a capture's block has ended: the removal ``remover`` finished
    (it deletes files under the exclusive store lock, which waits for the
    block), the snapshot is gone and nothing is left staged."""
    try:
        remover.wait(60)
    finally:
        remover.kill()
    assert remover.returncode == 0, remover.stderr.read()
    with pytest.raises(UnknownSnapshot):
        store.get(snapshot_id)
    assert list((store.root / "staging").iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("only_changed_pages", [False, True])
def test_a_removal_of_the_parent_beside_an_open_capture(store, xfs, only_changed_pages):
    # Another process removes a capture's parent (its only snapshot so far)
    # while the capture is open, at various moments. Either the capture
    # finishes first, and its snapshot restores byte for byte once the
    # parent is gone, or the removal comes first and finish refuses as a
    # commit would, leaving nothing staged and the image committable again.
    # Comparing pages with the parent's reads its layers while it goes.
    rnd = random.Random(7)
    image = xfs / "ram.img"
    make_base_image(image, SIZE, 7)
    for round_, wait in enumerate([0.0, 0.3, 0.8, 1.5, 3.0]):
        parent = store.commit(image, message=f"parent {round_}")
        _scribble(image, rnd, 10, mapped=True)
        with store.capturing(image, only_changed_pages=only_changed_pages) as capture:
            held = digest(image)
            remover = _removing(store, parent.id)
            snap = None
            try:
                time.sleep(wait)
                _scribble(image, rnd, 5, mapped=False)
                snap = capture.finish(message=f"child {round_}")
            except StoreError as e:
                assert "removed meanwhile; commit it again" in str(e)
            except BaseException:
                remover.kill()
                raise
        _removed(store, remover, parent.id)
        if snap is None:
            snap = store.commit(image, message=f"again {round_}")
            held = digest(image)
        assert snap.id in {s.id for s in store.log()}
        check = xfs / f"child{round_}.img"
        store.restore(snap.id, check)
        assert digest(check) == held
        store.restore(snap.id, image)
    assert store.verify() == {}


@pytest.mark.slow
def test_a_removal_of_the_lender_beside_an_open_capture(store, xfs):
    # Another process removes the snapshot a capture borrows pages from
    # while the capture is open, at various moments. Either the capture
    # commits first, and its layer reference keeps the lender's layer, or
    # the removal comes first and finish refuses, since the removal dropped
    # the record of the lender's layer and deletes its file once the capture
    # lets go of the store. Either way the image's next snapshot restores
    # byte for byte once the lender is gone.
    image, rnd = _committed_ram_image(store, xfs, 11)
    disk = xfs / "disk.img"
    make_base_image(disk, SIZE, 12)
    pages = SIZE // BLOCK
    outcomes = []
    for round_, wait in enumerate([0.0, 0.3, 0.8, 1.5, 3.0]):
        blocks = [rnd.randbytes(BLOCK) for _ in range(6)]
        with open(disk, "r+b") as f:
            for k, page in enumerate(rnd.sample(range(pages), len(blocks))):
                os.pwrite(f.fileno(), blocks[k], page * BLOCK)
        lender = store.commit(disk, message=f"disk {round_}")
        with open(image, "r+b") as f:
            for k, page in enumerate(rnd.sample(range(pages // 4), len(blocks))):
                os.pwrite(f.fileno(), blocks[k], 4 * page * BLOCK)
        with store.capturing(image, only_changed_pages=True) as capture:
            held = digest(image)
            remover = _removing(store, lender.id)
            snap = None
            try:
                time.sleep(wait)
                snap = capture.finish(message=f"memory {round_}", borrow_from=lender)
                assert capture.borrowed == len(blocks) * BLOCK
            except StoreError as e:
                assert "removed meanwhile; commit it again" in str(e)
            except BaseException:
                remover.kill()
                raise
        _removed(store, remover, lender.id)
        outcomes.append(snap is not None)
        if snap is None:
            snap = store.commit(image, message=f"again {round_}")
        check = xfs / f"memory{round_}.img"
        store.restore(snap.id, check)
        assert digest(check) == held
    assert store.verify() == {}
    assert True in outcomes


@pytest.mark.parametrize("seed", range(3))
def test_a_capture_of_changed_pages_stores_only_the_pages_whose_bytes_differ(store, xfs, seed):
    # Pages rewritten with the bytes they held move to new extents but are
    # not stored again; a page changed before the top-up and changed back in
    # it is the parent's; the short last page is kept as it is. Every
    # snapshot restores byte for byte, and the next commit sees what follows.
    image, rnd = _committed_ram_image(store, xfs, seed)
    pages = SIZE // BLOCK
    for step in range(4):
        before = image.read_bytes()
        changed = set(rnd.sample(range(pages), 12))
        rewritten = set(rnd.sample(range(pages), 40)) - changed
        reverted = set(rnd.sample(sorted(changed), 3))
        with open(image, "r+b") as f:
            for page in sorted(rewritten):
                os.pwrite(f.fileno(), before[page * BLOCK:(page + 1) * BLOCK], page * BLOCK)
            for page in sorted(changed):
                os.pwrite(f.fileno(), rnd.randbytes(BLOCK), page * BLOCK)
            if step % 2:
                os.pwrite(f.fileno(), rnd.randbytes(100), SIZE - 300)  # into the short page
        with store.capturing(image, only_changed_pages=True) as capture:
            with open(image, "r+b") as f:
                for page in sorted(reverted):
                    os.pwrite(f.fileno(), before[page * BLOCK:(page + 1) * BLOCK], page * BLOCK)
            capture.take_more()
            held = image.read_bytes()
            _scribble(image, rnd, 6, mapped=True)                    # after: not in it
            snap = capture.finish(message=f"step {step}")
        differing = {p for p in range(pages)
                     if held[p * BLOCK:(p + 1) * BLOCK] != before[p * BLOCK:(p + 1) * BLOCK]}
        assert differing == changed - reverted
        tail = SIZE - pages * BLOCK
        assert len(differing) * BLOCK <= snap.changed_bytes <= len(differing) * BLOCK + tail
        # Every page written was compared (whole pages: not the short one).
        assert capture.compared >= len(rewritten | changed) * BLOCK
        layer = store.layer_path(layer_number(snap.id))
        assert os.stat(layer).st_blocks * 512 <= len(differing) * BLOCK + BLOCK
        check = xfs / f"check{step}.img"
        store.restore(snap.id, check)
        assert check.read_bytes() == held
        after = image.read_bytes()
        following = store.commit(image, message=f"after {step}")
        store.restore(following.id, check)
        assert check.read_bytes() == after
        # Restored in place over the image from where it stands now.
        store.restore(snap.id, image)
        assert image.read_bytes() == held
    assert store.verify() == {}
    assert list((store.root / "staging").iterdir()) == []


@pytest.mark.parametrize("seed", range(3))
def test_a_capture_of_changed_pages_borrows_the_pages_another_snapshot_stored(store, xfs, seed):
    # A VM's RAM holds in its page cache blocks its disk snapshot stored:
    # such pages point into the disk snapshot's layer instead of being
    # stored again, and the RAM image shares those blocks from then on, so
    # that a later write to one is seen as any other. One of them is written
    # after the top-up, before the kernel shares it: the snapshot still holds
    # what was captured, and the next commit sees the write. Every snapshot
    # restores byte for byte, also once the disk snapshots are removed.
    image, rnd = _committed_ram_image(store, xfs, seed)
    disk = xfs / "disk.img"
    make_base_image(disk, SIZE, seed + 100)
    store.commit(disk, message="disk base")
    pages = SIZE // BLOCK
    snaps, disk_snaps, wanted = [], [], []
    for step in range(4):
        blocks = [rnd.randbytes(BLOCK) for _ in range(10)]
        with open(disk, "r+b") as f:
            for k, page in enumerate(rnd.sample(range(pages), len(blocks))):
                os.pwrite(f.fileno(), blocks[k], page * BLOCK)
        disk_snaps.append(store.commit(disk, message=f"disk {step}"))
        before = image.read_bytes()
        cached = [4 * p for p in rnd.sample(range(pages // 4), len(blocks))]
        own = {4 * p + 2 for p in rnd.sample(range(pages // 4 - 1), 8)}
        with open(image, "r+b") as f:
            for k, page in enumerate(cached):
                os.pwrite(f.fileno(), blocks[k], page * BLOCK)
            for page in sorted(own):
                os.pwrite(f.fileno(), rnd.randbytes(BLOCK), page * BLOCK)
        with store.capturing(image, only_changed_pages=True) as capture:
            capture.take_more()
            held = image.read_bytes()
            with open(image, "r+b") as f:   # written before the kernel shares it
                os.pwrite(f.fileno(), rnd.randbytes(BLOCK), cached[0] * BLOCK)
            snap = capture.finish(message=f"step {step}", borrow_from=disk_snaps[-1])
        assert capture.borrowed == len(cached) * BLOCK
        differing = own | set(cached)
        tail = SIZE - pages * BLOCK   # the short last page, kept as it is
        assert len(differing) * BLOCK <= snap.changed_bytes <= len(differing) * BLOCK + tail
        layer = store.layer_path(layer_number(snap.id))
        assert os.stat(layer).st_blocks * 512 <= len(own) * BLOCK + BLOCK
        assert layer_number(disk_snaps[-1].id) in set(store.load_map(snap).pieces.layer.tolist())
        check = xfs / f"check{step}.img"
        store.restore(snap.id, check)
        assert check.read_bytes() == held
        _scribble(image, rnd, 2, mapped=True)
        with open(image, "r+b") as f:   # a page the disk's block now backs
            os.pwrite(f.fileno(), rnd.randbytes(100), cached[1] * BLOCK + 50)
        after = image.read_bytes()
        following = store.commit(image, message=f"after {step}")
        store.restore(following.id, check)
        assert check.read_bytes() == after
        # The pages it shares with the disk's layer and did not write are
        # not changes to the next commit.
        changes = store.differences(snap, following)
        untouched = {p for p in cached[2:] if held[p * BLOCK:(p + 1) * BLOCK]
                     == after[p * BLOCK:(p + 1) * BLOCK]}
        assert not any(o // BLOCK <= p < -(-(o + n) // BLOCK) for p in untouched
                       for o, n in zip(changes.offset.tolist(), changes.length.tolist()))
        snaps += [snap, following]
        wanted += [held, after]
        # Restored in place over the image from where it stands now.
        store.restore(snap.id, image)
        assert image.read_bytes() == held
        assert before != held
    for i, (s, want) in enumerate(zip(snaps, wanted)):
        store.restore(s.id, xfs / "check.img")
        assert (xfs / "check.img").read_bytes() == want
    for s in disk_snaps[1:]:
        store.rm(s.id)
    for s, want in zip(snaps, wanted):
        store.restore(s.id, xfs / "check.img")
        assert (xfs / "check.img").read_bytes() == want
    assert store.verify() == {}
    assert list((store.root / "staging").iterdir()) == []


@pytest.mark.parametrize("seed", range(3))
def test_a_capture_topped_up_within_ranges_takes_those_alone(store, xfs, seed):
    # take_more(within=...) maps and takes only those ranges (a VM's
    # device-state area, written once its RAM runs again): the snapshot is
    # the image as captured, but for them; the next commit sees the rest.
    image, rnd = _committed_ram_image(store, xfs, seed)
    start, length = 256 * BLOCK, 300 * BLOCK
    within = (np.array([start], np.uint64), np.array([length], np.uint64))
    for step in range(3):
        _scribble(image, rnd, 10, mapped=True)
        with store.capturing(image) as capture:
            held = image.read_bytes()
            _scribble(image, rnd, 6, mapped=True)   # anywhere, after the capture
            with open(image, "r+b") as f:
                os.pwrite(f.fileno(), rnd.randbytes(rnd.randint(1, length)), start)
            capture.take_more(within=within)
            now = image.read_bytes()
            _scribble(image, rnd, 3, mapped=False)   # after the top-up: not in it
            snap = capture.finish(message=f"step {step}")
        check = xfs / f"check{step}.img"
        store.restore(snap.id, check)
        assert check.read_bytes() == held[:start] + now[start:start + length] + \
            held[start + length:]
        after = image.read_bytes()
        following = store.commit(image, message=f"after {step}")
        store.restore(following.id, check)
        assert check.read_bytes() == after
    assert store.verify() == {}


def test_a_topped_up_capture_keeps_the_short_last_block_shared(store, xfs):
    # The short last block of an image is cloned into the layer at its end;
    # what take_more clones behind it would unshare it (the kernel zeroes
    # the rest of that block first), and a write of the image there would
    # then go in place, which no extent map shows. The next commits must
    # still see every write to it.
    image, rnd = _committed_ram_image(store, xfs, 3)
    for step in range(3):
        with open(image, "r+b") as f:
            os.pwrite(f.fileno(), rnd.randbytes(50), SIZE - 100)
        with store.capturing(image) as capture:
            with open(image, "r+b") as f:
                os.pwrite(f.fileno(), rnd.randbytes(BLOCK), rnd.randrange(SIZE // BLOCK) * BLOCK)
            capture.take_more()
            held = image.read_bytes()
            snap = capture.finish(message=f"step {step}")
        with open(image, "r+b") as f:
            os.pwrite(f.fileno(), rnd.randbytes(50), SIZE - 60)
        after = store.commit(image, message=f"after {step}")
        for s, want in ((snap, held), (after, image.read_bytes())):
            store.restore(s.id, xfs / "check.img")
            assert (xfs / "check.img").read_bytes() == want
    assert store.verify() == {}


def test_recently_written_is_what_the_nearest_snapshots_wrote(store, xfs):
    # Five snapshots, each writing its own pages: the newest three wrote
    # theirs, and the limit stops at the ancestor that would pass it.
    image = xfs / "img"
    make_base_image(image, SIZE, 5)
    snaps = [store.commit(image, message="base")]
    for k in range(5):
        with open(image, "r+b") as f:
            os.pwrite(f.fileno(), random.Random(k).randbytes(2 * BLOCK), (10 + 20 * k) * BLOCK)
        snaps.append(store.commit(image, message=f"step {k}"))
    offsets, lengths = store.recently_written(snaps[-1].id, 3, 1 << 30)
    assert sorted(zip(offsets.tolist(), lengths.tolist())) == [
        ((10 + 20 * k) * BLOCK, 2 * BLOCK) for k in (2, 3, 4)]
    offsets, lengths = store.recently_written(snaps[-1].id, 3, 5 * BLOCK)
    assert sorted(zip(offsets.tolist(), lengths.tolist())) == [
        ((10 + 20 * k) * BLOCK, 2 * BLOCK) for k in (3, 4)]
    # The base snapshot wrote the whole image; a limit keeps it out.
    offsets, _ = store.recently_written(snaps[1].id, 4, 1 << 20)
    assert offsets.tolist() == [10 * BLOCK]
