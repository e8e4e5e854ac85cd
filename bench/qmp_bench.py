"""What QMP costs a checkpoint's pause: blockdiff's own QMP client next to
QEMU's ``qemu.qmp`` library, on one QEMU process, in the same run.

    python bench/qmp_bench.py [--rounds N] [--json out.json]

A checkpoint pauses the VM with ``stop`` and resumes it with ``cont``; what
lies between is the snapshot's work, so the client's share of the pause is
the round trip of those two commands. Rows, each timed N times (400):
- connect: open the control socket, read the greeting, ``qmp_capabilities``;
- stop + cont: the two round trips that bracket a pause;
- query-status: one round trip with a reply to decode.
The QEMU is a paused q35 machine with no disk (``-S``), under TCG.

Needs QEMU (qemu-system-x86_64) and ``pip install qemu.qmp``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _percentiles(samples: list[float]) -> dict:
    a = np.asarray(samples) * 1e6
    return {"n": len(a), "p50_us": float(np.percentile(a, 50)),
            "p99_us": float(np.percentile(a, 99)), "min_us": float(a.min())}


def _start_qemu(directory: Path) -> subprocess.Popen:
    qemu = shutil.which("qemu-system-x86_64")
    if qemu is None:
        sys.exit("bench/qmp_bench.py: qemu-system-x86_64 not found (apt-get install "
                 "qemu-system-x86)")
    sock = directory / "qmp.sock"
    proc = subprocess.Popen([qemu, "-machine", "q35", "-accel", "tcg", "-m", "64", "-S",
                             "-display", "none", "-nodefaults", "-no-user-config",
                             "-qmp", f"unix:{sock},server=on,wait=off"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while not sock.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            sys.exit(f"bench/qmp_bench.py: QEMU did not start: {proc.stderr.read().decode()}")
        time.sleep(0.01)
    return proc


def _time(rounds: int, operation) -> list[float]:
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        operation()
        samples.append(time.perf_counter() - start)
    return samples


def ours(sock: str, rounds: int) -> dict:
    from blockdiff.vm.qemu import QMP

    rows = {"connect": _time(rounds, lambda: QMP(sock).close())}
    with QMP(sock) as q:
        rows["stop + cont"] = _time(rounds, lambda: (q.command("stop"), q.command("cont")))
        q.command("stop")
        rows["query-status"] = _time(rounds, lambda: q.command("query-status"))
    return rows


def library_sync(sock: str, rounds: int) -> dict:
    """qemu.qmp's synchronous client, as synchronous code like the sandbox's
    would use it."""
    from qemu.qmp.legacy import QEMUMonitorProtocol

    def connect():
        q = QEMUMonitorProtocol(sock)
        q.connect()
        q.close()

    rows = {"connect": _time(rounds, connect)}
    q = QEMUMonitorProtocol(sock)
    q.connect()
    try:
        rows["stop + cont"] = _time(rounds, lambda: (q.cmd("stop"), q.cmd("cont")))
        q.cmd("stop")
        rows["query-status"] = _time(rounds, lambda: q.cmd("query-status"))
    finally:
        q.close()
    return rows


def library_async(sock: str, rounds: int) -> dict:
    """qemu.qmp's native asyncio client inside one running event loop: its
    best case, for a caller that is asynchronous already."""
    from qemu.qmp import QMPClient

    async def run() -> dict:
        async def timed(operation) -> list[float]:
            samples = []
            for _ in range(rounds):
                start = time.perf_counter()
                await operation()
                samples.append(time.perf_counter() - start)
            return samples

        async def connect():
            client = QMPClient("bench")
            await client.connect(sock)
            await client.disconnect()

        rows = {"connect": await timed(connect)}
        client = QMPClient("bench")
        await client.connect(sock)
        try:
            async def stop_cont():
                await client.execute("stop")
                await client.execute("cont")

            rows["stop + cont"] = await timed(stop_cont)
            await client.execute("stop")
            rows["query-status"] = await timed(lambda: client.execute("query-status"))
        finally:
            await client.disconnect()
        return rows

    return asyncio.run(run())


CLIENTS = {"blockdiff QMP": ours, "qemu.qmp (sync)": library_sync,
           "qemu.qmp (asyncio)": library_async}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="qmp-bench-") as tmp:
        proc = _start_qemu(Path(tmp))
        try:
            sock = str(Path(tmp) / "qmp.sock")
            results = {name: {row: _percentiles(s) for row, s in run(sock, args.rounds).items()}
                       for name, run in CLIENTS.items()}
        finally:
            proc.kill()
            proc.wait()
    ours_row = results["blockdiff QMP"]
    print("| client | connect p50 | stop + cont p50 (p99) | query-status p50 | "
          "stop + cont / ours |")
    print("|---|---|---|---|---|")
    for name, rows in results.items():
        pause = rows["stop + cont"]
        print(f"| {name} | {rows['connect']['p50_us']:,.0f} µs | {pause['p50_us']:,.0f} µs "
              f"({pause['p99_us']:,.0f}) | {rows['query-status']['p50_us']:,.0f} µs | "
              f"{pause['p50_us'] / ours_row['stop + cont']['p50_us']:.2f}× |")
    print(f"\n{args.rounds} rounds each, one QEMU (q35, TCG, paused), {os.cpu_count()} CPUs.")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
