"""The object tier (blockdiff.store.remote) against a real SeaweedFS S3 server:
round trips compared byte for byte, immutability, damage detection, errors
that keep secrets out, and a server killed mid-transfer."""

from __future__ import annotations

import filecmp
import logging
import os
import threading
import traceback
import tracemalloc
import uuid
from pathlib import Path

import numpy as np
import pytest
from objectstore import point_boto3_at, running_seaweedfs

from blockdiff import native
from blockdiff.errors import Damaged, NoSuchObject, ObjectExists, RemoteError
from blockdiff.store import remote as remote_module
from blockdiff.store.remote import (
    ChunkChecksums,
    MiB,
    S3Remote,
    layer_key,
    map_key,
    parse_url,
)

# The fixtures, where pytest looks for them.

PART = 5 * MiB
CHUNK = 16 * 1024


@pytest.fixture
def remote(s3_env):
    """A remote below a prefix of its own, with small parts."""
    return S3Remote(f"s3://{s3_env.bucket}/{uuid.uuid4().hex}", part_size=PART, concurrency=4)


def write_random(path: Path, size: int, seed: int = 0) -> bytes:
    data = np.random.default_rng(seed).integers(0, 256, size, np.uint8).tobytes()
    path.write_bytes(data)
    return data


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".partial"))


def checksums_of(path: Path, pos, length) -> ChunkChecksums:
    """The store's chunk checksums of some runs of a file."""
    pos, length = np.array(pos, np.uint64), np.array(length, np.uint64)
    with open(path, "rb") as f:
        crcs = native.chunk_crcs(f.fileno(), pos, length, CHUNK, path)
    return ChunkChecksums(pos, length, CHUNK, crcs)


def test_keys_and_urls():
    assert parse_url("s3://bucket/some/prefix/") == ("bucket", "some/prefix")
    assert parse_url("s3://bucket") == ("bucket", "")
    for bad in ("http://bucket/x", "s3:///x", "s3://user:pw@bucket/x", "s3://bucket/x?y=1"):
        with pytest.raises(RemoteError, match="not an object store URL"):
            parse_url(bad)
    assert layer_key("000000000000002a.layer") == "layers/000000000000002a.layer"
    assert map_key("abc.0123456789abcdef.map") == "maps/abc.0123456789abcdef.map"


@pytest.mark.parametrize("size", [0, 1, PART - 1, PART, PART + 1, 3 * PART + 12345])
def test_round_trip_of_odd_sizes(remote, s3_env, tmp_path, size):
    source = tmp_path / "source"
    write_random(source, size, seed=size)
    assert remote.put_file("layers/x", source) is True
    raw = s3_env.client().head_object(Bucket=s3_env.bucket, Key=f"{remote.prefix}/layers/x")
    assert raw["ContentLength"] == size
    # A second upload of the same file sends nothing and succeeds.
    assert remote.put_file("layers/x", source) is False
    landed = tmp_path / "landed"
    remote.get_file("layers/x", landed, size)
    assert filecmp.cmp(source, landed, shallow=False)
    assert landed.stat().st_mode & 0o777 == 0o600
    assert leftovers(tmp_path) == []


def test_sparse_file_with_data_at_both_ends(remote, tmp_path):
    size = 300 * MiB + 4321
    source = tmp_path / "sparse"
    head = np.random.default_rng(1).integers(0, 256, 3 * MiB + 17, np.uint8).tobytes()
    tail = np.random.default_rng(2).integers(0, 256, 2 * MiB + 5, np.uint8).tobytes()
    with open(source, "wb") as f:
        f.write(head)
        f.seek(size - len(tail))
        f.write(tail)
    assert source.stat().st_size == size
    remote.put_file("layers/sparse", source)
    landed = tmp_path / "landed"
    remote.get_file("layers/sparse", landed, size)
    assert filecmp.cmp(source, landed, shallow=False)
    # The zeros between came back as holes, not as 300 MiB written.
    assert landed.stat().st_blocks * 512 < 16 * MiB


def test_parallel_ranged_downloads_land_where_they_belong(s3_env, tmp_path):
    import boto3
    session = boto3.Session()
    ranges, lock = [], threading.Lock()
    # The first two GETs wait for each other: were they sequential, the
    # barrier would break and the download fail.
    barrier = threading.Barrier(2, timeout=20)

    def before_get(params, **kwargs):
        with lock:
            ranges.append(params["Range"])
            first_two = len(ranges) <= 2
        if first_two:
            barrier.wait()

    session.events.register("provide-client-params.s3.GetObject", before_get)
    remote = S3Remote(f"s3://{s3_env.bucket}/{uuid.uuid4().hex}", part_size=PART,
                      concurrency=4, session=session)
    size = 6 * PART + 999
    source = tmp_path / "source"
    data = write_random(source, size, seed=7)
    remote.put_file("layers/x", source)
    # Into an open file at an offset, between bytes that must stay.
    target = tmp_path / "target"
    before, after = b"B" * 4096, b"A" * 777
    target.write_bytes(before + bytes(size) + after)
    fd = os.open(target, os.O_RDWR)
    try:
        remote.get_into("layers/x", fd, target, len(before), size)
    finally:
        os.close(fd)
    assert target.read_bytes() == before + data + after
    expected = [f"bytes={start}-{min(start + PART, size) - 1}" for start in range(0, size, PART)]
    assert sorted(ranges, key=lambda r: int(r[6:].split("-")[0])) == expected


def test_memory_stays_bounded_by_what_is_in_flight(remote, tmp_path):
    size = 60 * MiB
    source = tmp_path / "source"
    write_random(source, size, seed=3)
    tracemalloc.start()
    try:
        remote.put_file("layers/big", source)
        _, upload_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        remote.get_file("layers/big", tmp_path / "landed", size)
        _, download_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Parts in flight x part size (4 x 5 MiB), pieces in flight x 1 MiB; the
    # file is 60 MiB.
    assert upload_peak < 4 * PART + 8 * MiB, upload_peak
    assert download_peak < 4 * remote_module.PIECE + 8 * MiB, download_peak
    assert filecmp.cmp(source, tmp_path / "landed", shallow=False)


@pytest.mark.parametrize("size", [1000, 2 * PART + 1])
def test_an_existing_object_is_never_overwritten(remote, tmp_path, size):
    first, other = tmp_path / "first", tmp_path / "other"
    original = write_random(first, size, seed=1)
    write_random(other, size, seed=2)
    remote.put_file("layers/x", first)
    with pytest.raises(ObjectExists, match="already holds other content"):
        remote.put_file("layers/x", other)
    (tmp_path / "short").write_bytes(original[:-1])
    with pytest.raises(ObjectExists):
        remote.put_file("layers/x", tmp_path / "short")
    remote.get_file("layers/x", tmp_path / "landed", size)
    assert (tmp_path / "landed").read_bytes() == original


@pytest.mark.parametrize("size", [1000, 2 * PART + 1])
def test_the_conditional_write_refuses_a_key_taken_after_the_check(remote, tmp_path,
                                                                   monkeypatch, size):
    """Two hosts racing for a key: the HEAD check of the loser saw no object;
    SeaweedFS's If-None-Match on the write itself still refuses it."""
    first, other = tmp_path / "first", tmp_path / "other"
    original = write_random(first, size, seed=1)
    write_random(other, size, seed=2)
    remote.put_file("layers/x", first)
    real_head = S3Remote._head
    missed = []

    def head_missing_once(self, key, missing_ok=False):
        if not missed:
            missed.append(key)
            return None
        return real_head(self, key, missing_ok)

    monkeypatch.setattr(S3Remote, "_head", head_missing_once)
    with pytest.raises(ObjectExists):
        remote.put_file("layers/x", other)
    assert missed == ["layers/x"] and remote._conditional
    monkeypatch.undo()
    remote.get_file("layers/x", tmp_path / "landed", size)
    assert (tmp_path / "landed").read_bytes() == original


def test_an_object_not_written_by_blockdiff_is_not_taken_for_the_file(remote, s3_env, tmp_path):
    source = tmp_path / "source"
    data = write_random(source, 5000)
    s3_env.client().put_object(Bucket=s3_env.bucket, Key=f"{remote.prefix}/layers/x", Body=data)
    with pytest.raises(ObjectExists, match="did not write"):
        remote.put_file("layers/x", source)


def overwrite_behind_our_back(s3_env, remote, key: str, data: bytes, keep_metadata: bool):
    client = s3_env.client()
    full = f"{remote.prefix}/{key}"
    metadata = client.head_object(Bucket=s3_env.bucket, Key=full)["Metadata"]
    client.delete_object(Bucket=s3_env.bucket, Key=full)
    client.put_object(Bucket=s3_env.bucket, Key=full, Body=data,
                      Metadata=metadata if keep_metadata else {})


def test_a_damaged_object_fails_the_chunk_checksums(remote, s3_env, tmp_path):
    size = 3 * PART + 100
    source = tmp_path / "layer"
    data = bytearray(write_random(source, size, seed=5))
    runs = checksums_of(source, [0, 2 * MiB + 4096], [40000, 9 * MiB])
    remote.put_file("layers/x", source, runs)
    data[2 * MiB + 4096 + 3 * CHUNK + 5] ^= 0xFF          # inside the second run
    overwrite_behind_our_back(s3_env, remote, "layers/x", bytes(data), keep_metadata=False)
    landed = tmp_path / "landed"
    with pytest.raises(Damaged, match=r"1 of the \d+ chunks fail their CRC32C \(the first at "
                                      rf"byte {2 * MiB + 4096 + 3 * CHUNK}\)"):
        remote.get_file("layers/x", landed, size, runs)
    assert not landed.exists() and leftovers(tmp_path) == []


def test_a_damaged_object_fails_its_digest(remote, s3_env, tmp_path):
    """Without the store's checksums (a map), the digest it was stored with."""
    size = PART + 3
    source = tmp_path / "map"
    data = bytearray(write_random(source, size, seed=6))
    remote.put_file("maps/x", source)
    data[-1] ^= 1
    overwrite_behind_our_back(s3_env, remote, "maps/x", bytes(data), keep_metadata=True)
    landed = tmp_path / "landed"
    landed.write_bytes(b"what was there")
    with pytest.raises(Damaged, match="does not match the digest"):
        remote.get_file("maps/x", landed, size)
    assert landed.read_bytes() == b"what was there" and leftovers(tmp_path) == []


def test_an_object_of_another_size_is_refused_before_anything_is_written(remote, tmp_path):
    source = tmp_path / "source"
    write_random(source, 1000)
    remote.put_file("layers/x", source)
    with pytest.raises(Damaged, match="1000 bytes where 1001 were expected"):
        remote.get_file("layers/x", tmp_path / "landed", 1001)
    assert not (tmp_path / "landed").exists() and leftovers(tmp_path) == []


def test_a_damaged_local_file_is_not_uploaded(remote, tmp_path):
    source = tmp_path / "layer"
    data = bytearray(write_random(source, 100000))
    runs = checksums_of(source, [0], [100000])
    data[50000] ^= 1
    source.write_bytes(data)
    with pytest.raises(Damaged, match="local copy is damaged and was not uploaded"):
        remote.put_file("layers/x", source, runs)
    assert remote.stat("layers/x") is None


def test_a_file_changing_during_its_upload_is_not_stored(remote, tmp_path, monkeypatch):
    source = tmp_path / "layer"
    write_random(source, 2 * PART + 1)
    real_pread = os.pread

    # A writer changes the second part after the digest was taken.
    def changing_pread(fd, length, offset):
        if offset == PART:
            with open(source, "r+b") as f:
                f.seek(offset + 10)
                f.write(b"changed")
        return real_pread(fd, length, offset)

    monkeypatch.setattr(os, "pread", changing_pread)
    with pytest.raises(Damaged, match="changed while it was being uploaded"):
        remote.put_file("layers/x", source)
    monkeypatch.undo()
    assert remote.stat("layers/x") is None


def test_missing_objects(remote, tmp_path):
    assert remote.stat("layers/none") is None
    with pytest.raises(NoSuchObject, match=r"download s3://.*/layers/none: no such object"):
        remote.get_file("layers/none", tmp_path / "landed", 10)
    assert not (tmp_path / "landed").exists() and leftovers(tmp_path) == []


def assert_keeps_secrets(error: BaseException, secrets: list[str], remote) -> str:
    text = "".join(traceback.format_exception(error)) + repr(error) + repr(remote)
    for secret in secrets:
        assert secret not in text
    message = str(error)
    assert "\n" not in message
    return message


def test_errors_keep_the_secret_out(s3_env, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    source = tmp_path / "source"
    write_random(source, 1000)
    wrong_secret = "WRONG-" + s3_env.secret_key[::-1]
    secrets = [s3_env.secret_key, wrong_secret]

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong_secret)
    remote = S3Remote(f"s3://{s3_env.bucket}/p")
    for attempt in (lambda: remote.put_file("layers/x", source),
                    lambda: remote.get_file("layers/x", tmp_path / "landed", 1000),
                    lambda: remote.stat("layers/x"),
                    lambda: list(remote.list())):
        with pytest.raises(RemoteError) as caught:
            attempt()
        message = assert_keeps_secrets(caught.value, secrets, remote)
        assert "refused the credentials" in message and "AWS_SECRET_ACCESS_KEY" in message
        assert f"s3://{s3_env.bucket}/p" in message

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_env.secret_key)
    remote = S3Remote("s3://no-such-bucket-here/p")
    for attempt in (lambda: remote.put_file("layers/x", source),
                    lambda: remote.stat("layers/x"),
                    lambda: remote.get_file("layers/x", tmp_path / "landed", 1000)):
        with pytest.raises(RemoteError) as caught:
            attempt()
        message = assert_keeps_secrets(caught.value, secrets, remote)
        assert "there is no bucket no-such-bucket-here" in message

    from objectstore import free_ports
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_ports(1)[0]}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    remote = S3Remote(f"s3://{s3_env.bucket}/p")
    with pytest.raises(RemoteError) as caught:
        remote.put_file("layers/x", source)
    message = assert_keeps_secrets(caught.value, secrets, remote)
    assert message.startswith(f"upload s3://{s3_env.bucket}/p/layers/x: cannot reach")
    assert "AWS_ENDPOINT_URL" in message
    assert not (tmp_path / "landed").exists()
    for record in caplog.records:
        for secret in secrets:
            assert secret not in record.getMessage()


def test_list_and_delete(remote, tmp_path, monkeypatch):
    sizes = {"layers/a.layer": 10, "layers/b.layer": 0, "maps/a.map": 7,
             "maps/b.map": PART + 1, "layers/c.layer": 3}
    for key, size in sizes.items():
        write_random(tmp_path / "f", size)
        remote.put_file(key, tmp_path / "f")
    assert [(o.key, o.size) for o in remote.list("layers/")] == [
        ("layers/a.layer", 10), ("layers/b.layer", 0), ("layers/c.layer", 3)]
    assert {o.key: o.size for o in remote.list()} == sizes
    monkeypatch.setattr(remote_module, "DELETE_BATCH", 2)     # several batches
    remote.delete(["layers/a.layer", "maps/b.map", "layers/none", "maps/a.map"])
    assert [o.key for o in remote.list()] == ["layers/b.layer", "layers/c.layer"]
    remote.delete([])
    assert remote.stat("maps/b.map") is None


@pytest.mark.services
def test_a_server_killed_mid_transfer_leaves_nothing_under_the_final_name(
        tmp_path, monkeypatch):
    from objectstore import unavailable_reason
    if unavailable_reason():
        pytest.skip(unavailable_reason())
    files = tmp_path / "files"
    files.mkdir()
    size = 8 * PART + 1
    source = files / "source"
    write_random(source, size, seed=9)
    with running_seaweedfs(tmp_path / "server") as server:
        point_boto3_at(server, monkeypatch, tmp_path)
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
        remote = S3Remote(f"s3://{server.bucket}/p", part_size=PART, concurrency=4)
        remote.put_file("layers/x", source)

        real_pwrite = os.pwrite

        def pwrite_then_kill(fd, data, offset):
            server.kill()
            return real_pwrite(fd, data, offset)

        monkeypatch.setattr(os, "pwrite", pwrite_then_kill)
        landed = files / "landed"
        with pytest.raises(RemoteError) as caught:
            remote.get_file("layers/x", landed, size)
        monkeypatch.setattr(os, "pwrite", real_pwrite)
        assert "\n" not in str(caught.value)
        assert not landed.exists() and leftovers(files) == []

        server.start()
        real_pread = os.pread

        def pread_then_kill(fd, length, offset):
            if offset == 2 * PART:
                server.kill()
            return real_pread(fd, length, offset)

        monkeypatch.setattr(os, "pread", pread_then_kill)
        with pytest.raises(RemoteError):
            remote.put_file("layers/y", source)
        monkeypatch.setattr(os, "pread", real_pread)

        server.start()
        assert remote.stat("layers/y") is None
        assert remote.put_file("layers/y", source) is True
        remote.get_file("layers/y", landed, size)
        assert filecmp.cmp(source, landed, shallow=False)
