"""Random sequences of operations on two hosts of one shared store, with
faults injected between and inside them, against a model of every
snapshot's bytes.

Two hosts are two store directories on two XFS filesystems, sharing one
PostgreSQL catalog and one bucket of a SeaweedFS server of the test's own
(it is stopped and started). Each step picks a host and one of: commit
(after random writes to the host's image), restore in place, fork (restore
to a new path), rm, compact, gc (``--cache-size 0``: every uploaded copy
evicted, the objects swept), push and pull. Some steps run in-process through the
library, others as ``python3 -m blockdiff`` in a process of their own; a
fault may be injected into a step:

- kill: the command's process gets SIGKILL at a random moment;
- object store down: SeaweedFS stopped before the step, started after it;
- PostgreSQL restarted before the step, or while a command runs;
- clock: this process's wall clock (``time.time`` as blockdiff's modules
  read it) stepped an hour forward or back, for the
  rest of the sequence.

After every step: the catalog's snapshots are the model's (a killed command
may or may not have done its work: what it did is read back from the
catalog); every snapshot the catalog says is durable restores byte for byte
on both hosts, and every local one on its host; no snapshot durable before
the step is less than durable after it unless it was removed; an image
forked by a killed command is either absent or exact. After a gc: nothing
is left behind, that is the host's ``objects/`` holds only what rows name,
and once the sweep's grace period is over the bucket holds only what rows
name.

Why a seeded random sequence and not hypothesis's state machine: with real
servers and SIGKILL at random moments, a run depends on timing as well as
on its steps, so hypothesis's replay and shrinking would only call a
failure flaky. Each run prints its seed and logs every step; a failure
names the step, and the seed replays the same steps.

Budget: 24 steps in CI (about two minutes here), 6 at
``BLOCKDIFF_TEST_BUDGET=small``, 2000 at ``full`` (a soak; see tests/budget.py);
``BLOCKDIFF_FAULT_SEED`` replays a run.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
import sys
import threading
import time
import types
import uuid
from pathlib import Path

import budget
import objectstore
import pytest
from objectstore import once_back, point_boto3_at, running_seaweedfs

from blockdiff.errors import BlockdiffError, RemoteError
from blockdiff.store import Store
from blockdiff.store.objects import layer_name, map_name
from blockdiff.store.remote import layer_key, map_key

pytestmark = [pytest.mark.services, pytest.mark.slow]

BLOCK = 4096
IMAGE = 2 << 20
STEPS = budget.steps(small=6, ci=24, full=2000)
MAX_SNAPSHOTS = 8
# A killed command gets SIGKILL this long after it starts, at most: a
# command takes 1-2 s here, most of it starting the interpreter.
KILL_WITHIN = 2.5
HOUR = 3600.0
# Both ways: a step back once made a commit after an eviction and a fetch
# trust an extent map that no longer held (a copy's wall-clock `placed`
# compared with a snapshot's `created`) and record wrong bytes (seed 3, 40
# steps found it).
CLOCK_STEPS = (-HOUR, HOUR)


class Clock:
    """This process's wall clock as blockdiff's modules read it, stepped by
    ``offset`` seconds (the ``time`` module everywhere else)."""

    def __init__(self):
        self.offset = 0.0
        self.shim = types.SimpleNamespace(**{name: getattr(time, name) for name in dir(time)
                                             if not name.startswith("__")})
        self.shim.time = lambda: time.time() + self.offset

    def install(self, monkeypatch) -> None:
        for name, module in list(sys.modules.items()):
            if name.startswith("blockdiff") and getattr(module, "time", None) is time:
                monkeypatch.setattr(module, "time", self.shim)


class Host:
    """One host: its store (open in this process), its directory and its
    working image with the bytes the model says it holds (None: unknown,
    after a killed restore)."""

    def __init__(self, name: str, root: Path, store: Store):
        self.name, self.root, self.store = name, root, store
        self.image = root.parent / f"work-{name}.img"
        self.content: bytes | None = None


class Run:
    """One sequence: the hosts, the servers, the model and the log."""

    def __init__(self, hosts, server, pg, seed, clock, log):
        self.hosts = hosts
        self.server = server
        self.pg = pg
        self.rng = random.Random(seed)
        self.clock = clock
        self.log = log
        self.expected: dict[str, bytes] = {}      # every live snapshot's bytes
        self.durable: set[str] = set()
        self.counter = 0

    # ------------------------------------------------------------ helpers

    def say(self, what: str) -> None:
        self.log.append(what)
        print(what, flush=True)

    def path(self, host: Host, what: str) -> Path:
        self.counter += 1
        return host.root.parent / f"{what}-{self.counter}.img"

    def cli(self, *args, kill: bool = False, restart_pg: bool = False):
        """``blockdiff ARGS`` in a process of its own; with ``kill``,
        SIGKILLed at a random moment (None then if it was killed). With
        ``restart_pg``, PostgreSQL restarts while it runs."""
        process = subprocess.Popen([sys.executable, "-m", "blockdiff", *map(str, args)],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        restarter = None
        if restart_pg:
            restarter = threading.Timer(self.rng.uniform(0, KILL_WITHIN), self.pg.restart)
            restarter.start()
        try:
            if kill:
                try:
                    out, err = process.communicate(timeout=self.rng.uniform(0, KILL_WITHIN))
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.communicate()
                    self.say("    killed")
                    return None
            else:
                out, err = process.communicate(timeout=300)
        finally:
            if restarter is not None:
                restarter.join()
        assert "Traceback" not in err, err
        return subprocess.CompletedProcess(args, process.returncode, out, err)

    def catalog_ids(self) -> set[str]:
        return {s.id for s in self.hosts[0].store.log()}

    def reconcile(self, committed_bytes: bytes | None = None) -> None:
        """Take in what a command that failed or was killed did: snapshots
        it removed are gone, a snapshot it committed holds ``committed_bytes``."""
        ids = self.catalog_ids()
        for sid in set(self.expected) - ids:
            self.say(f"    {sid} is gone")
            del self.expected[sid]
            self.durable.discard(sid)
        new = ids - set(self.expected)
        assert len(new) <= (1 if committed_bytes is not None else 0), new
        for sid in new:
            self.say(f"    {sid} was committed")
            self.expected[sid] = committed_bytes

    def pick(self) -> str | None:
        return self.rng.choice(sorted(self.expected)) if self.expected else None

    def ensure_image(self, host: Host) -> None:
        """A host's working image with bytes the model knows: restored from
        a snapshot if a killed restore left it unknown, made anew if none."""
        if host.content is not None and host.image.exists():
            return
        for sid in sorted(self.expected):
            try:
                host.store.restore(sid, host.image)
            except BlockdiffError:
                continue
            host.content = host.image.read_bytes()
            assert host.content == self.expected[sid]
            return
        host.image.unlink(missing_ok=True)
        host.image.write_bytes(bytes(IMAGE))
        host.content = bytes(IMAGE)

    def scribble(self, host: Host) -> None:
        data = bytearray(host.content)
        with open(host.image, "r+b") as f:
            for _ in range(self.rng.randint(1, 4)):
                at = self.rng.randrange(IMAGE // BLOCK - 4) * BLOCK
                chunk = self.rng.randbytes(self.rng.randint(1, 4) * BLOCK)
                f.seek(at)
                f.write(chunk)
                data[at:at + len(chunk)] = chunk
        host.content = bytes(data)

    # ---------------------------------------------------------- operations

    def commit(self, host: Host, fault: str) -> None:
        self.ensure_image(host)
        self.scribble(host)
        if fault in ("kill", "pg-during"):
            done = self.cli("commit", "--store", host.root, host.image,
                            kill=fault == "kill", restart_pg=fault == "pg-during")
            if done is not None and done.returncode not in (0, 14):
                assert done.returncode in (13,), done.stderr
            self.reconcile(host.content)
            return
        try:
            snap = host.store.commit(host.image)
        except RemoteError:
            assert fault == "remote-down"
            self.reconcile(host.content)
            return
        self.expected[snap.id] = host.content

    def restore_in_place(self, host: Host, fault: str) -> None:
        sid = self.pick()
        if sid is None:
            return
        self.ensure_image(host)
        if fault in ("kill", "pg-during"):
            done = self.cli("restore", "--store", host.root, sid, host.image,
                            kill=fault == "kill", restart_pg=fault == "pg-during")
            if done is None or done.returncode != 0:
                host.content = None       # whatever it wrote is not vouched for
                self.reconcile()
                return
        else:
            try:
                host.store.restore(sid, host.image)
            except BlockdiffError as e:
                self.allowed_failure(sid, fault, e)
                host.content = None
                return
        host.content = host.image.read_bytes()
        assert host.content == self.expected[sid], f"in-place restore of {sid} on {host.name}"

    def fork(self, host: Host, fault: str) -> None:
        sid = self.pick()
        if sid is None:
            return
        out = self.path(host, "fork")
        if fault in ("kill", "pg-during"):
            done = self.cli("restore", "--store", host.root, sid, out,
                            kill=fault == "kill", restart_pg=fault == "pg-during")
            if done is not None and done.returncode != 0:
                assert not out.exists()
        else:
            try:
                host.store.restore(sid, out)
            except BlockdiffError as e:
                self.allowed_failure(sid, fault, e)
                assert not out.exists()
        if out.exists():
            assert out.read_bytes() == self.expected[sid], f"fork of {sid} on {host.name}"
            out.unlink()

    def rm(self, host: Host, fault: str) -> None:
        sid = self.pick()
        if sid is None:
            return
        if fault in ("kill", "pg-during"):
            self.cli("rm", "--store", host.root, sid, kill=fault == "kill",
                     restart_pg=fault == "pg-during")
            self.reconcile()
            return
        try:
            host.store.rm(sid)
        except BlockdiffError as e:
            # Refused while the object store is down, or while a snapshot
            # built on it is only on the other host: then nothing was removed.
            assert ((fault == "remote-down" and isinstance(e, RemoteError))
                    or "not in the object store yet" in str(e)), e
            assert sid in self.catalog_ids()
            return
        del self.expected[sid]
        self.durable.discard(sid)

    def compact(self, host: Host, fault: str) -> None:
        """Compacting changes no snapshot's bytes, and (checked after the
        step) leaves every durable snapshot durable: the new layer and maps
        are uploaded before the rows switch, or nothing changes."""
        sid = self.pick()
        if sid is None:
            return
        if fault in ("kill", "pg-during"):
            done = self.cli("compact", "--store", host.root, sid, kill=fault == "kill",
                            restart_pg=fault == "pg-during")
            if done is not None and done.returncode != 0:
                assert done.returncode in (6, 13, 14), done.stderr
            self.reconcile()
            return
        before = host.store.get(sid).map_sha256
        try:
            host.store.compact(sid)
        except BlockdiffError as e:
            # Refused while the object store is down, or for a snapshot
            # whose layers are only on the other host: then nothing changed.
            assert ((fault == "remote-down" and isinstance(e, RemoteError))
                    or "not in the object store yet" in str(e)), e
            assert host.store.get(sid).map_sha256 == before
            return

    def gc(self, host: Host, fault: str) -> None:
        done = self.cli("gc", "--store", host.root, "--cache-size", "0",
                        kill=fault == "kill", restart_pg=fault == "pg-during")
        self.reconcile()
        if done is None or done.returncode != 0:
            assert done is None or done.returncode in (13, 14), done.stderr
            return
        self.check_left_behind(host)

    def push(self, host: Host, fault: str) -> None:
        done = self.cli("push", "--store", host.root, kill=fault == "kill",
                        restart_pg=fault == "pg-during")
        if done is not None and done.returncode != 0:
            assert done.returncode in (13, 14), done.stderr

    def pull(self, host: Host, fault: str) -> None:
        sid = self.pick()
        if sid is None:
            return
        done = self.cli("pull", "--store", host.root, sid, kill=fault == "kill",
                        restart_pg=fault == "pg-during")
        if done is not None and done.returncode != 0:
            assert done.returncode in (6, 13, 14), done.stderr

    def allowed_failure(self, sid: str, fault: str, error: BlockdiffError) -> None:
        """A restore may fail only while the object store is down, or for a
        snapshot not uploaded yet from another host."""
        if fault == "remote-down" and isinstance(error, RemoteError):
            return
        assert sid not in self.durable, f"durable {sid} failed to restore: {error}"
        assert "not in the object store yet" in str(error), error

    # ------------------------------------------------------------- checks

    def check(self) -> None:
        """What must hold between steps (see the module's docstring)."""
        assert self.catalog_ids() == set(self.expected)
        for host in self.hosts:
            placement = {p.snapshot: p for p in host.store.placement()}
            now_durable = {sid for sid, p in placement.items() if p.durable}
            lost = self.durable - now_durable
            assert not lost, f"no longer durable: {lost}"
            for sid, p in placement.items():
                if not (p.durable or p.here):
                    continue
                out = self.path(host, "check")
                host.store.restore(sid, out)
                assert out.read_bytes() == self.expected[sid], f"{sid} on {host.name}"
                out.unlink()
        self.durable = now_durable

    def check_left_behind(self, host: Host) -> None:
        """After a gc on ``host``: its objects/ holds only what rows name,
        and the bucket, once the grace period is over, too."""
        store = host.store
        snaps = store.log()
        named = {store.map_path(s).name for s in snaps}
        named |= {layer_name(x) for x in store.catalog.copies_here()}
        assert {p.name for p in store.objects.iterdir()} <= named
        # A killed fetch's or push's staged files (and the temporary files
        # beside them) are swept once their process is gone.
        assert list(store.staging.iterdir()) == []
        # The bucket: sweep as if the grace period were over, then only
        # what the rows name (and the maps a removal may be rewriting) stays.
        replication_sweep(store)
        keys = {info.key for info in store.remote.list("")}
        wanted = {layer_key(layer_name(x)) for x in store.catalog.layer_ids()}
        wanted |= {map_key(map_name(s.id, s.map_sha256)) for s in snaps}
        rewritable = {s.id for s in snaps if s.map_base is not None}
        extra = {k for k in keys - wanted
                 if not (k.startswith("maps/") and k[5:].split(".")[0] in rewritable)}
        assert not extra, f"left in the bucket: {sorted(extra)}"

    # --------------------------------------------------------------- faults

    def remote_up(self) -> None:
        if self.server.process is None:
            self.server.start()

    def step(self, number: int) -> None:
        host = self.rng.choice(self.hosts)
        operation = self.rng.choice(["commit", "commit", "restore_in_place", "fork", "rm",
                                     "compact", "gc", "push", "pull"])
        if len(self.expected) >= MAX_SNAPSHOTS and operation == "commit":
            operation = "rm"
        fault = self.rng.choice(["none", "none", "none", "kill", "kill", "remote-down",
                                 "pg-before", "pg-during", "clock"])
        if fault == "pg-during" and operation not in ("gc", "push", "pull"):
            fault = "kill" if self.rng.random() < 0.5 else "pg-during"
        self.say(f"step {number}: {operation} on {host.name} ({fault})")
        if fault == "remote-down":
            self.server.stop()
        elif fault == "pg-before":
            self.pg.restart()
        elif fault == "clock":
            self.clock.offset += self.rng.choice(CLOCK_STEPS)
            self.say(f"    clock offset {self.clock.offset:+.0f} s")
        try:
            getattr(self, operation)(host, fault)
        finally:
            self.remote_up()
        once_back(self.check)


def replication_sweep(store: Store) -> None:
    from blockdiff.store import replication
    once_back(lambda: replication.sweep_remote(store, grace=0))


def test_two_hosts_under_faults_keep_every_durable_snapshot_exact(
        xfs, second_xfs, postgres_server, postgres_url, tmp_path, monkeypatch):
    objectstore._require_seaweedfs()
    seed = int(os.environ.get("BLOCKDIFF_FAULT_SEED", random.randrange(1 << 32)))
    print(f"BLOCKDIFF_FAULT_SEED={seed}")
    log: list[str] = []
    other = second_xfs / f"b-{uuid.uuid4().hex[:8]}"
    other.mkdir()
    clock = Clock()
    with running_seaweedfs(tmp_path / "weed") as server, contextlib.ExitStack() as stack:
        point_boto3_at(server, monkeypatch, tmp_path)
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
        a = stack.enter_context(Store.init(xfs / "store", catalog=postgres_url,
                                           remote=f"s3://{server.bucket}/faults"))
        b = stack.enter_context(Store.init(other / "store", catalog=postgres_url))
        clock.install(monkeypatch)
        run = Run([Host("A", a.root, a), Host("B", b.root, b)], server, postgres_server,
                  seed, clock, log)
        try:
            for number in range(STEPS):
                run.step(number)
        except BaseException:
            print(f"failed with BLOCKDIFF_FAULT_SEED={seed} after:\n" + "\n".join(log))
            raise
        finally:
            run.remote_up()
            if postgres_server.process is None:
                postgres_server.start()
    shutil.rmtree(other, ignore_errors=True)
