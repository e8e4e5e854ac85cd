"""The VM kill sweep: the CLI killed (SIGKILL) at swept moments of ``vm
restore``, ``vm fork`` and ``vm snapshot``, each followed by the next command
on the VM, which must leave it running at a checkpoint with its processes,
or clearly stopped: never hung, half-resumed or unbootable.

The moments are named points inside the library (``BLOCKDIFF_VM_CRASH_AT``,
see blockdiff.vm.intents) and a few spread over the operation's measured
duration. ``BLOCKDIFF_TEST_BUDGET=full`` sweeps every point with every next
command and more moments (a soak); the default is a bounded sweep for CI.
Real QEMU guests (TCG where KVM does not work) on a real XFS store.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import budget
import pytest
from clirun import cli as in_process_cli
from guests import COUNTER, PAYLOAD, run

from blockdiff.errors import GuestTimeout
from blockdiff.vm import guestlink
from blockdiff.vm.intents import CRASH_ENV
from blockdiff.vm.sandbox import Sandbox
from scenarios import assert_same_bytes


@pytest.fixture
def store(vm_store):
    return vm_store


@pytest.fixture
def box(memory_box):
    return memory_box


FULL = budget.FULL
# Longer than any command here takes under TCG on a loaded machine; a
# command that takes longer hangs.
COMMAND_TIMEOUT = 300
RESTORE_POINTS = ["restore.stopped", "restore.killed", "restore.taken", "resume.started",
                  "resume.loaded", "resume.running"]
FORK_POINTS = ["fork.registered", "fork.images", "resume.started", "resume.loaded",
               "resume.running"]
SNAPSHOT_POINTS = ["checkpoint.frozen", "checkpoint.paused", "checkpoint.captured"]
NEXT = ["exec", "ls", "snapshot", "stop", "restore"]
# Fractions of an operation's measured duration to kill it at.
MOMENTS = [0.2, 0.35, 0.5, 0.65, 0.8, 0.95] if FULL else [0.4, 0.7]


def cli(store, *args, crash_at: str | None = None, timeout: float = COMMAND_TIMEOUT):
    env = environment(store)
    if crash_at is not None:
        env[CRASH_ENV] = crash_at
    try:
        return subprocess.run([sys.executable, "-m", "blockdiff", *args], capture_output=True,
                              text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"blockdiff {' '.join(args)} hung (no answer in {timeout} s)")


def environment(store) -> dict:
    env = dict(os.environ, BLOCKDIFF_STORE=str(store.root))
    env.pop(CRASH_ENV, None)
    return env


def killed_after(store, seconds: float, *args) -> None:
    """Run a command and SIGKILL it ``seconds`` after it started."""
    process = subprocess.Popen([sys.executable, "-m", "blockdiff", *args],
                               env=environment(store), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        process.wait(seconds)   # the moment of the kill, swept: not a wait for a condition
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGKILL)
    process.wait(COMMAND_TIMEOUT)


def killed_when(store, condition, *args) -> None:
    """Run a command and SIGKILL it as soon as ``condition()`` holds (polled,
    bounded), or let it finish."""
    process = subprocess.Popen([sys.executable, "-m", "blockdiff", *args],
                               env=environment(store), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + COMMAND_TIMEOUT
    while process.poll() is None and time.monotonic() < deadline:
        if condition():
            process.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    process.wait(COMMAND_TIMEOUT)


def new_qemu(box):
    """A condition: VM ``box`` has a QEMU other than the one it has now."""
    before = box.pid

    def appeared() -> bool:
        now = box.machine.pid
        return now is not None and now != before
    return appeared


def timed(store, *args) -> float:
    began = time.monotonic()
    done = cli(store, *args)
    assert done.returncode == 0, done.stderr
    return time.monotonic() - began


def status(store, name: str) -> dict | None:
    done = cli(store, "vm", "ls", "--json")
    assert done.returncode == 0, done.stderr
    return {s["name"]: s for s in json.loads(done.stdout)}.get(name)


def in_guest(store, name: str, command: str):
    return cli(store, "vm", "exec", name, "--", "sh", "-c", command)


def assert_at_checkpoint(store, name: str, pid: int, digest: str, marker: str) -> None:
    """VM ``name`` runs the checkpoint's processes: the counter started before
    it, running on; its tmpfs payload; the file the step wrote."""
    state = status(store, name)
    assert state["state"] == "running" and state["running"], state
    done = in_guest(store, name, f"kill -0 {pid} && sha256sum /mnt/ram/payload && "
                                 f"cat /step && cat /tmp/counter")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split("\n")
    assert lines[0].split()[0] == digest
    assert lines[1] == marker
    counted = int(lines[2])
    # Running, not frozen or paused: the counter moves on.
    deadline = time.monotonic() + 60
    while int(in_guest(store, name, "cat /tmp/counter").stdout) == counted:
        assert time.monotonic() < deadline, "the counter does not move: the guest is frozen"


def assert_stopped_at(store, name: str, snapshot_id: str, scratch) -> None:
    """VM ``name`` stopped, its disk byte for byte the checkpoint's."""
    state = status(store, name)
    assert state["state"] == "stopped" and state["pid"] is None, state
    copy = scratch / f"check-{snapshot_id}.img"
    store.restore(snapshot_id, copy)
    assert_same_bytes(Sandbox(store, name).disk, copy)
    copy.unlink()


def checkpointed_step(box, marker: str) -> tuple[int, str, str]:
    """A running step (a counter, a payload in tmpfs, a file on disk)
    checkpointed whole: its counter's pid, payload's hash and checkpoint."""
    pid = int(run(box, COUNTER))
    digest = run(box, PAYLOAD).split()[0]
    run(box, f"echo {marker} > /step && sync")
    checkpoint = box.checkpoint(marker)
    assert box.last_checkpoint.memory
    box.standby.wait()
    return pid, digest, checkpoint


def next_command(store, name: str, which: str, checkpoint: str, tmp_path) -> None:
    """The next command on VM ``name`` after one that was killed, and what
    it must leave: the VM at ``checkpoint``, running (stopped, then resumed
    by ``start``, after ``stop``)."""
    if which == "ls":
        # It says what the VM is, without waiting on it...
        state = status(store, name)
        assert state is not None and state["state"] in (
            "running", "stopped", "restore interrupted", "fork incomplete",
            "checkpoint interrupted", "start interrupted"), state
        # ...and the next command finishes the operation.
        which = "exec"
    if which == "exec":
        done = in_guest(store, name, "true")
        assert done.returncode == 0, done.stderr
    elif which == "snapshot":
        done = cli(store, "vm", "snapshot", name, "-m", "after a kill", "--json")
        assert done.returncode == 0, done.stderr
        taken = json.loads(done.stdout)
        # A whole-VM checkpoint, not a crash-consistent disk alone.
        assert taken["memory"] is not None and taken["timing"]["memory"], taken
        flush = store.get(taken["id"]).meta["vm.flush"]
        assert flush == "fsfreeze", flush
    elif which == "stop":
        unfinished = status(store, name)["state"] in ("restore interrupted", "fork incomplete")
        done = cli(store, "vm", "stop", name)
        assert done.returncode == 0, done.stderr
        if unfinished:
            assert_stopped_at(store, name, checkpoint, tmp_path)
        assert status(store, name)["state"] == "stopped"
        done = cli(store, "vm", "start", name)
        assert done.returncode == 0, done.stderr
        if not unfinished:
            # Nothing was left to finish: the VM stopped and booted anew,
            # and is brought back to the checkpoint.
            done = cli(store, "vm", "restore", name, checkpoint)
            assert done.returncode == 0, done.stderr
    elif which == "restore":
        done = cli(store, "vm", "restore", name, checkpoint)
        assert done.returncode == 0, done.stderr
        assert "resumed with its processes" in done.stdout


def cases(points: list[str]) -> list[tuple[str, str]]:
    """Each point with a next command (every one with each, in a full sweep)."""
    if FULL:
        return [(point, which) for point in points for which in NEXT]
    return [(point, NEXT[i % len(NEXT)]) for i, point in enumerate(points)]


def test_a_killed_restore_is_finished_by_the_next_command(store, box, tmp_path):
    pid, digest, checkpoint = checkpointed_step(box, "restored-step")
    run(box, f"kill {pid}; echo later > /step")
    for point, which in cases(RESTORE_POINTS):
        done = cli(store, "vm", "restore", "box", checkpoint, crash_at=point)
        assert done.returncode == -signal.SIGKILL, (point, done.stderr)
        next_command(store, "box", which, checkpoint, tmp_path)
        assert_at_checkpoint(store, "box", pid, digest, "restored-step")
        # The step after, which each restore undoes.
        in_guest(store, "box", f"kill {pid}; echo later > /step")

    # Killed as soon as its new QEMU is there (waiting for the device state,
    # or loading it), which no one would resume.
    for which in NEXT if FULL else ["exec"]:
        in_guest(store, "box", f"kill {pid}; echo later > /step")
        killed_when(store, new_qemu(box), "vm", "restore", "box", checkpoint)
        next_command(store, "box", which, checkpoint, tmp_path)
        if in_guest(store, "box", "cat /step").stdout.strip() == "later":
            assert cli(store, "vm", "restore", "box", checkpoint).returncode == 0
        assert_at_checkpoint(store, "box", pid, digest, "restored-step")

    # Killed at moments spread over its measured duration (the issue's
    # 0.4-0.8 s), then each next command.
    seconds = timed(store, "vm", "restore", "box", checkpoint)
    for i, fraction in enumerate(MOMENTS):
        in_guest(store, "box", f"kill {pid}; echo later > /step")
        killed_after(store, seconds * fraction, "vm", "restore", "box", checkpoint)
        next_command(store, "box", NEXT[i % len(NEXT)], checkpoint, tmp_path)
        # A restore killed before it began leaves the step after: restored now.
        if in_guest(store, "box", "cat /step").stdout.strip() == "later":
            assert cli(store, "vm", "restore", "box", checkpoint).returncode == 0
        assert_at_checkpoint(store, "box", pid, digest, "restored-step")


def test_a_killed_restore_then_stop_leaves_it_stopped_at_the_checkpoint(store, box,
                                                                        tmp_path):
    pid, digest, checkpoint = checkpointed_step(box, "restored-step")
    run(box, f"kill {pid}; echo later > /step")
    done = cli(store, "vm", "restore", "box", checkpoint, crash_at="resume.loaded")
    assert done.returncode == -signal.SIGKILL, done.stderr
    # QEMU holds the device state, paused: what it is, not "running".
    state = status(store, "box")
    assert state["state"] == "restore interrupted" and not state["running"], state
    assert state["qemu"] in ("paused", "postmigrate", "inmigrate"), state
    done = cli(store, "vm", "stop", "box")
    assert done.returncode == 0, done.stderr
    assert_stopped_at(store, "box", checkpoint, tmp_path)
    # start resumes the checkpoint instead of booting.
    done = cli(store, "vm", "start", "box")
    assert done.returncode == 0, done.stderr
    assert_at_checkpoint(store, "box", pid, digest, "restored-step")


def test_a_killed_disk_swap_leaves_the_vm_stopped_at_the_snapshot(store, vm_image, tmp_path):
    # A disk-only VM's restore swaps the disk under the running guest.
    with Sandbox.create(store, "plain", image=vm_image.rootfs, memory=False) as plain:
        plain.start()
        run(plain, "echo swapped-step > /step && sync")
        snapshot = plain.checkpoint("step")
        for point in ["restore.detached", "restore.swap-paused"]:
            assert in_guest(store, "plain", "echo later > /step").returncode == 0
            done = cli(store, "vm", "restore", "plain", snapshot, crash_at=point)
            assert done.returncode == -signal.SIGKILL, (point, done.stdout, done.stderr)
            assert status(store, "plain")["state"] == "restore interrupted"
            # The guest was detached (its processes ended, its disk
            # unmounted), perhaps paused: the next command finishes the
            # disk's restore and leaves the VM clearly stopped, and says so.
            done = in_guest(store, "plain", "true")
            assert done.returncode == 9 and "not running" in done.stderr, done.stderr
            assert_stopped_at(store, "plain", snapshot, tmp_path)
            assert cli(store, "vm", "start", "plain").returncode == 0
            assert in_guest(store, "plain", "cat /step").stdout == "swapped-step\n"


def test_a_killed_fork_is_made_again_or_removed(store, box, tmp_path):
    pid, digest, checkpoint = checkpointed_step(box, "forked-step")
    sweep = [(point, which, None) for point, which in cases(FORK_POINTS)]
    seconds = timed(store, "vm", "fork", "box", checkpoint, "probe")
    assert cli(store, "vm", "rm", "probe").returncode == 0
    sweep += [(None, NEXT[i % len(NEXT)], seconds * f) for i, f in enumerate(MOMENTS)]
    for n, (point, which, after) in enumerate(sweep):
        name = f"fork{n}"
        if point is not None:
            done = cli(store, "vm", "fork", "box", checkpoint, name, crash_at=point)
            assert done.returncode == -signal.SIGKILL, (point, done.stderr)
        else:
            killed_after(store, after, "vm", "fork", "box", checkpoint, name)
        if status(store, name) is None:
            # Killed before it was registered: the name is free again.
            done = cli(store, "vm", "fork", "box", checkpoint, name)
            assert done.returncode == 0, done.stderr
        else:
            next_command(store, name, which, checkpoint, tmp_path)
        assert_at_checkpoint(store, name, pid, digest, "forked-step")
        done = cli(store, "vm", "rm", name)
        assert done.returncode == 0, done.stderr
        assert status(store, name) is None
        # The VM forked from runs on, its standby and spares usable.
        assert in_guest(store, "box", f"kill -0 {pid}").returncode == 0


def test_a_fork_whose_checkpoint_is_gone_is_incomplete_and_removable(store, box):
    _, _, checkpoint = checkpointed_step(box, "forked-step")
    done = cli(store, "vm", "fork", "box", checkpoint, "orphan", crash_at="fork.images")
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert status(store, "orphan")["state"] == "fork incomplete"
    store.rm(checkpoint)
    done = in_guest(store, "orphan", "true")
    assert done.returncode == 9 and "incomplete fork" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    done = cli(store, "vm", "rm", "orphan")
    assert done.returncode == 0, done.stderr
    assert status(store, "orphan") is None


def test_a_killed_snapshot_leaves_the_vm_running_on(store, box, tmp_path):
    pid, digest, checkpoint = checkpointed_step(box, "step")
    sweep = [(point, which, None) for point, which in cases(SNAPSHOT_POINTS)]
    seconds = timed(store, "vm", "snapshot", "box", "-m", "probe")
    sweep += [(None, NEXT[i % len(NEXT)], seconds * f) for i, f in enumerate(MOMENTS)]
    for point, which, after in sweep:
        if point is not None:
            done = cli(store, "vm", "snapshot", "box", "-m", "killed", crash_at=point)
            assert done.returncode == -signal.SIGKILL, (point, done.stderr)
        else:
            killed_after(store, after, "vm", "snapshot", "box", "-m", "killed")
        next_command(store, "box", which, checkpoint, tmp_path)
        assert_at_checkpoint(store, "box", pid, digest, "step")


def test_exec_on_a_guest_that_does_not_answer_times_out(store, box, monkeypatch):
    box.machine.pause()   # as a restore killed at the wrong moment left it, before
    assert status(store, "box")["state"] == "paused"
    monkeypatch.setattr(guestlink, "ANSWER_WAIT", 2.0)
    with pytest.raises(GuestTimeout, match="did not answer within 2 s"):
        box.exec("true")
    # The CLI too, with one line and exit 9 (in this process, so with the
    # bound patched: waiting out the default 30 s proves nothing more).
    done = in_process_cli("vm", "exec", "box", "--", "true", code=9,
                          env=environment(store))
    assert "did not answer within 2 s" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    box.machine.resume()
    assert box.exec("true").status == 0


def test_intent_records_name_their_writer_and_survive_damage(tmp_path):
    from blockdiff.vm import intents

    with intents.pending(tmp_path, "restore", snapshot="abc") as intent:
        found = intents.read(tmp_path)
        assert found == intent and found.mine() and found.writer_alive()
        assert found.args == {"snapshot": "abc"} and found.describe() == "restore of abc"
    assert intents.read(tmp_path) is None
    # A writer that is gone, and a pid the kernel hands out again, are told apart.
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    (tmp_path / intents.INTENT).write_text(json.dumps(
        {"op": "fork", "pid": int(gone), "started": 1, "args": {}}))
    assert not intents.read(tmp_path).writer_alive()
    # A damaged record is an operation of unknown kind whose writer is gone.
    for damaged in (b"\xff\xfe", b"[1, 2]", b"{" * 100000, b'{"op": "x"}'):
        (tmp_path / intents.INTENT).write_bytes(damaged)
        found = intents.read(tmp_path)
        assert found.op == "unknown" and not found.writer_alive()
    with pytest.raises(RuntimeError, match="failed"), \
            intents.pending(tmp_path, "start", durable=False, failed=True):
        raise RuntimeError("failed")
    assert intents.read(tmp_path) is None


def test_a_vm_create_killed_before_it_was_registered_leaves_its_name_free(store, vm_image):
    done = cli(store, "vm", "create", "half", "--image", str(vm_image.rootfs),
               crash_at="registry.staged")
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert status(store, "half") is None
    done = cli(store, "vm", "create", "half", "--image", str(vm_image.rootfs))
    assert done.returncode == 0, done.stderr
    assert status(store, "half")["state"] == "stopped"
    assert not (store.root / "vms" / "half" / "intent.json").exists()
    assert not (store.root / "vms" / ".half.creating").exists()
