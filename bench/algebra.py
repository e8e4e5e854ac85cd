"""Time and peak memory of the extent algebra on a synthetic map.

    python bench/algebra.py [--extents N] [--repeat R] [--delta-ranges K]

Two maps of N extents (1,000,000 by default) with random lengths and
physical addresses, every other extent of the target rewritten elsewhere, as
after a step that touched half an image's extents. Prints the median time of
``changed_ranges`` and the process's peak RSS, which includes Python, numpy and
both maps. Then the median time of reading one delta map (a step's K ranges,
101 by default, spliced into its parent's extent map and piece table of N
entries), the work a map stored as a delta costs per link of its chain.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import numpy as np

from blockdiff.engine.extents import (
    ExtentMap,
    PieceTable,
    changed_ranges,
    normalize_ranges,
    partition,
    pieces_within,
    remap,
    splice_pieces,
)

BLOCK = 4096


def synthetic_pair(n: int) -> tuple[ExtentMap, ExtentMap]:
    """A base map of n extents and a target with every other one rewritten."""
    rng = np.random.default_rng(7)
    length = rng.integers(1, 8, n).astype(np.uint64) * np.uint64(BLOCK)
    logical = np.zeros(n, np.uint64)
    np.cumsum(length[:-1], out=logical[1:])
    physical = rng.permutation(n).astype(np.uint64) * np.uint64(1 << 20)
    size = int(logical[-1] + length[-1])
    flags = np.zeros(n, np.uint32)
    base = ExtentMap.from_arrays(logical, physical, length, flags, size)
    moved = physical.copy()
    moved[::2] += np.uint64(BLOCK)
    return ExtentMap.from_arrays(logical, moved, length, flags, size), base


def median_seconds(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def delta_splice(base: ExtentMap, k: int):
    """What reading a delta map does: a step's k one-block ranges spliced into
    the parent's extent map and piece table (one piece per extent)."""
    rng = np.random.default_rng(11)
    pieces = PieceTable(base.logical, base.length,
                        rng.integers(1, 200, len(base)).astype(np.int64), base.logical, base.size)
    offsets = rng.choice(base.size // BLOCK, size=k, replace=False).astype(np.uint64)
    starts, ends = normalize_ranges(offsets * np.uint64(BLOCK), np.full(k, BLOCK, np.uint64),
                                    base.size)
    own_pieces, _ = pieces_within(pieces, starts, ends)
    own_extents, _ = partition(base, starts, ends)

    def splice():
        splice_pieces(pieces, starts, ends, own_pieces)
        remap(base, starts, ends, own_extents)

    return splice


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--extents", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--delta-ranges", type=int, default=101)
    args = parser.parse_args()
    target, base = synthetic_pair(args.extents)
    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        ranges = changed_ranges(target, base, BLOCK)
        times.append(time.perf_counter() - start)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"changed_ranges on {args.extents:,} extents: median {statistics.median(times):.3f} s "
          f"over {args.repeat} runs, {len(ranges):,} ranges; peak RSS {peak_mb:.0f} MB")
    splice = median_seconds(delta_splice(base, args.delta_ranges), max(args.repeat, 20))
    print(f"a delta map of {args.delta_ranges} ranges spliced into a map and piece table of "
          f"{args.extents:,} entries: median {splice * 1000:.2f} ms")


if __name__ == "__main__":
    main()
