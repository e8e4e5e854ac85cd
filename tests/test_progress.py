"""Progress: the library's callbacks add up to what they announce, in batches
while one native call would otherwise do all the work; the CLI draws a bar on
a terminal and nothing anywhere else."""

from __future__ import annotations

import fcntl
import json
import os
import struct
import subprocess
import sys
import termios

import numpy as np
import pytest

from blockdiff import native
from blockdiff.progress import NO_PROGRESS, Steps
from blockdiff.store.store import Store

MIB = 1 << 20


class Recorder:
    """A progress that keeps every phase: ``[what, unit, total, advanced, advances]``."""

    def __init__(self):
        self.phases: list[list] = []
        self.finished = 0

    def start(self, total, unit, what):
        self.phases.append([what, unit, total, 0, 0])

    def advance(self, n):
        assert self.phases, "advanced before any phase started"
        self.phases[-1][3] += n
        self.phases[-1][4] += 1

    def finish(self):
        self.finished += 1

    def check_complete(self):
        """Every phase advanced exactly to its total."""
        for what, _, total, advanced, _ in self.phases:
            assert advanced == total, f"{what}: advanced {advanced} of {total}"

    def phase(self, what):
        found = [p for p in self.phases if p[0] == what]
        assert found, f"no phase {what!r} in {[p[0] for p in self.phases]}"
        return found[-1]


def write_image(path, data_mib: int, *, seed: int = 1) -> int:
    """An image of random data with a hole in the middle; its data bytes."""
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        f.write(rng.bytes(data_mib // 2 * MIB))
        f.seek(8 * MIB, os.SEEK_CUR)
        f.write(rng.bytes(data_mib // 2 * MIB))
    return data_mib // 2 * 2 * MIB


@pytest.fixture
def store(xfs):
    s = Store.init(xfs / "store")
    yield s
    s.close()


def test_native_batches_give_the_same_results(xfs):
    path = xfs / "data"
    write_image(path, 160)
    # A range longer than a batch (cut in two), many short ones, a
    # zero-length one, one ending off a chunk boundary.
    offset = np.array([0, 100 * MIB + 4096, 104 * MIB] + [120 * MIB + i * 65536
                                                          for i in range(300)], np.uint64)
    length = np.array([100 * MIB, 0, 12 * MIB + 5] + [65536 - 512] * 300, np.uint64)
    with open(path, "rb") as f:
        fd = f.fileno()
        recorder = Recorder()
        recorder.start(int(length.sum()), "B", "chunks")
        whole = native.chunk_crcs(fd, offset, length, 16384, path)
        batched = native.chunk_crcs(fd, offset, length, 16384, path, progress=recorder)
        assert np.array_equal(whole, batched)
        recorder.check_complete()
        assert recorder.phases[0][4] >= 3   # the long range's two pieces, the rest
        recorder.start(int(length.sum()), "B", "ranges")
        crcs, _ = native.transfer_ranges(fd, -1, offset, None, length, path, checksums=True)
        batched, _ = native.transfer_ranges(fd, -1, offset, None, length, path,
                                            checksums=True, progress=recorder)
        assert np.array_equal(crcs, batched)
        recorder.check_complete()
        assert recorder.phases[1][4] >= 2


def test_commit_verify_export_import_add_up(store, xfs):
    image = xfs / "disk.img"
    data = write_image(image, 160)   # more than two batches
    rec = Recorder()
    snap = store.commit(image, progress=rec)
    rec.check_complete()
    what, unit, total, _, advances = rec.phase("checksumming")
    assert (unit, total) == ("B", data) and advances >= 2

    # A second step: only what changed is read.
    with open(image, "r+b") as f:
        f.seek(4 * MIB)
        f.write(os.urandom(3 * MIB))
    rec = Recorder()
    child = store.commit(image, progress=rec)
    rec.check_complete()
    assert rec.phase("checksumming")[2] == 3 * MIB

    rec = Recorder()
    assert store.verify(progress=rec) == {}
    rec.check_complete()
    assert rec.phase("checking layers")[2] == data + 3 * MIB

    out = xfs / "child.bdx"
    rec = Recorder()
    result = store.export(child.id, out, progress=rec)
    rec.check_complete()
    assert rec.phase("writing the diff")[2] == result.data_bytes == data

    rec = Recorder()
    with Store.init(xfs / "other") as other:
        imported = other.import_(out, progress=rec)
    rec.check_complete()
    assert imported.ids == [child.id]
    assert rec.phase("checking the diff")[2] == data
    assert rec.phase("checksumming")[2] == data
    assert snap.id != child.id


def test_fork_and_compact_add_up(store, xfs):
    image = xfs / "disk.img"
    data = write_image(image, 64)
    snap = store.commit(image)
    rec = Recorder()
    store.compact(snap.id, progress=rec)
    rec.check_complete()
    assert rec.phase("copying")[2] == data
    assert rec.phase("checksumming")[2] == data
    # A layer whose file changed since its last whole check (here only its
    # times) is read whole by a fork; one vouched for is not read at all.
    store.restore(snap.id, xfs / "fork.img")
    layer = int(store.load_map(store.get(snap.id)).pieces.layer[0])
    os.utime(store.layer_path(layer))
    for name, checked in (("fork2.img", data), ("fork3.img", 0)):
        rec = Recorder()
        store.restore(snap.id, xfs / name, progress=rec)
        rec.check_complete()
        assert rec.phase("checking layers")[2] == checked


def test_steps_count_each_step_once():
    rec = Recorder()
    steps = Steps(rec, 3)
    for name in ("a", "b", "c"):
        steps.begin(name)
    steps.end()
    steps.end()
    assert [p[0] for p in rec.phases] == ["a (1/3)", "b (2/3)", "c (3/3)"]
    rec.check_complete()


def test_the_default_progress_takes_anything():
    NO_PROGRESS.start(10, "B", "nothing")
    NO_PROGRESS.advance(10)
    NO_PROGRESS.finish()


# ------------------------------------------------------------------- CLI


def _run(args, *, stderr_tty: bool):
    """Run the CLI; returns ``(status, stdout, what reached stderr)``, stderr a
    pseudo-terminal (120 columns) or a pipe."""
    cmd = [sys.executable, "-m", "blockdiff", *map(str, args)]
    env = dict(os.environ, TERM="xterm", COLUMNS="120")
    if not stderr_tty:
        proc = subprocess.run(cmd, capture_output=True, env=env, timeout=120)
        return proc.returncode, proc.stdout, proc.stderr
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=slave,
                                stdin=subprocess.DEVNULL, env=env)
        os.close(slave)
        drawn = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:   # EIO: the child closed its end
                break
            if not chunk:
                break
            drawn += chunk
        stdout = proc.stdout.read()
        proc.wait(timeout=120)
        proc.stdout.close()
    finally:
        os.close(master)
    return proc.returncode, stdout, drawn


@pytest.fixture
def cli_store(xfs):
    path = xfs / "store"
    Store.init(path).close()
    image = xfs / "disk.img"
    write_image(image, 96)
    return path, image


def test_a_bar_is_drawn_on_a_terminal(cli_store):
    path, image = cli_store
    status, stdout, drawn = _run(["commit", "--store", path, image], stderr_tty=True)
    assert status == 0, drawn
    text = drawn.decode(errors="replace")
    assert "commit: checksumming" in text
    assert "/101MB" in text     # the total, in bytes (96 MiB)
    assert len(stdout.decode().strip()) == 16   # the id, and only it, on stdout
    status, _, drawn = _run(["verify", "--store", path], stderr_tty=True)
    assert status == 0
    assert "verify: checking layers" in drawn.decode(errors="replace")


def test_nothing_on_stderr_when_piped_or_json(cli_store):
    path, image = cli_store
    status, stdout, err = _run(["commit", "--store", path, image], stderr_tty=False)
    assert status == 0 and err == b""
    snapshot = stdout.decode().strip()
    status, stdout, drawn = _run(["verify", "--store", path, "--json"], stderr_tty=True)
    assert status == 0 and drawn == b""
    assert json.loads(stdout) == {"consistent": True, "problems": {}}
    out = image.with_suffix(".bdx")
    status, stdout, drawn = _run(["export", "--store", path, snapshot, out, "--json"],
                                 stderr_tty=True)
    assert status == 0 and drawn == b""
    assert json.loads(stdout)["id"] == snapshot
    status, _, err = _run(["verify", "--store", path], stderr_tty=False)
    assert status == 0 and err == b""


# -------------------------------------------------------------------- VMs


def test_vm_create_start_and_fork_report_their_phases(xfs, vm_image):
    from blockdiff.vm.sandbox import Sandbox

    with Store.init(xfs / "store") as store:
        try:
            rec = Recorder()
            box = Sandbox.create(store, "box", image=vm_image.rootfs, progress=rec)
            rec.check_complete()
            assert rec.phase("checksumming")[2] > 0   # the root disk's first commit
            rec = Recorder()
            box.start(progress=rec)
            rec.check_complete()
            boot = f"booting: waiting for the guest daemon ({box.status().accel}) (2/2)"
            assert [p[0] for p in rec.phases] == ["starting QEMU (1/2)", boot]
            snapshot = box.checkpoint("one")
            rec = Recorder()
            box.fork(snapshot, "box2", progress=rec, disk_only=True)
            rec.check_complete()
            assert [p[0] for p in rec.phases] == ["checking layers", "starting QEMU (1/2)", boot]
            # From the checkpoint's memory: no boot to report; the disk's
            # layers checked as it is filled from them.
            box.standby.wait()
            for pair in box.standby.pairs:
                pair.disk.path.unlink()
            rec = Recorder()
            assert box.fork(snapshot, "box3", progress=rec).disk_source == ""
            rec.check_complete()
            assert [p[0] for p in rec.phases] == ["checking layers"]
            # From the disk spare, which is that checkpoint's disk already:
            # nothing to fill, nothing to check.
            box.standby.wait()
            rec = Recorder()
            assert box.fork(snapshot, "box4", progress=rec).disk_source == "spare"
            rec.check_complete()
            assert rec.phases == []
        finally:
            for sandbox in Sandbox.list(store):
                sandbox._kill()
