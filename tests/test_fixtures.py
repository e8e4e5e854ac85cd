"""Self-tests for the filesystem fixtures and scenario helpers."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

import filesystems
import scenarios
from blockdiff.errors import FilesystemError
from filesystems import FIEMAP_EXTENT_SHARED, FIEMAP_EXTENT_UNWRITTEN, KINDS, data_ranges, fiemap
from scenarios import BLOCK, SCENARIOS, assert_same_bytes

HERE = Path(__file__).resolve().parent
MiB = 1 << 20


def mount_points() -> set[str]:
    return {mountpoint for _, mountpoint, _ in filesystems.mount_table()}


def loop_backing_files() -> list[str]:
    out = subprocess.run(["losetup", "--list", "--noheadings", "--output", "BACK-FILE"],
                         capture_output=True, text=True, check=True).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


def filefrag(path: Path) -> str:
    return subprocess.run(["filefrag", "-v", str(path)],
                          capture_output=True, text=True, check=True).stdout


def write_random(path: Path, size: int, seed: int = 0) -> bytes:
    data = scenarios.random_bytes(random.Random(seed), size)
    with open(path, "wb") as f:
        f.write(data)
        os.fsync(f.fileno())
    return data


def require(kind: str) -> None:
    reason = filesystems.filesystem_unavailable_reason(kind)
    if reason:
        pytest.skip(f"{kind} unavailable: {reason}")


@pytest.fixture
def mount_root():
    """A private directory for mounted_filesystem() that must end up empty."""
    root = filesystems.default_tmp_dir() / f"selftest-{uuid.uuid4().hex[:8]}"
    root.mkdir(parents=True)
    yield root
    leftovers = list(root.iterdir())
    if not leftovers:
        root.rmdir()
    assert leftovers == [], f"mounted_filesystem left {leftovers} behind"


def assert_cleaned(work: Path) -> None:
    assert not any(m.startswith(str(work)) for m in mount_points()), "still mounted"
    assert not any(str(work) in b for b in loop_backing_files()), "loop device still attached"
    assert not work.exists()


# --- the fixtures themselves ------------------------------------------------

def test_any_fs_is_mounted_empty_and_writable(any_fs, request):
    kind = request.node.callspec.params["any_fs"]
    assert filesystems.filesystem_type(any_fs) == kind
    assert os.path.ismount(any_fs.parent)
    assert list(any_fs.iterdir()) == []
    data = write_random(any_fs / "file", 3 * MiB + 17)
    assert (any_fs / "file").read_bytes() == data


def test_named_fixtures(xfs, btrfs, ext4, tmpfs):
    for path, kind in [(xfs, "xfs"), (btrfs, "btrfs"), (ext4, "ext4"), (tmpfs, "tmpfs")]:
        assert filesystems.filesystem_type(path) == kind


def test_each_test_gets_a_fresh_directory(xfs):
    # Paired with the previous test, which used the same session mount.
    assert list(xfs.iterdir()) == []
    assert len(list(xfs.parent.iterdir())) == 1


def test_fresh_filesystem_has_requested_size(fresh_filesystem):
    mnt = fresh_filesystem("xfs", size=320 * MiB)
    assert os.path.ismount(mnt) and list(mnt.iterdir()) == []
    st = os.statvfs(mnt)
    assert 250 * MiB < st.f_blocks * st.f_frsize <= 320 * MiB
    (mnt / "big").write_bytes(b"")
    with pytest.raises(OSError, match="No space left"):
        scenarios.sequential_write(mnt / "big", 0, 400 * MiB, seed=0)


def test_report_header_lists_every_kind(pytestconfig):
    results = pytestconfig.hook.pytest_report_header(config=pytestconfig,
                                                     start_path=Path.cwd())
    header = "\n".join(line for lines in results for line in lines)
    for kind in KINDS:
        assert f"  {kind}: " in header


# --- reflinks and extent maps -----------------------------------------------

def test_clone_shares_extents(reflink_fs):
    base, target = reflink_fs / "base", reflink_fs / "target"
    data = write_random(base, 4 * MiB)
    scenarios.clone_file(base, target)
    assert target.read_bytes() == data

    base_map, target_map = fiemap(base), fiemap(target)
    assert base_map and all(e.flags & FIEMAP_EXTENT_SHARED for e in target_map)
    assert [(e.logical, e.physical) for e in base_map] == \
           [(e.logical, e.physical) for e in target_map]
    assert "shared" in filefrag(target)

    # Writing the clone leaves the base untouched.
    scenarios.random_block_writes(target, count=10, seed=3)
    assert base.read_bytes() == data
    assert target.read_bytes() != data
    assert any(not e.flags & FIEMAP_EXTENT_SHARED for e in fiemap(target))


@pytest.mark.parametrize("kind", ["ext4", "tmpfs"])
def test_clone_unsupported_without_reflink(kind, request):
    path = request.getfixturevalue(kind)
    write_random(path / "base", 8192)
    with pytest.raises(OSError):
        scenarios.clone_file(path / "base", path / "target")


def test_btrfs_small_files_are_inline(btrfs):
    # Documents kernel behaviour engine code must cope with: files up to
    # max_inline (2048 bytes by default) live in metadata, reported with
    # DATA_INLINE | NOT_ALIGNED and physical offset 0.
    write_random(btrfs / "small", 100)
    (extent,) = fiemap(btrfs / "small")
    assert extent.flags & filesystems.FIEMAP_EXTENT_DATA_INLINE
    assert extent.flags & filesystems.FIEMAP_EXTENT_NOT_ALIGNED


def test_fiemap_without_sync_sees_delalloc(xfs):
    with open(xfs / "f", "wb") as f:
        f.write(b"x" * MiB)
        f.flush()
        unsynced = fiemap(xfs / "f", sync=False)
    assert unsynced[0].flags & filesystems.FIEMAP_EXTENT_DELALLOC
    assert not fiemap(xfs / "f")[0].flags & filesystems.FIEMAP_EXTENT_DELALLOC


# --- modifiers ----------------------------------------------------------------

def test_punch_hole_makes_hole(any_fs):
    path = any_fs / "img"
    data = write_random(path, MiB)
    scenarios.punch_hole(path, 256 * 1024, 256 * 1024)
    assert data_ranges(path) == [(0, 256 * 1024), (512 * 1024, MiB)]
    content = path.read_bytes()
    assert content[256 * 1024:512 * 1024] == bytes(256 * 1024)
    assert content[:256 * 1024] == data[:256 * 1024]
    assert os.path.getsize(path) == MiB


def test_punch_hole_unaligned_zeroes_edges(any_fs):
    path = any_fs / "img"
    data = bytearray(write_random(path, 4 * BLOCK))
    scenarios.punch_hole(path, BLOCK - 10, BLOCK + 20)
    data[BLOCK - 10:2 * BLOCK + 10] = bytes(BLOCK + 20)
    assert path.read_bytes() == data


@pytest.mark.parametrize("kind", ["xfs", "btrfs", "ext4"])
def test_preallocate_unwritten(kind, request):
    path = request.getfixturevalue(kind) / "img"
    data = write_random(path, MiB)
    scenarios.preallocate_unwritten(path, 256 * 1024, 256 * 1024)
    # SEEK_DATA treats unwritten extents as holes - but only while none of
    # their pages are cached, so this is checked before reading the file.
    assert data_ranges(path) == [(0, 256 * 1024), (512 * 1024, MiB)]

    content = path.read_bytes()
    assert content[256 * 1024:512 * 1024] == bytes(256 * 1024)
    assert content[512 * 1024:] == data[512 * 1024:]
    assert os.path.getsize(path) == MiB

    unwritten = [e for e in fiemap(path) if e.flags & FIEMAP_EXTENT_UNWRITTEN]
    assert [(e.logical, e.length) for e in unwritten] == [(256 * 1024, 256 * 1024)]
    assert "unwritten" in filefrag(path)

    scenarios.preallocate_unwritten(path, MiB, 3 * BLOCK + 5)
    assert os.path.getsize(path) == MiB + 3 * BLOCK + 5
    assert path.read_bytes()[MiB:] == bytes(3 * BLOCK + 5)


def test_preallocate_unwritten_tmpfs_reads_zeros(tmpfs):
    path = tmpfs / "img"
    write_random(path, MiB)
    scenarios.preallocate_unwritten(path, 0, 8192)
    assert path.read_bytes()[:8192] == bytes(8192)


@pytest.mark.parametrize("kind", ["xfs", "btrfs", "ext4"])
def test_zero_range(kind, request):
    path = request.getfixturevalue(kind) / "img"
    data = write_random(path, MiB)
    scenarios.zero_range(path, 100, 300 * 1024)
    content = path.read_bytes()
    assert content[:100] == data[:100]
    assert content[100:100 + 300 * 1024] == bytes(300 * 1024)
    assert content[100 + 300 * 1024:] == data[100 + 300 * 1024:]
    scenarios.zero_range(path, MiB - 10, 100)  # extends the file
    assert os.path.getsize(path) == MiB + 90


def test_zero_range_writes_zeros_on_tmpfs(tmpfs):
    # tmpfs has no FALLOC_FL_ZERO_RANGE; the scenario writes zeros instead.
    write_random(tmpfs / "img", MiB)
    scenarios.zero_range(tmpfs / "img", BLOCK, 2 * BLOCK)
    content = (tmpfs / "img").read_bytes()
    assert content[BLOCK:3 * BLOCK] == bytes(2 * BLOCK) and any(content[:BLOCK])


def test_grow_and_shrink(any_fs):
    path = any_fs / "img"
    data = write_random(path, 10 * BLOCK)
    scenarios.grow(path, 100 * BLOCK + 7)
    content = path.read_bytes()
    assert len(content) == 100 * BLOCK + 7
    assert content[:10 * BLOCK] == data
    assert content[10 * BLOCK:98 * BLOCK] == bytes(88 * BLOCK)
    assert content[-2 * BLOCK:] != bytes(2 * BLOCK)

    scenarios.shrink(path, 5 * BLOCK + 123)
    assert path.read_bytes() == data[:5 * BLOCK + 123]

    scenarios.grow(path, 6 * BLOCK, write_tail=False)
    assert path.read_bytes() == data[:5 * BLOCK + 123] + bytes(BLOCK - 123)
    with pytest.raises(ValueError):
        scenarios.shrink(path, 7 * BLOCK)


def test_sequential_write_extends(any_fs):
    path = any_fs / "img"
    path.write_bytes(b"")
    scenarios.sequential_write(path, 5000, 20 * MiB, seed=1)
    assert os.path.getsize(path) == 5000 + 20 * MiB
    first = path.read_bytes()
    scenarios.sequential_write(path, 5000, 20 * MiB, seed=1)
    assert path.read_bytes() == first


def test_make_base_image(any_fs):
    size = 8 * MiB + 1234
    a, b, c = any_fs / "a", any_fs / "b", any_fs / "c"
    scenarios.make_base_image(a, size, seed=5)
    scenarios.make_base_image(b, size, seed=5)
    scenarios.make_base_image(c, size, seed=6)
    assert os.path.getsize(a) == size
    assert_same_bytes(a, b)
    assert a.read_bytes() != c.read_bytes()
    ranges = data_ranges(a)
    covered = sum(end - start for start, end in ranges)
    assert ranges and 0 < covered < size

    dense = any_fs / "dense"
    scenarios.make_base_image(dense, size, seed=5, sparse_fraction=0.0)
    assert data_ranges(dense) == [(0, size)]


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenarios_are_deterministic(reflink_fs, name):
    size = 4 * MiB + 321
    targets = []
    for run in ("a", "b"):
        base, target = reflink_fs / f"base-{run}", reflink_fs / f"target-{run}"
        scenarios.make_base_image(base, size, seed=11)
        SCENARIOS[name](base, target, 42)
        targets.append((base, target))
    (base_a, target_a), (base_b, target_b) = targets
    assert_same_bytes(base_a, base_b)
    assert_same_bytes(target_a, target_b)

    original = reflink_fs / "original"
    scenarios.make_base_image(original, size, seed=11)
    target_size = os.path.getsize(target_a)
    if name == "empty_base":
        assert os.path.getsize(base_a) == 0
        assert_same_bytes(target_a, original)
    else:
        assert_same_bytes(base_a, original)  # the base is never modified
    if name == "empty_target":
        assert target_size == 0
    elif name == "grow":
        assert target_size > size and target_size % BLOCK != 0
    elif name == "shrink_unaligned":
        assert target_size < size and target_size % BLOCK != 0
    elif name in ("random_4k_writes", "sequential_writes", "punched_holes", "zero_ranges",
                  "unwritten_extents", "mixed"):
        assert target_a.read_bytes() != original.read_bytes()
    if name in ("random_4k_writes", "punched_holes", "zero_ranges", "unwritten_extents"):
        assert any(e.flags & FIEMAP_EXTENT_SHARED for e in fiemap(target_a))


def test_assert_same_bytes(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    data = bytearray(os.urandom(3 * MiB + 100))
    a.write_bytes(data)
    b.write_bytes(data)
    assert_same_bytes(a, b)

    data[2 * MiB + 5] ^= 1
    b.write_bytes(data)
    with pytest.raises(AssertionError, match=f"offset {2 * MiB + 5}$"):
        assert_same_bytes(a, b)

    b.write_bytes(data[:MiB])
    with pytest.raises(AssertionError, match=rf"\({MiB} bytes\).*offset {MiB}$"):
        assert_same_bytes(a, b)


# --- cleanup guarantees ---------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_mounted_filesystem_cleans_up(kind, mount_root):
    require(kind)
    with filesystems.mounted_filesystem(kind, tmp_dir=mount_root) as mnt:
        work = mnt.parent
        assert str(mnt) in mount_points()
        assert filesystems.filesystem_type(mnt) == kind
        if kind != "tmpfs":
            assert any(str(work) in b for b in loop_backing_files())
        write_random(mnt / "f", MiB)
    assert_cleaned(work)


def test_cleanup_after_exception(mount_root):
    require("xfs")
    with pytest.raises(ZeroDivisionError):
        with filesystems.mounted_filesystem("xfs", tmp_dir=mount_root) as mnt:
            work = mnt.parent
            1 / 0
    assert_cleaned(work)


@pytest.mark.parametrize("mkfs", [["false"], ["mkfs.ext4", "-q", "-F"]],
                         ids=["mkfs-fails", "mount-fails"])
def test_cleanup_when_setup_fails(mkfs, mount_root, monkeypatch):
    require("xfs")
    # ext4 on the device makes "mount -t xfs" fail after mkfs succeeded.
    monkeypatch.setitem(filesystems.MKFS, "xfs", mkfs)
    with pytest.raises(FilesystemError):
        with filesystems.mounted_filesystem("xfs", tmp_dir=mount_root):
            pass
    assert not any(str(mount_root) in m for m in mount_points())
    assert not any(str(mount_root) in b for b in loop_backing_files())


def test_busy_mount_is_lazily_unmounted_and_reported(mount_root):
    require("xfs")
    with pytest.raises(FilesystemError, match="busy"):
        with filesystems.mounted_filesystem("xfs", tmp_dir=mount_root) as mnt:
            work = mnt.parent
            leaked = open(mnt / "f", "wb")
    try:
        assert str(mnt) not in mount_points()
        assert not work.exists()
    finally:
        leaked.close()
    # The loop device was marked autoclear and goes away with the last user.
    deadline = time.monotonic() + 10
    while any(str(work) in b for b in loop_backing_files()):
        assert time.monotonic() < deadline, "loop device not released"
        time.sleep(0.1)


def test_stale_mounts_of_dead_processes_are_swept(mount_root):
    require("xfs")
    # A process that dies inside the context manager without any cleanup.
    code = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(HERE)!r})
        import filesystems
        cm = filesystems.mounted_filesystem("xfs", tmp_dir={str(mount_root)!r})
        print(cm.__enter__(), flush=True)
        os._exit(0)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    mnt = Path(out.strip())
    assert str(mnt) in mount_points()

    assert filesystems.cleanup_stale_mounts(mount_root) == [mnt.parent]
    assert_cleaned(mnt.parent)


# --- whole pytest sessions in a subprocess ------------------------------------------

INNER_TESTS = """
import os, time
import pytest

def record(path):
    with open(os.environ["RECORD"], "a") as f:
        f.write(f"{path}\\n")

def test_uses_every_fs(any_fs):
    record(any_fs)

def test_crashes(xfs):
    record(xfs)
    raise RuntimeError("boom")

@pytest.mark.bench
def test_benchmark():
    pass

def test_hangs(btrfs):
    record(btrfs)
    if os.environ.get("HANG"):
        time.sleep(600)
"""


@pytest.fixture
def inner_project(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    for name in ("conftest.py", "filesystems.py", "scenarios.py", "services.py", "postgres.py",
                 "objectstore.py", "guests.py"):
        shutil.copy(HERE / name, project / name)
    (project / "pytest.ini").write_text("[pytest]\n")
    (project / "test_inner.py").write_text(INNER_TESTS)
    return project


def run_inner(project: Path, *args: str, **env: str) -> subprocess.Popen:
    environment = dict(os.environ)
    environment.pop(filesystems.SKIP_ENV, None)
    environment.update(RECORD=str(project / "record.txt"), **env)
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", "-rs", "-p", "no:cacheprovider", *args],
        cwd=project, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)


def assert_session_cleaned(pid: int) -> None:
    prefix = str(filesystems.default_tmp_dir() / f"{filesystems.MOUNT_PREFIX}{pid}-")
    assert not any(m.startswith(prefix) for m in mount_points())
    assert not any(b.startswith(prefix) for b in loop_backing_files())
    assert not any(str(p).startswith(prefix) for p in filesystems.default_tmp_dir().iterdir())


def test_session_reports_skips_and_cleans_up(inner_project):
    for kind in ("xfs", "btrfs", "tmpfs"):
        require(kind)
    proc = run_inner(inner_project, **{filesystems.SKIP_ENV: "ext4"})
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out  # test_crashes fails on purpose
    assert "ext4: unavailable - disabled by BLOCKDIFF_TEST_SKIP_FS" in out
    assert "xfs: available" in out
    assert "SKIPPED [1] test_inner.py" in out and "ext4 unavailable: disabled by" in out
    assert "benchmark; pass --run-bench to run" in out
    assert "4 passed" in out and "1 failed" in out and "2 skipped" in out, out

    recorded = (inner_project / "record.txt").read_text().split()
    assert len(recorded) == 5
    assert not set(recorded) & mount_points()
    assert_session_cleaned(proc.pid)


def test_session_runs_benchmarks_when_asked(inner_project):
    proc = run_inner(inner_project, "--run-bench", "-k", "benchmark")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert "1 passed" in out


def test_sigterm_tears_down_mounts(inner_project):
    require("btrfs")
    record = inner_project / "record.txt"
    proc = run_inner(inner_project, "-k", "hangs", HANG="1")
    try:
        deadline = time.monotonic() + 60
        while not record.exists() or not record.read_text():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        assert str(Path(record.read_text().strip()).parent) in mount_points()
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert_session_cleaned(proc.pid)
