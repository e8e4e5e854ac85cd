"""SIGKILL at many points of commit, restore, rm and gc: the store stays
consistent and every snapshot committed before restores byte for byte."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from blockdiff.store.store import Store
from scenarios import make_base_image

pytestmark = [pytest.mark.slow]

SIZE = 8 * 1024 * 1024

# Runs store operations in a loop until killed; prints each committed id with
# the SHA-256 of what it committed, so the test knows what every id must hold.
_WORKER = r"""
import hashlib, os, random, sys
from blockdiff.store.retention import Policy
from blockdiff.store.store import Store

store = Store(sys.argv[1])
image, op = sys.argv[2], sys.argv[3]
rng = random.Random(int(sys.argv[4]))
snaps = [s.id for s in store.log()]
while True:
    if op == "commit":
        with open(image, "r+b") as f:
            for _ in range(20):
                f.seek(rng.randrange(0, 2048) * 4096)
                f.write(rng.randbytes(4096))
            if rng.random() < 0.3:
                f.truncate(rng.randrange(1, 3 * 1024 * 1024) * 4 + 1)
        digest = hashlib.sha256(open(image, "rb").read()).hexdigest()
        snap = store.commit(image, parent=snaps[-1] if snaps else None)
        print(snap.id, digest, flush=True)
        snaps.append(snap.id)
    elif op == "restore":
        store.restore(rng.choice(snaps), image)
        store.restore(rng.choice(snaps), image + f".fork{rng.randrange(1000)}")
    elif op == "rm":
        victim = rng.choice(store.log()[1:] or [None])
        if victim is not None:
            store.rm(victim.id)
    elif op == "gc":
        store.gc(Policy(keep_last=rng.randrange(3, 8)))
"""


def _digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _check(store: Store, expected: dict[str, str], directory) -> None:
    assert store.verify() == {}
    live = {s.id for s in store.log()}
    for snap_id in live:
        out = directory / f"check-{snap_id}.img"
        store.restore(snap_id, out)
        assert _digest(out) == expected[snap_id], f"snapshot {snap_id} changed"
        out.unlink()


@pytest.mark.parametrize("op", ["commit", "restore", "rm", "gc"])
def test_sigkill_at_many_points(xfs, op):
    store_dir = xfs / "store"
    Store.init(store_dir).close()
    image = xfs / "disk.img"
    make_base_image(image, SIZE, 1)
    expected: dict[str, str] = {}
    rng = random.Random(op)
    # Some history first, so restore, rm and gc have something to work on.
    with Store(store_dir) as store:
        for step in range(8):
            with open(image, "r+b") as f:
                f.seek(step * 65536)
                f.write(os.urandom(65536))
            expected[store.commit(image).id] = _digest(image)
    for attempt in range(12):
        proc = subprocess.Popen([sys.executable, "-c", _WORKER, str(store_dir), str(image),
                                 op, str(attempt)], stdout=subprocess.PIPE, text=True)
        time.sleep(rng.uniform(0.05, 0.6))
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate()
        # Killed by us, not ended on its own: a worker that fails at once
        # would leave nothing to check, and the test would prove nothing.
        assert proc.returncode == -signal.SIGKILL, (proc.returncode, out)
        # Complete lines only: the kill may cut the last one short, and its
        # snapshot is then checked below as one of unknown content.
        for line in out.split("\n")[:-1]:
            fields = line.split()
            assert len(fields) == 2, f"the worker printed {line!r} in {out!r}"
            expected[fields[0]] = fields[1]
        with Store(store_dir) as store:
            # A commit killed after its catalog transaction but before printing
            # is a snapshot we cannot check by content; it must still verify.
            unknown = {s.id for s in store.log()} - set(expected)
            for snap_id in unknown:
                out_path = xfs / "unknown.img"
                store.restore(snap_id, out_path)
                expected[snap_id] = _digest(out_path)
                out_path.unlink()
            _check(store, expected, xfs)
        for leftover in xfs.glob("disk.img.fork*"):
            leftover.unlink()
