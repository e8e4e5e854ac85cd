"""Benchmark of sandbox VM checkpoints and restores, next to full-copy snapshots.

    python bench/vm_bench.py [--steps N] [--disk-mib N] [--pool-mib N] [--json out.json]

One scratch XFS (reflink=1) loop mount holds the store. The VM image is built
by ``blockdiff vm build-image`` (cached in the work directory) with a
``--disk-mib`` root disk (4096), into which the host writes a ``--pool-mib``
file of random data (1024) before the first boot, so the disk holds real data.
The VM (TCG where KVM does not work) then runs N agent steps (50), each
writing about 100 random 4 KiB blocks into the pool and 1 MiB to a new file,
and a checkpoint after each.

Rows:
- checkpoint: the VM paused (QMP stop to cont) and the whole call (guest
  fsfreeze, pause, thaw) per step, p50/p99;
- full-copy snapshot: the same pause with a full sparse copy of the disk (cp
  --reflink=never) instead of a commit, every tenth step;
- restore to running: from the call until the guest runs a command again: at
  the step before, undoing an uncommitted step (an agent retrying it); at a
  random earlier step, by swapping the disk under the running guest; by
  rebooting (what a VM whose disk changed size gets); and from a full copy
  (stop QEMU, copy the disk back, boot);
- fork to running: a new VM from a snapshot, booted.

Those VMs checkpoint their disk only. A second VM, whose checkpoints hold
the whole VM (RAM and device state with the disk, the default), then runs
``--memory-steps`` small steps (20) with a process counting in the
background, and the rows for whole-VM checkpoints are, side by side with a
cold boot, QEMU's own full-RAM save and restore (``migrate`` of the RAM to
a file, ``-incoming`` from it) and the disk-only checkpoint:
- pause per checkpoint with memory: a small step, and a step that dirties
  100 MiB of guest RAM (a tmpfs file);
- RAM bytes stored per step (the memory snapshot's changed bytes, with the
  device state), with and without the 4 KiB page-cache warm-up that
  counters QEMU's MADV_HUGEPAGE;
- restore to running with the processes (QEMU killed, disk and memory
  restored, resumed until the guest daemon answered), at a random earlier
  step, and until a first command ran;
- fork to running: a new VM resumed from a random earlier checkpoint, the
  same two ways, forks following each other; and from the checkpoint just
  taken, each once the VM's spares are ready (an agent forking where it
  is, between its steps).

Checkpoints and swap restores read QEMU's dirty bitmap (all but the first
checkpoint after a boot); the report says how many did.

Needs root, xfsprogs, QEMU, and what ``blockdiff vm build-image`` needs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
# This checkout's blockdiff first, not whichever one pip installed last.
sys.path[:0] = [HERE, os.path.dirname(HERE)]

try:
    from store_bench import human, stats

    from blockdiff.demo import scratch
    from blockdiff.store.store import Store
    from blockdiff.vm.image import build_image
    from blockdiff.vm.sandbox import Sandbox
except ImportError as e:
    sys.exit(f"bench/vm_bench.py: {e}")

MiB = 1 << 20
DEFAULT_TMP_DIR = "/var/tmp/blockdiff-vm-bench"
RANDOM_BLOCKS = 100
COPY_EVERY = 10
RESTORE_SAMPLES = 10
UNDO_SAMPLES = 10
REBOOT_SAMPLES = 3


def fill_pool(disk: Path, pool_mib: int, seed: int, workdir: Path) -> None:
    """Write the random pool file into the ext4 disk image from the host."""
    mnt = workdir / "fill"
    mnt.mkdir(exist_ok=True)
    subprocess.run(["mount", "-o", "loop", str(disk), str(mnt)], check=True)
    try:
        (mnt / "data").mkdir(exist_ok=True)
        rnd = random.Random(seed)
        with open(mnt / "data" / "pool", "wb") as f:
            for _ in range(pool_mib):
                f.write(rnd.randbytes(MiB))
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def step_command(k: int, pool_blocks: int, rnd: random.Random) -> str:
    offsets = " ".join(str(o) for o in rnd.sample(range(pool_blocks), RANDOM_BLOCKS))
    return (f"for o in {offsets}; do dd if=/dev/urandom of=/data/pool bs=4k count=1 seek=$o "
            f"conv=notrunc 2>/dev/null; done; head -c {MiB} /dev/urandom > /data/step-{k}; "
            f"echo {k} > /data/last")


def until_running(box: Sandbox) -> None:
    result = box.exec(["true"], timeout=60)
    assert result.status == 0


def run(args) -> dict:
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    image = build_image(work / "image", disk_size=args.disk_mib * MiB)
    rnd = random.Random(args.seed)
    with scratch.mounted_filesystem("xfs", tmp_dir=work / "scratch",
                                    size=(args.disk_mib * 3 + 2048) * MiB) as mnt:
        base = mnt / "base.img"
        shutil.copyfile(image.rootfs, base)
        fill_pool(base, args.pool_mib, args.seed, work)
        os.sync()  # the pool on disk, not in the page cache, as an installed system is
        store = Store.init(mnt / "store")
        if args.memory_only:
            try:
                memory = run_memory(args, store, base, image, args.pool_mib * MiB // 4096, rnd,
                                    work)
            finally:
                for b in Sandbox.list(store):
                    b._kill()
                store.close()
            return {"machine": {"host": platform.node(), "kernel": platform.release(),
                                "cpus": os.cpu_count()},
                    "config": {"disk_mib": args.disk_mib, "pool_mib": args.pool_mib},
                    "memory": memory}
        start = time.monotonic()
        box = Sandbox.create(store, "bench", image=base, kernel=image.directory, memory=False)
        create_seconds = time.monotonic() - start
        root_id = store.lineage(box.disk)[0]
        try:
            box.start()
            accel = box.status().accel
            pause, total, copy_pause, ids, tracked = [], [], [], [], []
            pool_blocks = args.pool_mib * MiB // 4096
            for k in range(args.steps):
                assert box.exec(step_command(k, pool_blocks, rnd)).status == 0
                ids.append(box.checkpoint(f"step {k}"))
                pause.append(box.last_checkpoint.paused)
                total.append(box.last_checkpoint.total)
                tracked.append(box.last_checkpoint.tracked)
                if k % COPY_EVERY == 0:
                    copy_pause.append(full_copy_pause(box, mnt / "copy.img"))
            full_copy = mnt / "copy.img"
            copy_step = ids[-1]

            swap, undo, reboot, copy_restore, fork = [], [], [], [], []
            swaps_tracked = 0
            for k in range(UNDO_SAMPLES):
                assert box.exec(step_command(args.steps + k, pool_blocks, rnd)).status == 0
                start = time.monotonic()
                timing = box.restore(ids[-1])
                until_running(box)
                undo.append(time.monotonic() - start)
                swaps_tracked += timing.tracked
                assert not timing.rebooted
                assert box.exec("cat /data/last").stdout == f"{args.steps - 1}\n".encode()
            for k in rnd.sample(range(args.steps - 1), min(RESTORE_SAMPLES, args.steps - 1)):
                start = time.monotonic()
                timing = box.restore(ids[k])
                until_running(box)
                assert not timing.rebooted
                swap.append(time.monotonic() - start)
                swaps_tracked += timing.tracked
                assert box.exec("cat /data/last").stdout == f"{k}\n".encode()
            for k in rnd.sample(range(args.steps), REBOOT_SAMPLES):
                start = time.monotonic()
                box._kill()
                store.restore(ids[k], box.disk)
                box.start()
                reboot.append(time.monotonic() - start)
                assert box.exec("cat /data/last").stdout == f"{k}\n".encode()
            for _ in range(REBOOT_SAMPLES):
                start = time.monotonic()
                box._kill()
                copy_file(full_copy, box.disk)
                box.start()
                copy_restore.append(time.monotonic() - start)
            for i, k in enumerate(rnd.sample(range(args.steps), REBOOT_SAMPLES)):
                start = time.monotonic()
                other = box.fork(ids[k], f"fork{i}")
                until_running(other)
                fork.append(time.monotonic() - start)
                other.destroy()
            changed = sum(s.changed_bytes for s in store.log(copy_step) if s.id != root_id)
            disk_pause = stats(pause)
            box._kill()
            memory = run_memory(args, store, base, image, pool_blocks, rnd, work)
        finally:
            for b in Sandbox.list(store):
                b._kill()
            store.close()
    return {
        "machine": {"host": platform.node(), "kernel": platform.release(), "accel": accel,
                    "cpus": os.cpu_count()},
        "config": {"steps": args.steps, "disk_mib": args.disk_mib, "pool_mib": args.pool_mib},
        "checkpoint_paused": stats(pause) | {"samples": pause},
        "checkpoint_total": stats(total),
        "full_copy_paused": stats(copy_pause) | {"samples": copy_pause},
        "restore_undo": stats(undo),
        "restore_swap": stats(swap),
        "checkpoints_tracked": sum(tracked),
        "swaps_tracked": swaps_tracked,
        "swaps": len(undo) + len(swap),
        "restore_reboot": stats(reboot),
        "restore_full_copy": stats(copy_restore),
        "fork": stats(fork),
        "create_seconds": create_seconds,
        "changed_bytes": changed,
        "disk_only_paused": disk_pause,
        "memory": memory,
    }


# Forks of random earlier steps, at most one a step: their p50 is the fork row,
# which one or two slow guests move when there are only five.
MEMORY_FORKS = 10
LATEST_FORKS = 3    # of the checkpoint just taken, each once its spares are ready
DIRTY_MIB = 100
BIG_STEPS = 3
COUNTER = ("(i=0; while true; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.1; done) "
           ">/dev/null 2>&1 & echo $!")


def fork_to_running(box: Sandbox, snapshot_id: str, name: str, pid: int):
    """Fork ``box`` at ``snapshot_id`` into ``name``, check that process
    ``pid`` came along, and remove the fork: seconds until it resumed and
    until a first command ran, its phases, where its memory image came
    from, whether its QEMU was one started ahead."""
    start = time.monotonic()
    other = box.fork(snapshot_id, name)
    resumed = time.monotonic() - start
    phases = other.last_restore_phases | other.machine.last_launch
    until_running(other)
    command = time.monotonic() - start
    assert other.exec(f"kill -0 {pid}").status == 0
    other.destroy()
    return resumed, command, phases, other.memory_source, other.machine.took_waiting


def run_memory(args, store: Store, base: Path, image, pool_blocks: int, rnd: random.Random,
               work: Path) -> dict:
    """The whole-VM rows (see the module's docstring)."""
    from blockdiff.vm import machine as machine_module

    box = Sandbox.create(store, "whole", image=base, kernel=image.directory)
    cold, cold_command = [], []
    for _ in range(REBOOT_SAMPLES):
        box._kill()
        start = time.monotonic()
        box.start()                      # until the guest daemon answers
        cold.append(time.monotonic() - start)
        until_running(box)
        cold_command.append(time.monotonic() - start)
    pid = int(box.exec(COUNTER).stdout)
    assert box.exec("mkdir -p /mnt/ram && mount -t tmpfs -o size=160m tmpfs /mnt/ram").status == 0
    pause, total, stored, compared, borrowed, ids = [], [], [], [], [], []
    for k in range(args.memory_steps):
        assert box.exec(step_command(k, pool_blocks, rnd)).status == 0
        ids.append(box.checkpoint(f"whole step {k}"))
        assert box.last_checkpoint.memory
        pause.append(box.last_checkpoint.paused)
        total.append(box.last_checkpoint.total)
        stored.append(box.last_checkpoint.memory_bytes)
        compared.append(box.last_checkpoint.memory_compared)
        borrowed.append(box.last_checkpoint.memory_borrowed)
    big_pause, big_stored = [], []
    for k in range(BIG_STEPS):
        assert box.exec(f"head -c {DIRTY_MIB * MiB} /dev/urandom > /mnt/ram/blob").status == 0
        box.checkpoint(f"dirtied {DIRTY_MIB} MiB")
        big_pause.append(box.last_checkpoint.paused)
        big_stored.append(box.last_checkpoint.memory_bytes)
    assert box.exec("rm -f /mnt/ram/blob").status == 0
    disk_only = []
    for k in range(UNDO_SAMPLES):
        assert box.exec(step_command(1000 + k, pool_blocks, rnd)).status == 0
        box.checkpoint("disk only", memory=False)
        disk_only.append(box.last_checkpoint.paused)
    restore, restore_command, phases, restore_standby, restore_prestarted = [], [], [], [], []
    for k in rnd.sample(range(1, args.memory_steps), min(RESTORE_SAMPLES, args.memory_steps - 1)):
        start = time.monotonic()
        timing = box.restore(ids[k])     # until the guest daemon has resumed it
        restore.append(time.monotonic() - start)
        until_running(box)
        restore_command.append(time.monotonic() - start)
        phases.append(box.last_restore_phases | box.machine.last_launch)
        restore_standby.append(timing.standby)
        restore_prestarted.append(timing.prestarted)
        assert timing.memory and box.exec(f"kill -0 {pid}").status == 0
        assert box.exec("cat /data/last").stdout == f"{k}\n".encode()
    forks = [fork_to_running(box, ids[k], f"whole-fork{i}", pid)
             for i, k in enumerate(rnd.sample(range(args.memory_steps),
                                                   min(MEMORY_FORKS, args.memory_steps)))]
    fork, fork_command, fork_phases, fork_source, fork_prestarted = (
        list(column) for column in zip(*forks))
    # An agent forking where it is now (best-of-N from its current step),
    # with its VM's spares prepared meanwhile, as between its steps.
    assert box.exec(step_command(3000, pool_blocks, rnd)).status == 0
    now = box.checkpoint("fork point")
    latest, latest_source, latest_prestarted = [], [], []
    for i in range(LATEST_FORKS):
        box.standby.wait()
        seconds, _, _, source, ahead = fork_to_running(box, now, f"latest-fork{i}", pid)
        latest.append(seconds)
        latest_source.append(source)
        latest_prestarted.append(ahead)
    qemu_save, qemu_restore, qemu_command, saved_bytes = full_ram_save_restore(
        store, base, image, work)
    # The same small steps on a VM whose page cache is not warmed in 4 KiB
    # pages: QEMU's MADV_HUGEPAGE makes them 2 MiB folios.
    real_warm = machine_module.warm_page_cache
    machine_module.warm_page_cache = lambda *args, **kwargs: None
    try:
        cold_cache = Sandbox.create(store, "unwarmed", image=base, kernel=image.directory)
        cold_cache.start()
        unwarmed = []
        for k in range(6):
            assert cold_cache.exec(step_command(2000 + k, pool_blocks, rnd)).status == 0
            cold_cache.checkpoint("unwarmed")
            unwarmed.append(cold_cache.last_checkpoint.memory_bytes)
        cold_cache.destroy()
    finally:
        machine_module.warm_page_cache = real_warm
    box.destroy()
    return {"memory_mb": box.vm.memory_mb, "steps": args.memory_steps,
            "cold_boot": stats(cold), "cold_boot_command": stats(cold_command),
            "paused": stats(pause) | {"samples": pause},
            "total": stats(total), "stored": stats(stored[1:]) | {"first": stored[0]},
            "compared": stats(compared[1:]), "borrowed": stats(borrowed[1:]),
            "dirty_mib": DIRTY_MIB, "big_paused": stats(big_pause),
            "big_stored": stats(big_stored), "disk_only_paused": stats(disk_only),
            "restore": stats(restore), "restore_command": stats(restore_command),
            "restore_phases": phases, "restore_standby": restore_standby,
            "restore_prestarted": restore_prestarted,
            "fork": stats(fork), "fork_command": stats(fork_command),
            "fork_phases": fork_phases, "fork_source": fork_source,
            "fork_prestarted": fork_prestarted,
            "fork_latest": stats(latest), "fork_latest_source": latest_source,
            "fork_latest_prestarted": latest_prestarted,
            "qemu_save_paused": stats(qemu_save), "qemu_restore": stats(qemu_restore),
            "qemu_restore_command": stats(qemu_command),
            "qemu_saved_bytes": saved_bytes, "unwarmed_stored": stats(unwarmed[1:])}


def full_ram_save_restore(store: Store, base: Path, image, work: Path):
    """QEMU's own way: the whole RAM migrated to a file while paused, and a
    new QEMU started with -incoming from it. On a VM with anonymous RAM."""
    from blockdiff.vm.qemu import Launch
    from blockdiff.vm.qmp_talk import wait_for_migration

    box = Sandbox.create(store, "full-ram", image=base, kernel=image.directory, memory=False)
    box.start()
    assert box.exec(COUNTER).status == 0
    saved = box.directory / "full-ram.state"
    pauses, restores, commands = [], [], []
    try:
        for _ in range(REBOOT_SAMPLES):
            with box.machine.qmp() as q:
                q.command("stop")
                start = time.monotonic()
                fd = os.open(saved, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
                try:
                    q.pass_fd("full", fd)
                    q.command("migrate", uri="fd:full")
                    wait_for_migration(q, 120, "saving the whole VM")
                    os.fsync(fd)   # durable, as a store commit is
                finally:
                    os.close(fd)
                q.command("cont")
                pauses.append(time.monotonic() - start)
            start = time.monotonic()
            box.machine.kill()
            vm = box.vm
            Launch(vm.name, vm.directory, vm.kernel_dir / "vmlinuz", vm.kernel_dir / "initrd.img",
                   vm.disk, vm.memory_mb, vm.cpus, box.machine.accel or "tcg",
                   incoming=True).start()
            with box.machine.qmp() as q:
                fd = os.open(saved, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    q.pass_fd("full", fd)
                finally:
                    os.close(fd)
                q.command("migrate-incoming", uri="fd:full")
                wait_for_migration(q, 120, "loading the whole VM")
                q.command("cont")
            with box.machine.guest() as link:
                link.ping(timeout=60)
            restores.append(time.monotonic() - start)
            until_running(box)
            commands.append(time.monotonic() - start)
        size = os.path.getsize(saved)
    finally:
        box.destroy()
    return pauses, restores, commands, size


def copy_file(src: Path, dst: Path) -> None:
    subprocess.run(["cp", "--reflink=never", "--sparse=always", str(src), str(dst)], check=True)
    fd = os.open(dst, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def full_copy_pause(box: Sandbox, out: Path) -> float:
    """The VM paused for a full-copy snapshot, flushed and frozen like ours."""
    with box.machine.guest() as link, box.machine.qmp() as q:
        link.freeze()
        try:
            q.command("stop")
            start = time.monotonic()
            try:
                out.unlink(missing_ok=True)
                copy_file(box.disk, out)
            finally:
                q.command("cont")
                paused = time.monotonic() - start
        finally:
            link.thaw()
    return paused


def table(r: dict) -> str:
    if "checkpoint_paused" not in r:
        return memory_table(r)

    def ms(s: float | None) -> str:
        if s is None:
            return "–"
        return f"{s * 1000:.0f} ms" if s < 10 else f"{s:.1f} s"

    rows = [
        ("checkpoint: VM paused", r["checkpoint_paused"], r["full_copy_paused"]),
        ("checkpoint: whole call (freeze, pause, thaw)", r["checkpoint_total"], None),
        ("restore to running: undo the last step (disk swapped, no reboot)",
         r["restore_undo"], r["restore_full_copy"]),
        ("restore to running: random earlier step (disk swapped, no reboot)",
         r["restore_swap"], r["restore_full_copy"]),
        ("restore to running with a reboot", r["restore_reboot"], r["restore_full_copy"]),
        ("fork to running (new VM booted)", r["fork"], r["restore_full_copy"]),
    ]
    out = ["| | p50 | p99 | full copy p50 | full copy / blockdiff |", "|---|---|---|---|---|"]
    for name, ours, theirs in rows:
        line = f"| {name} | {ms(ours['p50'])} | {ms(ours['p99'])} |"
        if theirs:
            line += f" {ms(theirs['p50'])} | {theirs['p50'] / ours['p50']:.0f}× |"
        else:
            line += " | |"
        out.append(line)
    c = r["config"]
    out.append(f"\n{c['steps']} steps, {c['disk_mib']} MiB disk with a {c['pool_mib']} MiB pool, "
               f"{r['machine']['accel']}; the steps changed {human(r['changed_bytes'])} in all. "
               f"Creating the VM (its disk reflinked and committed whole as the root "
               f"snapshot, before it runs) took {ms(r['create_seconds'])}. QEMU's dirty bitmap "
               f"said what to map in {r['checkpoints_tracked']} of {c['steps']} checkpoints "
               f"and {r['swaps_tracked']} of {r['swaps']} swap restores.")
    if "memory" in r:
        out.append("")
        out.append(memory_table(r))
    return "\n".join(out)


def memory_table(r: dict) -> str:
    """The whole-VM rows, against a cold boot, QEMU's full-RAM save/restore
    and the disk-only checkpoint."""
    m = r["memory"]

    def ms(s: float) -> str:
        return f"{s * 1000:.0f} ms" if s < 10 else f"{s:.1f} s"

    def mib(b: float) -> str:
        return f"{b / MiB:.1f} MiB"

    cold, save, load = m["cold_boot"]["p50"], m["qemu_save_paused"]["p50"], m["qemu_restore"]["p50"]
    cold_command, load_command = m["cold_boot_command"]["p50"], m["qemu_restore_command"]["p50"]
    disk = m["disk_only_paused"]["p50"]   # on the same VM, between its whole-VM steps
    out = ["| whole-VM checkpoint | p50 | p99 | against |", "|---|---|---|---|",
           f"| pause, small step | {ms(m['paused']['p50'])} | "
           f"{ms(m['paused']['p99']) if m['paused']['p99'] else '–'} | "
           f"{m['paused']['p50'] / disk:.1f}× the disk-only pause ({ms(disk)}); "
           f"{m['paused']['p50'] / save:.2f}× QEMU's full-RAM save ({ms(save)}) |",
           f"| pause, a step that dirtied {m['dirty_mib']} MiB | "
           f"{ms(m['big_paused']['p50'])} | – | "
           f"{m['big_paused']['p50'] / save:.2f}× QEMU's full-RAM save |",
           f"| restore to running, processes back | {ms(m['restore']['p50'])} | "
           f"{ms(m['restore']['p99']) if m['restore']['p99'] else '–'} | "
           f"{m['restore']['p50'] / cold:.2f}× a cold boot ({ms(cold)}); "
           f"{m['restore']['p50'] / load:.2f}× QEMU's full-RAM restore ({ms(load)}) |",
           f"| … and a first command run | {ms(m['restore_command']['p50'])} | "
           f"{ms(m['restore_command']['p99']) if m['restore_command']['p99'] else '–'} | "
           f"{m['restore_command']['p50'] / cold_command:.2f}× a cold boot and a command "
           f"({ms(cold_command)}); {m['restore_command']['p50'] / load_command:.2f}× "
           f"QEMU's ({ms(load_command)}) |",
           f"| fork to running, processes back | {ms(m['fork']['p50'])} | – | "
           f"{m['fork']['p50'] / cold:.2f}× a cold boot |",
           f"| … and a first command run | {ms(m['fork_command']['p50'])} | – | "
           f"{m['fork_command']['p50'] / cold_command:.2f}× a cold boot and a command |",
           f"| fork of the checkpoint just taken, to running | "
           f"{ms(m['fork_latest']['p50'])} | – | {m['fork_latest']['p50'] / cold:.2f}× a cold "
           f"boot |",
           f"| stored per small step (RAM + device state) | {mib(m['stored']['p50'])} | – | "
           f"of {mib(m['compared']['p50'])} whose extents moved; {mib(m['borrowed']['p50'])} "
           f"more point into the disk snapshot's layer (page cache of what the step wrote); "
           f"QEMU's full-RAM save: "
           f"{mib(m['qemu_saved_bytes'])}; without the 4 KiB warm-up: "
           f"{mib(m['unwarmed_stored']['p50'])} |",
           f"| stored per {m['dirty_mib']} MiB step | {mib(m['big_stored']['p50'])} | – | |",
           f"\n{m['memory_mb']} MiB of guest RAM, {m['steps']} small steps with a process "
           f"running; the first checkpoint after the boot stored {mib(m['stored']['first'])}; "
           f"the standby memory image was used by {sum(m['restore_standby'])} of "
           f"{len(m['restore_standby'])} restores, a QEMU started ahead by "
           f"{sum(m['restore_prestarted'])}; of {len(m['fork_source'])} forks, "
           f"{m['fork_source'].count('spare')} took the spares and "
           f"{m['fork_source'].count('standby copy')} copied the standby (the other "
           f"forks follow them closely), {sum(m['fork_prestarted'])} took a QEMU started "
           f"ahead; {m['fork_latest_source'].count('spare')} of "
           f"{len(m['fork_latest_source'])} forks of the checkpoint just taken took the "
           f"spares, {sum(m['fork_latest_prestarted'])} a QEMU started ahead."]
    answering = guest_cpu(m["fork_phases"], r["machine"]["cpus"])
    if answering:
        out.append(f"Forks' guests answered their resume in "
                   f"{', '.join(ms(a.seconds) for a in answering)}; meanwhile their "
                   f"QEMU ran {', '.join(f'{a.qemu:.0%}' for a in answering)} of a core "
                   f"and faulted {', '.join(str(a.major_faults) for a in answering)} times "
                   f"on pages not in the page cache, and the host's cores were "
                   f"{', '.join(f'{a.host:.0%}' for a in answering)} busy.")
    return "\n".join(out)


class Answer(NamedTuple):
    seconds: float        # from the resume's request to the guest's answer
    qemu: float           # share of a core the fork's QEMU ran meanwhile
    host: float           # share of the host's cores that were busy
    major_faults: int     # QEMU's page faults that read the disk


def guest_cpu(phases: list[dict], cpus: int) -> list[Answer]:
    """For each launch whose phases say what ran while its guest answered,
    by seconds: what ran and what was read meanwhile."""
    return sorted(Answer(p["guest"], p["guest-qemu-cpu"] / p["guest"],
                         p["guest-host-cpu"] / (p["guest"] * cpus),
                         p.get("guest-major-faults", 0))
                  for p in phases if "guest-qemu-cpu" in p and p["guest"] > 0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--disk-mib", type=int, default=4096)
    ap.add_argument("--pool-mib", type=int, default=1024)
    ap.add_argument("--memory-steps", type=int, default=20,
                    help="small steps of the whole-VM part (20)")
    ap.add_argument("--memory-only", action="store_true",
                    help="run the whole-VM part alone (its rows only)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    ap.add_argument("--plot", metavar="OUT", type=Path,
                    help="also draw the results to OUT.png and OUT.svg (bench/plots.py)")
    ap.add_argument("--workdir", default=DEFAULT_TMP_DIR,
                    help=f"where the image cache and scratch filesystem go ({DEFAULT_TMP_DIR})")
    args = ap.parse_args(argv)
    if args.steps < 2 or args.pool_mib < 1 or args.pool_mib * 2 > args.disk_mib:
        ap.error("need at least 2 steps and a pool of at most half the disk")
    if args.memory_steps < 6:
        ap.error("need at least 6 memory steps")
    if os.geteuid() != 0:
        sys.exit("bench/vm_bench.py: needs root (loop mounts)")
    results = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))
    if args.plot:
        from plots import vm_figure

        for path in vm_figure(results, args.plot):
            print(f"drew {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
