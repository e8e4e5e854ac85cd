"""A store shared by several hosts (blockdiff.store.shared): two "hosts" are
two store directories on two XFS filesystems, used by separate processes,
sharing one catalog and one bucket of a real SeaweedFS S3 server. Every
restore is compared byte for byte."""

from __future__ import annotations

import contextlib
import filecmp
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import objectstore
import postgres
import pytest
from objectstore import once_back, point_boto3_at, running_seaweedfs

from blockdiff.errors import Damaged, RemoteError, StoreError, UnknownSnapshot, UsageError
from blockdiff.store import Store
from blockdiff.store.objects import layer_name
from blockdiff.store.remote import layer_key
from blockdiff.store.replication import sweep_remote
from blockdiff.store.retention import Policy
from blockdiff.store.views import view_path

pytestmark = [pytest.mark.services]

MiB = 1 << 20
IMAGE = 64 * MiB
BLOCK = 4096


@pytest.fixture
def bucket_url(s3_env):
    return f"s3://{s3_env.bucket}/{uuid.uuid4().hex}"


@pytest.fixture
def hosts(xfs, host_b_dir, catalog, bucket_url):
    """Two hosts' stores of one shared store: A made it, B joined."""
    a = Store.init(xfs / "store", catalog=catalog, remote=bucket_url)
    b = Store.init(host_b_dir / "store", catalog=catalog)
    yield a, b
    a.close()
    b.close()


@contextlib.contextmanager
def hosts_on_their_own_object_store(xfs, host_b_dir, catalog, tmp_path, monkeypatch):
    """``(server, a, b)``: a SeaweedFS of the test's own (to stop and start)
    and two hosts' stores of one shared store on it, A made it, B joined;
    boto3 gives up on it after two attempts."""
    objectstore._require_seaweedfs()
    with running_seaweedfs(tmp_path / "weed") as server:
        point_boto3_at(server, monkeypatch, tmp_path)
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
        a = Store.init(xfs / "store", catalog=catalog, remote=f"s3://{server.bucket}/x")
        b = Store.init(host_b_dir / "store", catalog=catalog)
        yield server, a, b


def cli(*args, check=True) -> subprocess.CompletedProcess:
    """The command line in a process of its own (another host's process)."""
    done = subprocess.run([sys.executable, "-m", "blockdiff", *map(str, args)],
                          capture_output=True, text=True, timeout=300)
    if check and done.returncode != 0:
        raise AssertionError(f"blockdiff {' '.join(map(str, args))} failed "
                             f"({done.returncode}): {done.stderr}")
    return done


def scribble(path: Path, rng, writes: int = 6, blocks: int = 8) -> None:
    """Random writes of ``blocks`` blocks each at random places."""
    with open(path, "r+b") as f:
        for _ in range(writes):
            f.seek(int(rng.integers(0, IMAGE // BLOCK - blocks)) * BLOCK)
            f.write(rng.bytes(blocks * BLOCK))


def new_image(path: Path, rng) -> None:
    with open(path, "wb") as f:
        f.truncate(IMAGE)
    scribble(path, rng, writes=20, blocks=64)


def start_line(xfs: Path, tmp_path: Path, seed: int):
    """``(image, keep, rng)``: a new image on host A's filesystem, the
    directory ``commit_line`` keeps snapshots' bytes in, and the random
    source of its writes."""
    keep = tmp_path / "keep"
    keep.mkdir()
    rng = np.random.default_rng(seed)
    image = xfs / "disk.img"
    new_image(image, rng)
    return image, keep, rng


def commit_line(store: Store, image: Path, keep: Path, rng, count: int, **options):
    """``count`` commits of ``image``, each after some writes; a copy of each
    snapshot's bytes kept in ``keep``. Returns the ids."""
    ids = []
    for _ in range(count):
        scribble(image, rng)
        snap = store.commit(image, **options)
        shutil.copyfile(image, keep / snap.id)
        ids.append(snap.id)
    return ids


def flip_object_byte(s3_env, key: str) -> tuple[bytes, bytes]:
    """Put the object at ``key`` back with its middle byte flipped (same
    size, no metadata changed); ``(good, bad)`` bytes."""
    client = s3_env.client()
    good = client.get_object(Bucket=s3_env.bucket, Key=key)["Body"].read()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF
    client.put_object(Bucket=s3_env.bucket, Key=key, Body=bytes(bad))
    return good, bytes(bad)


def layer_bytes(store: Store, snapshot_ids) -> int:
    """The size of the layers the snapshots wrote themselves."""
    return sum(os.stat(store.layer_path(int(sid, 16))).st_size for sid in snapshot_ids)


def test_a_line_made_on_one_host_restores_on_another_fetching_only_what_it_lacks(
        hosts, xfs, host_b_dir, tmp_path):
    a, b = hosts
    image, keep, rng = start_line(xfs, tmp_path, 1)
    first = commit_line(a, image, keep, rng, 4)
    assert all(p.state == "durable" for p in b.placement())

    store_b = host_b_dir / "store"
    # Every snapshot, forked on B by another process, byte for byte.
    for sid in first:
        fork = host_b_dir / f"fork-{sid}"
        out = json.loads(cli("restore", "--store", store_b, sid, fork, "--json").stdout)
        assert out["forked"] and filecmp.cmp(fork, keep / sid, shallow=False)
    # The first fork fetched everything up to it; the later ones only what was new.
    # In place, on B, to every snapshot in turn.
    work = host_b_dir / "work.img"
    shutil.copyfile(host_b_dir / f"fork-{first[0]}", work)
    for sid in reversed(first):
        cli("restore", "--store", store_b, sid, work)
        assert filecmp.cmp(work, keep / sid, shallow=False)

    # More on A: B fetches exactly the new snapshots' layers.
    more = commit_line(a, image, keep, rng, 3)
    restored = b.restore(more[-1], host_b_dir / "newest.img")
    assert restored.fetched_bytes == layer_bytes(a, more)
    assert filecmp.cmp(host_b_dir / "newest.img", keep / more[-1], shallow=False)
    # Nothing fetched twice.
    assert b.restore(more[0], host_b_dir / "again.img").fetched_bytes == 0
    log = json.loads(cli("log", "--store", store_b, "--json").stdout)
    assert {entry["where"] for entry in log} == {"durable"}
    assert cli("verify", "--store", store_b).returncode == 0


def test_commits_on_the_second_host_restore_on_the_first(hosts, xfs, host_b_dir, tmp_path):
    a, b = hosts
    image, keep, rng = start_line(xfs, tmp_path, 2)
    base = commit_line(a, image, keep, rng, 2)[-1]

    # B continues from A's snapshot: its first commit compares with the
    # view its restore recorded, so it stores only what the step wrote.
    work = host_b_dir / "work.img"
    b.restore(base, work)
    assert view_path(b, b.get(base)).exists()
    on_b = commit_line(b, work, keep, rng, 3)
    for sid in on_b:
        assert b.get(sid).changed_bytes <= 6 * 8 * BLOCK
    # A restores B's work, forked and in place.
    for sid in on_b:
        fork = xfs / f"from-b-{sid}"
        a.restore(sid, fork)
        assert filecmp.cmp(fork, keep / sid, shallow=False)
    a.restore(on_b[-1], image)
    assert filecmp.cmp(image, keep / on_b[-1], shallow=False)
    # And A goes on from there.
    after = commit_line(a, image, keep, rng, 2)
    b.restore(after[-1], work)
    assert filecmp.cmp(work, keep / after[-1], shallow=False)


def test_without_a_view_a_commit_compares_contents_and_later_ones_stay_right(
        hosts, xfs, host_b_dir, tmp_path):
    """The danger a view guards against: an image block written in place
    keeps its address. Without a view, the commit must not trust another
    host's addresses; after it, writes in place must still be seen."""
    a, b = hosts
    image, keep, rng = start_line(xfs, tmp_path, 3)
    base = commit_line(a, image, keep, rng, 1)[-1]
    work = host_b_dir / "work.img"
    b.restore(base, work)
    view_path(b, b.get(base)).unlink()
    first = commit_line(b, work, keep, rng, 1)[-1]
    # The same ranges written again, in place: every commit must see them.
    for round_ in range(3):
        with open(work, "r+b") as f:
            f.seek(0)
            f.write(bytes([round_ + 1]) * (4 * BLOCK))
        snap = b.commit(work)
        assert snap.changed_bytes >= 4 * BLOCK
        shutil.copyfile(work, keep / snap.id)
    for sid in [first, snap.id]:
        a.restore(sid, xfs / f"check-{sid}")
        assert filecmp.cmp(xfs / f"check-{sid}", keep / sid, shallow=False)


def test_a_snapshot_not_pushed_is_pending_and_named_by_the_host_that_has_it(
        hosts, xfs, host_b_dir, tmp_path):
    a, b = hosts
    image, keep, rng = start_line(xfs, tmp_path, 4)
    sid = commit_line(a, image, keep, rng, 1, push=False)[-1]
    assert {p.snapshot: p.state for p in a.placement()}[sid] == "local"
    assert {p.snapshot: p.state for p in b.placement()}[sid] == "pending"
    done = cli("restore", "--store", host_b_dir / "store", sid, host_b_dir / "x.img",
               check=False)
    assert done.returncode == 6 and "Traceback" not in done.stderr
    assert "not in the object store yet" in done.stderr and "blockdiff push" in done.stderr
    assert a.shared.name in done.stderr
    assert not (host_b_dir / "x.img").exists()
    pushed = json.loads(cli("push", "--store", xfs / "store", "--json").stdout)
    assert pushed["layers"] == 1 and pushed["maps"] == 1 and pushed["durable"] == [sid]
    b.restore(sid, host_b_dir / "x.img")
    assert filecmp.cmp(host_b_dir / "x.img", keep / sid, shallow=False)
    assert cli("push", "--store", xfs / "store", "--json").stdout.count('"layers": 0') == 1


def test_placement_reads_one_state_while_another_host_commits_and_removes(
        hosts, xfs, host_b_dir, tmp_path, catalog, monkeypatch):
    """Where every snapshot is, read while another host commits and removes
    between the reads: every answer names the snapshots of one state (a
    background push reading it beside a commit raised KeyError)."""
    if not catalog.startswith("postgresql"):
        pytest.skip("SQLite's writer waits for this reader: the other host cannot write between")
    a, b = hosts
    b.close()     # its process is another host's: the CLI's below
    image, keep, rng = start_line(xfs, tmp_path, 12)
    first, second = commit_line(a, image, keep, rng, 2)
    image_b = host_b_dir / "b.img"
    cli("restore", "--store", host_b_dir / "store", second, image_b)
    seen_before = {s.id for s in a.catalog.all()}
    real_placement = type(a.catalog).placement
    made = []

    def between(catalog_self):
        # Another host changes the catalog between this host's reads.
        if not made:
            scribble(image_b, rng)
            store_b = host_b_dir / "store"
            made.append(json.loads(cli("commit", "--store", store_b, image_b, "--parent",
                                       second, "--json").stdout)["id"])
            cli("rm", "--store", store_b, first)
        return real_placement(catalog_self)

    monkeypatch.setattr(type(a.catalog), "placement", between)
    placed = {p.snapshot for p in a.placement()}
    assert placed == seen_before
    monkeypatch.undo()
    assert {p.snapshot for p in a.placement()} == (seen_before - {first}) | set(made)


def test_a_damaged_or_missing_object_is_never_restored(hosts, xfs, host_b_dir, tmp_path,
                                                      s3_env, bucket_url):
    a, b = hosts
    image, keep, rng = start_line(xfs, tmp_path, 5)
    sid = commit_line(a, image, keep, rng, 1)[-1]
    name = layer_name(int(sid, 16))
    key = f"{bucket_url.split('/', 3)[3]}/{layer_key(name)}"
    client = s3_env.client()
    # Behind the store's back, with no metadata: only the catalog's checksums can tell.
    flip_object_byte(s3_env, key)
    with pytest.raises(Damaged, match="fail their CRC32C"):
        b.restore(sid, host_b_dir / "x.img")
    assert not (host_b_dir / "x.img").exists()
    assert not b.layer_path(int(sid, 16)).exists()
    assert os.listdir(b.staging) == []
    client.delete_object(Bucket=s3_env.bucket, Key=key)
    done = cli("restore", "--store", host_b_dir / "store", sid, host_b_dir / "x.img",
               check=False)
    assert done.returncode == 14 and "no such object" in done.stderr
    assert "Traceback" not in done.stderr
    problems = json.loads(cli("verify", "--store", host_b_dir / "store", "--json",
                              check=False).stdout)["problems"]
    assert any("missing from the object store" in p for p in problems[sid])


def test_removing_a_snapshot_deletes_its_objects_for_every_host(
        hosts, xfs, host_b_dir, tmp_path, s3_env, bucket_url):
    a, b = hosts
    image, keep, rng = start_line(xfs, tmp_path, 6)
    first, second, third = commit_line(a, image, keep, rng, 3)
    b.restore(third, host_b_dir / "x.img")       # B holds every layer now
    prefix = bucket_url.split("/", 3)[3]

    def keys():
        listed = s3_env.client().list_objects_v2(Bucket=s3_env.bucket, Prefix=prefix)
        return {o["Key"][len(prefix) + 1:] for o in listed.get("Contents", ())}

    assert layer_key(layer_name(int(second, 16))) in keys()
    b.rm(second)          # its layer stays: the third snapshot uses its blocks
    assert not any(k.startswith("maps/" + second) for k in keys())
    b.rm(third)
    b.rm(first)
    assert not any(k.startswith("maps/") for k in keys())
    # The layers no snapshot uses are gone from the bucket; A's copies go
    # with its next gc.
    assert not any(k.startswith("layers/") for k in keys())
    a.gc(Policy())
    assert list(a.objects.iterdir()) == []
    # The image's bytes on B are its own.
    assert filecmp.cmp(host_b_dir / "x.img", keep / third, shallow=False)


def _retried_while_unreachable(*args, seconds: float = 60.0) -> subprocess.CompletedProcess:
    """``cli(*args)`` again while it fails with status 14 (a restarted
    object store still bringing its volumes back)."""
    deadline = time.monotonic() + seconds
    while True:
        done = cli(*args, check=False)
        if done.returncode != 14 or time.monotonic() > deadline:
            return done
        time.sleep(0.5)


def test_the_host_whose_removal_of_a_snapshot_comes_second_says_it_is_gone(
        hosts, xfs, tmp_path, monkeypatch):
    """Both hosts remove the tip (no map builds on it) at once, A's switch
    landing while B's removal is between reading its rows and its own: B's
    finds the row gone and says so; it does not say it removed it too."""
    from blockdiff.store import removal
    a, b = hosts
    image, keep, rng = start_line(xfs, tmp_path, 17)
    first, tip = commit_line(a, image, keep, rng, 2)
    upload_rewritten, raced = removal.upload_rewritten, []

    def a_removes_it_first(store, *args):
        if store is b and not raced:
            raced.append(a.rm(tip).removed)
        return upload_rewritten(store, *args)

    monkeypatch.setattr(removal, "upload_rewritten", a_removes_it_first)
    with pytest.raises(UnknownSnapshot, match="removed by another process or host"):
        b.rm(tip)
    assert raced == [[tip]]
    assert [s.id for s in b.log()] == [first]
    b.restore(first, tmp_path / "first")
    assert filecmp.cmp(tmp_path / "first", keep / first, shallow=False)


def test_a_removal_overtaken_by_the_other_hosts_finds_the_whole_map_fetched_here(
        hosts, xfs, host_b_dir, tmp_path, monkeypatch):
    """B's removal of a snapshot has read which map builds on it and is
    writing that one whole when A's removal of it switches, and a restore on
    B fetches the map A wrote whole, the same file B's would be: B's removal
    starts again, finds the snapshot gone and says so."""
    a, b = hosts
    image, keep, rng = start_line(xfs, tmp_path, 18)
    first, second, third = commit_line(a, image, keep, rng, 3)
    assert b.get(third).map_base == second
    write, raced = b.maps.files.write, []

    def overtaken(path, data):
        if path.name.endswith("whole.map") and not raced:
            raced.append(cli("rm", "--store", a.root, second).returncode)
            b.restore(third, host_b_dir / "third")
        return write(path, data)

    monkeypatch.setattr(b.maps.files, "write", overtaken)
    with pytest.raises(UnknownSnapshot, match="removed by another process or host"):
        b.rm(second)
    assert raced == [0]
    assert b.get(third).map_base is None
    assert filecmp.cmp(host_b_dir / "third", keep / third, shallow=False)
    assert b.verify() == {}


def test_rm_while_the_object_store_is_unreachable_never_makes_a_snapshot_non_durable(
        xfs, host_b_dir, catalog, tmp_path, monkeypatch):
    """Removing a parent rewrites its children's maps whole: a child that
    was durable must be durable the moment the parent's rows go. With the
    object store down, rm refuses (status 14) and removes nothing; once it
    is back, rm removes (status 0) and the child is restorable by every
    host, even after the host that ran rm is gone."""
    with hosts_on_their_own_object_store(xfs, host_b_dir, catalog, tmp_path,
                                         monkeypatch) as (server, a, b):
        image, keep, rng = start_line(xfs, tmp_path, 13)
        first, second, third, fourth = commit_line(a, image, keep, rng, 4)
        assert b.get(third).map_base == second      # a delta on the one to remove
        a.close()
        server.stop()
        # Nothing builds on the newest: it goes, its objects wait for a sweep.
        done = cli("rm", "--store", xfs / "store", fourth, check=False)
        assert done.returncode == 0, done.stderr
        done = cli("rm", "--store", xfs / "store", second, check=False)
        assert done.returncode == 14, done.stderr
        assert "Traceback" not in done.stderr and "nothing was removed" in done.stderr
        assert [s.id for s in b.log()] == [third, second, first]
        assert {p.snapshot: p.state for p in b.placement()} == dict.fromkeys(
            (first, second, third), "durable")
        server.start()
        done = _retried_while_unreachable("rm", "--store", xfs / "store", second)
        assert done.returncode == 0, done.stderr
        assert [s.id for s in b.log()] == [third, first]
        assert {p.snapshot: p.state for p in b.placement()} == dict.fromkeys(
            (first, third), "durable")
        # The objects the removal could not delete go with a sweep.
        once_back(lambda: sweep_remote(b, grace=0))
        assert not [info.key for info in b.remote.list("") if fourth in info.key]
        # Host A is gone for good: B restores both from the object store.
        shutil.rmtree(xfs / "store")
        for sid in (third, first):
            once_back(lambda sid=sid: b.restore(sid, host_b_dir / f"x-{sid}"))
            assert filecmp.cmp(host_b_dir / f"x-{sid}", keep / sid, shallow=False)
        b.close()


def _durable_line_to_compact(a: Store, b: Store, xfs: Path, tmp_path: Path, seed: int):
    """Four durable snapshots on A, the second the one to compact (the third
    a delta on it, the fourth on the third); their ids, the directory of
    their bytes, and every snapshot's map digest as B sees it."""
    image, keep, rng = start_line(xfs, tmp_path, seed)
    ids = commit_line(a, image, keep, rng, 4)
    a.push()
    assert b.get(ids[2]).map_base == ids[1] and b.get(ids[3]).map_base == ids[2]
    assert {p.snapshot: p.state for p in b.placement()} == dict.fromkeys(ids, "durable")
    return ids, keep, {s.id: s.map_sha256 for s in b.log()}


def _restored_by_b_alone(a_root: Path, b: Store, host_b_dir: Path, ids, keep: Path) -> None:
    """Host A is gone for good: B restores every snapshot, byte for byte."""
    shutil.rmtree(a_root)
    for sid in ids:
        once_back(lambda sid=sid: b.restore(sid, host_b_dir / f"x-{sid}"))
        assert filecmp.cmp(host_b_dir / f"x-{sid}", keep / sid, shallow=False)


def test_compacting_a_durable_snapshot_keeps_it_and_its_dependents_durable(
        hosts, xfs, host_b_dir, tmp_path):
    """The compacted snapshot's new layer and map, and the maps of the
    snapshots built on it, rewritten whole, are in the object store when
    their rows switch: every snapshot stays durable, with no push after it,
    and another host restores them all once the compacting host is gone."""
    a, b = hosts
    ids, keep, maps = _durable_line_to_compact(a, b, xfs, tmp_path, 14)
    done = cli("compact", "--store", xfs / "store", ids[1], check=False)
    assert done.returncode == 0, done.stderr
    assert b.get(ids[1]).map_sha256 != maps[ids[1]]
    assert b.get(ids[2]).map_base is None                   # written whole
    assert {p.snapshot: p.state for p in b.placement()} == dict.fromkeys(ids, "durable")
    _restored_by_b_alone(xfs / "store", b, host_b_dir, ids, keep)


def test_compact_while_the_object_store_is_unreachable_changes_nothing(
        xfs, host_b_dir, catalog, tmp_path, monkeypatch):
    """With the object store down, compacting a durable snapshot refuses
    (status 14) and changes nothing: every row as it was, every snapshot
    durable and restorable by another host. Once it is back, compact does
    it, and everything stays durable."""
    with hosts_on_their_own_object_store(xfs, host_b_dir, catalog, tmp_path,
                                         monkeypatch) as (server, a, b):
        ids, keep, maps = _durable_line_to_compact(a, b, xfs, tmp_path, 15)
        layers = {sid: b.catalog.layers_of(b.get(sid)) for sid in ids}
        a.close()
        files = sorted(os.listdir(xfs / "store" / "objects"))
        server.stop()
        done = cli("compact", "--store", xfs / "store", ids[1], check=False)
        assert done.returncode == 14, done.stderr
        assert {s.id: s.map_sha256 for s in b.log()} == maps
        assert {sid: b.catalog.layers_of(b.get(sid)) for sid in ids} == layers
        assert {p.snapshot: p.state for p in b.placement()} == dict.fromkeys(ids, "durable")
        assert "Traceback" not in done.stderr and "was not compacted" in done.stderr
        assert sorted(os.listdir(xfs / "store" / "objects")) == files
        server.start()
        done = _retried_while_unreachable("compact", "--store", xfs / "store", ids[1])
        assert done.returncode == 0, done.stderr
        assert b.get(ids[1]).map_sha256 != maps[ids[1]]
        assert {p.snapshot: p.state for p in b.placement()} == dict.fromkeys(ids, "durable")
        _restored_by_b_alone(xfs / "store", b, host_b_dir, ids, keep)
        b.close()


def test_compacting_a_snapshot_not_uploaded_while_the_object_store_is_unreachable(
        xfs, host_b_dir, catalog, tmp_path, monkeypatch):
    """A snapshot not uploaded yet (and the one built on it) needs nothing of
    the object store to be compacted: compact succeeds with it down (status
    0, not 14, which says nothing changed), the bytes stay the same, and the
    snapshots wait for a push as they did; after it, another host restores
    them."""
    with hosts_on_their_own_object_store(xfs, host_b_dir, catalog, tmp_path,
                                         monkeypatch) as (server, a, b):
        image, keep, rng = start_line(xfs, tmp_path, 16)
        ids = commit_line(a, image, keep, rng, 2, push=False)
        assert b.get(ids[1]).map_base == ids[0]
        before = {s.id: s.map_sha256 for s in b.log()}
        a.close()
        server.stop()
        done = cli("compact", "--store", xfs / "store", ids[0], check=False)
        assert done.returncode == 0, done.stderr
        assert b.get(ids[0]).map_sha256 != before[ids[0]]
        assert b.get(ids[1]).map_base is None                   # written whole
        assert {p.snapshot: p.state for p in b.placement()} == dict.fromkeys(ids, "pending")
        for sid in ids:
            cli("restore", "--store", xfs / "store", sid, tmp_path / f"a-{sid}")
            assert filecmp.cmp(tmp_path / f"a-{sid}", keep / sid, shallow=False)
        server.start()
        done = _retried_while_unreachable("push", "--store", xfs / "store")
        assert done.returncode == 0, done.stderr
        assert {p.snapshot: p.state for p in b.placement()} == dict.fromkeys(ids, "durable")
        _restored_by_b_alone(xfs / "store", b, host_b_dir, ids, keep)
        b.close()


REMOVER = """\
import json, sys
from blockdiff.errors import BlockdiffError
from blockdiff.store import Store
store, ids = Store(sys.argv[1]), json.loads(sys.argv[2])
for sid in ids:
    try:
        store.rm(sid)
        print(json.dumps([sid, "removed"]), flush=True)
    except BlockdiffError as e:
        print(json.dumps([sid, type(e).__name__, str(e)]), flush=True)
store.close()
"""

FORKER = """\
import json, os, sys
from pathlib import Path
from blockdiff.errors import BlockdiffError
from blockdiff.store import Store
store, ids, out, stop = Store(sys.argv[1]), json.loads(sys.argv[2]), Path(sys.argv[3]), \\
    Path(sys.argv[4])
in_place = len(sys.argv) > 5       # restore one image over and over instead
round_ = 0
while round_ < 2 or not stop.exists():
    for sid in ids:
        path = out / ("in-place.img" if in_place else f"{round_}-{sid}.img")
        try:
            store.restore(sid, path)
            print(json.dumps([sid, str(path)]), flush=True)
        except BlockdiffError as e:
            print(json.dumps([sid, None, type(e).__name__, str(e)]), flush=True)
    round_ += 1
store.close()
"""


@pytest.mark.parametrize("catalog", ["postgresql"], indirect=True)
def test_snapshots_removed_around_one_by_two_hosts_leave_it_restorable_everywhere(
        hosts, xfs, host_b_dir, tmp_path):
    """Both hosts remove the seven ancestors of a line's tip (each in its
    own process, in opposite orders) while a third process, on B, forks all
    eight over and over. The tip, which nobody removes, restores byte for
    byte every time, on both hosts; a removed one either restores byte for
    byte or is refused with one clear error; the rm's that lose a race to
    the other host say the snapshot is gone."""
    a, b = hosts
    image, keep, rng = start_line(xfs, tmp_path, 14)
    for round_ in range(2):
        line = commit_line(a, image, keep, rng, 8)
        if round_ == 0:      # the tip's map a delta on a chain of the seven
            assert b.get(line[-1]).map_base == line[-2]
        tip, ancestors = line[-1], line[:-1]
        out = host_b_dir / f"forks-{round_}"
        out.mkdir()
        stop = tmp_path / f"stop-{round_}"
        # One process forks all eight, another restores the tip in place
        # over and over (little to do but read its chain of maps).
        forker, restorer = [
            subprocess.Popen([sys.executable, "-c", FORKER, str(b.root), json.dumps(ids),
                              str(out), str(stop), *extra],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for ids, extra in ((list(reversed(line)), ()), ([tip], ("in-place",)))]
        removers = [subprocess.Popen([sys.executable, "-c", REMOVER, str(root),
                                      json.dumps(order)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                    for root, order in ((a.root, ancestors),
                                        (b.root, list(reversed(ancestors))))]
        outcomes = []
        for remover in removers:
            got, err = remover.communicate(timeout=600)
            assert remover.returncode == 0, err
            outcomes += [json.loads(line_) for line_ in got.splitlines()]
        stop.touch()
        forks = []
        for process in (restorer, forker):     # the in-place one's last result first
            got, err = process.communicate(timeout=600)
            assert process.returncode == 0, err
            forks += [json.loads(line_) for line_ in got.splitlines()]
        assert [s.id for s in b.log()][0] == tip and not set(ancestors) & {
            s.id for s in b.log()}
        assert len([f for f in forks if f[0] == tip]) >= 2
        for fork in forks:
            sid, path = fork[0], fork[1]
            if sid == tip:
                assert path is not None, fork
            if path is not None:
                assert filecmp.cmp(path, keep / sid, shallow=False), fork
            else:
                # Removed under the fork: a layer it needed may be gone too.
                assert fork[2] in ("UnknownSnapshot", "StoreError", "NoSuchObject"), fork
        # Each ancestor was removed by one host; the other was told it is gone.
        for sid in ancestors:
            said = [o for o in outcomes if o[0] == sid]
            assert [o[1] for o in said].count("removed") == 1, said
            for o in said:
                assert o[1] in ("removed", "UnknownSnapshot"), said
        assert {p.snapshot: p.state for p in b.placement()}[tip] == "durable"
        for host, where in ((a, xfs), (b, host_b_dir)):
            host.restore(tip, where / f"tip-{round_}.img")
            assert filecmp.cmp(where / f"tip-{round_}.img", keep / tip, shallow=False)
        shutil.rmtree(out)
    assert a.verify() == {} and b.verify() == {}


def test_eviction_drops_only_uploaded_copies_and_they_come_back(
        hosts, xfs, host_b_dir, tmp_path):
    a, b = hosts
    image, keep, rng = start_line(xfs, tmp_path, 7)
    ids = commit_line(a, image, keep, rng, 3)
    pending = commit_line(a, image, keep, rng, 1, push=False)
    evicted, freed = a.evict(0)
    assert sorted(evicted) == sorted(int(s, 16) for s in ids)
    assert freed > 0
    assert a.layer_path(int(pending[0], 16)).exists()       # not uploaded: kept
    # The image's next commit cannot trust the addresses of evicted copies:
    # it compares contents, and gets the change right.
    scribble(image, rng)
    snap = a.commit(image)
    shutil.copyfile(image, keep / snap.id)
    for sid in ids + pending + [snap.id]:
        a.restore(sid, xfs / f"back-{sid}")
        assert filecmp.cmp(xfs / f"back-{sid}", keep / sid, shallow=False)
    done = cli("gc", "--store", xfs / "store", "--cache-size", "0", "--json")
    assert json.loads(done.stdout)["evicted"] > 0


def test_commit_survives_the_object_store_dying_mid_upload_and_pushes_later(
        xfs, host_b_dir, catalog, tmp_path, monkeypatch):
    objectstore._require_seaweedfs()
    with running_seaweedfs(tmp_path / "weed") as server:
        point_boto3_at(server, monkeypatch, tmp_path)
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
        url = f"s3://{server.bucket}/x"
        a = Store.init(xfs / "store", catalog=catalog, remote=url)
        b = Store.init(host_b_dir / "store", catalog=catalog)
        rng = np.random.default_rng(8)
        image = xfs / "disk.img"
        new_image(image, rng)
        real_pread = os.pread

        def pread_then_kill(fd, length, offset):
            server.kill()            # in the middle of the layer's upload
            return real_pread(fd, length, offset)

        monkeypatch.setattr(os, "pread", pread_then_kill)
        with pytest.raises(RemoteError, match="committed on this host but not uploaded"):
            a.commit(image)
        monkeypatch.setattr(os, "pread", real_pread)
        (sid,) = [p.snapshot for p in a.placement()]
        assert {p.snapshot: p.state for p in a.placement()}[sid] == "local"
        copy = tmp_path / "copy"
        shutil.copyfile(image, copy)
        server.start()
        # Nothing half-written: no object under the layer's key until the push.
        assert once_back(lambda: a.remote.stat(layer_key(layer_name(int(sid, 16))))) is None
        once_back(a.push)
        b.restore(sid, host_b_dir / "x.img")
        assert filecmp.cmp(host_b_dir / "x.img", copy, shallow=False)
        a.close()
        b.close()


def test_joining_checks_the_object_store_and_refuses_mismatches(
        xfs, host_b_dir, catalog, bucket_url, s3_env, monkeypatch):
    made = xfs / "nope"
    for args, status, text in [
            (["--remote", f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/p"], 14, "no bucket"),
            (["--remote", "http://example.com/x"], 14, "not an object store URL"),
            ([], 2, "first host of a shared store names its object store")]:
        done = cli("init", made, "--catalog", catalog, *args, check=False)
        assert done.returncode == status, done.stderr
        assert text in done.stderr and "Traceback" not in done.stderr
        assert not made.exists()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-at-all")
    done = cli("init", made, "--catalog", catalog, "--remote", bucket_url, check=False)
    assert done.returncode == 14 and "refused the credentials" in done.stderr
    assert "not-the-secret-at-all" not in done.stderr + done.stdout
    assert not made.exists()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_env.secret_key)
    Store.init(xfs / "a", catalog=catalog, remote=bucket_url).close()
    with pytest.raises(UsageError, match="leave --remote out"):
        Store.init(host_b_dir / "b", catalog=catalog, remote=bucket_url + "-other")
    assert not (host_b_dir / "b").exists()
    with pytest.raises(StoreError, match="already a blockdiff store"):
        Store.init(xfs / "a", catalog=catalog)
    # A host's configuration never holds a secret, and is private.
    with Store.init(host_b_dir / "b", catalog=catalog) as b:
        config = (b.root / "shared.json").read_text()
        assert s3_env.secret_key not in config
        assert os.stat(b.root / "shared.json").st_mode & 0o077 == 0


def test_the_object_store_killed_during_a_fetch_leaves_nothing_and_a_retry_works(
        xfs, host_b_dir, catalog, tmp_path, monkeypatch):
    with hosts_on_their_own_object_store(xfs, host_b_dir, catalog, tmp_path,
                                         monkeypatch) as (server, a, b):
        image, keep, rng = start_line(xfs, tmp_path, 9)
        sid = commit_line(a, image, keep, rng, 1)[-1]
        real_pwrite = os.pwrite

        def pwrite_then_kill(fd, data, offset):
            server.kill()
            return real_pwrite(fd, data, offset)

        monkeypatch.setattr(os, "pwrite", pwrite_then_kill)
        with pytest.raises(RemoteError) as caught:
            b.restore(sid, host_b_dir / "x.img")
        monkeypatch.setattr(os, "pwrite", real_pwrite)
        assert "\n" not in str(caught.value)
        assert not (host_b_dir / "x.img").exists()
        assert list(b.objects.iterdir()) == [b.map_path(b.get(sid))]   # the map had landed
        assert list(b.staging.iterdir()) == []
        server.start()
        once_back(lambda: b.restore(sid, host_b_dir / "x.img"))
        assert filecmp.cmp(host_b_dir / "x.img", keep / sid, shallow=False)
        assert b.verify() == {}
        a.close()
        b.close()


@pytest.mark.parametrize("catalog", ["postgresql"], indirect=True)
def test_postgresql_restarted_between_commits_loses_nothing(hosts, xfs, host_b_dir, tmp_path,
                                                            postgres_server):
    a, b = hosts
    image, keep, rng = start_line(xfs, tmp_path, 10)
    before = commit_line(a, image, keep, rng, 2)
    postgres_server.restart()
    after = commit_line(a, image, keep, rng, 2)      # reconnects
    postgres_server.restart()
    assert [s.id for s in b.log()][:4] == list(reversed(before + after))
    for sid in before + after:
        b.restore(sid, host_b_dir / f"x-{sid}")
        assert filecmp.cmp(host_b_dir / f"x-{sid}", keep / sid, shallow=False)


def test_an_unreachable_or_newer_catalog_is_one_clear_line(xfs, tmp_path, bucket_url,
                                                           postgres_server, postgres_url):
    from postgres import free_port
    dead = f"postgresql://postgres@127.0.0.1:{free_port()}/nothing"
    done = cli("init", xfs / "a", "--catalog", dead, "--remote", bucket_url, check=False)
    assert done.returncode == 13 and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "127.0.0.1" in done.stderr
    assert not (xfs / "a").exists()
    # A password in the URL is kept out of the configuration, the output and errors.
    secret = postgres_server.password
    url = postgres_server.url(postgres_url.rsplit("/", 1)[1], user=postgres.PASSWORD_ROLE,
                              password=secret)
    admin = postgres_server.admin()
    try:
        database = postgres_url.rsplit("/", 1)[1]
        admin.execute(f'GRANT ALL ON DATABASE "{database}" TO {postgres.PASSWORD_ROLE}')
    finally:
        admin.close()
    done = cli("init", xfs / "a", "--catalog", url, "--remote", bucket_url)
    assert secret not in done.stdout + done.stderr
    assert secret not in (xfs / "a" / "shared.json").read_text()
    assert os.stat(xfs / "a" / "catalog.pgpass").st_mode & 0o077 == 0
    listed = cli("log", "--store", xfs / "a")            # the passfile lets it in again
    assert listed.returncode == 0 and secret not in listed.stdout + listed.stderr
    # A catalog written by a newer blockdiff is refused, and nothing changes.
    import psycopg
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("UPDATE catalog.schema_versions SET version = 99 WHERE name = 'catalog'")
    done = cli("log", "--store", xfs / "a", check=False)
    assert done.returncode == 13 and "newer blockdiff" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_host_with_a_cache_size_keeps_its_copies_under_it(xfs, host_b_dir, catalog,
                                                            bucket_url, tmp_path):
    a = Store.init(xfs / "store", catalog=catalog, remote=bucket_url)
    b = Store.init(host_b_dir / "store", catalog=catalog, cache_size=256 * 1024)
    image, keep, rng = start_line(xfs, tmp_path, 11)   # a root layer of 5 MiB
    ids = commit_line(a, image, keep, rng, 4)

    def held() -> int:
        return sum(os.stat(b.layer_path(x)).st_blocks * 512 for x in b.catalog.copies_here())

    for sid in ids:
        b.restore(sid, host_b_dir / f"x-{sid}")
        assert filecmp.cmp(host_b_dir / f"x-{sid}", keep / sid, shallow=False)
        assert held() <= 256 * 1024
    # What was evicted comes back when needed.
    b.restore(ids[0], host_b_dir / "again.img")
    assert filecmp.cmp(host_b_dir / "again.img", keep / ids[0], shallow=False)
    with pytest.raises(UsageError, match="give --catalog too"):
        Store.init(tmp_path / "plain", cache_size=1)
    a.close()
    b.close()


def test_fetching_restores_beside_a_host_evicting_and_sweeping(hosts, xfs, host_b_dir,
                                                               tmp_path):
    """Host B restores (fetching what it lacks) in one process while another
    process of B evicts every copy it may and sweeps, over and over: every
    restore is byte for byte, none fails."""
    a, b = hosts
    image, keep, rng = start_line(xfs, tmp_path, 12)
    ids = commit_line(a, image, keep, rng, 4)
    store_b = host_b_dir / "store"
    evictor = subprocess.Popen(
        [sys.executable, "-c", "import sys\n"
         "from blockdiff.store import Store\n"
         "from blockdiff.store.retention import Policy\n"
         "with Store(sys.argv[1]) as s:\n"
         "    for _ in range(40):\n"
         "        s.evict(0)\n"
         "        s.gc(Policy())\n", str(store_b)],
        stderr=subprocess.PIPE, text=True)
    try:
        rounds = 0
        while evictor.poll() is None or rounds < 8:
            sid = ids[rounds % len(ids)]
            out = host_b_dir / f"r-{rounds}.img"
            cli("restore", "--store", store_b, sid, out)
            assert filecmp.cmp(out, keep / sid, shallow=False)
            out.unlink()
            rounds += 1
    finally:
        if evictor.poll() is None:
            evictor.kill()
        _, err = evictor.communicate()
    assert evictor.returncode == 0, err
    assert b.verify() == {}


def _grant_password_role(postgres_server, postgres_url) -> str:
    """The database of ``postgres_url``, opened to the password role."""
    database = postgres_url.rsplit("/", 1)[1]
    admin = postgres_server.admin()
    try:
        admin.execute(f'GRANT ALL ON DATABASE "{database}" TO {postgres.PASSWORD_ROLE}')
    finally:
        admin.close()
    return database


def _files_hold(root: Path, secret: str, *, but=()) -> list[str]:
    """The files under ``root`` (but those named ``but``) whose bytes hold ``secret``."""
    return [str(p) for p in root.rglob("*") if p.is_file() and p.name not in but
            and secret.encode() in p.read_bytes()]


def test_a_catalog_password_in_any_form_is_never_shown_or_stored(
        xfs, tmp_path, bucket_url, postgres_server, postgres_url, monkeypatch):
    """libpq takes a password from the URL's user information and from the
    ``password`` query parameter (its name percent-encoded or not): none of
    them reaches init's output, shared.json, log --json or an error, and
    the passfile lets every later command in."""
    database = _grant_password_role(postgres_server, postgres_url)
    monkeypatch.setenv("PGPASSFILE", str(tmp_path / "no-pgpass"))   # only the store's
    monkeypatch.delenv("PGPASSWORD", raising=False)
    secret = postgres_server.password
    base = f"postgresql://{postgres.PASSWORD_ROLE}@127.0.0.1:{postgres_server.port}/{database}"
    wrong = f"postgresql://{postgres.PASSWORD_ROLE}:not-it@127.0.0.1:{postgres_server.port}"
    forms = [f"{base}?password={secret}",
             f"{base}?sslmode=disable&pass%77ord={secret}&application_name=x",
             # The query's password wins over the user information's, as in libpq.
             f"{wrong}/{database}?password={secret}"]
    for n, url in enumerate(forms):
        root = xfs / f"a{n}"
        done = cli("init", root, "--catalog", url, *(["--remote", bucket_url] if n == 0 else []))
        assert secret not in done.stdout + done.stderr
        assert "not-it" not in done.stdout + done.stderr
        assert _files_hold(root, secret, but={"catalog.pgpass"}) == []
        config = json.loads((root / "shared.json").read_text())
        assert "password=" not in config["catalog"] and "%77ord" not in config["catalog"]
        assert "not-it" not in config["catalog"]
        listed = cli("log", "--store", root, "--json")
        assert secret not in listed.stdout + listed.stderr
    # Refused, and the error says nothing of the secret: an sslpassword
    # (libpq reads it from the connection string only), and URLs libpq
    # cannot read (its own message quotes the URL whole).
    for url, text in [(f"{base}?sslpassword={secret}", "sslpassword"),
                      (f"postgresql://u:{secret}@[::1/{database}", "IPv6"),
                      (f"postgresql://u:{secret}@127.0.0.1:99999/{database}", "port"),
                      (f"{base}?password={secret}&port=0", "port"),
                      # A "/" in a password that is not percent-encoded ends
                      # libpq's host part: the "password" is a port to it.
                      (f"postgresql://u:{secret}/x@127.0.0.1/{database}", "port"),
                      (f"host=127.0.0.1 password={secret}", "postgresql:// URL")]:
        done = cli("init", xfs / "b", "--catalog", url, check=False)
        assert done.returncode == 2, done.stderr
        assert text in done.stderr and secret not in done.stdout + done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
        assert not (xfs / "b").exists() and not Path(url).exists()


def test_malformed_ports_and_addresses_at_init_are_one_line(xfs, tmp_path, postgres_url,
                                                            bucket_url, s3_env, monkeypatch):
    """A port out of range or not a number, or an IPv6 address without its
    bracket, in the catalog's URL, the object store's or its endpoint: one
    line, the status of the error table, nothing made."""
    made = xfs / "nope"
    host = f"127.0.0.1:{postgres_url.rsplit(':', 1)[1].split('/')[0]}"
    cases = [(["--catalog", "postgresql://postgres:pw@127.0.0.1:99999/x"], 2),
             (["--catalog", "postgresql://postgres:pw@127.0.0.1:port/x"], 2),
             (["--catalog", "postgresql://postgres@127.0.0.1:70000/x"], 2),
             (["--catalog", "postgresql://postgres:pw@[::1/x"], 2),
             (["--catalog", "postgresql://postgres@[::1/x?password=pw"], 2),
             (["--catalog", f"postgresql://postgres@{host}/x?port=99999"], 2),
             (["--catalog", postgres_url, "--remote", f"s3://{s3_env.bucket}:99999/x"], 14),
             (["--catalog", postgres_url, "--remote", f"s3://{s3_env.bucket}:abc/x"], 14),
             (["--catalog", postgres_url, "--remote", "s3://[::1/x"], 14),
             (["--catalog", postgres_url, "--remote", "s3://[::1]/x"], 14)]
    for args, status in cases:
        done = cli("init", made, *args, check=False)
        assert done.returncode == status, (args, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
        assert "pw" not in done.stderr.replace("postgresql://postgres", "")
        assert not made.exists()
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://u:pw@[::1")
    done = cli("init", made, "--catalog", postgres_url, "--remote", bucket_url, check=False)
    assert done.returncode == 14 and "AWS_ENDPOINT_URL" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and ":pw@" not in done.stderr
    assert not made.exists()


@pytest.mark.parametrize("catalog", ["sqlite"], indirect=True)
def test_a_damaged_shared_json_is_one_line_and_never_hangs(xfs, catalog, bucket_url, tmp_path):
    """shared.json is read as every small file is: bounded, UTF-8 JSON of
    bounded depth, a regular file (a link to /dev/zero or a FIFO is refused,
    not read until the end of time), every field checked."""
    root = xfs / "store"
    Store.init(root, catalog=catalog, remote=bucket_url).close()
    config = root / "shared.json"
    good = json.loads(config.read_text())
    damages = {
        "not UTF-8": b'{"version": 1, "catalog": "\xff\xfe"}',
        "nested": b"[" * 200_000 + b"]" * 200_000,
        "nested in the limit": b'{"a": ' * 1000 + b"1" + b"}" * 1000,
        "a lone surrogate": json.dumps({**good, "name": "\ud800"}).encode(),
        "an IPv6 URL without its bracket":
            json.dumps({**good, "catalog": "postgresql://u@[::1/db"}).encode(),
        "a port out of range": json.dumps({**good, "catalog": "postgresql://u@h:99999/d"}).encode(),
        "a relative catalog": json.dumps({**good, "catalog": "cat.sqlite"}).encode(),
        "a host id that is not one": json.dumps({**good, "host": "../../x"}).encode(),
        "not an object": b"[1, 2]",
        "empty": b"",
    }
    for what, data in [*damages.items(), ("a link to /dev/zero", None), ("a FIFO", None)]:
        config.unlink()
        if what == "a link to /dev/zero":
            config.symlink_to("/dev/zero")
        elif what == "a FIFO":
            os.mkfifo(config, 0o600)
        else:
            config.write_bytes(data)
        done = subprocess.run([sys.executable, "-m", "blockdiff", "log", "--store", str(root)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 7, (what, done.stderr)
        assert "shared.json is damaged" in done.stderr and "Traceback" not in done.stderr, what
        assert len(done.stderr.strip().splitlines()) == 1, what
    config.unlink()
    config.write_text(json.dumps(good))
    cli("log", "--store", root)


def test_a_unix_socket_catalog_with_a_password_joins_and_connects(
        xfs, tmp_path, bucket_url, postgres_server, postgres_url, monkeypatch):
    """A catalog reached over the server's unix socket, its directory
    percent-encoded in the URL's host (and with capitals in its path): the
    passfile names the directory as libpq matches it, decoded and with its
    case kept, so init and every later command connect, as psql does."""
    database = _grant_password_role(postgres_server, postgres_url)
    monkeypatch.setenv("PGPASSFILE", str(tmp_path / "no-pgpass"))
    monkeypatch.delenv("PGPASSWORD", raising=False)
    sockets = tmp_path / "PgSocket"
    sockets.symlink_to(postgres_server.directory)
    encoded = str(sockets).replace("/", "%2F")
    secret = postgres_server.password
    for n, url in enumerate([
            f"postgresql://{postgres.PASSWORD_ROLE}:{secret}@{encoded}:{postgres_server.port}"
            f"/{database}",
            f"postgresql:///{database}?host={encoded}&port={postgres_server.port}"
            f"&user={postgres.PASSWORD_ROLE}&password={secret}"]):
        root = xfs / f"a{n}"
        done = cli("init", root, "--catalog", url, *(["--remote", bucket_url] if n == 0 else []))
        assert secret not in done.stdout + done.stderr
        assert _files_hold(root, secret, but={"catalog.pgpass"}) == []
        assert cli("log", "--store", root).returncode == 0
    with Store(xfs / "a0") as a, Store(xfs / "a1") as b:
        image, keep, rng = start_line(xfs, tmp_path, 13)
        sid = commit_line(a, image, keep, rng, 1)[0]
        b.restore(sid, xfs / "x.img")
        assert filecmp.cmp(xfs / "x.img", keep / sid, shallow=False)


def overwrite_data(image: Path, rng, start: int) -> None:
    """16 KiB of new bytes written over the first data of ``image`` at or
    after ``start`` (not a hole: a write there keeps the blocks' addresses)."""
    with open(image, "r+b") as f:
        at = os.lseek(f.fileno(), start, os.SEEK_DATA) // BLOCK * BLOCK
        f.seek(at)
        f.write(rng.bytes(16 * 1024))


@pytest.mark.parametrize("step", ["back", "forward"])
def test_a_stepped_clock_never_fakes_an_unchanged_image(hosts, xfs, host_b_dir, tmp_path,
                                                         monkeypatch, step):
    """Host A's clock steps (back an hour after its commit, or forward an
    hour for the commit and then back to the right time): its copies are
    evicted and fetched again, the image is rewritten in place, and the next
    commit must see the change. Whether a copy was there when a snapshot was
    committed comes from the catalog's generations, not from A's clock."""
    a, b = hosts
    image, keep, rng = start_line(xfs, tmp_path, 13)
    real = time.time
    offset = {"s": 3600.0 if step == "forward" else 0.0}
    monkeypatch.setattr(time, "time", lambda: real() + offset["s"])
    first = commit_line(a, image, keep, rng, 1)[-1]
    offset["s"] -= 3600.0            # the step: an hour back
    evicted, _ = a.evict(0)          # as gc --cache-size 0 does
    assert int(first, 16) in evicted
    a.restore(first, xfs / "elsewhere.img")      # fetches the copy again
    assert a.layer_path(int(first, 16)).exists()
    overwrite_data(image, rng, 0)                # in place: the blocks are the image's own
    second = a.commit(image)
    assert second.changed_bytes >= 16 * 1024
    shutil.copyfile(image, keep / second.id)
    # And once more, from the second snapshot, with the clock stepped again.
    offset["s"] += 7200.0
    overwrite_data(image, rng, IMAGE // 2)
    third = a.commit(image)
    assert third.changed_bytes >= 16 * 1024
    shutil.copyfile(image, keep / third.id)
    monkeypatch.setattr(time, "time", real)
    for sid in (first, second.id, third.id):
        a.restore(sid, xfs / f"a-{sid}")
        assert filecmp.cmp(xfs / f"a-{sid}", keep / sid, shallow=False)
        b.restore(sid, host_b_dir / f"b-{sid}")
        assert filecmp.cmp(host_b_dir / f"b-{sid}", keep / sid, shallow=False)


# A command of blockdiff's CLI in a process of its own that, once its first
# transfer of object bytes is under way, says so on stdout and stops there
# (every transfer thread held), so that the test kills it at that moment.
HELD_CLI = """
import sys, threading
from blockdiff.store import remote
from blockdiff.cli import main

first = threading.Lock()

def held(original):
    def call(*args, **kwargs):
        result = original(*args, **kwargs)
        if first.acquire(blocking=False):      # one line, whichever thread is first
            print("under way", flush=True)
        threading.Event().wait()
        return result
    return call

remote._pwrite_all = held(remote._pwrite_all)                     # a download
remote.S3Remote._read_part = held(remote.S3Remote._read_part)     # a multipart upload
sys.argv = ["blockdiff", *sys.argv[1:]]
main()
"""


def killed_under_way(*args) -> None:
    """Run ``blockdiff ARGS`` (see HELD_CLI) and SIGKILL it mid-transfer."""
    proc = subprocess.Popen([sys.executable, "-c", HELD_CLI, *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line == "under way\n", proc.stderr.read() if proc.poll() is not None else line
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == -9


def test_a_fetch_or_push_killed_mid_transfer_leaves_nothing_after_gc(
        hosts, xfs, host_b_dir, tmp_path, s3_env, bucket_url, monkeypatch):
    a, b = hosts
    image, keep, rng = start_line(xfs, tmp_path, 14)
    sid = commit_line(a, image, keep, rng, 1)[-1]
    store_b = host_b_dir / "store"
    # A fetch killed on B: its staged download stays until a gc.
    killed_under_way("restore", "--store", store_b, sid, host_b_dir / "x.img")
    left = list(b.staging.iterdir())
    assert left and all(p.name.endswith(".partial") for p in left)
    cli("restore", "--store", store_b, sid, host_b_dir / "x.img")
    assert filecmp.cmp(host_b_dir / "x.img", keep / sid, shallow=False)
    cli("gc", "--store", store_b)
    assert list(b.staging.iterdir()) == []

    # A push killed on A half-way through a multipart upload (a layer of
    # more than one part): its parts stay in the bucket until a sweep.
    with open(image, "r+b") as f:
        f.seek(16 * MiB)
        f.write(rng.bytes(12 * MiB))
    big = a.commit(image, push=False)
    shutil.copyfile(image, keep / big.id)
    killed_under_way("push", "--store", xfs / "store")
    client, prefix = s3_env.client(), bucket_url.split("/", 3)[3] + "/"

    def uploads() -> list[str]:
        listed = client.list_multipart_uploads(Bucket=s3_env.bucket, Prefix=prefix)
        return [u["Key"][len(prefix):] for u in listed.get("Uploads", ())]

    assert uploads() == [layer_key(layer_name(int(big.id, 16)))]
    # Too young by the object store's clock: kept (its push may be at it
    # still), however far this host's clock has stepped forward.
    # So is an object no row names (an upload whose rows went meanwhile
    # deletes its own).
    stray = prefix + layer_key(layer_name(0xFF))
    client.put_object(Bucket=s3_env.bucket, Key=stray, Body=b"x")
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 7200.0)
    a.sweep_remote()
    monkeypatch.setattr(time, "time", real)
    assert len(uploads()) == 1
    assert client.list_objects_v2(Bucket=s3_env.bucket, Prefix=stray)["KeyCount"] == 1
    # Older than the grace: aborted, whatever the hosts' clocks say.
    assert a.sweep_remote(grace=0) >= 2
    assert uploads() == []
    assert client.list_objects_v2(Bucket=s3_env.bucket, Prefix=stray)["KeyCount"] == 0
    assert list(a.staging.iterdir()) == []
    # The push done again makes it durable; B restores it byte for byte.
    cli("push", "--store", xfs / "store")
    assert b.durable(big.id)
    b.restore(big.id, host_b_dir / "big.img")
    assert filecmp.cmp(host_b_dir / "big.img", keep / big.id, shallow=False)
    assert cli("gc", "--store", store_b).returncode == 0
    assert list(b.staging.iterdir()) == [] and b.verify() == {}


def damage_file(path: Path, at: int) -> None:
    """One byte of a read-only object file flipped in place, its mode kept."""
    mode = os.stat(path).st_mode & 0o777
    os.chmod(path, 0o600)
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.chmod(path, mode)


def test_a_damaged_object_or_local_copy_is_never_kept_and_is_fetched_again(
        hosts, xfs, host_b_dir, tmp_path, s3_env, bucket_url):
    a, b = hosts
    image, keep, rng = start_line(xfs, tmp_path, 15)
    sid = commit_line(a, image, keep, rng, 1)[-1]
    store_b = host_b_dir / "store"
    map_file = b.map_path(b.get(sid)).name
    key = f"{bucket_url.split('/', 3)[3]}/maps/{map_file}"
    client = s3_env.client()
    # Other bytes of the same size, behind the store's back: refused, and
    # nothing of it enters B's objects/.
    good, _ = flip_object_byte(s3_env, key)
    done = cli("restore", "--store", store_b, sid, host_b_dir / "x.img", check=False)
    assert done.returncode == 7 and "Traceback" not in done.stderr
    assert "not the map the catalog records" in done.stderr
    assert not (host_b_dir / "x.img").exists()
    assert not (b.objects / map_file).exists() and list(b.staging.iterdir()) == []
    # The right object put back: B restores it at once.
    client.put_object(Bucket=s3_env.bucket, Key=key, Body=good)
    cli("restore", "--store", store_b, sid, host_b_dir / "x.img")
    assert filecmp.cmp(host_b_dir / "x.img", keep / sid, shallow=False)

    # B's own copies damaged: verify names the damage, --repair fetches
    # them again, and then every check passes.
    layer = b.layer_path(int(sid, 16))
    damage_file(b.objects / map_file, 100)
    damage_file(layer, os.stat(layer).st_size // 2)
    plain = cli("verify", "--store", store_b, "--json", check=False)
    assert plain.returncode == 7
    assert json.loads(plain.stdout)["problems"][sid]
    repaired = cli("verify", "--store", store_b, "--repair", "--json")
    out = json.loads(repaired.stdout)
    assert out["consistent"] and sorted(out["fetched_again"]) == sorted([map_file, layer.name])
    assert cli("verify", "--store", store_b).returncode == 0
    # Damaged again: the next restore replaces them itself.
    damage_file(b.objects / map_file, 100)
    damage_file(layer, os.stat(layer).st_size // 3)
    cli("restore", "--store", store_b, sid, host_b_dir / "y.img")
    assert filecmp.cmp(host_b_dir / "y.img", keep / sid, shallow=False)
    assert filecmp.cmp(host_b_dir / "x.img", keep / sid, shallow=False)
    assert cli("verify", "--store", store_b).returncode == 0
    cli("gc", "--store", store_b)
    assert list(b.staging.iterdir()) == []


def test_a_host_unknown_to_the_catalog_is_told_so_when_it_fetches(hosts, xfs, host_b_dir,
                                                                  tmp_path):
    a, b = hosts
    image, keep, rng = start_line(xfs, tmp_path, 16)
    sid = commit_line(a, image, keep, rng, 1)[-1]
    with a.catalog.transaction() as db:
        db.execute("DELETE FROM hosts WHERE id = ?", (b.shared.host,))
    done = cli("restore", "--store", host_b_dir / "store", sid, host_b_dir / "x.img",
               check=False)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "removed from the store" not in done.stderr
    assert "not among the shared catalog's hosts" in done.stderr
    assert not (host_b_dir / "x.img").exists()
    assert not b.layer_path(int(sid, 16)).exists()
