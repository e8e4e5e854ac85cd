"""Store operations racing each other in separate processes (the command line).

Each test runs real ``blockdiff`` processes side by side on one store for a
fixed number of iterations, then checks what the store guarantees whatever
the interleaving:

- a commit that printed an id made a snapshot that ``log`` lists and that
  restores to exactly the bytes the image had when it was committed, until
  it is removed;
- ``blockdiff verify`` exits 0;
- an operation that cannot be done fails with one line on stderr, never with
  a traceback, and never reports success while leaving damage behind.

Nothing here waits for a particular interleaving: the checks hold for every
one of them, so a correct store passes however the processes are scheduled.
Every process is killed (SIGKILL) and waited for at the end, also on failure.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import blockdiff
from blockdiff.store.store import Store
from scenarios import make_base_image
from sweeper import SWEEPER

pytestmark = [pytest.mark.slow]

BLOCK = 4096
SIZE = 8 * 1024 * 1024
CALL_TIMEOUT = 30      # seconds one command may take before it counts as hung
RACE_BUDGET = 40       # seconds after which the loops start no new iteration

# The processes run the same blockdiff as the tests, wherever it is imported from.
_PACKAGE_ROOT = str(Path(blockdiff.__file__).resolve().parent.parent)


def _env() -> dict:
    env = dict(os.environ)
    env.pop("BLOCKDIFF_STORE", None)
    env["PYTHONPATH"] = os.pathsep.join(
        [_PACKAGE_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def _digest_file(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _rewrite_blocks(path, rng: random.Random, count: int) -> None:
    """Rewrite ``count`` random 4 KiB blocks of an image and fsync it."""
    fd = os.open(path, os.O_RDWR)
    try:
        nblocks = os.fstat(fd).st_size // BLOCK
        for _ in range(count):
            os.pwrite(fd, rng.randbytes(BLOCK), rng.randrange(nblocks) * BLOCK)
        os.fsync(fd)
    finally:
        os.close(fd)


class Race:
    """Loops of ``blockdiff`` commands in threads, each command its own process.

    Every command's outcome is recorded; ``close`` stops the loops, SIGKILLs
    whatever still runs and waits for every process and thread.
    """

    def __init__(self):
        self.stop = threading.Event()
        self.deadline = time.monotonic() + RACE_BUDGET
        self.lock = threading.Lock()
        self.running: set[subprocess.Popen] = set()
        self.threads: list[threading.Thread] = []
        self.errors: list[str] = []       # exceptions in the loops themselves
        self.late = False                 # a loop gave up at the deadline
        self.env = _env()

    def run(self, *args) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-m", "blockdiff", *map(str, args)]
        with self.lock:
            if self.stop.is_set():
                raise RuntimeError("the race was stopped")
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, env=self.env, start_new_session=True)
            self.running.add(proc)
        try:
            try:
                out, err = proc.communicate(timeout=CALL_TIMEOUT)
            except subprocess.TimeoutExpired:
                _kill(proc)
                out, err = proc.communicate()
                err += f"\n[{' '.join(map(str, args))}: still running after {CALL_TIMEOUT} s]"
            return subprocess.CompletedProcess(argv, proc.returncode, out, err)
        finally:
            with self.lock:
                self.running.discard(proc)

    def background(self, script: str, *args) -> subprocess.Popen:
        """A Python process running ``script`` (with ``args``) beside the loops."""
        proc = subprocess.Popen([sys.executable, "-c", script, *map(str, args)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=self.env, start_new_session=True)
        with self.lock:
            self.running.add(proc)
        return proc

    def finish(self, proc: subprocess.Popen, stop_file: Path) -> subprocess.CompletedProcess:
        """Ask a background process to stop (``stop_file``) and collect it."""
        stop_file.touch()
        try:
            out, err = proc.communicate(timeout=CALL_TIMEOUT)
        except subprocess.TimeoutExpired:
            _kill(proc)
            out, err = proc.communicate()
            err += f"\n[still running {CALL_TIMEOUT} s after it was asked to stop]"
        with self.lock:
            self.running.discard(proc)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def in_time(self) -> bool:
        if time.monotonic() < self.deadline:
            return True
        self.late = True
        return False

    def spawn(self, target, *args) -> threading.Thread:
        def body():
            try:
                target(*args)
            except Exception as e:   # reported by the test, not lost in a thread
                if not self.stop.is_set():
                    self.errors.append(f"{target.__name__}: {type(e).__name__}: {e}")

        thread = threading.Thread(target=body, daemon=True)
        self.threads.append(thread)
        thread.start()
        return thread

    def join(self) -> None:
        """Wait for every loop to end on its own."""
        for thread in self.threads:
            thread.join(RACE_BUDGET + CALL_TIMEOUT)

    def problems(self) -> list[str]:
        """What went wrong in the race itself: errors of its threads, lateness."""
        problems = list(self.errors)
        if self.late:
            problems.append(f"the race did not finish within {RACE_BUDGET} s")
        return problems

    def close(self) -> None:
        self.stop.set()
        with self.lock:
            running = list(self.running)
        for proc in running:
            _kill(proc)
        for thread in self.threads:
            thread.join(CALL_TIMEOUT + 5)
        with self.lock:
            running = list(self.running)
        for proc in running:   # started just before stop was set
            _kill(proc)
            proc.wait()


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _cli(*args) -> subprocess.CompletedProcess:
    """One command outside the race (setup and checks)."""
    return subprocess.run([sys.executable, "-m", "blockdiff", *map(str, args)],
                          capture_output=True, text=True, env=_env(), timeout=CALL_TIMEOUT)


def _one_line_error(proc: subprocess.CompletedProcess) -> bool:
    lines = proc.stderr.strip().splitlines()
    return len(lines) == 1 and lines[0].startswith("blockdiff: error: ")


def _printed_id(proc: subprocess.CompletedProcess) -> str:
    """The id a commit printed as its last line."""
    words = proc.stdout.split()
    return words[-1] if words else "(nothing printed)"


def _describe(what: str, proc: subprocess.CompletedProcess) -> str:
    return f"{what} exited {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}"


def _report(header: str, problems: list[str], directory: Path) -> str:
    """The problems, each once (with how often it came), paths shortened."""
    counts: dict[str, int] = {}
    for problem in problems:
        problem = problem.replace(str(directory), "DIR")
        counts[problem] = counts.get(problem, 0) + 1
    return "\n".join([header] + [p if n == 1 else f"{p}  [{n} times]"
                                  for p, n in counts.items()])


def _no_tracebacks(problems: list[str], outcomes) -> None:
    for what, proc in outcomes:
        if "Traceback" in proc.stderr:
            problems.append(f"{what} printed a traceback:\n{proc.stderr.strip()}")


def _check_store(problems: list[str], store_dir: Path, expected: dict[str, str],
                 scratch: Path) -> set[str]:
    """verify exits 0, and every snapshot in ``expected`` that ``log`` lists
    restores into a new path with exactly that content. Returns the listed ids."""
    verify = _cli("verify", "--store", store_dir)
    if verify.returncode != 0:
        problems.append(_describe("verify", verify))
    log = _cli("log", "--store", store_dir, "--json")
    if log.returncode != 0:
        problems.append(_describe("log", log))
        return set()
    listed = {entry["id"] for entry in json.loads(log.stdout)}
    with Store(store_dir) as store:
        for snap_id, digest in expected.items():
            if snap_id not in listed:
                continue
            out = scratch / f"check-{snap_id}.img"
            try:
                store.restore(snap_id, out)
                if _digest_file(out) != digest:
                    problems.append(f"snapshot {snap_id} restores to other bytes than it "
                                    f"was committed with")
            except Exception as e:
                problems.append(f"restoring snapshot {snap_id}: {type(e).__name__}: {e}")
            finally:
                out.unlink(missing_ok=True)
    return listed




def _start_sweeper(race: Race, scratch: Path, *stores):
    stop = scratch / "stop-sweeper"
    return race.background(SWEEPER, stop, RACE_BUDGET + CALL_TIMEOUT, *stores), stop


def _sweeper_problems(proc: subprocess.CompletedProcess) -> list[str]:
    if proc.returncode != 0 or "Traceback" in proc.stderr:
        return [f"the gc sweep process exited {proc.returncode}:\n{proc.stderr.strip()}"]
    return []


def _gc_loop(race: Race, store_dir: Path, gc_args, done: threading.Event, outcomes) -> None:
    """``blockdiff gc`` one after another until ``done`` (at least once)."""
    while True:
        proc = race.run("gc", "--store", store_dir, *gc_args)
        outcomes.append(("gc", proc))
        if done.is_set() or race.stop.is_set() or not race.in_time():
            return


def _beside_gc(race: Race, scratch: Path, store_dir: Path, gc_args, done: threading.Event,
               gcs: list, workers, others=()) -> subprocess.CompletedProcess:
    """Run the ``workers`` (and ``others``, which stop when ``done`` is set)
    beside a ``blockdiff gc`` loop and a sweeping process, until the workers
    end; then stop the rest and return the sweeper's outcome."""
    # A worker is a function, or a tuple of a function and its arguments.
    started = [race.spawn(*w) if isinstance(w, tuple) else race.spawn(w) for w in workers]
    for other in others:
        race.spawn(other)
    race.spawn(_gc_loop, race, store_dir, gc_args, done, gcs)
    sweeper, stop = _start_sweeper(race, scratch, store_dir)
    for thread in started:
        thread.join(RACE_BUDGET + CALL_TIMEOUT)
    done.set()
    race.join()
    return race.finish(sweeper, stop)


# ------------------------------------------------------------------ gc vs commit

COMMITS = 15


@pytest.mark.parametrize("gc_args", [[], ["--keep-last", "1000"]],
                         ids=["sweep", "keep-last"])
def test_gc_racing_commits(xfs, gc_args):
    """Two processes commit their own image again and again while gc runs
    without pause (``blockdiff gc`` processes one after another, and a process
    sweeping through the library many times a second). gc removes no snapshot
    (no policy, or a --keep-last larger than the store), so nothing may be
    lost: every commit succeeds, its id is listed, verify passes and every
    snapshot restores to the bytes committed."""
    store_dir = xfs / "store"
    assert _cli("init", store_dir).returncode == 0
    images = [xfs / f"vm{n}.img" for n in range(2)]
    for n, image in enumerate(images):
        make_base_image(image, SIZE, 100 + n)
    commits: list[tuple[str, str, subprocess.CompletedProcess]] = []  # (image, digest, proc)
    gcs: list = []
    done = threading.Event()
    race = Race()
    try:
        def committer(image, seed):
            rng = random.Random(seed)
            for step in range(COMMITS):
                if race.stop.is_set() or not race.in_time():
                    return
                if step:
                    _rewrite_blocks(image, rng, rng.randint(1, 6))
                digest = _digest_file(image)
                proc = race.run("commit", "--store", store_dir, image, "-m", f"step {step}")
                commits.append((image.name, digest, proc))

        swept = _beside_gc(race, xfs, store_dir, gc_args, done, gcs,
                           [(committer, image, n) for n, image in enumerate(images)])
    finally:
        race.close()

    problems = race.problems()
    _no_tracebacks(problems, [(f"commit of {name}", p) for name, _, p in commits] + gcs)
    expected = {}
    for name, digest, proc in commits:
        if proc.returncode != 0:
            problems.append(_describe(f"commit of {name}", proc))
        else:
            expected[_printed_id(proc)] = digest
    problems += [_describe("gc", p) for _, p in gcs if p.returncode != 0]
    if len(commits) != 2 * COMMITS:
        problems.append(f"{len(commits)} of {2 * COMMITS} commits ran")
    listed = _check_store(problems, store_dir, expected, xfs)
    problems += [f"commit printed {snap_id}, which log does not list"
                 for snap_id in expected if snap_id not in listed]
    problems += _sweeper_problems(swept)
    assert not problems, _report(f"{len(gcs)} gc runs and {swept.stdout.strip()} sweeps "
                                 f"beside {len(commits)} commits:", problems, xfs)


# ------------------------------------------------------------------ rm vs commit

LINE_COMMITS = 25


def test_rm_racing_commits_on_one_line(xfs):
    """One process commits child after child of one image while another
    removes snapshots of that line, now and then the newest (the parent of
    the commit under way). A commit may then be refused, with one line on
    stderr and the store's exit status (6); one that printed an id must have
    made a snapshot that stays listed until rm removes it and restores byte
    for byte; verify passes afterwards."""
    store_dir = xfs / "store"
    assert _cli("init", store_dir).returncode == 0
    image = xfs / "disk.img"
    make_base_image(image, SIZE, 7)
    commits: list[tuple[str, subprocess.CompletedProcess]] = []
    rms: list[tuple[str, subprocess.CompletedProcess]] = []
    logs: list = []
    done = threading.Event()
    race = Race()
    try:
        def committer():
            rng = random.Random(1)
            for step in range(LINE_COMMITS):
                if race.stop.is_set() or not race.in_time():
                    return
                if step:
                    _rewrite_blocks(image, rng, rng.randint(1, 6))
                digest = _digest_file(image)
                commits.append((digest, race.run("commit", "--store", store_dir, image,
                                                 "-m", f"step {step}")))

        def remover():
            rng = random.Random(2)
            while not race.stop.is_set():
                removed_some = any(p.returncode == 0 for _, p in rms)
                if (done.is_set() and removed_some) or not race.in_time():
                    return
                log = race.run("log", "--store", store_dir, "--json")
                logs.append(("log", log))
                if log.returncode != 0:
                    continue
                line = [entry["id"] for entry in json.loads(log.stdout)]   # newest first
                if len(line) < 2:
                    continue
                # Mostly an older snapshot, sometimes the newest: the one the
                # commit under way is likely to build on.
                victim = line[0] if rng.random() < 0.25 else rng.choice(line[1:])
                rms.append((victim, race.run("rm", "--store", store_dir, victim)))

        worker = race.spawn(committer)
        race.spawn(remover)
        worker.join(RACE_BUDGET + CALL_TIMEOUT)
        done.set()
        race.join()
    finally:
        race.close()

    problems = race.problems()
    _no_tracebacks(problems, [("commit", p) for _, p in commits]
                   + [(f"rm {v}", p) for v, p in rms] + logs)
    expected = {}
    for digest, proc in commits:
        if proc.returncode == 0:
            expected[_printed_id(proc)] = digest
        elif proc.returncode != 6 or not _one_line_error(proc):
            problems.append("a commit failed other than with one line and exit 6: "
                            + _describe("commit", proc))
    removed = {victim for victim, proc in rms if proc.returncode == 0}
    for victim, proc in rms:
        if proc.returncode != 0 and (proc.returncode != 6 or not _one_line_error(proc)):
            problems.append("rm failed other than with one line and exit 6: "
                            + _describe(f"rm {victim}", proc))
    problems += [_describe("log", p) for _, p in logs if p.returncode != 0]
    if len(commits) != LINE_COMMITS:
        problems.append(f"{len(commits)} of {LINE_COMMITS} commits ran")
    if not removed:
        problems.append("no rm succeeded")
    listed = _check_store(problems, store_dir, expected, xfs)
    problems += [f"commit printed {snap_id}; it is gone, but no rm removed it"
                 for snap_id in expected if snap_id not in listed and snap_id not in removed]
    problems += [f"snapshot {snap_id} is listed, but no commit reported it"
                 for snap_id in listed if snap_id not in expected]
    problems += [f"rm {snap_id} succeeded, but log still lists it"
                 for snap_id in removed & listed]
    assert not problems, _report(f"{len(rms)} rm runs ({len(removed)} removed) beside "
                                 f"{len(commits)} commits:", problems, xfs)


# ------------------------------------------------------- import vs restore and gc

LINE = 12
PRESENT = 3   # snapshots store B has before the race


def _line_of_snapshots(store_dir: Path, image: Path, count: int, seed: int) -> list:
    """Commit ``count`` steps of one image; ``[(id, digest)]`` oldest first."""
    rng = random.Random(seed)
    line = []
    with Store(store_dir) as store:
        for step in range(count):
            if step:
                _rewrite_blocks(image, rng, rng.randint(1, 8))
                if step % 4 == 0:   # a bigger step now and then
                    _rewrite_blocks(image, rng, 64)
            line.append((store.commit(image, message=f"step {step}").id, _digest_file(image)))
    return line


def test_import_racing_restores_and_gc(xfs):
    """Snapshots exported from store A are imported into store B while B runs
    gc sweeps (the command, and the library in a loop) and forks of the
    snapshots it already has. Every import and
    restore succeeds, every fork has its snapshot's bytes, verify passes and
    every imported snapshot restores to A's bytes."""
    store_a, store_b = xfs / "a", xfs / "b"
    for s in (store_a, store_b):
        assert _cli("init", s).returncode == 0
    image = xfs / "disk.img"
    make_base_image(image, SIZE, 11)
    line = _line_of_snapshots(store_a, image, LINE, 12)
    digests = dict(line)
    exports = []
    exports_dir = xfs / "exports"
    exports_dir.mkdir()
    with Store(store_a) as a:
        for i, (snap_id, _) in enumerate(line):
            out = exports_dir / f"{snap_id}.bdexport"
            # Whole every few, otherwise on the previous step (which B then has).
            a.export(snap_id, out, since=None if i % 4 == 0 else line[i - 1][0])
            exports.append((snap_id, out))
    with Store(store_b) as b:
        for snap_id, out in exports[:PRESENT]:
            b.import_(out)
            assert snap_id in {s.id for s in b.log()}

    imports, restores, gcs = [], [], []
    done = threading.Event()
    race = Race()
    try:
        def importer():
            for snap_id, out in exports[PRESENT:]:
                if race.stop.is_set() or not race.in_time():
                    return
                imports.append((snap_id, race.run("import", "--store", store_b, out)))

        def restorer():
            rng = random.Random(3)
            n = 0
            while not race.stop.is_set():
                snap_id = rng.choice(line[:PRESENT])[0]
                fork = xfs / f"fork{n}.img"
                n += 1
                proc = race.run("restore", "--store", store_b, snap_id, fork)
                ok = proc.returncode == 0 and _digest_file(fork) == digests[snap_id]
                restores.append((snap_id, proc, ok))
                fork.unlink(missing_ok=True)
                if done.is_set() or not race.in_time():
                    return

        swept = _beside_gc(race, xfs, store_b, [], done, gcs, [importer], [restorer])
    finally:
        race.close()

    problems = race.problems()
    _no_tracebacks(problems, [(f"import {i}", p) for i, p in imports]
                   + [(f"restore {i}", p) for i, p, _ in restores] + gcs)
    for snap_id, proc in imports:
        if proc.returncode != 0:
            problems.append(_describe(f"import of {snap_id}", proc))
    for snap_id, proc, ok in restores:
        if proc.returncode != 0:
            problems.append(_describe(f"restore of {snap_id}", proc))
        elif not ok:
            problems.append(f"a fork of {snap_id} does not have its bytes")
    problems += [_describe("gc", p) for _, p in gcs if p.returncode != 0]
    if len(imports) != LINE - PRESENT:
        problems.append(f"{len(imports)} of {LINE - PRESENT} imports ran")
    listed = _check_store(problems, store_b, digests, xfs)
    problems += [f"{snap_id} was imported, but B's log does not list it"
                 for snap_id, proc in imports if proc.returncode == 0 and snap_id not in listed]
    problems += _sweeper_problems(swept)
    assert not problems, _report(f"{len(gcs)} gc runs, {swept.stdout.strip()} sweeps and "
                                 f"{len(restores)} forks beside {len(imports)} imports:",
                                 problems, xfs)


# ------------------------------------------------------------------ compact vs gc

def test_compact_racing_gc(xfs):
    """Every snapshot of a line and of a branch is compacted, twice over,
    while gc runs without pause (the command, and the library in a loop).
    Compaction changes no content: every compact
    succeeds, verify passes and every snapshot restores byte for byte."""
    store_dir = xfs / "store"
    assert _cli("init", store_dir).returncode == 0
    image = xfs / "disk.img"
    make_base_image(image, SIZE, 21)
    line = _line_of_snapshots(store_dir, image, 10, 22)
    branch = xfs / "branch.img"
    with Store(store_dir) as store:
        store.restore(line[4][0], branch)
    line += _line_of_snapshots(store_dir, branch, 4, 23)
    digests = dict(line)
    order = [snap_id for snap_id, _ in line]
    random.Random(24).shuffle(order)

    compacts, gcs = [], []
    done = threading.Event()
    race = Race()
    try:
        def compactor():
            for snap_id in order + order:
                if race.stop.is_set() or not race.in_time():
                    return
                compacts.append((snap_id, race.run("compact", "--store", store_dir, snap_id)))

        swept = _beside_gc(race, xfs, store_dir, [], done, gcs, [compactor])
    finally:
        race.close()

    problems = race.problems()
    _no_tracebacks(problems, [(f"compact {i}", p) for i, p in compacts] + gcs)
    for snap_id, proc in compacts:
        if proc.returncode != 0:
            problems.append(_describe(f"compact of {snap_id}", proc))
    problems += [_describe("gc", p) for _, p in gcs if p.returncode != 0]
    if len(compacts) != 2 * len(order):
        problems.append(f"{len(compacts)} of {2 * len(order)} compactions ran")
    listed = _check_store(problems, store_dir, digests, xfs)
    problems += [f"snapshot {snap_id} is gone" for snap_id in digests if snap_id not in listed]
    problems += _sweeper_problems(swept)
    assert not problems, _report(f"{len(gcs)} gc runs and {swept.stdout.strip()} sweeps "
                                 f"beside {len(compacts)} compactions:", problems, xfs)


# ------------------------------------------------------------------ export vs rm and gc

def test_export_racing_rm_and_gc(xfs):
    """Snapshots are exported (whole and as increments) while other snapshots
    of the same line are removed and gc runs without pause. Every export of a
    snapshot still there succeeds, and imported into a new store it restores
    to the bytes committed; verify passes."""
    store_dir, other_dir = xfs / "store", xfs / "other"
    for s in (store_dir, other_dir):
        assert _cli("init", s).returncode == 0
    image = xfs / "disk.img"
    make_base_image(image, SIZE, 31)
    line = _line_of_snapshots(store_dir, image, 12, 32)
    digests = dict(line)
    kept = [snap_id for i, (snap_id, _) in enumerate(line) if i % 3 == 0]
    doomed = [snap_id for snap_id, _ in line if snap_id not in kept]
    exports_dir = xfs / "exports"
    exports_dir.mkdir()

    exports, rms, gcs = [], [], []
    done = threading.Event()
    race = Race()
    try:
        def exporter():
            for round_ in range(2):
                for i, snap_id in enumerate(kept):
                    if race.stop.is_set() or not race.in_time():
                        return
                    out = exports_dir / f"{round_}-{snap_id}.bdx"
                    since = ["--since", kept[i - 1]] if i and round_ else []
                    exports.append((snap_id, out, since,
                                    race.run("export", "--store", store_dir, snap_id, out,
                                             *since)))

        def remover():
            for snap_id in doomed:
                if done.is_set() or race.stop.is_set() or not race.in_time():
                    return
                rms.append((snap_id, race.run("rm", "--store", store_dir, snap_id)))

        swept = _beside_gc(race, xfs, store_dir, [], done, gcs, [exporter, remover])
    finally:
        race.close()

    problems = race.problems()
    _no_tracebacks(problems, [(f"export {i}", p) for i, _, _, p in exports]
                   + [(f"rm {i}", p) for i, p in rms] + gcs)
    problems += [_describe(f"export of {i}", p) for i, _, _, p in exports if p.returncode]
    problems += [_describe(f"rm of {i}", p) for i, p in rms if p.returncode]
    problems += [_describe("gc", p) for _, p in gcs if p.returncode != 0]
    if len(exports) != 2 * len(kept):
        problems.append(f"{len(exports)} of {2 * len(kept)} exports ran")
    # Whole exports first, then the increments on them, into the other store.
    with Store(other_dir) as other:
        for snap_id, out, since, proc in sorted(exports, key=lambda e: bool(e[2])):
            if proc.returncode or other.catalog.get(snap_id) is not None:
                continue
            other.import_(out)
    listed = _check_store(problems, other_dir, {i: digests[i] for i in kept}, xfs)
    problems += [f"snapshot {i} was exported but could not be imported" for i in kept
                 if i not in listed]
    _check_store(problems, store_dir, {i: digests[i] for i in kept}, xfs)
    problems += _sweeper_problems(swept)
    assert not problems, _report(f"{len(gcs)} gc runs, {swept.stdout.strip()} sweeps and "
                                 f"{len(rms)} removals beside {len(exports)} exports:",
                                 problems, xfs)
