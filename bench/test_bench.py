"""pytest-benchmark benchmarks of the blockdiff library.

    pytest bench --run-bench [--benchmark-json out.json]

create_diff / apply_diff run on a 256 MiB image with 1 % of its blocks
rewritten, on a scratch XFS loop mount (needs root and xfsprogs; skipped with
the reason from blockdiff.demo.scratch otherwise); the extent algebra runs on a
synthetic pair of 500,000-extent maps (no root needed).
"""

from __future__ import annotations

import filecmp
import os
import shutil
import subprocess

import numpy as np
import pytest
import workloads

from blockdiff import native
from blockdiff.demo import scratch
from blockdiff.engine import diff as engine
from blockdiff.engine.extents import DATA, ZERO, ExtentMap, changed_ranges

pytestmark = pytest.mark.bench

FORMATS = ["v1", "v2"]
SPEC = workloads.Spec("bench", "256 MiB image, 1% of blocks overwritten",
                      256 * workloads.MiB, 0.01)


def _same(a: str, b: str) -> bool:
    if shutil.which("cmp"):
        return subprocess.run(["cmp", "-s", a, b], check=False).returncode == 0
    return filecmp.cmp(a, b, shallow=False)


def _rm(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@pytest.fixture(scope="module")
def workload():
    reason = scratch.filesystem_unavailable_reason("xfs")
    if reason:
        pytest.skip(f"no scratch XFS filesystem: {reason}")
    with workloads.scratch_xfs(4 * SPEC.size) as mnt:
        yield workloads.build(SPEC, mnt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_create_diff(benchmark, workload, fmt):
    out = os.path.join(workload.dir, f"create-{fmt}.diff")
    kw = {"base": workload.base, "format": fmt}

    res = benchmark.pedantic(engine.create_diff, args=(out, workload.target), kwargs=kw,
                             setup=lambda: _rm(out), rounds=5, iterations=1, warmup_rounds=1)

    assert res.ranges > 0
    assert res.data_bytes >= workload.changed_blocks * workloads.BLOCK
    benchmark.extra_info.update(ranges=res.ranges, data_bytes=res.data_bytes,
                                extents_target=workload.extents_target)


@pytest.mark.parametrize("fmt", FORMATS)
def test_apply_diff(benchmark, workload, fmt):
    diff = os.path.join(workload.dir, f"apply-{fmt}.diff")
    restored = os.path.join(workload.dir, f"apply-{fmt}.restored")
    _rm(diff)
    engine.create_diff(diff, workload.target, base=workload.base, format=fmt)

    benchmark.pedantic(engine.apply_diff, args=(diff, restored),
                       kwargs={"base": workload.base}, setup=lambda: _rm(restored),
                       rounds=5, iterations=1, warmup_rounds=1)

    assert _same(workload.target, restored), "restored image differs from the target"


N_EXTENTS = 500_000
EXTENT = 2 * workloads.BLOCK  # 8 KiB extents


def _synthetic_maps(n: int = N_EXTENTS, changed: float = 0.3, seed: int = 7):
    """A base of n contiguous 8 KiB extents and a target sharing all but a
    random `changed` fraction of them (those moved elsewhere, a few of them
    unwritten).  Returns (target, base, bytes that must come out as DATA)."""
    rng = np.random.default_rng(seed)
    logical = np.arange(n, dtype=np.uint64) * np.uint64(EXTENT)
    length = np.full(n, EXTENT, np.uint64)
    # shuffled physical placement so no two neighbours are physically adjacent
    slots = rng.permutation(2 * n).astype(np.uint64)[:n]
    base_phys = np.uint64(1 << 30) + slots * np.uint64(EXTENT)
    moved = rng.random(n) < changed
    target_phys = base_phys.copy()
    target_phys[moved] = np.uint64(1 << 40) + np.arange(int(moved.sum()), dtype=np.uint64) \
        * np.uint64(EXTENT)
    tflags = np.zeros(n, np.uint32)
    unwritten = moved & (rng.random(n) < 0.05)
    tflags[unwritten] = native.EXTENT_UNWRITTEN
    tflags[-1] |= native.EXTENT_LAST
    bflags = np.zeros(n, np.uint32)
    bflags[-1] = native.EXTENT_LAST
    size = n * EXTENT
    target = ExtentMap.from_arrays(logical, target_phys, length, tflags, size)
    base = ExtentMap.from_arrays(logical, base_phys, length, bflags, size)
    data_bytes = int((moved & ~unwritten).sum()) * EXTENT
    zero_bytes = int(unwritten.sum()) * EXTENT
    return target, base, data_bytes, zero_bytes


def test_changed_ranges_500k_extents(benchmark):
    target, base, data_bytes, zero_bytes = _synthetic_maps()

    res = benchmark.pedantic(changed_ranges, args=(target, base), rounds=5, iterations=1,
                             warmup_rounds=1)

    benchmark.extra_info.update(extents=N_EXTENTS, ranges=len(res))
    assert res.bytes_of(DATA) == data_bytes
    assert res.bytes_of(ZERO) == zero_bytes
