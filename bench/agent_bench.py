"""What an agent checkpoint costs per step, with and without a disk snapshot.

    python bench/agent_bench.py [--steps N] [--image-mib N] [--no-vm] [--json out.json]

On a scratch XFS (reflink=1) loop mount, N steps (100) of an agent whose
state holds a plan of 50 items and a growing list of results (a few KiB of
JSON), each step also making one journalled tool call:

- no disk: the state, messages and journal only (SQLite, synchronous=FULL);
- the same, sealed with AES-256-GCM;
- an image disk: the step writes 100 random 4 KiB blocks into a
  ``--image-mib`` image (1024) and the checkpoint commits it to the store;
- a VM: the step runs a command in a sandbox VM (TCG where KVM does not work)
  that writes 100 random 4 KiB blocks, and the checkpoint freezes, pauses,
  commits and resumes it.

Per step it reports the checkpoint's p50/p99 and the part of it spent on the
disk, and the journalled tool call's overhead over calling the tool directly.
Needs root and xfsprogs (and QEMU for the VM row).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
# This checkout's blockdiff first, not whichever one pip installed last.
sys.path[:0] = [HERE, os.path.dirname(HERE)]

try:
    from store_bench import stats

    from blockdiff.agent.agent import Agent, Tool
    from blockdiff.agent.disks import ImageDisk
    from blockdiff.agent.sealing import new_key
    from blockdiff.demo import scratch
    from blockdiff.store.store import Store
except ImportError as e:
    sys.exit(f"bench/agent_bench.py: {e}")

MiB = 1 << 20
DEFAULT_TMP_DIR = "/var/tmp/blockdiff-agent-bench"


def echo_tool(args, request_id):
    return {"echo": args, "id": request_id}


def run_case(store: Store, thread: str, steps: int, *, disk=None, key=None,
             work=None) -> dict:
    """Steps of an agent; ``work(k)`` changes the sandbox in step k."""
    checkpoint, disk_part, calls = [], [], []
    with Agent(store, thread, disk=disk, key=key, tools=[Tool("echo", echo_tool)]) as agent:
        agent.state = {"plan": [f"item {i}: do something useful" for i in range(50)],
                       "results": [], "cursor": 0}
        for k in range(steps):
            with agent.step(f"step {k}") as step:
                if work is not None:
                    work(k)
                start = time.perf_counter()
                result = step.call("echo", {"k": k})
                calls.append(time.perf_counter() - start)
                step.state["results"].append(result)
                step.state["cursor"] = k + 1
                step.messages.append({"role": "tool", "content": f"step {k} done"})
            checkpoint.append(step.result.seconds)
            disk_part.append(step.result.disk_seconds)
    direct = []
    for k in range(steps):
        start = time.perf_counter()
        echo_tool({"k": k}, "x")
        direct.append(time.perf_counter() - start)
    return {"checkpoint": stats(checkpoint), "disk": stats(disk_part), "call": stats(calls),
            "direct_call": stats(direct)}


def random_blocks(path: Path, size: int, rng: random.Random):
    def work(k: int) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            for block in rng.sample(range(size // 4096), 100):
                os.pwrite(fd, rng.randbytes(4096), block * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
    return work


def run(args) -> dict:
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    size = args.image_mib * MiB
    results = {}
    with scratch.mounted_filesystem("xfs", tmp_dir=work / "scratch",
                                    size=3 * size + 4096 * MiB) as mnt:
        store = Store.init(mnt / "store")
        results["no disk"] = run_case(store, "plain", args.steps)
        results["no disk, sealed"] = run_case(store, "sealed", args.steps, key=new_key())
        image = mnt / "disk.img"
        with open(image, "wb") as f:
            for _ in range(args.image_mib):
                f.write(rng.randbytes(MiB))
        os.sync()
        results["image disk"] = run_case(store, "image", args.steps,
                                         disk=ImageDisk(store, image),
                                         work=random_blocks(image, size, rng))
        if not args.no_vm and shutil.which("qemu-system-x86_64"):
            results["VM"] = run_vm(store, work, args.steps)
        store.close()
    return {"config": {"steps": args.steps, "image_mib": args.image_mib}, "rows": results}


def run_vm(store: Store, work: Path, steps: int) -> dict:
    from blockdiff.vm.image import build_image
    from blockdiff.vm.sandbox import Sandbox

    image = build_image(work / "vm-image")
    box = Sandbox.create(store, "agent-bench", image=image.rootfs)
    try:
        box.start()
        box.exec("dd if=/dev/urandom of=/root/pool bs=1M count=64 2>/dev/null")

        def work_in_guest(k: int) -> None:
            offsets = " ".join(str(random.Random(k).randrange(16384)) for _ in range(100))
            box.exec(f"for o in {offsets}; do dd if=/dev/urandom of=/root/pool bs=4k count=1 "
                     f"seek=$o conv=notrunc 2>/dev/null; done")
        return run_case(store, "vm", steps, disk=box, work=work_in_guest)
    finally:
        box.destroy()


def table(r: dict) -> str:
    def ms(s):
        return "–" if s is None else f"{s * 1000:.1f} ms"

    out = ["| per step | checkpoint p50 | p99 | of which disk (p50) | journalled call p50 "
           "(direct) |", "|---|--:|--:|--:|--:|"]
    for name, row in r["rows"].items():
        out.append(f"| {name} | {ms(row['checkpoint']['p50'])} | {ms(row['checkpoint']['p99'])} "
                   f"| {ms(row['disk']['p50'])} | {ms(row['call']['p50'])} "
                   f"({row['direct_call']['p50'] * 1e6:.1f} µs) |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--image-mib", type=int, default=1024)
    ap.add_argument("--no-vm", action="store_true", help="leave out the VM row")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--workdir", default=DEFAULT_TMP_DIR)
    args = ap.parse_args(argv)
    if args.steps < 1 or args.image_mib < 1:
        ap.error("need at least one step and a 1 MiB image")
    if os.geteuid() != 0:
        sys.exit("bench/agent_bench.py: needs root (loop mounts)")
    results = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
