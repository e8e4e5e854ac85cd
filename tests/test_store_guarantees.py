"""The store's guarantees against damage, reuse and hostile input.

Each test is one way the store used to lose or hand back wrong data, or to
be broken by its input; every restore is compared byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import stat
import struct
import subprocess
import sys
from pathlib import Path

import clirun
import pytest

import filesystems
import scenarios
from blockdiff.errors import Damaged, InvalidDiff, StoreError, UsageError
from blockdiff.store.retention import Policy
from blockdiff.store.store import EXPORT_MAGIC, Store
from scenarios import make_base_image

SIZE = 4 * 1024 * 1024 + 777


def digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def cli(*args, store=None, check=None, umask=None):
    env = dict(os.environ)
    if store is not None:
        env["BLOCKDIFF_STORE"] = str(store)
    if umask is None:   # a process of its own only where its umask is tested
        return clirun.cli(*args, code=check, env=env)
    proc = subprocess.run([sys.executable, "-m", "blockdiff", *map(str, args)],
                          capture_output=True, text=True, env=env,
                          preexec_fn=None if umask is None else (lambda: os.umask(umask)))
    assert "Traceback" not in proc.stderr, proc.stderr
    if check is not None:
        assert proc.returncode == check, (proc.returncode, proc.stdout, proc.stderr)
    return proc


@pytest.fixture
def store(xfs):
    s = Store.init(xfs / "store")
    yield s
    s.close()


def line(store, xfs, steps, blocks=5, name="disk.img"):
    image = xfs / name
    make_base_image(image, SIZE, 50)
    snaps, digests = [], []
    for step in range(steps):
        if step:
            scenarios.random_block_writes(image, count=blocks, seed=100 + step)
        snaps.append(store.commit(image, message=f"step {step}"))
        digests.append(digest(image))
    return image, snaps, digests


def restores_exactly(store, xfs, snaps, digests):
    for snap, expected in zip(snaps, digests):
        out = xfs / f"check-{snap.id}.img"
        store.restore(snap.id, out)
        assert digest(out) == expected, snap.id
        out.unlink()


def damage(path: Path, offset: int, data: bytes = b"\xde\xad\xbe\xef") -> None:
    """Change bytes of a read-only store file, as a stray write would."""
    os.chmod(path, 0o600)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)
    os.chmod(path, 0o400)


def rewrite_record(export: Path, out: Path, change) -> None:
    """Write ``out``: ``export`` with its record changed by ``change(record)``."""
    raw = export.read_bytes()
    length, magic = struct.unpack("<Q8s", raw[-16:])
    assert magic == EXPORT_MAGIC
    record = json.loads(raw[-16 - length:-16])
    change(record)
    body = record if isinstance(record, bytes) else json.dumps(record).encode()
    out.write_bytes(raw[:-16 - length] + body + struct.pack("<Q", len(body)) + EXPORT_MAGIC)


# ---------------------------------------------------------------- data loss

def test_an_empty_catalog_is_damage_not_an_empty_store(store, xfs):
    image, snaps, digests = line(store, xfs, 3)
    root = store.root
    store.close()
    objects = sorted(p.name for p in (root / "objects").iterdir())
    for name in ("catalog.sqlite-wal", "catalog.sqlite-shm"):
        (root / name).unlink(missing_ok=True)
    (root / "catalog.sqlite").write_bytes(b"")
    for command in (["log"], ["verify"], ["gc"], ["gc", "--keep-last", "0"], ["tree"]):
        proc = cli(*command, store=root, check=7)
        assert "catalog.sqlite is damaged" in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in (root / "objects").iterdir()) == objects


def test_a_catalog_without_its_tables_or_store_id_is_refused(store, xfs):
    root = store.root
    store.close()
    db = sqlite3.connect(root / "catalog.sqlite")
    db.execute("DELETE FROM store")
    db.commit()
    db.close()
    with pytest.raises(Damaged, match="no store id"):
        Store(root)


def test_lost_layer_references_are_found_and_stop_removal(store, xfs):
    image, snaps, digests = line(store, xfs, 4)
    layers_before = sorted(p.name for p in store.objects.glob("*.layer"))
    db = sqlite3.connect(store.root / "catalog.sqlite")
    db.execute("DELETE FROM layer_refs WHERE snapshot = (SELECT seq FROM snapshots WHERE id = ?)",
               (snaps[3].id,))
    db.commit()
    db.close()
    problems = store.verify()
    assert snaps[3].id in problems and "catalog" in problems
    for remove in (lambda: store.rm(snaps[0].id),
                   lambda: store.gc(Policy(keep_last=1)),
                   lambda: store.gc(Policy())):
        with pytest.raises(Damaged, match="lost layer references"):
            remove()
    assert sorted(p.name for p in store.objects.glob("*.layer")) == layers_before
    restores_exactly(store, xfs, snaps, digests)


# ------------------------------------------------------- silent wrong restores

def test_reimport_after_rm_is_refused_and_descendants_stay_exact(store, xfs):
    image, snaps, digests = line(store, xfs, 3)
    w, x, y = snaps
    store.export(x.id, xfs / "x.bdx")
    store.rm(x.id)
    with pytest.raises(StoreError, match="was removed from this store"):
        store.import_(xfs / "x.bdx")
    assert store.verify() == {}
    restores_exactly(store, xfs, [w, y], [digests[0], digests[2]])


def test_crafted_export_cannot_replace_objects(store, xfs):
    image, snaps, digests = line(store, xfs, 3)
    store.export(snaps[1].id, xfs / "one.bdx")
    compacted = store.compact(snaps[2].id)
    compaction_layer = store.load_map(compacted).own_layer
    objects = {p.name: digest(p) for p in store.objects.iterdir()}
    # A record carrying another snapshot's id: the diff inside holds snapshot 1.
    rewrite_record(xfs / "one.bdx", xfs / "other-id.bdx",
                   lambda r: r["snapshot"].update(id=snaps[0].id))
    with pytest.raises(InvalidDiff, match="its diff holds another"):
        store.import_(xfs / "other-id.bdx")
    # The same in another store, now with a compaction layer's id.
    other = Store.init(xfs / "other")
    other.import_(xfs / "one.bdx")
    other.export(snaps[1].id, xfs / "again.bdx")
    rewrite_record(xfs / "again.bdx", xfs / "layer-id.bdx",
                   lambda r: r["snapshot"].update(id=f"{compaction_layer:016x}"))
    with pytest.raises(InvalidDiff):
        store.import_(xfs / "layer-id.bdx")
    other.close()
    assert {p.name: digest(p) for p in store.objects.iterdir()} == objects
    assert list(store.staging.iterdir()) == []
    assert store.verify() == {}
    restores_exactly(store, xfs, snaps, digests)


def test_import_of_an_id_that_names_a_layer_is_refused(store, xfs):
    """An export whose snapshot id is the number of a compaction layer here."""
    image, snaps, digests = line(store, xfs, 2)
    compacted = store.compact(snaps[1].id)
    layer_id = f"{store.load_map(compacted).own_layer:016x}"
    # Make a genuine export under that id in another store.
    other = Store.init(xfs / "other")
    source = xfs / "source.img"
    make_base_image(source, SIZE, 9)
    from blockdiff.store.catalog import Snapshot
    other.commit(source, _imported=Snapshot(0, layer_id, None, 1.0, "", {}))
    other.export(layer_id, xfs / "clash.bdx")
    other.close()
    before = {p.name: digest(p) for p in store.objects.iterdir()}
    with pytest.raises(StoreError, match="name of an object"):
        store.import_(xfs / "clash.bdx")
    assert {p.name: digest(p) for p in store.objects.iterdir()} == before
    restores_exactly(store, xfs, snaps, digests)


def test_failed_import_leaves_nothing(store, xfs):
    image, snaps, digests = line(store, xfs, 2)
    other = Store.init(xfs / "other")
    store.export(snaps[0].id, xfs / "zero.bdx")
    store.export(snaps[1].id, xfs / "one.bdx", since=snaps[0].id)
    # Corrupt a data byte of the increment (its checksum then fails).
    raw = bytearray((xfs / "one.bdx").read_bytes())
    raw[8192 + 10] ^= 0xFF
    (xfs / "bad.bdx").write_bytes(bytes(raw))
    other.import_(xfs / "zero.bdx")
    before = sorted(p.name for p in other.objects.iterdir())
    with pytest.raises(InvalidDiff):
        other.import_(xfs / "bad.bdx")
    assert sorted(p.name for p in other.objects.iterdir()) == before
    assert list(other.staging.iterdir()) == []
    other.close()


def test_damaged_layer_is_never_handed_back(store, xfs):
    image, snaps, digests = line(store, xfs, 4)
    root_layer = store.layer_path(int(snaps[0].id, 16))
    damage(root_layer, 4096 * 7)
    # Every snapshot uses bytes of the root layer: none restores, in place or forked.
    for snap in snaps:
        with pytest.raises(Damaged, match=f"snapshot {snap.id} is damaged"):
            store.restore(snap.id, xfs / "fork.img")
        assert not (xfs / "fork.img").exists()
    # In place, with every block rewritten since: the restore must put back the
    # damaged block too, so it refuses, before anything was written.
    before = digest(image)
    with open(image, "r+b") as f:
        f.write(os.urandom(SIZE))
    written = digest(image)
    assert written != before
    with pytest.raises(Damaged, match=f"snapshot {snaps[1].id} is damaged"):
        store.restore(snaps[1].id, image)
    assert digest(image) == written
    problems = store.verify()
    assert set(problems) == {s.id for s in snaps}
    proc = cli("verify", store=store.root, check=7)
    for snap in snaps:
        assert snap.id in proc.stderr


def test_in_place_restore_checks_what_it_rewrites(store, xfs):
    image, snaps, digests = line(store, xfs, 3, blocks=20)
    store.restore(snaps[0].id, image)
    # Damage the layer of step 1: going to step 1 rewrites what step 1 wrote.
    layer = store.layer_path(int(snaps[1].id, 16))
    damage(layer, 100)
    with pytest.raises(Damaged):
        store.restore(snaps[1].id, image)
    assert digest(image) == digests[0]       # untouched: the check comes first
    with pytest.raises(Damaged):                     # a fork checks whole layers
        store.restore(snaps[2].id, xfs / "other.img")


def test_damage_to_a_removed_snapshots_layer_is_still_found(store, xfs):
    image, snaps, digests = line(store, xfs, 3)
    a, b, c = snaps
    store.rm(a.id)
    layer = store.layer_path(int(a.id, 16))
    assert layer.exists()          # B and C still use A's data
    damage(layer, 4096 * 3)
    problems = store.verify()
    assert set(problems) == {b.id, c.id}
    for snap in (b, c):
        with pytest.raises(Damaged):
            store.restore(snap.id, xfs / "fork.img")


def test_a_catalog_size_that_disagrees_with_the_map_is_damage(store, xfs):
    image, snaps, digests = line(store, xfs, 2)
    db = sqlite3.connect(store.root / "catalog.sqlite")
    db.execute("UPDATE snapshots SET size = size + 4096 WHERE id = ?", (snaps[1].id,))
    db.commit()
    db.close()
    assert snaps[1].id in store.verify()
    with pytest.raises(Damaged, match="the catalog says"):
        store.restore(snaps[1].id, xfs / "fork.img")


def test_diff_and_export_after_compaction_see_content(store, xfs):
    image, snaps, digests = line(store, xfs, 6, blocks=10)
    a, c = snaps[0], snaps[-1]
    before = store.diff(a.id, c.id)
    store.export(c.id, xfs / "before.bdx", since=a.id)
    store.compact(c.id)
    after = store.diff(a.id, c.id)
    assert after.offset.tolist() == before.offset.tolist()
    assert after.length.tolist() == before.length.tolist()
    store.export(c.id, xfs / "after.bdx", since=a.id)
    assert os.path.getsize(xfs / "after.bdx") <= os.path.getsize(xfs / "before.bdx") + 4096
    # Compacting the base too changes nothing either.
    store.compact(a.id)
    again = store.diff(a.id, c.id)
    assert again.length.sum() == before.length.sum()
    other = Store.init(xfs / "other")
    store.export(a.id, xfs / "a.bdx")
    other.import_(xfs / "a.bdx")
    other.import_(xfs / "after.bdx")
    other.restore(c.id, xfs / "there.img")
    assert digest(xfs / "there.img") == digests[-1]
    other.close()


def test_diff_reports_no_difference_for_identical_snapshots(store, xfs):
    image, snaps, digests = line(store, xfs, 2)
    store.restore(snaps[0].id, image)
    again = store.commit(image)
    # At most the unaligned last block, which a commit after a restore records.
    assert int(store.diff(snaps[0].id, again.id).length.sum()) <= 4096
    d = store.diff(snaps[0].id, snaps[1].id)
    assert 0 < int(d.length.sum()) <= 5 * 4096


# ------------------------------------------------------------------ security

def test_restore_never_writes_through_a_symlink(store, xfs):
    image, snaps, digests = line(store, xfs, 2)
    victim = xfs / "victim"
    victim.write_bytes(b"precious" * 1000)
    link = xfs / "link.img"
    link.symlink_to(victim)
    with pytest.raises(UsageError, match="symbolic link"):
        store.restore(snaps[0].id, link)
    assert victim.read_bytes() == b"precious" * 1000
    proc = cli("restore", snaps[0].id, link, store=store.root, check=2)
    assert "symbolic link" in proc.stderr
    # Nor into a store's own file through a link, nor through a dangling one.
    layer = store.layer_path(int(snaps[0].id, 16))
    before = digest(layer)
    (xfs / "to-layer.img").symlink_to(layer)
    with pytest.raises(UsageError):
        store.restore(snaps[1].id, xfs / "to-layer.img")
    (xfs / "dangling.img").symlink_to(xfs / "nowhere")
    with pytest.raises(UsageError):
        store.restore(snaps[1].id, xfs / "dangling.img")
    assert not (xfs / "nowhere").exists()
    # A hard link to a layer is refused too.
    os.link(layer, xfs / "hard.img")
    with pytest.raises(UsageError, match="hard links"):
        store.restore(snaps[1].id, xfs / "hard.img")
    assert digest(layer) == before
    assert store.verify() == {}


def test_store_is_private_under_a_permissive_umask(xfs):
    root = xfs / "store"
    cli("init", root, check=0, umask=0o022)
    image = xfs / "disk.img"
    make_base_image(image, SIZE, 3)
    cli("commit", image, store=root, check=0, umask=0o022)
    cli("gc", store=root, check=0, umask=0o022)
    for path in [root, *root.rglob("*")]:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        assert mode & 0o077 == 0, f"{path} is {mode:o}"
    for path in (root / "objects").iterdir():
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o400, path
    # Outputs honour the umask: a fork and an export under 077 and 022.
    sid = json.loads(cli("log", "--json", store=root, check=0).stdout)[0]["id"]
    cli("restore", sid, xfs / "private.img", store=root, check=0, umask=0o077)
    assert stat.S_IMODE(os.stat(xfs / "private.img").st_mode) == 0o600
    cli("export", sid, xfs / "x.bdx", store=root, check=0, umask=0o077)
    assert stat.S_IMODE(os.stat(xfs / "x.bdx").st_mode) == 0o600
    cli("restore", sid, xfs / "shared.img", store=root, check=0, umask=0o022)
    assert stat.S_IMODE(os.stat(xfs / "shared.img").st_mode) == 0o644


def test_group_store(xfs):
    import grp

    # A group other than root's, so that the store's group visibly changes.
    name, gid = next(((g.gr_name, g.gr_gid) for g in grp.getgrall() if g.gr_gid != 0),
                     ("root", 0))
    root = xfs / "store"
    cli("init", root, "--group", name, check=0, umask=0o022)
    image = xfs / "disk.img"
    make_base_image(image, SIZE, 3)
    cli("commit", image, store=root, check=0, umask=0o022)
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o2750
    assert os.stat(root).st_gid == gid
    assert stat.S_IMODE(os.stat(root / "catalog.sqlite").st_mode) == 0o640
    for path in (root / "objects").iterdir():
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o440, path
        assert os.stat(path).st_gid == gid
    proc = cli("init", xfs / "s2", "--group", "no-such-group-here", check=2)
    assert "no group" in proc.stderr and not (xfs / "s2").exists()


# ------------------------------------------------------------ hostile input

@pytest.mark.parametrize("change", [
    lambda r: r["snapshot"].update(meta=["a", "list"]),
    lambda r: r["snapshot"].update(meta="a string"),
    lambda r: r["snapshot"].update(meta={"k": {"nested": 1}}),
    lambda r: r["snapshot"].update(created="yesterday"),
    lambda r: r["snapshot"].update(created=1e300),
    lambda r: r["snapshot"].update(created=-1),
    lambda r: r["snapshot"].update(expires="never"),
    lambda r: r["snapshot"].update(message=["x"]),
    lambda r: r["snapshot"].update(message="m" * 70000),
    lambda r: r["snapshot"].update(id="XYZ"),
    lambda r: r.update(base="../../etc"),
    lambda r: r.update(version=99),
    lambda r: r.clear(),
], ids=["meta-list", "meta-str", "meta-nested", "created-str", "created-huge",
        "created-negative", "expires-str", "message-list", "message-huge", "id", "base",
        "version", "empty"])
def test_crafted_records_are_refused_and_break_nothing(store, xfs, change):
    image, snaps, digests = line(store, xfs, 1)
    store.export(snaps[0].id, xfs / "one.bdx")
    store.rm(snaps[0].id)
    other = xfs / "other"
    cli("init", other, check=0)
    rewrite_record(xfs / "one.bdx", xfs / "bad.bdx", change)
    proc = cli("import", xfs / "bad.bdx", store=other, check=3)
    assert "export record" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert list((other / "objects").iterdir()) == []
    for command in (["log"], ["tree"], ["gc"], ["verify"]):
        cli(*command, store=other, check=0)


def test_a_deeply_nested_record_is_refused(store, xfs):
    image, snaps, digests = line(store, xfs, 1)
    store.export(snaps[0].id, xfs / "one.bdx")
    raw = (xfs / "one.bdx").read_bytes()
    length = struct.unpack("<Q", raw[-16:-8])[0]
    body = b"[" * 100000 + b"]" * 100000
    (xfs / "deep.bdx").write_bytes(raw[:-16 - length] + body + struct.pack("<Q", len(body))
                                   + EXPORT_MAGIC)
    proc = cli("import", xfs / "deep.bdx", store=xfs / "store", check=3)
    assert "export record" in proc.stderr


def test_corrupt_export_of_a_snapshot_the_store_has_is_read_and_refused(store, xfs):
    image, snaps, digests = line(store, xfs, 2)
    store.export(snaps[1].id, xfs / "one.bdx")
    raw = bytearray((xfs / "one.bdx").read_bytes())
    raw[8192 + 100] ^= 0x01
    (xfs / "bad.bdx").write_bytes(bytes(raw))
    with pytest.raises(InvalidDiff):
        store.import_(xfs / "bad.bdx")
    proc = cli("import", xfs / "one.bdx", store=store.root, check=0)
    assert "skipped" in proc.stderr and snaps[1].id in proc.stdout


def test_negative_ttl_is_refused(store, xfs):
    image = xfs / "disk.img"
    make_base_image(image, SIZE, 1)
    for ttl in (-5, float("nan"), float("inf")):
        with pytest.raises(UsageError):
            store.commit(image, ttl=ttl)
    assert store.log() == []


@pytest.mark.slow
def test_full_disk_names_enospc_and_gc_still_frees_space(fresh_filesystem):
    root = fresh_filesystem("xfs", size=320 * 1024 * 1024)
    Store.init(root / "store").close()
    image = root / "disk.img"
    make_base_image(image, 32 * 1024 * 1024, 80, sparse_fraction=0.0, zero_fraction=0.0)
    cli("commit", image, store=root / "store", check=0)
    image.unlink()        # the snapshot now holds the only copy of those blocks
    filesystems.fill(root)   # to the last block
    for command in (["log"], ["verify"]):
        proc = cli(*command, store=root / "store", check=1)
        assert "No space left on device" in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
    cli("gc", "--keep-last", "0", store=root / "store", check=0)
    assert os.statvfs(root).f_bavail * os.statvfs(root).f_frsize > 16 * 1024 * 1024
    cli("log", store=root / "store", check=0)
    os.unlink(root / "filler")


def test_errors_name_the_output_not_its_temporary_file(store, xfs, fresh_filesystem):
    image, snaps, digests = line(store, xfs, 2)
    full = fresh_filesystem("xfs", size=320 * 1024 * 1024)
    filesystems.fill(full)
    for args, out in ((["export", snaps[1].id], full / "one.bdx"),
                      (["restore", snaps[1].id], full / "fork.img")):
        proc = cli(*args, out, store=store.root, check=1)
        assert "No space left on device" in proc.stderr, proc.stderr
        assert str(out) in proc.stderr and ".partial" not in proc.stderr, proc.stderr
        assert not out.exists()
    assert [p.name for p in full.iterdir()] == ["filler"]


def test_what_a_restore_reads_to_check_follows_the_change(store, xfs, monkeypatch):
    from blockdiff.store import layers

    image, snaps, digests = line(store, xfs, 3, blocks=8)
    # A fork of layers vouched for at their commit reads nothing to check them.
    assert store.restore(snaps[2].id, xfs / "fork.img").checked_bytes == 0
    # Past the vouching window a fork reads every layer it uses, once.
    monkeypatch.setattr(layers, "VOUCH_SECONDS", -1)
    whole = store.restore(snaps[2].id, xfs / "fork2.img").checked_bytes
    used = {int(layer) for layer in store.load_map(snaps[2]).pieces.layer}
    assert whole == sum(int(store.layers.decoded(layer).length.sum()) for layer in used) > 0
    # In place, the chunks holding what is rewritten: the bytes rewritten and
    # at most two partial chunks more for each range (8 blocks a step).
    result = store.restore(snaps[0].id, image)
    assert 0 < result.checked_bytes <= result.bytes + 2 * result.ranges * layers.CHUNK
    assert result.checked_bytes < whole
    assert digest(image) == digests[0]


def test_layers_without_records_get_them_on_open(store, xfs):
    """As in a store made before layer records: they are made on first open."""
    image, snaps, digests = line(store, xfs, 3)
    root = store.root
    store.close()
    db = sqlite3.connect(root / "catalog.sqlite")
    db.execute("DELETE FROM layers")
    db.commit()
    db.close()
    with Store(root) as reopened:
        assert reopened.catalog.unrecorded_layers() == set()
        assert reopened.verify() == {}
        restores_exactly(reopened, xfs, snaps, digests)
