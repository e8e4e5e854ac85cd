"""Sandbox VMs: real QEMU guests (TCG where KVM does not work) on a real XFS store.

Every guest here boots the image ``blockdiff vm build-image`` makes; the image
is built once per machine into a cache directory. The checkpoints here hold
the disk alone; those that hold the whole VM are tests/test_vm_memory.py's. Every restore is checked
twice: inside the guest (the files are exactly those of the step) and on the
host (the disk is byte-identical to the snapshot, fork by fork).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from guests import IMAGE_CACHE

from blockdiff.errors import GuestTimeout, UnknownSnapshot, UnknownVM
from blockdiff.store.store import Store
from blockdiff.vm import qemu
from blockdiff.vm.image import build_image
from blockdiff.vm.machine import RUNTIME_FILES, Machine
from blockdiff.vm.registry import Registry
from blockdiff.vm.sandbox import Sandbox
from scenarios import assert_same_bytes

LISTING = "cd /work 2>/dev/null && find . -type f | sort | xargs -r md5sum"


def _cli(*args, env=None, check=False):
    done = subprocess.run([sys.executable, "-m", "blockdiff", *args], capture_output=True,
                          text=True, env=env, timeout=300)
    if check:
        assert done.returncode == 0, done.stderr
    return done


@pytest.fixture
def store(vm_store):
    return vm_store


@pytest.fixture
def box(store, vm_image):
    # Disk-only checkpoints: what this module tests. Whole-VM checkpoints
    # (the default) are tests/test_vm_memory.py's.
    with Sandbox.create(store, "box", image=vm_image.rootfs, memory=False) as sandbox:
        sandbox.start()
        yield sandbox


def listing(sandbox: Sandbox) -> str:
    result = sandbox.exec(LISTING)
    assert result.status == 0, result.stderr
    return result.stdout.decode()


def assert_disk_is(store: Store, sandbox: Sandbox, snapshot_id: str, scratch: Path) -> None:
    """The VM's disk, byte for byte, against a fresh fork of the snapshot."""
    fork = scratch / f"check-{snapshot_id}.img"
    store.restore(snapshot_id, fork)
    assert_same_bytes(sandbox.disk, fork)
    fork.unlink()


def step(sandbox: Sandbox, k: int) -> None:
    result = sandbox.exec(
        f"mkdir -p /work && echo step{k} > /work/f{k} && "
        f"dd if=/dev/urandom of=/work/data bs=64k count={k + 1} 2>/dev/null && "
        f"rm -f /work/f{k - 2}")
    assert result.status == 0, result.stderr


# ------------------------------------------------------------- the image


def test_image_build_is_cached_and_reproducible(vm_image, tmp_path):
    again = build_image(IMAGE_CACHE)
    assert again.cached and again.manifest == vm_image.manifest
    modules = vm_image.manifest["modules"]
    # Each module after what it depends on.
    assert modules.index("virtio.ko") < modules.index("virtio_pci.ko")
    assert modules.index("virtio_ring.ko") < modules.index("virtio_blk.ko")
    assert "virtio_console.ko" in modules


def test_rebuild_gives_identical_files(vm_image, xfs):
    other = build_image(xfs / "image", force=True)
    assert not other.cached
    assert other.manifest["sha256"] == vm_image.manifest["sha256"]


def test_initramfs_holds_guestd_init_and_modules(vm_image):
    import gzip

    data = gzip.decompress(vm_image.initrd.read_bytes())
    names, offset = [], 0
    while True:
        header = data[offset:offset + 110]
        assert header[:6] == b"070701"
        size, namesize = int(header[54:62], 16), int(header[94:102], 16)
        name = data[offset + 110:offset + 110 + namesize - 1].decode()
        if name == "TRAILER!!!":
            break
        names.append(name)
        offset += 110 + namesize
        offset += -offset % 4
        offset += size + (-size % 4)
    assert {"init", "bin/busybox", "sbin/blockdiff-guestd", "dev/console",
            "lib/modules/load-order"} <= set(names)
    assert {f"lib/modules/{m}" for m in vm_image.manifest["modules"]} <= set(names)


# ------------------------------------------------------- steps and restore


def test_steps_restore_exactly_in_the_guest_and_on_disk(store, box, xfs):
    ids, listings = [], []
    for k in range(5):
        step(box, k)
        listings.append(listing(box))
        ids.append(box.checkpoint(f"step {k}", {"step": str(k)}))
        assert box.last_checkpoint.paused < 5.0
        assert store.get(ids[-1]).meta["vm.flush"] == "fsfreeze"
    assert len(set(listings)) == 5
    # Taken under fsfreeze, a snapshot holds a clean ext4: no journal to replay.
    check = xfs / "frozen.img"
    store.restore(ids[4], check)
    header = subprocess.run(["dumpe2fs", "-h", str(check)], capture_output=True, text=True,
                            check=True).stdout
    assert "needs_recovery" not in header and "Filesystem state:         clean" in header
    check.unlink()

    for k in (1, 4, 0, 3):
        timing = box.restore(ids[k])
        assert not timing.rebooted, "the disk should be swapped under the running guest"
        assert listing(box) == listings[k]
    # Byte for byte on the host: a mounted disk is not byte-stable (the guest
    # writes mount times into the superblock), so compare a stopped VM's.
    box.stop()
    box.restore(ids[2])
    assert_disk_is(store, box, ids[2], xfs)
    box.start()
    assert listing(box) == listings[2]
    line = [s for s in store.log(ids[4])][::-1]
    assert [s.id for s in line[1:]] == ids
    assert line[0].message == "VM box created from rootfs.img" and line[0].parent is None


def test_restore_while_stopped_then_boot(store, box, xfs):
    step(box, 0)
    first = box.checkpoint("one")
    expected = listing(box)
    step(box, 1)
    box.checkpoint("two")
    box.stop()
    box.restore(first)
    assert not box.running
    assert_disk_is(store, box, first, xfs)
    box.start()
    assert listing(box) == expected


def test_restore_to_a_disk_of_another_size_reboots(store, box, vm_image, xfs):
    bigger = xfs / "bigger.img"
    shutil.copyfile(vm_image.rootfs, bigger)
    os.truncate(bigger, os.path.getsize(bigger) + (64 << 20))
    with Sandbox.create(store, "big", image=bigger, kernel=vm_image.directory,
                        memory=False) as big:
        big.start()
        step(big, 7)
        expected = listing(big)
        snapshot_id = big.checkpoint("big step")
    timing = box.restore(snapshot_id)
    assert timing.rebooted
    assert listing(box) == expected
    assert os.path.getsize(box.disk) == os.path.getsize(bigger)


def test_forks_diverge_independently(store, box, xfs):
    step(box, 0)
    base = box.checkpoint("base")
    base_listing = listing(box)
    left = box.fork(base, "left")
    right = box.fork(base, "right")
    try:
        assert listing(left) == listing(right) == base_listing
        assert left.exec("echo left > /work/side").status == 0
        assert right.exec("echo right > /work/side && rm /work/f0").status == 0
        box.exec("echo trunk > /work/trunk")
        assert left.exec("cat /work/side").stdout == b"left\n"
        assert right.exec("cat /work/side; ls /work").stdout == b"right\ndata\nside\n"
        assert box.exec("ls /work").stdout == b"data\nf0\ntrunk\n"
        left_id, right_id = left.checkpoint("left"), right.checkpoint("right")
        assert store.get(left_id).parent == store.get(right_id).parent == base
        right.restore(left_id)
        assert right.exec("cat /work/side").stdout == b"left\n"
        right.stop()
        right.restore(left_id)
        assert_disk_is(store, right, left_id, xfs)
    finally:
        left.destroy()
        right.destroy()


def test_a_machine_is_shut_down_softly_at_the_end_of_its_block(store, vm_image):
    """The QEMU process on its own, as a context manager: launched in the
    block, powered off by the guest daemon at its end (the disk unmounted, so
    its ext4 needs no recovery), its runtime files gone."""
    Sandbox.create(store, "m", image=vm_image.rootfs)
    vm = Registry(store).entry("m")
    with Machine(vm) as machine:
        machine.launch()
        assert machine.running and machine.accel in ("kvm", "tcg")
        with machine.guest() as link:
            assert link.ping().startswith("blockdiff-guestd")
    assert not machine.running
    assert not [f for f in RUNTIME_FILES if (vm.directory / f).exists()]
    header = subprocess.run(["dumpe2fs", "-h", str(vm.disk)], capture_output=True, text=True,
                            check=True).stdout
    assert "needs_recovery" not in header


# ------------------------------------------------------------- crashes


def test_qemu_killed_mid_step_leaves_a_good_store(store, box, xfs):
    step(box, 0)
    ids = [box.checkpoint("zero")]
    expected = listing(box)
    step(box, 1)
    ids.append(box.checkpoint("one"))
    # A step in progress: a writer in the background, then QEMU dies.
    box.exec("dd if=/dev/urandom of=/work/stream bs=4k count=100000 2>/dev/null &")
    time.sleep(0.5)
    os.kill(box.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while box.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not box.running
    assert store.verify() == {}
    # The crashed disk can itself be snapshotted (crash-consistent)...
    crashed = box.checkpoint("after the crash")
    assert "vm.flush" not in store.get(crashed).meta
    # ...and every earlier snapshot restores, inside the guest and on disk.
    box.restore(ids[0])
    assert_disk_is(store, box, ids[0], xfs)
    box.start()
    assert listing(box) == expected
    assert store.verify() == {}


def test_a_guest_that_does_not_answer_times_out_clearly(store, box):
    box.machine.pause()  # the guest no longer runs: its daemon cannot answer
    try:
        started = time.monotonic()
        with box.machine.guest() as link, pytest.raises(GuestTimeout, match="did not answer"):
            link.ping(timeout=1.0)
        assert time.monotonic() - started < 5
        box.guest_timeout = 1.0
        snapshot_id = box.checkpoint("mute guest")
        assert store.get(snapshot_id).meta["vm.flush"].startswith("none")
    finally:
        box.machine.resume()
    # The thaw queued behind the late freeze leaves the guest writable.
    result = box.exec("echo ok > /work-ok && cat /work-ok", timeout=30)
    assert result.stdout == b"ok\n"


def test_a_checkpoint_killed_midway_leaves_no_paused_or_frozen_vm(store, box):
    # A checkpointing process killed between the freeze and the thaw, the
    # VM paused: it leaves the guest frozen, the VM paused, its intent record.
    env = dict(os.environ, BLOCKDIFF_STORE=str(store.root),
               BLOCKDIFF_VM_CRASH_AT="checkpoint.paused")
    done = _cli("vm", "snapshot", "box", "-m", "killed", env=env)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert (box.directory / "intent.json").exists()
    assert box.status().state == "checkpoint interrupted" and box.status().qemu == "paused"
    result = box.exec("echo ok > /after && cat /after", timeout=30)
    assert result.stdout == b"ok\n"
    assert not (box.directory / "intent.json").exists()
    assert box.status().state == "running"
    box.checkpoint("after recovery")
    assert box.last_checkpoint.paused < 5.0


def test_a_guest_that_never_boots_reports_its_console(store, vm_image, xfs):
    blank = xfs / "blank.img"
    with open(blank, "wb") as f:
        f.truncate(64 << 20)  # no filesystem on it
    with Sandbox.create(store, "blank", image=blank, kernel=vm_image.directory) as sandbox:
        with pytest.raises(qemu.VMError, match="cannot mount /dev/vda"):
            sandbox.start(timeout=60)
        assert not sandbox.running


# ------------------------------------------------------------ commands


def test_exec_status_output_stdin_and_timeouts(box):
    r = box.exec("echo out; echo err >&2; exit 7")
    assert (r.status, r.stdout, r.stderr) == (7, b"out\n", b"err\n")
    assert box.exec(["cat"], input=b"x" * 300_000).stdout == b"x" * 300_000
    assert box.exec(["pwd"], cwd="/etc").stdout == b"/etc\n"
    assert box.exec(["no-such-command"]).status == 127
    assert box.exec("kill -TERM $$").status == 128 + signal.SIGTERM
    big = box.exec("head -c 5000000 /dev/zero")
    assert big.stdout == b"\0" * 5_000_000
    # A background process holding the output open does not hold the reply.
    started = time.monotonic()
    assert box.exec("sleep 30 & echo started").stdout == b"started\n"
    assert time.monotonic() - started < 10
    killed = box.exec("sleep 30", timeout=0.5)
    assert killed.timed_out and killed.status == 128 + signal.SIGKILL


def test_commands_run_in_the_disk_not_the_initramfs(box):
    # The disk's /etc/hostname comes from the image; the initramfs has none.
    assert box.exec(["cat", "/etc/hostname"]).stdout == b"sandbox\n"
    assert box.exec("mount | grep ' / '").status == 0


# ------------------------------------------------------------------ CLI


def test_cli_lifecycle_outlives_each_command(store, vm_image, xfs):
    env = dict(os.environ, BLOCKDIFF_STORE=str(store.root))
    _cli("vm", "create", "cli", "--image", str(vm_image.rootfs), env=env, check=True)
    _cli("vm", "start", "cli", env=env, check=True)
    # The VM keeps running after the starting process exited.
    done = _cli("vm", "exec", "cli", "--", "sh", "-c", "echo one > /f; echo to-err >&2; exit 3",
                env=env)
    assert (done.returncode, done.stdout, done.stderr) == (3, "", "to-err\n")
    first = _cli("vm", "snapshot", "cli", "-m", "one", env=env, check=True).stdout
    first_id = first.strip().splitlines()[-1]
    assert "paused" in first
    _cli("vm", "exec", "cli", "--", "sh", "-c", "echo two > /f", env=env, check=True)
    _cli("vm", "snapshot", "cli", env=env, check=True)
    restored = _cli("vm", "restore", "cli", first_id, env=env, check=True)
    assert "running" in restored.stdout
    assert _cli("vm", "exec", "cli", "--", "cat", "/f", env=env).stdout == "one\n"
    # The restore's process left the VM's spares at "one" as it exited.
    forked = json.loads(_cli("vm", "fork", "cli", first_id, "cli2", "--no-start", "--json",
                             env=env, check=True).stdout)
    assert (forked["memory_from"], forked["disk_from"]) == ("spare", "spare")
    ls = _cli("vm", "ls", env=env, check=True).stdout
    assert "cli " in ls and "running" in ls and "cli2" in ls and "stopped" in ls
    timeout = _cli("vm", "exec", "cli", "--timeout", "0.5", "--", "sleep", "10", env=env)
    assert timeout.returncode == 124 and "killed after 0.5 s" in timeout.stderr
    piped = subprocess.run([sys.executable, "-m", "blockdiff", "vm", "exec", "cli", "-i", "--",
                            "wc", "-c"], input=b"12345", capture_output=True, env=env)
    assert piped.stdout.strip() == b"5"
    _cli("vm", "stop", "cli", env=env, check=True)
    _cli("vm", "rm", "cli2", env=env, check=True)
    assert "cli2" not in _cli("vm", "ls", env=env).stdout


def _error_line(done, code):
    assert done.returncode == code, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("blockdiff: error: "), done.stderr
    return lines[0]


def test_cli_bad_input(store, vm_image, xfs, tmp_path):
    env = dict(os.environ, BLOCKDIFF_STORE=str(store.root))
    assert "no VM named nope" in _error_line(_cli("vm", "exec", "nope", "--", "ls", env=env), 9)
    assert "bad VM name" in _error_line(
        _cli("vm", "create", "../x", "--image", str(vm_image.rootfs), env=env), 2)
    lone = xfs / "lone.img"
    lone.write_bytes(b"\0" * 4096)
    assert "no kernel" in _error_line(_cli("vm", "create", "k", "--image", str(lone), env=env), 2)
    assert "exactly one" in _error_line(_cli("vm", "create", "k", env=env), 2)
    # A snapshot of another store.
    with Store.init(xfs / "other") as other:
        foreign = other.commit(lone).id
    _cli("vm", "create", "k", "--image", str(vm_image.rootfs), env=env, check=True)
    line = _error_line(_cli("vm", "restore", "k", foreign, env=env), 6)
    assert foreign in line
    assert "no snapshot" in line or "unknown" in line
    assert "already exists" in _error_line(
        _cli("vm", "create", "k", "--image", str(vm_image.rootfs), env=env), 9)
    assert "not running" in _error_line(_cli("vm", "exec", "k", "--", "ls", env=env), 9)
    # QEMU missing from PATH.
    bare = dict(env, PATH=str(tmp_path))
    line = _error_line(subprocess.run(
        [sys.executable, "-m", "blockdiff", "vm", "start", "k"], capture_output=True, text=True,
        env=bare), 9)
    assert "qemu-system-x86_64 is not installed" in line
    # The VM's kernel gone from the store.
    shutil.rmtree(store.root / "vms" / ".kernels")
    assert "kernel" in _error_line(_cli("vm", "start", "k", env=env), 9)


def test_api_errors(store, vm_image):
    with pytest.raises(UnknownVM):
        Sandbox(store, "ghost")
    with pytest.raises(UnknownSnapshot):
        Sandbox.create(store, "x", snapshot="0123456789abcdef", kernel=vm_image.directory)
    assert not (store.root / "vms" / "x").exists()
    with Sandbox.create(store, "eph", image=vm_image.rootfs, ephemeral=True):
        pass
    assert not (store.root / "vms" / "eph").exists()
    with Sandbox.create(store, "stopped", image=vm_image.rootfs) as sandbox:
        with pytest.raises(qemu.VMError, match="not running"):
            sandbox.exec("true")


# -------------------------------------------------------------- the probe


def test_kvm_probe_answers_in_bounded_time(vm_image, monkeypatch, tmp_path):
    started = time.monotonic()
    works, why = qemu.probe_kvm(vm_image.kernel, vm_image.initrd)
    assert time.monotonic() - started < qemu.PROBE_TIMEOUT + 10
    assert why
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv(qemu.ACCEL_ENV, "tcg")
    assert qemu.choose_accel(vm_image.kernel, vm_image.initrd)[0] == "tcg"
    monkeypatch.setenv(qemu.ACCEL_ENV, "warp")
    with pytest.raises(qemu.VMError, match="kvm or tcg"):
        qemu.choose_accel(vm_image.kernel, vm_image.initrd)



def test_a_kernel_of_your_own(store, vm_image, xfs):
    """A kernel given as a bzImage and its modules directory, not a package."""
    unpacked = xfs / "kernel"
    deb = next((IMAGE_CACHE / ".debs").glob("linux-image-*.deb"))
    subprocess.run(["dpkg-deb", "-x", str(deb), str(unpacked)], check=True)
    bzimage = next((unpacked / "boot").glob("vmlinuz-*"))
    modules = next((unpacked / "lib" / "modules").glob("*"))
    built = _cli("vm", "build-image", str(xfs / "own"), "--kernel-image", str(bzimage),
                 "--modules", str(modules), "--disk-size", "64", check=True)
    assert "built" in built.stdout
    again = _cli("vm", "build-image", str(xfs / "own"), "--kernel-image", str(bzimage),
                 "--modules", str(modules), "--disk-size", "64", check=True)
    assert "up to date" in again.stdout
    with Sandbox.create(store, "own", image=vm_image.rootfs, kernel=xfs / "own") as sandbox:
        sandbox.start()
        assert sandbox.exec("uname -r").stdout.decode().strip() == modules.name


def test_build_image_bad_input(xfs):
    line = _error_line(_cli("vm", "build-image", str(xfs / "x"), "--modules", str(xfs)), 8)
    assert "--kernel-image" in line
    line = _error_line(_cli("vm", "build-image", str(xfs / "x"), "--kernel-package",
                            "linux-image-no-such-kernel"), 8)
    assert "linux-image-no-such-kernel" in line
    assert not (xfs / "x" / "manifest.json").exists()


def test_agent_checkpoints_tie_state_to_the_vm_disk(store, box):
    """An agent thread whose sandbox is the VM: rewinding it puts the guest's
    files back (without a reboot), forking it makes a second VM."""
    from blockdiff.agent.agent import Agent, AgentDB, fork_thread

    with Agent(store, "run", disk=box) as agent:
        for k in range(3):
            with agent.step(f"write {k}"):
                assert box.exec(f"mkdir -p /work && echo {k} > /work/n{k}").status == 0
                agent.state["written"] = k + 1
        history = agent.history()
        assert len({c.disk_snapshot for c in history}) == 4  # start + three steps
        after_first = history[2]
        agent.rewind(after_first.id)
        assert box.exec("ls /work").stdout == b"n0\n"
        assert agent.state == {"written": 1}
        assert box.running and not box.last_restore.rebooted
    head = fork_thread(store, "run", history[1].id, "run2")
    with AgentDB(store) as db:
        assert db.thread("run2").disk == "vm:run2" and db.thread("run2").head == head
    forked = Sandbox(store, "run2")
    try:
        forked.start()
        assert forked.exec("ls /work").stdout == b"n0\nn1\n"
    finally:
        forked.destroy()


def test_an_unchanged_running_vm_is_not_snapshotted_again(store, box):
    first = box.checkpoint("one", skip_unchanged=True)
    nodes = len(store.log())
    assert box.checkpoint("same", skip_unchanged=True) == first
    # Written but still only in the guest's page cache: the check flushes it.
    box.exec("echo x > /new-file")
    second = box.checkpoint("changed", skip_unchanged=True)
    assert second != first and len(store.log()) == nodes + 1
    box.exec("sync")
    assert box.checkpoint("same again", skip_unchanged=True) == second
    box.stop()
    box.restore(second)
    box.start()
    assert box.exec("cat /new-file").stdout == b"x\n"


def test_dirty_tracking_snapshots_and_restores_exactly(store, box, xfs, monkeypatch):
    """With QEMU's dirty bitmap a checkpoint maps only what the guest wrote and
    a restore rewrites only that plus what differs between the snapshots. The
    disk is copied (reflinked) as the store captures it in each checkpoint and
    after each restore, before the guest writes again, and compared byte for
    byte with a fork of the snapshot."""
    captured = []
    real_capturing, real_restore = store.capturing, store.restore

    def capture(snapshot_id):
        copy = xfs / f"captured-{len(captured)}.img"
        subprocess.run(["cp", "--reflink=always", str(box.disk), str(copy)], check=True)
        captured.append((snapshot_id, copy))

    @contextlib.contextmanager
    def capturing(image, **kw):
        # A checkpoint's commit: the disk as captured, copied before the
        # guest can write again, is what its snapshot must hold.
        with real_capturing(image, **kw) as taken:
            copy = xfs / f"capturing-{len(captured)}.img"
            if Path(image) == box.disk:
                subprocess.run(["cp", "--reflink=always", str(box.disk), str(copy)], check=True)
            real_finish = taken.finish

            def finish(**kw):
                snap = real_finish(**kw)
                if Path(image) == box.disk:
                    captured.append((snap.id, copy))
                return snap

            taken.finish = finish
            yield taken

    def restore(snapshot_id, image, **kw):
        result = real_restore(snapshot_id, image, **kw)
        if Path(image) == box.disk:
            capture(snapshot_id)
        return result

    monkeypatch.setattr(store, "capturing", capturing)
    monkeypatch.setattr(store, "restore", restore)
    ids, listings = [], []
    for k in range(4):
        step(box, k)
        if k == 2:   # freed blocks discarded: holes in the image, dirty in the bitmap
            box.exec("rm -f /work/data && sync && fstrim / 2>/dev/null; true")
        listings.append(listing(box))
        ids.append(box.checkpoint(f"step {k}"))
        # The first checkpoint after a boot maps the whole disk: the bitmap
        # does not know what was written before it was made.
        assert box.last_checkpoint.tracked == (k > 0)
    for k in (1, 3, 0, 2):
        timing = box.restore(ids[k])
        assert timing.tracked and not timing.rebooted
        assert listing(box) == listings[k]
    # Old generations' bitmaps go: the current one and at most one that QEMU
    # had not let go of yet.
    with box.machine.qmp() as q:
        bitmaps = [b["name"] for n in q.command("query-named-block-nodes", flat=True)
                   for b in n.get("dirty-bitmaps", []) if n.get("node-name") == qemu.DISK_NODE]
    assert 1 <= len(bitmaps) <= 2, bitmaps
    box.stop()
    box.start()
    step(box, 9)
    box.checkpoint("after a reboot")
    assert not box.last_checkpoint.tracked
    for snapshot_id, copy in captured:
        fork = xfs / f"check-{snapshot_id}.img"
        store.restore(snapshot_id, fork)
        assert_same_bytes(copy, fork)
        fork.unlink()
    assert len(captured) == 4 + 4 + 1
    assert store.verify() == {}


def test_a_checkpoint_dying_after_the_bitmap_swap_is_not_trusted(store, box, monkeypatch):
    """Writes after such a death are only in the new bitmap, which no record
    names: the next checkpoint must map the whole disk, not read the old one."""
    from blockdiff.vm import machine as machine_module

    box.exec("echo a > /a")
    box.checkpoint("one")
    box.exec("echo b > /b")
    box.checkpoint("two")
    assert box.last_checkpoint.tracked
    real = machine_module.replace_dirty_bitmap

    def swaps_then_dies(q, bitmap):
        real(q, bitmap)
        raise KeyboardInterrupt("killed after the swap")

    monkeypatch.setattr(machine_module, "replace_dirty_bitmap", swaps_then_dies)
    box.exec("echo c > /c")
    with pytest.raises(KeyboardInterrupt):
        box.checkpoint("dies")
    monkeypatch.undo()
    box.exec("echo d > /d && sync")
    after = box.checkpoint("after")
    assert not box.last_checkpoint.tracked
    box.exec("echo e > /e")
    box.checkpoint("tracked again")
    assert box.last_checkpoint.tracked
    box.exec("rm /c /d /e")
    box.restore(after)
    assert box.exec("cat /a /b /c /d").stdout == b"a\nb\nc\nd\n"
    assert box.exec("test -e /e").status == 1


def test_a_console_message_reads_only_the_end_of_a_flooded_log(tmp_path):
    """The guest writes its console log: a launch failure quotes its last
    lines, reading only its end, whatever the guest wrote before."""
    from blockdiff.vm.machine import CONSOLE_TAIL, console_tail
    assert console_tail(tmp_path) == "no console output"
    with open(tmp_path / "console.log", "wb") as f:
        f.write(b"x" * (8 << 20) + b"\n" + b"y" * (2 * CONSOLE_TAIL) + b"\nmount failed\n\nend\n")
    tail = console_tail(tmp_path)
    assert tail.endswith("mount failed | end") and len(tail) < 1000
