"""Whole-VM checkpoints: real QEMU guests (TCG where KVM does not work) whose
checkpoints hold RAM and device state with the disk, on a real XFS store.

Each test checks inside the guest what a restore or a fork must bring back:
the same processes (their pids), their memory (a counter that runs on from
its checkpoint value, a payload in tmpfs whose hash is unchanged), a server
that still answers, a clock that is right and a random-number generator
that two forks do not share.
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import stat
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from guests import COUNTER, alive, counter, payload_hash, run, running_step

import filesystems
from blockdiff.errors import Damaged, NoSpace, VMError
from blockdiff.store.retention import Policy
from blockdiff.store.store import Store
from blockdiff.vm import device_state, procs, qemu, reserve
from blockdiff.vm import machine as machine_module
from blockdiff.vm.integrity import verify_vms
from blockdiff.vm.sandbox import MEMORY_KEY, Sandbox

MiB = 1 << 20


@pytest.fixture
def store(vm_store):
    return vm_store


@pytest.fixture
def box(memory_box):
    return memory_box


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def runs_qemu_of(pid: int, name: str) -> bool:
    """Whether process ``pid`` is the QEMU of VM ``name``."""
    return f"blockdiff-{name}".encode() in _cmdline(pid)


def test_processes_and_their_memory_survive_restore_and_fork(store, box):
    pid, digest = running_step(box)
    checkpoint = box.checkpoint("running")
    assert box.last_checkpoint.memory
    memory_id = store.get(checkpoint).meta[MEMORY_KEY]
    assert store.get(memory_id).meta["vm.part"] == "memory"
    at_checkpoint = counter(box)
    # The step after: the process killed, the payload and a file gone.
    run(box, f"kill {pid}; rm /mnt/ram/payload; echo later > /later")
    assert not alive(box, pid)
    box.checkpoint("after")

    timing = box.restore(checkpoint)
    assert timing.memory and not timing.rebooted
    assert alive(box, pid)
    assert payload_hash(box) == digest
    assert box.exec("test -e /later").status == 1
    # The counter runs on from where it was when the checkpoint was taken.
    first = counter(box)
    assert at_checkpoint - 2 <= first < at_checkpoint + 20
    time.sleep(1.0)
    assert counter(box) > first

    fork = box.fork(checkpoint, "fork")
    try:
        assert fork.running and fork.last_restore is None
        assert alive(fork, pid) and payload_hash(fork) == digest
        # Its guest RAM is its owner's alone, as the VM's own.
        assert stat.S_IMODE(os.stat(fork.machine.memory_image).st_mode) == 0o600
        # Forks diverge: what one does the other does not see.
        run(fork, f"kill {pid}; echo fork > /side")
        run(box, "echo trunk > /side")
        assert run(fork, "cat /side") == "fork\n" and not alive(fork, pid)
        assert run(box, "cat /side") == "trunk\n" and alive(box, pid)
        forked = fork.checkpoint("in the fork")
        assert MEMORY_KEY in store.get(forked).meta
    finally:
        fork.destroy()
    assert store.verify() == {}


def test_restores_start_from_the_standby_and_bring_back_each_checkpoint(store, box):
    pid, digest = running_step(box)
    first = box.checkpoint("first")
    run(box, f"kill {pid}; rm /mnt/ram/payload; echo later > /later")
    second = box.checkpoint("second")
    # Prepared at "second" while the guest ran; the restore takes it.
    timing = box.restore(first)
    assert timing.memory and timing.standby
    assert alive(box, pid) and payload_hash(box) == digest
    assert box.exec("test -e /later").status == 1
    # The image the dead guest left is the standby now, prepared again at
    # "first" while the guest runs, and taken by restores in a row.
    timing = box.restore(second)
    assert timing.standby and not alive(box, pid) and run(box, "cat /later") == "later\n"
    timing = box.restore(first)
    assert timing.standby and alive(box, pid) and payload_hash(box) == digest
    box.standby.wait()
    assert box.standby.failure is None
    assert not [p.name for p in box.directory.iterdir() if p.name.startswith(".memory")]
    # A fork takes the spares (a copy of the standby at "first", the disk
    # at "first"), brought to "second"; the standby stays, clean at "first".
    fork = box.fork(second, "fork")
    try:
        assert (fork.memory_source, fork.disk_source) == ("spare", "spare")
        assert not alive(fork, pid) and run(fork, "cat /later") == "later\n"
        assert stat.S_IMODE(os.stat(fork.machine.memory_image).st_mode) == 0o600
        assert store.lineage(box.standby.path) == (store.get(first).meta[MEMORY_KEY], "clean")
        assert alive(box, pid) and payload_hash(box) == digest
        # The next fork, at once: the spares are being made anew, so it
        # copies the standby or fills from the layers; the same either way.
        again = box.fork(first, "again")
        try:
            assert again.memory_source in ("spare", "standby copy", "")
            assert alive(again, pid) and payload_hash(again) == digest
            assert again.exec("test -e /later").status == 1
        finally:
            again.destroy()
    finally:
        fork.destroy()
    box.standby.wait()
    assert box.standby.failure is None and box.standby.spares_failure is None
    spares = [spare for pair in box.standby.pairs for spare in (pair.memory, pair.disk)]
    assert all(store.lineage(spare.path)[1] == "clean" for spare in spares)
    assert store.verify() == {}


def qemus_of(store: Store, name: str) -> set[int]:
    """The pids of every QEMU of VM ``name`` of ``store`` (or started ahead
    by it): its files are under the store's directory, so another store's
    "box" (a suite running beside this one) is not counted."""
    root = str(store.root).encode()
    return {int(pid) for pid in os.listdir("/proc")
            if pid.isdigit() and runs_qemu_of(int(pid), name) and root in _cmdline(int(pid))}



def waiting(sandbox: Sandbox, kind: str = machine_module.WAITING) -> set[int]:
    """The pids of the QEMUs of one kind waiting in the VM's directory."""
    return {int(p.read_text()) for p in sandbox.directory.glob(f"{kind}*.qemu.pid")}


def test_a_qemu_waits_for_the_next_restore_which_takes_it_over(store, box):
    # Each checkpoint's name is also in guest RAM only (a tmpfs), so a
    # restore that resumed another checkpoint's memory cannot pass.
    def in_ram() -> str:
        return run(box, "cat /mnt/ram/step")

    pid, digest = running_step(box)
    run(box, "echo first > /mnt/ram/step")
    first = box.checkpoint("first")
    run(box, f"kill {pid}; echo later > /later; echo second > /mnt/ram/step")
    second = box.checkpoint("second")
    box.standby.wait_standby()
    # Beside the VM's QEMU, one waits on the standby, paused, for a restore.
    assert box.standby.failure is None
    ready = waiting(box)
    assert len(ready) == 1 and ready <= qemus_of(store, "box")
    timing = box.restore(first)
    assert timing.memory and timing.standby and timing.prestarted
    assert box.pid in ready and box.machine.memory_backed
    assert alive(box, pid) and payload_hash(box) == digest and in_ram() == "first\n"
    assert box.exec("test -e /later").status == 1
    # Another waits, on the image the dead guest left, prepared at "first";
    # a checkpoint keeps it, and the next restore takes it.
    box.standby.wait_standby()
    ready = waiting(box)
    assert len(ready) == 1
    run(box, "echo third > /mnt/ram/step")
    third = box.checkpoint("third")
    box.standby.wait_standby()
    assert waiting(box) == ready
    timing = box.restore(second)
    assert timing.prestarted and box.pid in ready and in_ram() == "second\n"
    assert not alive(box, pid) and run(box, "cat /later") == "later\n"
    # One waiting on a file that is no longer the standby is not taken
    # over, but killed.
    box.standby.wait_standby()
    stale = waiting(box)
    os.unlink(box.standby.path)
    timing = box.restore(third)
    assert not timing.standby and not timing.prestarted
    assert alive(box, pid) and payload_hash(box) == digest and in_ram() == "third\n"
    assert not stale & qemus_of(store, "box")
    # Stopping the VM stops every QEMU of it, and leaves none of their files.
    box.standby.wait()
    assert len(qemus_of(store, "box")) >= 2
    box.stop()
    assert not qemus_of(store, "box")
    assert not [p.name for p in box.directory.iterdir() if p.name.startswith("waiting")]
    assert store.verify() == {}


def test_forks_take_over_the_qemu_waiting_on_the_spares(store, box):
    pid, digest = running_step(box)
    checkpoint = box.checkpoint("one")
    box.standby.wait()
    # One waits on each pair of spares.
    ready = waiting(box, machine_module.WAITING_FORK)
    assert len(ready) == 2 and ready <= qemus_of(store, "box")
    fork = box.fork(checkpoint, "fork")
    try:
        assert fork.memory_source == fork.disk_source == "spare" and fork.machine.took_waiting
        assert fork.pid in ready and fork.machine.memory_backed
        # What QEMU and the whole host ran while the guest answered (ticks
        # of 10 ms: the host's count may lag QEMU's by one).
        launch = fork.machine.last_launch
        assert 0 <= launch["guest-qemu-cpu"] <= launch["guest-host-cpu"] + 0.011
        assert launch["guest-major-faults"] >= 0
        assert alive(fork, pid) and payload_hash(fork) == digest
        # The next fork, at once, takes a pair and the QEMU waiting on it:
        # the other pair, or the one the first took, if already made anew.
        other = box.fork(checkpoint, "other")
        assert other.memory_source == other.disk_source == "spare"
        assert other.machine.took_waiting and other.pid != fork.pid
        assert alive(other, pid) and payload_hash(other) == digest
        run(other, f"kill {pid}")
        assert alive(fork, pid) and alive(box, pid)
        assert MEMORY_KEY in store.get(other.checkpoint("in a fork")).meta
        taken = {fork.pid, other.pid}
        other.destroy()
        assert other.pid is None and not taken - {fork.pid} & qemus_of(store, "box")
        # Both pairs made anew, with a QEMU on each.
        box.standby.wait()
        again = waiting(box, machine_module.WAITING_FORK)
        assert len(again) == 2 and not again & taken
        # A fork left stopped keeps no QEMU: it resumes when started.
        stopped = box.fork(checkpoint, "stopped", start=False)
        assert stopped.memory_source == stopped.disk_source == "spare"
        assert not qemus_of(store, "stopped") and len(again & qemus_of(store, "box")) == 1
        assert not [p.name for p in stopped.directory.iterdir() if p.name.startswith("waiting")]
        stopped.start()
        assert alive(stopped, pid) and payload_hash(stopped) == digest
        stopped.destroy()
    finally:
        fork.destroy()
    box.standby.wait()
    box.stop()
    assert not qemus_of(store, "box")
    assert store.verify() == {}


def test_two_processes_forking_one_vm_at_once_each_get_a_whole_fork(store, box):
    pid, digest = running_step(box)
    checkpoint = box.checkpoint("one")
    box.standby.wait()
    env = dict(os.environ, BLOCKDIFF_STORE=str(store.root))
    # Each takes a pair of spares, or copies the standby, or fills from the
    # layers, whichever it finds first: never a file the other took.
    forking = [subprocess.Popen([sys.executable, "-m", "blockdiff", "vm", "fork", "box",
                                 checkpoint, name, "--json"], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
               for name in ("left", "right")]
    done = [process.communicate(timeout=300) for process in forking]
    forks = [Sandbox(store, name) for name in ("left", "right")]
    try:
        assert [process.returncode for process in forking] == [0, 0], done
        results = [json.loads(out) for out, _ in done]
        assert all(result["memory"] and result["running"] for result in results)
        assert len({fork.pid for fork in forks} | {box.pid}) == 3
        images = {os.stat(fork.machine.memory_image).st_ino for fork in forks}
        disks = {os.stat(fork.disk).st_ino for fork in forks}
        assert len(images) == len(disks) == 2
        for fork in forks:
            assert alive(fork, pid) and payload_hash(fork) == digest
        run(forks[0], f"kill {pid}")
        assert alive(forks[1], pid) and alive(box, pid)
    finally:
        for fork in forks:
            fork.destroy()
    # Both processes left the spares they took made anew, clean.
    for pair in box.standby.pairs:
        for spare in (pair.memory, pair.disk):
            assert store.lineage(spare.path) == (store.lineage(spare.path)[0], "clean")
            assert store.lineage(spare.path)[0] is not None
    assert store.verify() == {}


def test_a_waiting_qemu_leaves_the_memory_image_it_maps_as_it_was(store, box):
    # What lets a QEMU wait on the standby: until a device state is loaded,
    # it neither reads nor writes guest RAM (its file stays clean).
    box.standby.wait_standby()
    box.machine.kill_waiting()
    image = box.directory / "ram-of-nobody.img"
    content = os.urandom(box.machine.ram_bytes + machine_module.DEVICE_STATE_AREA)
    image.write_bytes(content)
    box.machine.start_waiting(image)
    (ready,) = waiting(box)
    time.sleep(1.0)
    assert procs.holds(ready, image, box.disk)
    assert image.read_bytes() == content
    box.machine.kill_waiting()
    assert qemus_of(store, "box") == {box.pid} and image.read_bytes() == content


def test_two_forks_of_one_checkpoint_read_different_random_bytes(store, box):
    run(box, "true")
    checkpoint = box.checkpoint("base")
    left = box.fork(checkpoint, "left")
    right = box.fork(checkpoint, "right")
    try:
        reads = [run(vm, "head -c 32 /dev/urandom | od -An -tx1") for vm in (left, right, box)]
        assert len(set(reads)) == 3, reads
    finally:
        left.destroy()
        right.destroy()


def test_the_guest_clock_is_right_after_a_restore(store, box):
    run(box, "true")
    checkpoint = box.checkpoint("then")
    time.sleep(3.0)
    box.restore(checkpoint)
    guest = int(run(box, "date +%s"))
    assert abs(guest - time.time()) < 2.0


def test_a_server_started_in_a_step_answers_after_a_restore(store, box):
    run(box, "ifconfig lo 127.0.0.1 up && mkdir -p /www && echo hello > /www/index.html && "
             "httpd -p 127.0.0.1:8080 -h /www")
    assert run(box, "wget -qO- http://127.0.0.1:8080/") == "hello\n"
    serving = box.checkpoint("server up")
    run(box, "killall httpd; rm -r /www")
    assert box.exec("wget -qO- http://127.0.0.1:8080/").status != 0
    box.checkpoint("server gone")
    box.restore(serving)
    assert run(box, "wget -qO- http://127.0.0.1:8080/") == "hello\n"


def test_a_qemu_killed_during_a_memory_checkpoint_leaves_the_last_one_restorable(
        store, box, monkeypatch):
    pid, digest = running_step(box)
    good = box.checkpoint("good")
    nodes = len(store.log())
    run(box, "echo doomed > /doomed")
    real = device_state.wait_for_migration

    def dies_while_saving(q, timeout, what):
        os.kill(box.pid, signal.SIGKILL)
        return real(q, timeout, what)

    monkeypatch.setattr(device_state, "wait_for_migration", dies_while_saving)
    with pytest.raises(VMError):
        box.checkpoint("killed")
    monkeypatch.undo()
    deadline = time.monotonic() + 10
    while box.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not box.running
    assert len(store.log()) == nodes and store.verify() == {}
    box.restore(good)
    assert box.running and alive(box, pid) and payload_hash(box) == digest
    assert box.exec("test -e /doomed").status == 1


def test_a_disk_written_after_the_pause_is_captured_again_in_one(store, box, monkeypatch):
    # The disk of a whole-VM checkpoint is captured after its pause, the
    # guest frozen. Should QEMU count a write to it meanwhile, disk and
    # memory are captured again, the disk within the pause.
    pid, digest = running_step(box)
    run(box, "echo one > /one")
    pauses, counts = [], []
    real_paused, real_writes = box.machine.paused, box.machine.disk_writes

    def paused(mark, **kw):
        pauses.append(kw.get("read_later", False))
        return real_paused(mark, **kw)

    def writes():   # the count read after the first pause is one more
        counts.append(real_writes())
        return counts[-1] + (1 if len(counts) == 2 else 0)

    monkeypatch.setattr(box.machine, "paused", paused)
    monkeypatch.setattr(box.machine, "disk_writes", writes)
    checkpoint = box.checkpoint("again")
    monkeypatch.undo()
    assert pauses == [True, False] and box.last_checkpoint.memory
    assert len([s for s in store.log() if s.message.startswith("memory: again")]) == 1
    assert store.verify() == {} and list((store.root / "staging").iterdir()) == []
    run(box, "rm /one && echo later > /later")
    box.restore(checkpoint)
    assert alive(box, pid) and payload_hash(box) == digest
    assert run(box, "cat /one") == "one\n" and box.exec("test -e /later").status == 1


def test_a_guest_using_its_disk_before_it_is_restored_is_restored_again(
        store, box, monkeypatch):
    # An in-place restore puts the disk in place while QEMU loads the device
    # state and starts the guest's CPUs: the guest, frozen since the
    # checkpoint, uses its disk only once resumed. Should QEMU count a
    # request on it before the disk is in place, that QEMU is killed and
    # both images are restored first (the disk mapped whole).
    pid, digest = running_step(box)
    run(box, "echo one > /one")
    checkpoint = box.checkpoint("one")
    run(box, "echo two > /one && echo later > /later")
    seen = []
    real = machine_module.Machine._disk_stats

    def stats(self):
        counts = real(self)
        seen.append(dict(counts))
        if len(seen) == 1:
            counts["rd_operations"] = counts.get("rd_operations", 0) + 1
        return counts

    monkeypatch.setattr(machine_module.Machine, "_disk_stats", stats)
    timing = box.restore(checkpoint)
    monkeypatch.undo()
    assert timing.memory and len(seen) == 1   # the second launch restored first
    assert alive(box, pid) and payload_hash(box) == digest
    assert run(box, "cat /one") == "one\n" and box.exec("test -e /later").status == 1
    assert store.verify() == {}


def test_a_restore_failing_while_qemu_starts_leaves_no_qemu(store, box, monkeypatch):
    # QEMU starts while the disk and the memory image are restored in place;
    # should the memory image's restore fail once QEMU runs, that QEMU is
    # killed, and the checkpoint restores afterwards.
    pid, digest = running_step(box)
    checkpoint = box.checkpoint("good")
    run(box, "echo later > /later")
    box.standby.wait()
    box.standby.path.unlink()       # so that the memory image is restored in place
    real_restore, started = store.restore, []

    def failing(snapshot_id, image, **kw):
        if Path(image) == box.machine.memory_image:
            deadline = time.monotonic() + 30
            while box.machine.pid is None and time.monotonic() < deadline:
                time.sleep(0.01)
            started.append(box.machine.pid)
            raise Damaged("a layer of the memory snapshot fails its checksums (injected)")
        return real_restore(snapshot_id, image, **kw)

    monkeypatch.setattr(store, "restore", failing)
    with pytest.raises(Damaged, match="injected"):
        box.restore(checkpoint)
    monkeypatch.undo()
    assert started and started[0] is not None   # QEMU had started meanwhile
    assert not box.running and not runs_qemu_of(started[0], "box")
    box.restore(checkpoint)
    assert alive(box, pid) and payload_hash(box) == digest
    assert box.exec("test -e /later").status == 1


def test_a_checkpoint_of_another_machine_is_refused_with_what_to_do(
        store, box, vm_image, monkeypatch):
    run(box, "echo one > /one")
    checkpoint = box.checkpoint("one")
    with Sandbox.create(store, "small", image=vm_image.rootfs, memory_mb=192) as small:
        with pytest.raises(VMError, match="memory_mb 256 .this VM: 192.*fork"):
            small.restore(checkpoint)
        assert not small.running
        small.restore(checkpoint, disk_only=True)   # the files only
        assert not small.running
    monkeypatch.setattr(qemu, "qemu_version", lambda *a: "99.0.0")
    with pytest.raises(VMError, match="qemu '7.*99.0.0.*--disk-only"):
        box.restore(checkpoint)
    assert box.running   # refused before anything was touched
    timing = box.restore(checkpoint, disk_only=True)
    assert not timing.memory and not timing.rebooted
    assert run(box, "cat /one") == "one\n"


def test_saving_the_device_state_leaves_guest_ram_as_it_is(store, box):
    # A checkpoint maps the memory image's RAM while QEMU saves the device
    # state beside it (Machine.paused): that holds only if the save writes
    # no guest RAM. Read through the page cache, which QEMU's mapping is.
    running_step(box)
    machine = box.machine
    for k in range(4):
        run(box, f"head -c 300000 /dev/urandom > /tmp/x{k}; ls -R /bin /sbin > /dev/null")
        with machine.qmp() as q:
            machine.pause()
            try:
                before = machine.memory_image.read_bytes()[:machine.ram_bytes]
                state = device_state.saved(q, device_state.start_saving(q), machine.vm.name)
                after = machine.memory_image.read_bytes()[:machine.ram_bytes]
            finally:
                machine.resume()
        assert len(state) > 100_000
        assert before == after, k


def flip_copies(path: Path, data: bytes) -> int:
    """One byte flipped in every page-aligned copy of ``data`` that the
    image at ``path`` holds (a disk error, another process): how many."""
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        flipped, at = 0, m.find(data)
        while at >= 0:
            if at % 4096 == 0:
                m[at + 100] ^= 0xFF
                flipped += 1
            at = m.find(data, at + 1)
        m.flush()
    return flipped


def test_a_byte_flipped_in_the_standby_or_a_spare_is_never_resumed(store, box):
    pid, digest = running_step(box)
    run(box, "head -c 8192 /dev/urandom > /on-disk && sync")
    on_disk = run(box, "sha256sum /on-disk").split()[0]
    first = box.checkpoint("first")
    page = box.exec("head -c 4096 /mnt/ram/payload").stdout
    block = box.exec("head -c 4096 /on-disk").stdout
    run(box, "echo later > /later")
    box.checkpoint("second")
    box.standby.wait()      # the standby and both pairs of spares at "second"
    copies = [box.standby.path] + [pair.memory.path for pair in box.standby.pairs]
    for path in copies:
        assert flip_copies(path, page)
    disks = [pair.disk.path for pair in box.standby.pairs]
    for path in disks:
        assert flip_copies(path, block)

    # verify names each copy; the store's own layers are intact.
    assert store.verify() == {}
    found = verify_vms(store)["vm box"]
    assert sorted(p.split(":")[0] for p in found) == sorted(p.name for p in copies + disks)
    cli = subprocess.run([sys.executable, "-m", "blockdiff", "verify", "--store",
                          str(store.root)], capture_output=True, text=True, timeout=120)
    assert cli.returncode == 7 and "vm box: memory.standby:" in cli.stderr, cli.stderr

    # A fork takes a pair of spares at "second", brought to "first" where
    # the two differ and where the spares' extents are not their snapshot's.
    fork = box.fork(first, "fork")
    try:
        assert (fork.memory_source, fork.disk_source) == ("spare", "spare")
        assert alive(fork, pid) and payload_hash(fork) == digest
        assert run(fork, "sha256sum /on-disk").split()[0] == on_disk
    finally:
        fork.destroy()
    # A restore takes the standby, brought to "first" the same way.
    assert box.restore(first).standby
    assert alive(box, pid) and payload_hash(box) == digest
    box.standby.wait()
    assert verify_vms(store) == {} and store.verify() == {}


def test_a_full_store_refuses_a_checkpoint_and_never_kills_the_vm(fresh_filesystem, vm_image):
    # Room for the VM's reserve (its RAM, and its 1 GiB disk while that
    # leaves the filesystem half free), its first checkpoint and its standby.
    mnt = fresh_filesystem("xfs", size=3584 * MiB)
    with Store.init(mnt / "store") as small, \
            Sandbox.create(small, "box", image=vm_image.rootfs) as box:
        try:
            box.start()
            pid, digest = running_step(box)
            run(box, "head -c 1048576 /dev/urandom > /data && sync")
            first = box.checkpoint("first")
            box.standby.wait()
            filler = filesystems.fill(mnt)       # the store's filesystem full
            assert reserve.free_bytes(mnt) < MiB
            # The guest writes its RAM (pages it had, pages it had not: a
            # tmpfs file) and its disk, and answers.
            for i in range(3):
                run(box, f"rm -f /mnt/ram/more && head -c 8388608 /dev/urandom > /mnt/ram/more"
                         f" && head -c 65536 /dev/urandom > /written-{i} && sync")
            written = run(box, "sha256sum /mnt/ram/more /written-2")
            assert alive(box, pid) and payload_hash(box) == digest
            with pytest.raises(NoSpace, match="no space left on .* for a checkpoint of VM box"):
                box.checkpoint("refused")
            cli = subprocess.run([sys.executable, "-m", "blockdiff", "vm", "snapshot", "box",
                                  "--store", str(small.root)],
                                 capture_output=True, text=True, timeout=120)
            assert cli.returncode == 1, cli.stderr
            assert cli.stderr.startswith("blockdiff: error: no space left on ")
            assert len(cli.stderr.splitlines()) == 1 and "Traceback" not in cli.stderr
            assert box.machine.running and alive(box, pid) and payload_hash(box) == digest
            assert [s.message for s in small.log()].count("refused") == 0
            assert small.verify() == {}

            # Room again: checkpoints and restores as before.
            os.unlink(filler)
            run(box, "dd if=/dev/urandom of=/data bs=4096 count=256 conv=notrunc 2>/dev/null")
            on_disk = run(box, "sha256sum /data").split()[0]
            second = box.checkpoint("second")
            assert box.restore(first).memory
            assert alive(box, pid) and payload_hash(box) == digest
            assert run(box, "sha256sum /data").split()[0] != on_disk
            box.restore(second)
            assert run(box, "sha256sum /data").split()[0] == on_disk
            assert run(box, "sha256sum /mnt/ram/more /written-2") == written
            assert alive(box, pid)
            assert small.verify() == {}
        finally:
            box._kill()


def test_gc_and_rm_take_a_checkpoint_with_its_memory(store, booted_memory_box):
    # What a VM's first checkpoints store after its boot: a box booted here.
    box = booted_memory_box
    # A checkpoint is its disk snapshot; its memory snapshot (and the memory
    # base, of the disk snapshot the VM booted from) are parts of it, which
    # take no place of their own in gc's "last N" and go with it.
    pid = int(run(box, COUNTER))
    checkpoints = []
    for k in range(3):
        run(box, f"echo {k} > /root/k")
        checkpoints.append(box.checkpoint(f"step {k}"))
    memory = {c: store.get(c).meta[MEMORY_KEY] for c in checkpoints}
    assert all(store.get(m).meta["part-of"] == c for c, m in memory.items())
    base = [s for s in store.log() if s.meta.get("vm.part") == "memory-base"]
    assert len(base) == 1 and base[0].meta["part-of"] not in checkpoints
    store.gc(Policy(keep_last=2))
    assert {s.id for s in store.log()} == {c for c in checkpoints[1:]} | {
        memory[c] for c in checkpoints[1:]}
    box.restore(checkpoints[1])
    assert box.last_restore.memory and alive(box, pid) and run(box, "cat /root/k") == "1\n"
    assert store.rm(checkpoints[1]).removed == [memory[checkpoints[1]], checkpoints[1]]
    box.restore(checkpoints[2])
    assert box.last_restore.memory and alive(box, pid) and run(box, "cat /root/k") == "2\n"
    assert store.verify() == {}


# A gc process beside the forks: the first round removes the oldest
# checkpoint, every round sweeps, under the store's exclusive lock, until
# the file named by its second argument exists; then it prints its rounds.
GC_LOOP = """
import sys, time
from pathlib import Path
from blockdiff.store.retention import Policy
from blockdiff.store.store import Store
rounds = 0
with Store(sys.argv[1]) as store:
    while not Path(sys.argv[2]).exists():
        store.gc(Policy(keep_last=3 if rounds == 0 else 100))
        rounds += 1
        time.sleep(0.01)
print(rounds)
"""


def test_gc_beside_forks_whose_spares_worker_is_stopped(store, box, tmp_path):
    # Each fork stops the spares' worker while it resumes, which may be in
    # the middle of making anew the pair the fork before took, the store's
    # lock held shared; gc takes that lock exclusively. Whichever way they
    # interleave, every fork resumes whole, gc removes what it should, and
    # nothing waits long (the exact case, a worker stopped with the lock in
    # hand, is test_standby's gc test).
    pid, digest = running_step(box)
    checkpoints = []
    for k in range(4):
        run(box, f"echo {k} > /root/k")
        checkpoints.append(box.checkpoint(f"step {k}"))
    box.standby.wait()
    done = tmp_path / "done"
    gc = subprocess.Popen([sys.executable, "-c", GC_LOOP, str(store.root), str(done)],
                          text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    forks = []
    try:
        # In a row: each while the worker makes anew the pair the last took.
        for i, checkpoint in enumerate(checkpoints[1:] + checkpoints[-1:]):
            began = time.monotonic()
            forks.append((box.fork(checkpoint, f"fork{i}"), checkpoints.index(checkpoint)))
            assert time.monotonic() - began < 60
        done.touch()
        out, err = gc.communicate(timeout=120)
        for fork, k in forks:
            assert fork.machine.memory_backed
            assert alive(fork, pid) and payload_hash(fork) == digest
            assert run(fork, "cat /root/k") == f"{k}\n"
    finally:
        for fork, _ in forks:
            fork.destroy()
        if gc.poll() is None:
            gc.kill()
            gc.wait()
    assert gc.returncode == 0 and int(out) >= 1, err
    assert checkpoints[0] not in {s.id for s in store.log()}
    box.standby.wait()
    assert box.standby.spares_failure is None
    for pair in box.standby.pairs:
        for spare in (pair.memory, pair.disk):
            assert store.lineage(spare.path)[1] == "clean"
    box.restore(checkpoints[1])
    assert alive(box, pid) and run(box, "cat /root/k") == "1\n"
    assert store.verify() == {}


def test_ram_stored_per_small_step_is_a_few_mib(store, booted_memory_box):
    # What a VM's first checkpoints store after its boot: a box booted here.
    box = booted_memory_box
    run(box, COUNTER)
    stored = []
    for k in range(6):
        run(box, f"echo step{k} > /root/f{k}")
        box.checkpoint(f"step {k}")
        stored.append(box.last_checkpoint.memory_bytes)
        # Of the pages whose extents moved, only those whose bytes differ.
        assert box.last_checkpoint.memory_compared >= box.last_checkpoint.memory_bytes > 0
    # What the boot put in RAM was committed after the boot, as the base of
    # the first checkpoint's memory; each step stores only the 4 KiB pages it
    # changed (and the device state, about 400 KB).
    base = [s for s in store.log() if s.meta.get("vm.part") == "memory-base"]
    assert len(base) == 1 and base[0].changed_bytes > 16 * MiB
    assert statistics.median(stored) < 4 * MiB and max(stored) < 8 * MiB, stored


def test_the_page_cache_of_what_a_step_wrote_is_stored_once(store, box):
    # A file a step writes is in the guest's page cache and on its disk: the
    # memory snapshot points those pages into the disk snapshot's layer. A
    # restore brings the file back in the page cache (read as cached) and on
    # the disk (read past the cache), byte for byte.
    run(box, COUNTER)
    box.checkpoint("base")
    checkpoints, hashes = [], []
    for k in range(3):
        hashes.append(run(box, f"head -c 524288 /dev/urandom > /root/blob{k} && "
                               f"sha256sum < /root/blob{k}"))
        checkpoints.append(box.checkpoint(f"blob {k}"))
        timing = box.last_checkpoint
        assert timing.memory_borrowed >= 256 << 10, timing
        assert timing.memory_compared >= timing.memory_bytes + timing.memory_borrowed
    run(box, "rm /root/blob0 /root/blob1; sync")
    box.restore(checkpoints[1])
    for k in (0, 1):
        assert run(box, f"sha256sum < /root/blob{k}") == hashes[k]
        assert run(box, f"dd if=/root/blob{k} iflag=direct bs=64k 2>/dev/null | sha256sum"
                   ) == hashes[k]
    assert store.verify() == {}


def test_skip_unchanged_skips_only_when_nothing_ran(store, box):
    run(box, "echo a > /a")
    first = box.checkpoint("a", skip_unchanged=True)
    assert box.checkpoint("same", skip_unchanged=True) == first
    run(box, "true")   # ran, wrote nothing: memory changed
    second = box.checkpoint("ran", skip_unchanged=True)
    assert second != first and MEMORY_KEY in store.get(second).meta


def test_disk_only_vms_and_checkpoints(store, box, vm_image):
    run(box, "echo a > /a")
    disk_only = box.checkpoint("files", memory=False)
    assert MEMORY_KEY not in store.get(disk_only).meta and not box.last_checkpoint.memory
    with Sandbox.create(store, "plain", image=vm_image.rootfs, memory=False) as plain:
        assert not plain.memory_checkpoints
        plain.start()
        assert not plain.machine.memory_backed
        run(plain, "echo p > /p")
        snap = plain.checkpoint("plain")
        assert MEMORY_KEY not in store.get(snap).meta
        assert not plain.status().memory and not plain.status().snapshot_memory
    assert box.status().memory
    pid = int(run(box, COUNTER))
    whole = box.checkpoint("whole")
    assert box.status().snapshot_memory
    timing = box.restore(disk_only)
    assert not timing.memory and not alive(box, pid)
    timing = box.restore(whole)
    assert timing.memory and alive(box, pid)


def test_a_stopped_vm_or_fork_resumes_from_a_memory_checkpoint(store, box):
    pid, digest = running_step(box)
    checkpoint = box.checkpoint("running")
    box.stop()
    box.restore(checkpoint)
    assert box.running and alive(box, pid)
    fork = box.fork(checkpoint, "later", start=False)
    try:
        assert not fork.running
        fork.start()
        assert alive(fork, pid) and payload_hash(fork) == digest
    finally:
        fork.destroy()


def test_the_agent_chooses_per_checkpoint_and_a_rewind_brings_processes_back(store, box):
    from blockdiff.agent import Agent, Tool

    paid = []
    with Agent(store, "t", disk=box,
               tools=[Tool("pay", lambda args, rid: paid.append(rid) or {"ok": True},
                           idempotent=True)]) as agent:
        with agent.step("look around", memory=False):
            run(box, "ls / > /dev/null")
        looked = agent.db.checkpoint(agent.head).disk_snapshot
        assert MEMORY_KEY not in store.get(looked).meta        # a read-only step: disk only
        with agent.step("start a job and pay", memory=False) as step:
            pid, digest = running_step(box)
            step.call("pay", {"amount": 1})
        paying = agent.head
        # An external call checkpoints the processes whatever the step asked.
        assert MEMORY_KEY in store.get(agent.db.checkpoint(paying).disk_snapshot).meta
        with agent.step("stop the job"):
            run(box, f"kill {pid}")
        assert not alive(box, pid)
        agent.rewind(paying)
        assert alive(box, pid) and payload_hash(box) == digest
        assert len(paid) == 1                                   # the call is not made again
