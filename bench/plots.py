"""Plots of the store and VM benchmarks, drawn from their JSON results.

    python bench/plots.py store RESULTS.json OUT        # OUT.png and OUT.svg
    python bench/plots.py vm RESULTS.json OUT

``store_bench.py --plot OUT`` and ``vm_bench.py --plot OUT`` draw them at the
end of a run. The store figure shows the latency of every commit over the
run's steps next to a full copy and a reflink clone of the image, and the
restores (p50, with the p99 or the slowest run as a whisker) next to a full
copy back. The VM figure shows the distribution of the checkpoint pause next
to a full-copy snapshot's, and restore and fork to running next to a restore
from a full copy (which boots the VM: a cold boot).

Needs matplotlib (``pip install matplotlib``; in the ``test`` and ``bench``
extras).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

FULL_COPY = "#b03a2e"
CLONE = "#7f8c8d"
OURS = "#1f618d"
TRACKED = "#28b463"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")     # files only: no display, no GUI toolkit
    # Text stays text in the SVG: searchable, smaller, readable by a test.
    matplotlib.rcParams["svg.fonttype"] = "none"
    # Fixed ids: the same results draw the same file (a diff shows a change).
    matplotlib.rcParams["svg.hashsalt"] = "blockdiff"
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out: Path) -> list[Path]:
    out.parent.mkdir(parents=True, exist_ok=True)
    paths = [out.with_suffix(".png"), out.with_suffix(".svg")]
    fig.savefig(paths[0], dpi=110, bbox_inches="tight")
    # No timestamp in the SVG: the same results draw the same file.
    fig.savefig(paths[1], bbox_inches="tight", metadata={"Date": None})
    return paths


def _whisker(stats: dict) -> float:
    return stats["p99"] if stats.get("p99") is not None else stats["max"]


def _bars(ax, entries, reference, reference_label):
    """Horizontal p50 bars with a whisker to the p99 (or the slowest run)
    and a vertical line at the reference's p50, on a log axis in ms."""
    names = [name for name, _, _ in entries]
    p50 = [s["p50"] * 1000 for _, s, _ in entries]
    high = [(_whisker(s) - s["p50"]) * 1000 for _, s, _ in entries]
    colours = [c for _, _, c in entries]
    y = range(len(entries))
    ax.barh(y, p50, xerr=[[0] * len(entries), high], color=colours, capsize=3)
    ax.set_yticks(list(y), names)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.axvline(reference["p50"] * 1000, color=FULL_COPY, linestyle="--",
               label=f"{reference_label}: {reference['p50'] * 1000:,.0f} ms")
    for i, value in enumerate(p50):
        ax.annotate(f"{reference['p50'] * 1000 / value:,.0f}× faster", (value, i),
                    xytext=(4, -9), textcoords="offset points", fontsize=7)
    ax.set_xlabel("ms (log scale)")
    ax.legend(loc="upper right", fontsize=8)


def store_figure(results: dict, out: Path) -> list[Path]:
    """Draw the store benchmark's commits and restores to ``out``.png/.svg."""
    plt = _pyplot()
    rows, steps = results["rows"], results["meta"]["steps"]
    fig, (commits, restores) = plt.subplots(1, 2, figsize=(13, 4.6),
                                            gridspec_kw={"width_ratios": [1.15, 1]})
    # Odd steps commit with the map alone, even steps with the written ranges.
    for key, first, label, colour in (("commit", 1, "commit (extent map)", OURS),
                                      ("commit_tracked", 2, "commit, tracked (written ranges)",
                                       TRACKED)):
        samples = [s * 1000 for s in rows[key]["samples"]]
        commits.plot(range(first, first + 2 * len(samples), 2), samples, ".", markersize=3,
                     color=colour, label=label)
    for key, label, colour in (("full_copy", "full copy", FULL_COPY),
                               ("reflink_clone", "reflink clone", CLONE)):
        p50 = rows[key]["stats"]["p50"] * 1000
        commits.axhline(p50, color=colour, linestyle="--", label=f"{label}: {p50:,.1f} ms")
    commits.set_yscale("log")
    commits.set_xlabel("agent step")
    commits.set_ylabel("ms per snapshot (log scale)")
    size_gib = results["meta"]["image_size"] / 2**30
    commits.set_title(f"snapshot after each step ({size_gib:g} GiB image, {steps} steps)")
    commits.legend(fontsize=8, loc="center left")
    entries = [
        ("undo a step (depth 1)", rows["restore_depth_1"]["stats"], OURS),
        ("undo a step, tracked", rows["restore_depth_1_tracked"]["stats"], TRACKED),
        (f"undo at depth {steps}", rows[f"restore_depth_{steps}"]["stats"], OURS),
        (f"undo at depth {steps}, tracked", rows[f"restore_depth_{steps}_tracked"]["stats"],
         TRACKED),
        ("random earlier step, in place", rows["restore_in_place"]["stats"], OURS),
        ("random step, in place, tracked", rows["restore_in_place_tracked"]["stats"], TRACKED),
        ("fork into a new image", rows["restore_fork"]["stats"], OURS),
    ]
    _bars(restores, entries, rows["full_copy"]["stats"], "full copy")
    restores.set_title("restore (p50, whisker to p99 or slowest)")
    fig.tight_layout()
    paths = _save(fig, out)
    plt.close(fig)
    return paths


def vm_figure(results: dict, out: Path) -> list[Path]:
    """Draw the VM benchmark's pauses, restores and forks to ``out``.png/.svg."""
    plt = _pyplot()
    fig, (pauses, restores) = plt.subplots(1, 2, figsize=(13, 4.2))
    for key, label, colour in (("checkpoint_paused", "checkpoint (commit)", OURS),
                               ("full_copy_paused", "full-copy snapshot", FULL_COPY)):
        samples = sorted(s * 1000 for s in results[key]["samples"])
        share = [(i + 1) / len(samples) for i in range(len(samples))]
        pauses.step(samples, share, where="post", color=colour,
                    label=f"{label}: p50 {results[key]['p50'] * 1000:,.0f} ms")
    pauses.set_xscale("log")
    pauses.set_xlabel("VM paused, ms (log scale)")
    pauses.set_ylabel("share of checkpoints")
    pauses.set_title(f"pause per checkpoint ({results['machine']['accel']})")
    pauses.legend(fontsize=8, loc="lower right")
    entries = [
        ("undo the last step (disk swapped)", results["restore_undo"], OURS),
        ("random earlier step (disk swapped)", results["restore_swap"], OURS),
        ("restore with a reboot", results["restore_reboot"], OURS),
        ("fork (new VM booted)", results["fork"], OURS),
    ]
    _bars(restores, entries, results["restore_full_copy"], "full copy back + cold boot")
    restores.set_title("to running again (p50, whisker to p99 or slowest)")
    fig.tight_layout()
    paths = _save(fig, out)
    plt.close(fig)
    return paths


FIGURES = {"store": store_figure, "vm": vm_figure}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=sorted(FIGURES))
    ap.add_argument("results", type=Path, help="the benchmark's --json output")
    ap.add_argument("out", type=Path, help="the figure's path without suffix (.png and .svg)")
    args = ap.parse_args(argv)
    try:
        results = json.loads(args.results.read_text())
    except (OSError, ValueError) as e:
        print(f"bench/plots.py: cannot read {args.results}: {e}", file=sys.stderr)
        return 2
    try:
        paths = FIGURES[args.kind](results, args.out)
    except ImportError:
        print("bench/plots.py: needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 2
    except KeyError as e:
        print(f"bench/plots.py: {args.results} is not {args.kind}_bench.py output "
              f"(no {e})", file=sys.stderr)
        return 2
    print("\n".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
