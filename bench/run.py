"""Benchmark blockdiff against a full copy, a reflink clone and the kernel floor.

    python bench/run.py [--quick] [--repeat N] [--warmup N] [--json out.json]
                        [--only a,b,c,startup] [--drop-caches none|copy|all] [--cli CMD]

BLOCKDIFF_PEER=PROGRAM adds rows for another blockdiff-compatible program.

Needs root (loop device + XFS mount), xfsprogs, cc and the blockdiff package
(`bash .ci/setup`).  See bench/README.md for what each row of the tables means.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
# This checkout's blockdiff first, not whichever one pip installed last.
sys.path[:0] = [HERE, os.path.dirname(HERE)]

try:
    import workloads  # first: says how to install blockdiff if it is missing

    import blockdiff
    from blockdiff.demo import scratch
except ImportError as e:
    sys.exit(f"bench/run.py: {e}")


# --------------------------------------------------------------------------
# helpers


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class ProcError(RuntimeError):
    pass


@dataclasses.dataclass
class Sample:
    seconds: float
    maxrss_kb: int
    wall_s: float
    info: dict = dataclasses.field(default_factory=dict)


RUSAGE: str = "rusage"  # path of the compiled rusage.c, set in main()


def run_proc(argv: list[str], env: dict | None = None) -> tuple[float, int, str]:
    """Run argv to completion under rusage.c; return (wall seconds, peak RSS
    kB, stdout).  Wall time is fork to wait4 in rusage.c; the peak RSS is
    wait4()'s ru_maxrss for that one child (with what it waited for)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
            tempfile.NamedTemporaryFile("r", suffix=".json") as rep:
        p = subprocess.run([RUSAGE, rep.name, *argv], check=False, stdout=out, stderr=err,
                           env=env, cwd="/")
        out.seek(0)
        err.seek(0)
        stdout = out.read().decode(errors="replace")
        stderr = err.read().decode(errors="replace")
        report = rep.read()
    if p.returncode != 0:
        tail = " | ".join(stderr.strip().splitlines()[-3:])
        raise ProcError(f"{shlex.join(argv)} exited {p.returncode}: {tail}")
    r = json.loads(report)
    return r["wall_s"], r["maxrss_kb"], stdout


def last_json_line(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError(f"no JSON in output: {text[-200:]!r}")


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def rm(*paths: str) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def compile_c(tmpdir: str, name: str) -> str:
    cc = os.environ.get("CC", "cc")
    exe = os.path.join(tmpdir, name)
    subprocess.run([cc, "-O2", "-o", exe, os.path.join(HERE, name + ".c")], check=True)
    return exe


def settle(mountpoint: str, drop: bool) -> None:
    """Quiesce the scratch filesystem before a timed run: write back dirty
    data, then freeze and thaw it, which also finishes XFS's background
    inode inactivation (e.g. freeing the extents of the previous run's output,
    removed just before).  Optionally drop the page cache too."""
    os.sync()
    subprocess.run(["fsfreeze", "-f", mountpoint], check=True)
    subprocess.run(["fsfreeze", "-u", mountpoint], check=True)
    if drop:
        drop_caches()


def default_cli() -> list[str]:
    """The `blockdiff` console script installed next to this interpreter, as a
    normal install runs it; else `python -m blockdiff`."""
    script = os.path.join(os.path.dirname(sys.executable), "blockdiff")
    if os.access(script, os.X_OK):
        return [script]
    return [sys.executable, "-m", "blockdiff"]


def short_command(argv: list[str]) -> str:
    """A command line for row labels: programs by their base name."""
    head = os.path.basename(argv[0])
    if len(argv) > 2 and argv[1] == "-m":
        head = "python"
    return shlex.join([head, *argv[1:]])


# --------------------------------------------------------------------------
# operations


@dataclasses.dataclass
class Op:
    key: str
    label: str
    kind: str  # copy | create | apply | other
    run: Callable[[], Sample]
    outputs: tuple[str, ...] = ()  # removed before each run
    restored: str | None = None  # verified against the target after the runs
    needs: str | None = None  # key of the op whose output this one reads
    drop: bool = False  # drop the page cache before each run (copy rows)


def proc_sample(argv) -> Sample:
    wall, rss, _ = run_proc(argv)
    return Sample(wall, rss, wall)


def floor_sample(argv) -> Sample:
    wall, rss, out = run_proc(argv)
    info = last_json_line(out)
    return Sample(info["total_s"], rss, wall, info)


def worker_sample(args: list[str]) -> Sample:
    argv = [sys.executable, os.path.join(HERE, "libworker.py")] + args
    wall, _, out = run_proc(argv)
    info = last_json_line(out)
    return Sample(info["seconds"], info["maxrss_kb"], wall, info)


def make_ops(wl: workloads.Workload, floor: str, formats: list[str], cli: list[str],
             cli_format: str, peer: list[str] | None) -> list[Op]:
    d, T, B = wl.dir, wl.target, wl.base

    def p(name: str) -> str:
        return os.path.join(d, name)

    ops: list[Op] = []

    ops.append(Op(
        "full_copy", "full copy (cp --reflink=never + fsync)", "copy",
        lambda: proc_sample(["sh", "-c", 'cp --reflink=never "$1" "$2" && sync "$2"', "sh",
                             T, p("copy.img")]),
        outputs=(p("copy.img"),), drop=True))
    ops.append(Op(
        "reflink_clone", "reflink clone (cp --reflink=always + fsync)", "copy",
        lambda: proc_sample(["sh", "-c", 'cp --reflink=always "$1" "$2" && sync "$2"', "sh",
                             T, p("clone.img")]),
        outputs=(p("clone.img"),)))
    ops.append(Op(
        "floor_create", "kernel floor: create (floor.c)", "create",
        lambda: floor_sample([floor, "create", T, B, p("floor.diff")]),
        outputs=(p("floor.diff"), p("floor.diff.ranges"))))
    ops.append(Op(
        "floor_apply", "kernel floor: apply (floor.c)", "apply",
        lambda: floor_sample([floor, "apply", p("floor.diff"), B, p("floor.restored")]),
        outputs=(p("floor.restored"),), restored=p("floor.restored"), needs="floor_create"))

    ops.append(Op(
        "python_import", "python start-up + import blockdiff.engine.diff", "other",
        lambda: proc_sample([sys.executable, "-c", "import blockdiff.engine.diff"])))
    for fmt in formats:
        diff, rest = p(f"lib-{fmt}.diff"), p(f"lib-{fmt}.restored")
        ops.append(Op(
            f"lib_create_{fmt}", f"blockdiff create_diff() in-process, {fmt}", "create",
            lambda diff=diff, fmt=fmt: worker_sample(["create", diff, T, B, fmt]),
            outputs=(diff,)))
        ops.append(Op(
            f"lib_apply_{fmt}", f"blockdiff apply_diff() in-process, {fmt}", "apply",
            lambda diff=diff, rest=rest: worker_sample(["apply", diff, rest, B]),
            outputs=(rest,), restored=rest, needs=f"lib_create_{fmt}"))
    diff, rest = p("cli.diff"), p("cli.restored")
    name = short_command(cli)
    ops.append(Op(
        "cli_create", f"CLI: {name} create --format {cli_format}", "create",
        lambda diff=diff: proc_sample(
            cli + ["create", diff, T, "--base", B, "--format", cli_format]),
        outputs=(diff,)))
    ops.append(Op(
        "cli_apply", f"CLI: {name} apply", "apply",
        lambda diff=diff, rest=rest: proc_sample(cli + ["apply", diff, rest, "--base", B]),
        outputs=(rest,), restored=rest, needs="cli_create"))

    if peer:
        name = os.path.basename(peer[0]) if len(peer) == 1 else shlex.join(peer)
        diff, rest = p("peer.diff"), p("peer.restored")
        ops.append(Op(
            "peer_create", f"peer: {name} create", "create",
            lambda diff=diff: proc_sample(peer + ["create", diff, T, "--base", B]),
            outputs=(diff,)))
        ops.append(Op(
            "peer_apply", f"peer: {name} apply", "apply",
            lambda diff=diff, rest=rest: proc_sample(peer + ["apply", diff, rest, "--base", B]),
            outputs=(rest,), restored=rest, needs="peer_create"))
    return ops


def run_ops(ops: list[Op], wl: workloads.Workload, mountpoint: str, repeat: int, warmup: int,
            drop_policy: str) -> dict[str, dict]:
    """Run every op warmup + repeat times, in rounds (each round runs each op
    once, in order, so an apply reads the diff its create wrote in the same
    round and slow drift spreads over all ops).  Then verify the restores."""
    recs: dict[str, dict] = {op.key: {"label": op.label, "kind": op.kind} for op in ops}
    samples: dict[str, list[Sample]] = {op.key: [] for op in ops}
    failed: set[str] = set()

    for rnd in range(warmup + repeat):
        timed = rnd >= warmup
        log(f"  round {rnd + 1}/{warmup + repeat}" + ("" if timed else " (warm-up, not timed)"))
        for op in ops:
            if op.key in failed:
                continue
            if op.needs in failed:
                recs[op.key]["skipped"] = f"{op.needs} did not succeed"
                failed.add(op.key)
                continue
            rm(*op.outputs)
            settle(mountpoint, drop_policy == "all" or (drop_policy == "copy" and op.drop))
            try:
                s = op.run()
            except (ProcError, OSError, ValueError, KeyError) as e:
                recs[op.key]["error"] = str(e)
                failed.add(op.key)
                log(f"  {op.key}: ERROR {e}")
                continue
            if timed:
                samples[op.key].append(s)

    for op in ops:
        rec, ss = recs[op.key], samples[op.key]
        if op.key in failed or not ss:
            continue
        secs = [s.seconds for s in ss]
        rec.update(
            median_s=statistics.median(secs),
            min_s=min(secs),
            max_s=max(secs),
            runs_s=secs,
            wall_s=[s.wall_s for s in ss],
            maxrss_kb=max(s.maxrss_kb for s in ss),
        )
        infos = [s.info for s in ss if s.info]
        if infos:
            rec["info"] = infos[-1]
        log(f"  {op.key}: median {rec['median_s']:.4f} s"
            f"  (runs {', '.join(f'{x:.4f}' for x in secs)})")
        if op.key == "full_copy":
            rec["copy_shared_extents"] = workloads.shared_extents(op.outputs[0])
        if op.restored:
            t0 = time.perf_counter()
            r = subprocess.run(["cmp", wl.target, op.restored], check=False,
                               capture_output=True, text=True)
            rec["verified"] = r.returncode == 0
            if not rec["verified"]:
                rec["cmp"] = (r.stdout + r.stderr).strip()
                log(f"  {op.key}: {rec['cmp']}")
            log(f"  {op.key}: cmp restored vs target: "
                f"{'identical' if rec['verified'] else 'DIFFERENT'}"
                f" ({time.perf_counter() - t0:.1f} s)")
    return recs


def startup_ops(cli: list[str], store: str) -> list[Op]:
    """The start-up rows: an empty interpreter, the CLI's help, and a
    command on an empty store of one host (its catalog read, nothing else)."""
    name = short_command(cli)
    return [
        Op("python_pass", "python start-up (python -c pass)", "other",
           lambda: proc_sample([sys.executable, "-c", "pass"])),
        Op("cli_help", f"CLI: {name} --help", "other",
           lambda: proc_sample(cli + ["--help"])),
        Op("cli_log_empty", f"CLI: {name} log --store S (empty store of one host)", "other",
           lambda: proc_sample(cli + ["log", "--store", store])),
    ]


def run_startup(cli: list[str], repeat: int, warmup: int) -> dict[str, dict]:
    """Time the start-up rows in rounds, as run_ops does (no scratch
    filesystem: nothing is written but the empty store, made first)."""
    with tempfile.TemporaryDirectory(prefix="blockdiff-bench-startup-") as tmp:
        store = os.path.join(tmp, "store")
        run_proc(cli + ["init", "--allow-copy", store])
        ops = startup_ops(cli, store)
        samples: dict[str, list[float]] = {op.key: [] for op in ops}
        for rnd in range(warmup + repeat):
            for op in ops:
                seconds = op.run().seconds
                if rnd >= warmup:
                    samples[op.key].append(seconds)
    recs = {}
    for op in ops:
        secs = samples[op.key]
        recs[op.key] = {"label": op.label, "median_s": statistics.median(secs),
                        "min_s": min(secs), "max_s": max(secs), "runs_s": secs}
        log(f"  {op.key}: median {recs[op.key]['median_s']:.4f} s"
            f"  (runs {', '.join(f'{x:.4f}' for x in secs)})")
    return recs


# --------------------------------------------------------------------------
# report


def fmt_s(x: float) -> str:
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    if x >= 1:
        return f"{x:.2f}"
    if x >= 0.01:
        return f"{x:.3f}"
    return f"{x:.4f}"


def fmt_ratio(x: float) -> str:
    if x >= 10:
        return f"{x:.0f}×"
    if x >= 0.1:
        return f"{x:.2f}×"
    return f"{x:.3g}×"


def table(wrec: dict) -> str:
    ops = wrec["ops"]
    full = ops.get("full_copy", {}).get("median_s")
    floors = {"create": ops.get("floor_create", {}).get("median_s"),
              "apply": ops.get("floor_apply", {}).get("median_s")}
    w = wrec["workload"]
    lines = [
        f"### workload {w['spec']['name']}: {w['spec']['description']}",
        "",
        f"{w['spec']['size'] / workloads.MiB:.0f} MiB, {w['changed_blocks']} blocks overwritten, "
        f"target {w['extents_target']} extents, base {w['extents_base']} extents"
        + (f", {ops['floor_create']['info']['ranges']} changed ranges"
           if "info" in ops.get("floor_create", {}) else ""),
        "",
        "| operation | median s | vs full copy | vs kernel floor | peak RSS MB | ranges "
        "| restore |",
        "|---|--:|--:|--:|--:|--:|:-:|",
    ]
    for key, r in ops.items():
        if "median_s" not in r:
            why = r.get("skipped") or r.get("error", "")
            why = why.replace("|", "/")
            why = why if len(why) <= 160 else why[:157] + "..."
            status = "skipped" if "skipped" in r else "error"
            lines.append(f"| {r['label']} | {status}: {why} | | | | | |")
            continue
        m = r["median_s"]
        vs_full = fmt_ratio(m / full) if full else "–"
        fl = floors.get(r["kind"])
        vs_floor = fmt_ratio(m / fl) if fl and not key.startswith("floor_") else (
            "1×" if key.startswith("floor_") else "–")
        rss = f"{r['maxrss_kb'] / 1024:.1f}"
        ver = {True: "identical", False: "DIFFERENT"}.get(r.get("verified"), "")
        nr = r.get("info", {}).get("ranges", "")
        lines.append(f"| {r['label']} | {fmt_s(m)} | {vs_full} | {vs_floor} | {rss} | {nr} "
                     f"| {ver} |")
    fc = ops.get("floor_create", {}).get("info")
    fa = ops.get("floor_apply", {}).get("info")
    if fc and fa:
        lines += [
            "",
            (f"kernel floor breakdown (last run): create = fsync target {fc['fsync_target_s']:.4f}"
            f" + FIEMAP {fc['fiemap_s']:.4f} ({fc['fiemap_ioctls']} ioctls)"
            f" + merge {fc['merge_s']:.4f} + FICLONERANGE {fc['clone_s']:.4f}"
            f" ({fc['clone_ranges']} calls) + range table {fc['table_s']:.4f}"
            f" + fsync out {fc['fsync_out_s']:.4f} s; apply = FICLONE base"
            f" {fa['clone_base_s']:.4f} + FICLONERANGE {fa['clone_s']:.4f}"
            f" ({fa['clone_ranges']} calls) + fsync {fa['fsync_s']:.4f} s"),
        ]
    return "\n".join(lines)


def startup_table(recs: dict[str, dict], repeat: int) -> str:
    """The start-up rows: median seconds, and against an empty interpreter."""
    base = recs["python_pass"]["median_s"]
    lines = ["### start-up", "",
             f"Whole processes, median of {repeat} runs; the store is empty and of one host "
             f"(a SQLite catalog).", "",
             "| command | median s | vs python -c pass |", "|---|--:|--:|"]
    for r in recs.values():
        lines.append(f"| {r['label']} | {fmt_s(r['median_s'])} "
                     f"| {fmt_ratio(r['median_s'] / base)} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="blockdiff benchmark suite")
    ap.add_argument("--quick", action="store_true", help="small images (512/256/256 MiB)")
    ap.add_argument("--repeat", type=int, default=5,
                    help="timed runs per operation, the median is reported (default 5)")
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed rounds before the timed ones (default 1)")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    ap.add_argument("--only", default="",
                    help="comma separated workloads to run (a,b,c), and 'startup' for the "
                         "start-up rows")
    ap.add_argument("--drop-caches", choices=("none", "copy", "all"), default="copy",
                    help="drop the page cache before each run of: nothing, the full copy "
                         "(default), every operation")
    ap.add_argument("--formats", default="v1,v2", help="diff formats for the library rows")
    ap.add_argument("--cli", metavar="CMD", default=None,
                    help="command timed in the CLI rows, split like a shell command line "
                         "(default: the blockdiff script next to this Python, else "
                         "python -m blockdiff)")
    ap.add_argument("--cli-format", default="v2", help="diff format for the CLI rows")
    ap.add_argument("--workdir", default=None,
                    help="directory for the scratch XFS backing file and mount point "
                         f"(default {workloads.DEFAULT_TMP_DIR}); not on tmpfs")
    args = ap.parse_args(argv)
    if args.repeat < 1 or args.warmup < 0:
        ap.error("--repeat must be >= 1 and --warmup >= 0")
    cli = shlex.split(args.cli) if args.cli is not None else default_cli()
    if not cli:
        ap.error("--cli must not be empty")
    if shutil.which(cli[0]) is None:
        ap.error(f"--cli: {cli[0]} not found")
    only = {x for x in args.only.split(",") if x}
    specs = [spec for spec in workloads.specs(args.quick) if not only or spec.name in only]
    startup = not only or "startup" in only
    # The start-up rows need neither root nor a scratch filesystem.
    if specs and os.geteuid() != 0:
        print("bench/run.py needs root (loop device, mount, drop_caches)", file=sys.stderr)
        return 2
    reason = scratch.filesystem_unavailable_reason("xfs") if specs else None
    if reason:
        print(f"bench/run.py: cannot make a scratch XFS filesystem: {reason}", file=sys.stderr)
        return 2

    formats = [f for f in args.formats.split(",") if f]
    peer = shlex.split(os.environ["BLOCKDIFF_PEER"]) if os.environ.get("BLOCKDIFF_PEER") else None
    if peer and shutil.which(peer[0]) is None and not os.path.exists(peer[0]):
        print(f"BLOCKDIFF_PEER: {peer[0]} not found", file=sys.stderr)
        return 2

    bd_where = os.path.dirname(blockdiff.__file__)
    log(f"blockdiff from {bd_where}; CLI rows time {shlex.join(cli)}")

    meta = {
        "kernel": platform.release(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "quick": args.quick,
        "repeat": args.repeat,
        "warmup": args.warmup,
        "drop_caches": args.drop_caches,
        "blockdiff": bd_where,
        "cli": cli,
        "peer": peer,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    results: list[dict] = []
    startup_recs: dict[str, dict] | None = None
    dropped = {"none": "nothing", "copy": "the full copy", "all": "every operation"}
    print(f"## blockdiff benchmark ({'quick' if args.quick else 'full'} sizes)\n\n"
          f"Linux {meta['kernel']} {meta['machine']}, {meta['cpus']} CPUs, Python "
          f"{meta['python']}; scratch XFS (reflink=1) on a loop device; median of "
          f"{args.repeat} runs after {args.warmup} untimed; page cache dropped before each run "
          f"of: {dropped[args.drop_caches]}.\n\n"
          f"CLI rows time `{shlex.join(cli)}`; library rows and the start-up row run "
          f"`{sys.executable}`.\n", flush=True)
    with tempfile.TemporaryDirectory(prefix="blockdiff-bench-bin-") as bindir, \
            workloads.exit_on_signals():
        global RUSAGE
        floor = compile_c(bindir, "floor")
        RUSAGE = compile_c(bindir, "rusage")
        if startup:
            log("start-up rows")
            startup_recs = run_startup(cli, args.repeat, args.warmup)
            print(startup_table(startup_recs, args.repeat) + "\n", flush=True)
        with contextlib.ExitStack() as stack:
            if specs:
                mnt = stack.enter_context(
                    workloads.scratch_xfs(workloads.mount_size(args.quick), args.workdir))
                log(f"scratch XFS on {workloads.mount_source(mnt)} at {mnt}")
            for spec in specs:
                log(f"workload {spec.name}: building ({spec.description})")
                wl = workloads.build(spec, mnt)
                log(f"workload {spec.name}: built in {wl.build_s:.1f} s, target "
                    f"{wl.extents_target} extents, {wl.changed_blocks} blocks changed")
                try:
                    ops = make_ops(wl, floor, formats, cli, args.cli_format, peer)
                    orecs = run_ops(ops, wl, mnt, args.repeat, args.warmup, args.drop_caches)
                    wrec = {"workload": wl.as_dict(), "ops": orecs}
                    results.append(wrec)
                finally:
                    workloads.remove(wl)
                    workloads.trim(mnt)
                print(table(wrec) + "\n", flush=True)

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "startup": startup_recs, "workloads": results}, f,
                      indent=2)
        log(f"wrote {args.json}")
    bad = [(w["workload"]["spec"]["name"], k) for w in results for k, r in w["ops"].items()
           if r.get("verified") is False]
    if bad:
        log(f"restores that differ from the target: {bad}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
