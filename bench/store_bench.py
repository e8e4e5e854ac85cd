"""Benchmark of the snapshot store over a run of agent steps, next to full-copy
snapshots and a qcow2 overlay chain.

    python bench/store_bench.py [--quick] [--steps N] [--frag-mib N] [--json out.json]
                                [--drop-caches none|copy|all] [--workdir DIR]

One scratch XFS (reflink=1) loop mount holds everything. A 4 GiB image
(512 MiB with --quick) is written in full, committed as the root snapshot, and
then goes through N steps (200; 40 with --quick), each ~100 random 4 KiB
blocks plus 1 MiB sequential at a random aligned offset (pwrite, fsync)
followed by a timed ``Store.commit``. Then: restores of random earlier steps
in place and into a new path, restores at depth N and depth 1, the store's
size, full copies and reflink clones of the image, and a qcow2 overlay chain
given the same writes with qemu-img / qemu-io (Debian: qemu-utils). A second,
fragmented image (1 GiB, every other block rewritten: 100,000+ extents; 256
MiB with --quick) times commits and in-place restores after 100-block steps
next to whole-image reflink clones of it.

Every other commit and in-place restore is *tracked*: it is given the byte
ranges written since the image was last committed or restored (what QEMU's
dirty bitmap reports for a VM's disk), so the store maps only those instead of
the whole image. Tracked and untracked samples alternate on the same image, so
both see the same fragmentation.

Needs root, xfsprogs, qemu-utils and the blockdiff package. See
bench/README.md for what each row means.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
# This checkout's blockdiff first, not whichever one pip installed last.
sys.path[:0] = [HERE, os.path.dirname(HERE)]

try:
    import run as suite  # first: says how to install blockdiff if it is missing
    import workloads

    from blockdiff.demo import scratch
    from blockdiff.engine.extents import ExtentMap
    from blockdiff.store.store import Store
except ImportError as e:
    sys.exit(f"bench/store_bench.py: {e}")

BLOCK = workloads.BLOCK
MiB = workloads.MiB
GiB = workloads.GiB
DEFAULT_TMP_DIR = "/var/tmp/blockdiff-store-bench"
RANDOM_BLOCKS = 100          # random 4 KiB blocks per step
SEQUENTIAL = MiB             # plus one sequential write of this size
DIGESTS = 10                 # steps whose image is hashed at commit time
RESTORE_SAMPLES = 20         # restores of random earlier steps, in place and as forks
VERIFIED_SAMPLES = 4         # of which at least this many are checked against a digest
DEPTH_REPEAT = 10            # restores at depth N and at depth 1 (half of them tracked)
COPIES = 3                   # full copies and reflink clones timed
FRAG_REPEAT = 5              # 100-block steps on the fragmented image, per timed row
NOTHING = (np.zeros(0, np.uint64), np.zeros(0, np.uint64))   # written ranges: none
FRAG_MIN_EXTENTS = 100_000   # the fragmented image of the full run has at least this many
FRAG_TAG = 0x66726167_00000000   # "frag": blocks of the fragmenting step
FRAG_STEP_TAG = 0x66737470_00000000  # "fstp": blocks of the 100-block steps on it
log = suite.log


# --------------------------------------------------------------------------
# steps


@dataclasses.dataclass
class Step:
    """The writes of one agent step."""

    index: int
    blocks: np.ndarray       # 4 KiB block numbers, in write order
    seq_offset: int          # offset of the 1 MiB sequential write

    @property
    def pattern(self) -> int:
        """The byte qemu-io writes for this step (never zero)."""
        return 1 + self.index % 255

    def written(self) -> tuple[np.ndarray, np.ndarray]:
        """``(offsets, lengths)`` of its writes, as a dirty-block tracker reports them."""
        offsets = np.append(self.blocks * np.uint64(BLOCK), np.uint64(self.seq_offset))
        lengths = np.append(np.full(len(self.blocks), BLOCK, np.uint64), np.uint64(SEQUENTIAL))
        return offsets, lengths

    def qemu_io_commands(self) -> list[str]:
        args = []
        for b in self.blocks.tolist():
            args += ["-c", f"write -q -P {self.pattern} {b * BLOCK} {BLOCK}"]
        return args + ["-c", f"write -q -P {self.pattern} {self.seq_offset} {SEQUENTIAL}"]


def make_step(index: int, image_size: int, seed: int) -> Step:
    """Step ``index``: distinct random blocks and a MiB-aligned sequential range."""
    rng = np.random.default_rng([seed, index])
    nblocks = image_size // BLOCK
    blocks = rng.choice(nblocks, size=min(RANDOM_BLOCKS, nblocks), replace=False)
    seq = int(rng.integers(0, image_size // SEQUENTIAL)) * SEQUENTIAL
    return Step(index, blocks.astype(np.uint64), seq)


def write_step(path: str, step: Step, pool: np.ndarray) -> None:
    """Apply a step to the image: one pwrite per random block, one for the
    sequential range, then fsync. Every block carries its block number and the
    step number in its first 16 bytes, like the images of bench/workloads.py."""
    nseq = SEQUENTIAL // BLOCK
    buf = np.tile(pool, (-(-(len(step.blocks) + nseq) // len(pool)), 1))
    buf = buf[: len(step.blocks) + nseq]
    seq_blocks = np.arange(nseq, dtype=np.uint64) + np.uint64(step.seq_offset // BLOCK)
    buf[:, 0] = np.concatenate((step.blocks, seq_blocks))
    buf[:, 1] = 0x73746570_00000000 | step.index           # "step" tag
    fd = os.open(path, os.O_WRONLY)
    try:
        for i, b in enumerate(step.blocks.tolist()):
            os.pwrite(fd, buf[i], b * BLOCK)
        seq = memoryview(buf[len(step.blocks):]).cast("B")
        done = 0
        while done < len(seq):
            done += os.pwrite(fd, seq[done:], step.seq_offset + done)
        os.fsync(fd)
    finally:
        os.close(fd)


def write_blocks(path: str, blocks: np.ndarray, pool: np.ndarray, tag: int,
                 chunk: int = 4096) -> None:
    """One pwrite per 4 KiB block, in the order given, then fsync. Each block
    carries its block number and ``tag`` in its first 16 bytes."""
    blocks = np.asarray(blocks, dtype=np.uint64)
    fd = os.open(path, os.O_WRONLY)
    try:
        for start in range(0, len(blocks), chunk):
            part = blocks[start:start + chunk]
            buf = np.tile(pool, (-(-len(part) // len(pool)), 1))[: len(part)]
            buf[:, 0] = part
            buf[:, 1] = tag
            for i, b in enumerate(part.tolist()):
                os.pwrite(fd, buf[i], b * BLOCK)
        os.fsync(fd)
    finally:
        os.close(fd)


def fragmenting_blocks(nblocks: int, rng: np.random.Generator) -> np.ndarray:
    """Every other block (the even ones), in random order."""
    return rng.permutation(np.arange(0, nblocks, 2, dtype=np.uint64))


def block_ranges(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Written ranges of whole 4 KiB blocks."""
    blocks = np.asarray(blocks, np.uint64)
    return blocks * np.uint64(BLOCK), np.full(len(blocks), BLOCK, np.uint64)


def tracked_key(key: str, tracked: bool) -> str:
    return f"{key}_tracked" if tracked else key


def tracked_label(label: str, tracked: bool) -> str:
    return f"{label}, tracked (written ranges given)" if tracked else label


def choose_digest_steps(steps: int, rng: np.random.Generator) -> list[int]:
    """Steps hashed at commit time: the first, the last and random ones between."""
    between = np.arange(2, steps)
    pick = rng.choice(between, size=min(DIGESTS - 2, len(between)), replace=False)
    return sorted({1, steps, *pick.tolist()})


def choose_restore_steps(steps: int, digests: list[int], rng: np.random.Generator) -> list[int]:
    """Earlier steps (1 .. steps-1) to restore, at least VERIFIED_SAMPLES of
    them with a digest, in random order."""
    if steps < 2:
        return []
    with_digest = [k for k in digests if k < steps]
    sure = rng.choice(with_digest, size=min(VERIFIED_SAMPLES, len(with_digest)), replace=False)
    rest = rng.choice(np.arange(1, steps), size=RESTORE_SAMPLES - len(sure),
                      replace=steps - 1 < RESTORE_SAMPLES)
    picked = np.concatenate((sure, rest)).astype(int)
    rng.shuffle(picked)
    return picked.tolist()


# --------------------------------------------------------------------------
# measuring


def sha256_file(path: str, chunk: int = 8 * MiB) -> str:
    import hashlib

    h = hashlib.sha256()
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def allocated(paths) -> int:
    """Bytes allocated to the files (st_blocks; shared blocks count in full)."""
    return sum(os.stat(p).st_blocks * 512 for p in paths)


def stats(samples: list[float]) -> dict:
    """n, p50, p99 (only from 10 samples on), min, max."""
    a = np.asarray(samples, dtype=float)
    return {"n": len(a), "p50": float(np.percentile(a, 50)),
            "p99": float(np.percentile(a, 99)) if len(a) >= 10 else None,
            "min": float(a.min()), "max": float(a.max())}


def run_tool(argv: list[str]) -> None:
    p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       check=False)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} ... exited {p.returncode}: "
                           f"{(p.stderr or p.stdout).strip()[-500:]}")


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Bench:
    """Timed operations on one scratch mount, and what they measured."""

    def __init__(self, mnt: str, drop_caches: str):
        self.mnt = mnt
        self.drop = drop_caches
        self.rows: dict[str, dict] = {}
        self.checks: list[dict] = []

    def time(self, key: str, label: str, fn: Callable[[], object], *, copy: bool = False,
             detail: dict | None = None):
        """Settle the filesystem (sync, fsfreeze -f/-u, page cache dropped when
        --drop-caches says so), then time ``fn()``; returns what it returns."""
        suite.settle(self.mnt, self.drop == "all" or (copy and self.drop == "copy"))
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        row = self.rows.setdefault(key, {"label": label, "samples": [], "detail": []})
        row["samples"].append(dt)
        if detail is not None:
            row["detail"].append(detail)
        return out

    def check(self, what: str, step: int, path: str, expected: str) -> bool:
        ok = sha256_file(path) == expected
        self.checks.append({"what": what, "step": step, "identical": ok})
        log(f"  {what} of step {step}: sha256 {'identical' if ok else 'DIFFERENT'}")
        return ok


# --------------------------------------------------------------------------
# phases


def run_store(b: Bench, image: str, size: int, nsteps: int, seed: int,
              rng: np.random.Generator) -> dict:
    """Steps and commits, restores, depth, store size."""
    store_dir = os.path.join(b.mnt, "store")
    forks = os.path.join(b.mnt, "forks")
    os.makedirs(forks)
    digest_steps = choose_digest_steps(nsteps, rng)
    pool = workloads._pool(seed + 7)
    store = Store.init(store_dir)
    try:
        snaps = [b.time("commit_root", "store.commit of the full image (root snapshot)",
                        lambda: store.commit(image, message="initial image"))]
        digests: dict[int, str] = {}
        step_write_s = []
        log(f"{nsteps} steps; digests recorded for steps {digest_steps}")
        for i in range(1, nsteps + 1):
            step = make_step(i, size, seed)
            t0 = time.perf_counter()
            write_step(image, step, pool)
            step_write_s.append(time.perf_counter() - t0)
            tracked = i % 2 == 0
            key = tracked_key("commit", tracked)
            snap = b.time(key, tracked_label("store.commit after a step", tracked),
                          lambda i=i, t=tracked, st=step: store.commit(
                              image, message=f"step {i}", written=st.written() if t else None))
            b.rows[key]["detail"].append({"ranges": snap.ranges,
                                          "changed_bytes": snap.changed_bytes})
            snaps.append(snap)
            if i in digest_steps:
                digests[i] = sha256_file(image)
            if i % 25 == 0 or i == nsteps:
                c = b.rows["commit"]["samples"]
                ct = b.rows["commit_tracked"]["samples"]
                log(f"  step {i}: commit p50 so far {np.median(c) * 1000:.1f} ms, tracked "
                    f"{np.median(ct) * 1000:.1f} ms; {snap.ranges} ranges")

        log("restores of earlier steps in place")
        for n, k in enumerate(choose_restore_steps(nsteps, digest_steps, rng)):
            # Nothing is written between these restores.
            tracked = n % 2 == 1
            key = tracked_key("restore_in_place", tracked)
            res = b.time(key, tracked_label("store.restore in place, random earlier step",
                                            tracked),
                         lambda k=k, t=tracked: store.restore(
                             snaps[k].id, image, written=NOTHING if t else None),
                         detail={"step": k})
            assert res.tracked == tracked
            b.rows[key]["detail"][-1].update(ranges=res.ranges, bytes=res.bytes)
            if k in digests:
                b.check("restore in place", k, image, digests[k])

        log("restores of earlier steps into a new path (fork)")
        fork = os.path.join(forks, "fork.img")
        for k in choose_restore_steps(nsteps, digest_steps, rng):
            res = b.time("restore_fork", "store.restore into a new path (fork), random step",
                         lambda k=k: store.restore(snaps[k].id, fork),
                         detail={"step": k})
            b.rows["restore_fork"]["detail"][-1].update(ranges=res.ranges, bytes=res.bytes)
            if k in digests:
                b.check("restore to a new path", k, fork, digests[k])
            os.unlink(fork)

        log(f"restore in place at depth {nsteps} and depth 1, after one uncommitted step")
        extra = nsteps + 1
        for depth in (nsteps, 1):
            store.restore(snaps[depth].id, image)
            for n in range(DEPTH_REPEAT):
                step = make_step(extra, size, seed)
                write_step(image, step, pool)
                extra += 1
                tracked = n % 2 == 1
                key = tracked_key(f"restore_depth_{depth}", tracked)
                res = b.time(key, tracked_label(f"store.restore in place at depth {depth}, "
                                                f"after one uncommitted step", tracked),
                             lambda d=depth, t=tracked, st=step: store.restore(
                                 snaps[d].id, image, written=st.written() if t else None),
                             detail={"step": depth})
                assert res.tracked == tracked
                b.rows[key]["detail"][-1].update(ranges=res.ranges, bytes=res.bytes)
            b.check(f"restore in place at depth {depth}", depth, image, digests[depth])

        files = list(store.objects.iterdir())
        root_layer = store.objects / f"{snaps[0].id}.layer"
        step_layers = [p for p in files if p.suffix == ".layer" and p != root_layer]
        maps = [p for p in files if p.suffix == ".map"]
        sizes = {
            "image": size,
            "store_objects": allocated(files),
            "store_root_layer": allocated([root_layer]),
            "store_step_layers": allocated(step_layers),
            "store_maps": allocated(maps),
            "changed_bytes_steps": sum(s.changed_bytes for s in snaps[1:]),
            "changed_bytes_root": snaps[0].changed_bytes,
            "written_bytes_steps": nsteps * (RANDOM_BLOCKS * BLOCK + SEQUENTIAL),
            "catalog": allocated(Path(store_dir).glob("catalog.sqlite*")),
        }
    finally:
        store.close()
    return {"sizes": sizes, "digest_steps": digest_steps, "step_write_s": step_write_s}


def run_copies(b: Bench, image: str, nsteps: int) -> dict:
    """Whole-image snapshots: full copies and reflink clones."""
    out = os.path.join(b.mnt, "copy.img")
    for key, label, mode, copy in (
            ("full_copy", "full-copy snapshot (cp --reflink=never + fsync)", "never", True),
            ("reflink_clone", "reflink clone of the image (cp --reflink=always + fsync)",
             "always", False)):
        log(f"{label}, {COPIES} times")
        for _ in range(COPIES):
            b.time(key, label, lambda m=mode: (run_tool(["cp", f"--reflink={m}", image, out]),
                                               fsync_path(out)), copy=copy)
            if key == "full_copy" and workloads.shared_extents(out):
                raise RuntimeError("the full copy shares extents with the image")
            os.unlink(out)
    return {"full_copies_all_steps": (nsteps + 1) * os.path.getsize(image)}


def run_fragmented(b: Bench, store_dir: str, size: int, seed: int,
                   rng: np.random.Generator) -> dict:
    """A second image, fragmented by rewriting every other block after its
    first commit: commits and in-place restores after 100-block steps, next to
    whole-image reflink clones of it."""
    path = os.path.join(b.mnt, "fragmented.img")
    clone = os.path.join(b.mnt, "fragmented-clone.img")
    nblocks = size // BLOCK
    pool = workloads._pool(seed + 11)
    t0 = time.perf_counter()
    workloads.write_image(path, size, seed=seed + 1)
    log(f"fragmented image: wrote {human(size)} in {time.perf_counter() - t0:.1f} s")
    store = Store(store_dir)
    try:
        store.commit(path, message="fragmented image: initial")
        rewrite = fragmenting_blocks(nblocks, rng)
        t0 = time.perf_counter()
        write_blocks(path, rewrite, pool, FRAG_TAG)
        fd = os.open(path, os.O_RDONLY)
        try:
            extents = len(ExtentMap.of_file(fd, path))
        finally:
            os.close(fd)
        log(f"  rewrote every other block ({len(rewrite):,}) in random order in "
            f"{time.perf_counter() - t0:.1f} s: {extents:,} extents")
        if size >= GiB and extents < FRAG_MIN_EXTENTS:
            raise RuntimeError(f"the fragmented image has {extents:,} extents, fewer than "
                               f"{FRAG_MIN_EXTENTS:,}")
        frag = b.time("frag_commit", "fragmented image: store.commit of the fragmenting step",
                      lambda: store.commit(path, message="fragmenting step"))
        b.rows["frag_commit"]["detail"].append({"ranges": frag.ranges,
                                                "changed_bytes": frag.changed_bytes})
        digest = sha256_file(path)

        log(f"fragmented image: {FRAG_REPEAT} times a 100-block step, restore in place, "
            f"reflink clone")
        label = f"fragmented image ({extents:,} extents): restore in place after a 100-block step"
        for i in range(2 * FRAG_REPEAT):
            blocks = rng.choice(nblocks, size=min(RANDOM_BLOCKS, nblocks), replace=False)
            write_blocks(path, blocks, pool, FRAG_STEP_TAG | i)
            tracked = i % 2 == 1
            key = tracked_key("frag_restore", tracked)
            res = b.time(key, tracked_label(label, tracked),
                         lambda t=tracked, bl=blocks: store.restore(
                             frag.id, path, written=block_ranges(bl) if t else None),
                         detail={"step": 1})
            assert res.tracked == tracked
            b.rows[key]["detail"][-1].update(ranges=res.ranges, bytes=res.bytes)
            if i < 2:
                b.check("restore in place on the fragmented image", 1, path, digest)
            if tracked:
                continue
            b.time("frag_clone", "fragmented image: whole-image reflink clone "
                                 "(cp --reflink=always + fsync)",
                   lambda: (run_tool(["cp", "--reflink=always", path, clone]),
                            fsync_path(clone)))
            os.unlink(clone)

        log(f"fragmented image: {FRAG_REPEAT} times a 100-block step and a commit")
        for i in range(2 * FRAG_REPEAT):
            blocks = rng.choice(nblocks, size=min(RANDOM_BLOCKS, nblocks), replace=False)
            write_blocks(path, blocks, pool, FRAG_STEP_TAG | (2 * FRAG_REPEAT + i))
            tracked = i % 2 == 1
            key = tracked_key("frag_commit_step", tracked)
            snap = b.time(key, tracked_label(
                              "fragmented image: store.commit after a 100-block step", tracked),
                          lambda i=i, t=tracked, bl=blocks: store.commit(
                              path, message=f"fragmented image: step {i}",
                              written=block_ranges(bl) if t else None))
            b.rows[key]["detail"].append({"ranges": snap.ranges,
                                          "changed_bytes": snap.changed_bytes})
    finally:
        store.close()
    os.unlink(path)
    return {"frag_image": size, "frag_extents": extents, "frag_rewritten": len(rewrite)}


def run_qcow2(b: Bench, base_raw: str, size: int, nsteps: int, seed: int) -> dict:
    """The same steps as a qcow2 overlay chain, and flattening it."""
    d = os.path.join(b.mnt, "qcow2")
    os.makedirs(d)
    chain = [os.path.join(d, "base.qcow2")]
    log("qcow2: base image (qemu-img convert -f raw -O qcow2)")
    b.time("qcow2_base", "qcow2 base image (qemu-img convert -O qcow2 + fsync)",
           lambda: (run_tool(["qemu-img", "convert", "-q", "-f", "raw", "-O", "qcow2", base_raw,
                              chain[0]]), fsync_path(chain[0])), copy=True)
    os.unlink(base_raw)
    write_s = []
    for i in range(1, nsteps + 1):
        prev, top = chain[-1], os.path.join(d, f"step-{i:04d}.qcow2")
        b.time("qcow2_create", "qcow2 overlay (qemu-img create -b prev + fsync)",
               lambda p=prev, t=top: (run_tool(["qemu-img", "create", "-q", "-f", "qcow2",
                                                "-b", p, "-F", "qcow2", t]), fsync_path(t)))
        chain.append(top)
        t0 = time.perf_counter()
        run_tool(["qemu-io", "-f", "qcow2", "-t", "writeback",
                  *make_step(i, size, seed).qemu_io_commands(), top])
        write_s.append(time.perf_counter() - t0)
        if i % 25 == 0 or i == nsteps:
            c = b.rows["qcow2_create"]["samples"]
            log(f"  step {i}: overlay {c[-1] * 1000:.1f} ms, qemu-io writes "
                f"{write_s[-1] * 1000:.0f} ms")
    sizes = {"qcow2_base": allocated(chain[:1]), "qcow2_overlays": allocated(chain[1:])}
    flat = os.path.join(d, "flat.img")
    for depth in sorted({1, max(1, nsteps // 2), nsteps}):
        log(f"qcow2: flatten depth {depth} (qemu-img convert -O raw)")
        b.time(f"qcow2_flatten_{depth}",
               f"qcow2 restore: flatten depth {depth} (qemu-img convert -O raw + fsync)",
               lambda top=chain[depth]: (run_tool(["qemu-img", "convert", "-q", "-f", "qcow2",
                                                   "-O", "raw", top, flat]), fsync_path(flat)),
               copy=True)
        os.unlink(flat)
    return {"sizes": sizes, "qemu_io_write_s": write_s}


# --------------------------------------------------------------------------
# report


def human(n: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.2f}".rstrip("0").rstrip(".") + f" {unit}"
    return f"{n:.0f} B"


def table(rows: dict[str, dict], sizes: dict, nsteps: int) -> str:
    full = rows.get("full_copy", {}).get("stats", {}).get("p50")
    lines = ["| operation | n | p50 s | p99 s | p50 vs full-copy snapshot | notes |",
             "|---|--:|--:|--:|--:|---|"]
    for key, r in rows.items():
        s = r["stats"]
        p99 = suite.fmt_s(s["p99"]) if s["p99"] is not None else "–"
        # The fragmented image is another image, of another size.
        ratio = suite.fmt_ratio(s["p50"] / full) if full and not key.startswith("frag_") else "–"
        lines.append(f"| {r['label']} | {s['n']} | {suite.fmt_s(s['p50'])} | {p99} | {ratio} "
                     f"| {r.get('note', '')} |")
    z = sizes
    step_store = z["store_step_layers"] + z["store_maps"]
    lines += [
        "",
        f"- image: {human(z['image'])}; {nsteps} steps wrote {human(z['written_bytes_steps'])}, "
        f"the commits found {human(z['changed_bytes_steps'])} changed "
        f"({human(z['changed_bytes_steps'] / nsteps)} per step)",
        f"- store files (`objects/`, st_blocks, shared blocks counted in full): "
        f"{human(z['store_objects'])} = {z['store_objects'] / z['image']:.2f}× the image; "
        f"root layer {human(z['store_root_layer'])}, {nsteps} step layers "
        f"{human(z['store_step_layers'])}, maps {human(z['store_maps'])}; catalog "
        f"{human(z['catalog'])}",
        f"- store files of the steps (step layers + maps) {human(step_store)} = "
        f"{step_store / z['changed_bytes_steps']:.2f}× the bytes changed "
        f"(layers alone {z['store_step_layers'] / z['changed_bytes_steps']:.2f}×)",
        f"- full-copy snapshots of all {nsteps + 1} states: "
        f"{human(z['full_copies_all_steps'])} = {nsteps + 1}× the image",
    ]
    if "qcow2_overlays" in z:
        q = z["qcow2_base"] + z["qcow2_overlays"]
        lines.append(
            f"- qcow2 chain: {human(q)} (base {human(z['qcow2_base'])}, {nsteps} overlays "
            f"{human(z['qcow2_overlays'])} = {z['qcow2_overlays'] / z['changed_bytes_steps']:.2f}"
            f"× the bytes changed)")
    if "frag_extents" in z:
        lines.append(
            f"- fragmented image: {human(z['frag_image'])}, every other block "
            f"({z['frag_rewritten']:,}) rewritten in random order after its first commit: "
            f"{z['frag_extents']:,} extents; its rows compare with its own reflink clone, "
            f"not with the full copy of the main image")
    return "\n".join(lines)


def summarize(rows: dict[str, dict]) -> None:
    for key, r in rows.items():
        r["stats"] = stats(r["samples"])
        det = r.get("detail") or []
        n = len(r["samples"])
        trend = ""
        if n >= 40:
            first, last = np.median(r["samples"][:10]), np.median(r["samples"][-10:])
            trend = f"; p50 of the first 10 {suite.fmt_s(first)}, last 10 {suite.fmt_s(last)}"
        if key in ("commit", "commit_tracked") or key.startswith("frag_commit"):
            r["note"] = f"median {int(np.median([d['ranges'] for d in det]))} ranges{trend}"
        elif key.startswith("restore_") or key.startswith("frag_restore"):
            r["note"] = (f"median {int(np.median([d['ranges'] for d in det]))} ranges, "
                         f"{human(float(np.median([d['bytes'] for d in det])))}")
        elif key == "qcow2_create":
            r["note"] = f"qemu-img process; the writes (qemu-io) not timed{trend}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="512 MiB image, 40 steps, 256 MiB fragmented image")
    ap.add_argument("--steps", type=int, default=None, help="agent steps (default 200; 40 quick)")
    ap.add_argument("--image-mib", type=int, default=None,
                    help="image size in MiB (default 4096; 512 quick)")
    ap.add_argument("--frag-mib", type=int, default=None,
                    help="size in MiB of the fragmented image (default 1024; 256 quick)")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    ap.add_argument("--plot", metavar="OUT", type=Path,
                    help="also draw the results to OUT.png and OUT.svg (bench/plots.py)")
    ap.add_argument("--drop-caches", choices=("none", "copy", "all"), default="copy",
                    help="drop the page cache before each timed run of: nothing, the rows that "
                         "copy the whole image (default), every row")
    ap.add_argument("--no-qcow2", action="store_true", help="leave out the qcow2 chain")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workdir", default=DEFAULT_TMP_DIR,
                    help=f"directory for the scratch XFS backing file and mount point "
                         f"(default {DEFAULT_TMP_DIR}); not on tmpfs")
    args = ap.parse_args(argv)
    nsteps = args.steps or (40 if args.quick else 200)
    size = (args.image_mib or (512 if args.quick else 4096)) * MiB
    frag_size = (args.frag_mib or (256 if args.quick else 1024)) * MiB
    if nsteps < 2 or size < 16 * MiB or frag_size < 16 * MiB:
        ap.error("needs at least 2 steps and 16 MiB images")
    if os.geteuid() != 0:
        print("bench/store_bench.py needs root (loop device, mount, fsfreeze)", file=sys.stderr)
        return 2
    reason = scratch.filesystem_unavailable_reason("xfs")
    if reason:
        print(f"bench/store_bench.py: cannot make a scratch XFS filesystem: {reason}",
              file=sys.stderr)
        return 2
    qcow2 = not args.no_qcow2
    if qcow2 and not (shutil.which("qemu-img") and shutil.which("qemu-io")):
        print("bench/store_bench.py: qemu-img and qemu-io not found (apt-get install "
              "qemu-utils), or pass --no-qcow2", file=sys.stderr)
        return 2

    meta = {"kernel": platform.release(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "image_size": size, "steps": nsteps,
            "fragmented_image_size": frag_size,
            "drop_caches": args.drop_caches, "seed": args.seed, "quick": args.quick,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    rng = np.random.default_rng(args.seed)
    mount_size = 5 * size + 3 * frag_size + nsteps * 16 * MiB + 2 * GiB
    with workloads.exit_on_signals(), workloads.scratch_xfs(mount_size, args.workdir) as mnt:
        log(f"scratch XFS on {workloads.mount_source(mnt)} at {mnt}")
        b = Bench(mnt, args.drop_caches)
        image = os.path.join(mnt, "image.img")
        base_raw = os.path.join(mnt, "initial.img")
        t0 = time.perf_counter()
        workloads.write_image(image, size, seed=args.seed)
        workloads.reflink(image, base_raw)          # the initial state, for qcow2
        log(f"wrote a {human(size)} image in {time.perf_counter() - t0:.1f} s")
        out = run_store(b, image, size, nsteps, args.seed, rng)
        sizes = out["sizes"]
        sizes.update(run_copies(b, image, nsteps))
        sizes.update(run_fragmented(b, os.path.join(mnt, "store"), frag_size, args.seed, rng))
        qout = {}
        if qcow2:
            qout = run_qcow2(b, base_raw, size, nsteps, args.seed)
            sizes.update(qout["sizes"])
        os.sync()

    order = ["full_copy", "reflink_clone", "commit_root", "commit", "commit_tracked",
             "restore_in_place", "restore_in_place_tracked", "restore_fork",
             f"restore_depth_{nsteps}", f"restore_depth_{nsteps}_tracked", "restore_depth_1",
             "restore_depth_1_tracked", "frag_commit", "frag_commit_step",
             "frag_commit_step_tracked", "frag_restore", "frag_restore_tracked", "frag_clone",
             "qcow2_base",
             "qcow2_create"] + sorted((k for k in b.rows if k.startswith("qcow2_flatten_")),
                                      key=lambda k: int(k.rsplit("_", 1)[1]))
    rows = {k: b.rows[k] for k in order if k in b.rows}
    summarize(rows)
    qnote = (" qcow2 overlays get the same offsets and lengths as the steps, written with "
             "`qemu-io write -P <byte>` (a pattern byte per step, not the same data)."
             if qcow2 else "")
    dropped = {"none": "nothing", "copy": "the rows copying the whole image",
               "all": "every row"}[args.drop_caches]
    print(f"## blockdiff store benchmark ({'quick' if args.quick else 'full'} sizes)\n\n"
          f"Linux {meta['kernel']}, {meta['cpus']} CPUs, Python {meta['python']}; scratch XFS "
          f"(reflink=1) on a loop device. {human(size)} image, {nsteps} steps of "
          f"{RANDOM_BLOCKS} random 4 KiB blocks + {human(SEQUENTIAL)} sequential each. "
          f"Page cache dropped before each run of: {dropped}.{qnote}\n", flush=True)
    print(table(rows, sizes, nsteps))
    print()
    for suffix, how in (("", "mapped"), ("_tracked", "tracked")):
        depth = {k: rows[f"restore_depth_{k}{suffix}"]["stats"]["p50"] for k in (nsteps, 1)}
        print(f"restore in place at depth {nsteps} / depth 1 (p50, {how}): "
              f"{depth[nsteps] / depth[1]:.2f}×")
    for suffix, how in (("", "mapped"), ("_tracked", "tracked")):
        frag_ratio = (rows[f"frag_restore{suffix}"]["stats"]["p50"]
                      / rows["frag_clone"]["stats"]["p50"])
        print(f"in-place restore / reflink clone: {frag_ratio:.3f}× (fragmented image, "
              f"{sizes['frag_extents']:,} extents, p50, {how}; target ≤ 0.1)")
    bad = [c for c in b.checks if not c["identical"]]
    print(f"restores checked against the SHA-256 recorded at commit: {len(b.checks)}, "
          f"{'all identical' if not bad else f'{len(bad)} DIFFERENT'}")
    results = {"meta": meta, "rows": rows, "sizes": sizes, "checks": b.checks,
               "digest_steps": out["digest_steps"], "step_write_s": out["step_write_s"],
               "qemu_io_write_s": qout.get("qemu_io_write_s", [])}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        log(f"wrote {args.json}")
    if args.plot:
        from plots import store_figure

        for path in store_figure(results, args.plot):
            log(f"drew {path}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
