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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

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
        start = time.monotonic()
        box = Sandbox.create(store, "bench", image=base, kernel=image.directory)
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
    }


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
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--disk-mib", type=int, default=4096)
    ap.add_argument("--pool-mib", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    ap.add_argument("--plot", metavar="OUT", type=Path,
                    help="also draw the results to OUT.png and OUT.svg (bench/plots.py)")
    ap.add_argument("--workdir", default=DEFAULT_TMP_DIR,
                    help=f"where the image cache and scratch filesystem go ({DEFAULT_TMP_DIR})")
    args = ap.parse_args(argv)
    if args.steps < 2 or args.pool_mib < 1 or args.pool_mib * 2 > args.disk_mib:
        ap.error("need at least 2 steps and a pool of at most half the disk")
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
