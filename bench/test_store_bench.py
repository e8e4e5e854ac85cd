"""Tests of bench/store_bench.py: its helpers (no root needed) and one tiny
end-to-end run on a scratch XFS (root, xfsprogs; qemu-utils if installed).
Like everything in bench/, skipped unless --run-bench is given:

    pytest bench/test_store_bench.py --run-bench
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import store_bench
import workloads

BLOCK = store_bench.BLOCK
MiB = store_bench.MiB


def test_steps_are_reproducible_distinct_and_aligned():
    size = 64 * MiB
    a, b = store_bench.make_step(3, size, seed=1), store_bench.make_step(3, size, seed=1)
    assert np.array_equal(a.blocks, b.blocks) and a.seq_offset == b.seq_offset
    assert len(set(a.blocks.tolist())) == store_bench.RANDOM_BLOCKS
    assert int(a.blocks.max()) < size // BLOCK
    assert a.seq_offset % store_bench.SEQUENTIAL == 0
    assert a.seq_offset + store_bench.SEQUENTIAL <= size
    other = store_bench.make_step(4, size, seed=1)
    assert not np.array_equal(a.blocks, other.blocks)


def test_qemu_io_commands_replay_the_step():
    step = store_bench.make_step(255, 64 * MiB, seed=1)
    args = step.qemu_io_commands()
    assert step.pattern == 1                      # never a zero pattern
    assert args[::2] == ["-c"] * (store_bench.RANDOM_BLOCKS + 1)
    first = args[1].split()
    assert first[:4] == ["write", "-q", "-P", "1"]
    assert (int(first[4]), int(first[5])) == (int(step.blocks[0]) * BLOCK, BLOCK)
    assert args[-1].split()[4:] == [str(step.seq_offset), str(store_bench.SEQUENTIAL)]


def test_write_step_writes_exactly_the_step(tmp_path):
    size = 8 * MiB
    path = str(tmp_path / "image")
    workloads.write_image(path, size, seed=1)
    before = np.fromfile(path, dtype=np.uint64).reshape(-1, BLOCK // 8)
    step = store_bench.make_step(7, size, seed=1)
    store_bench.write_step(path, step, workloads._pool(5))
    after = np.fromfile(path, dtype=np.uint64).reshape(-1, BLOCK // 8)
    seq = np.arange(step.seq_offset // BLOCK, (step.seq_offset + store_bench.SEQUENTIAL) // BLOCK)
    written = np.union1d(step.blocks.astype(np.int64), seq)
    changed = np.flatnonzero((before != after).any(axis=1))
    assert np.array_equal(changed, written)
    assert np.array_equal(after[written, 0], written.astype(np.uint64))   # block numbers
    assert os.path.getsize(path) == size
    # What a dirty-block tracker would report: exactly those blocks.
    offsets, lengths = step.written()
    covered = np.zeros(size // BLOCK, bool)
    for o, n in zip(offsets.tolist(), lengths.tolist()):
        covered[o // BLOCK:(o + n) // BLOCK] = True
    assert np.array_equal(np.flatnonzero(covered), written)


def test_write_blocks_writes_exactly_the_blocks(tmp_path):
    size = 8 * MiB
    path = str(tmp_path / "image")
    workloads.write_image(path, size, seed=1)
    before = np.fromfile(path, dtype=np.uint64).reshape(-1, BLOCK // 8)
    blocks = np.array([1500, 3, 77, 2047, 0], dtype=np.uint64)
    store_bench.write_blocks(path, blocks, workloads._pool(5), 0xABC, chunk=2)
    after = np.fromfile(path, dtype=np.uint64).reshape(-1, BLOCK // 8)
    changed = np.flatnonzero((before != after).any(axis=1))
    assert np.array_equal(changed, np.sort(blocks).astype(np.int64))
    assert np.array_equal(after[blocks.astype(np.int64), 0], blocks)
    assert (after[blocks.astype(np.int64), 1] == 0xABC).all()
    assert os.path.getsize(path) == size
    offsets, lengths = store_bench.block_ranges(blocks)
    assert np.array_equal(offsets, blocks * BLOCK) and (lengths == BLOCK).all()


def test_fragmenting_blocks_are_every_other_block_shuffled():
    picked = store_bench.fragmenting_blocks(1001, np.random.default_rng(0))
    assert np.array_equal(np.sort(picked), np.arange(0, 1001, 2, dtype=np.uint64))
    assert not np.array_equal(picked, np.sort(picked))


def test_digest_and_restore_choices():
    rng = np.random.default_rng(0)
    digests = store_bench.choose_digest_steps(200, rng)
    assert len(digests) == store_bench.DIGESTS and digests[0] == 1 and digests[-1] == 200
    picks = store_bench.choose_restore_steps(200, digests, rng)
    assert len(picks) == store_bench.RESTORE_SAMPLES
    assert all(1 <= k < 200 for k in picks)
    assert len([k for k in picks if k in digests]) >= store_bench.VERIFIED_SAMPLES
    few = store_bench.choose_digest_steps(3, rng)
    assert few == [1, 2, 3]
    assert all(1 <= k < 3 for k in store_bench.choose_restore_steps(3, few, rng))


def test_stats_leaves_out_p99_of_few_samples():
    assert store_bench.stats([1.0, 2.0, 3.0])["p99"] is None
    s = store_bench.stats([float(x) for x in range(1, 101)])
    assert s["n"] == 100 and s["p50"] == pytest.approx(50.5) and s["p99"] == pytest.approx(99.01)


@pytest.mark.bench
def test_end_to_end_tiny_run(tmp_path, capsys, scratch_xfs_possible):
    out = tmp_path / "out.json"
    argv = ["--steps", "4", "--image-mib", "32", "--frag-mib", "16", "--json", str(out),
            "--workdir", str(tmp_path / "scratch")]
    if not (shutil.which("qemu-img") and shutil.which("qemu-io")):
        argv.append("--no-qcow2")
    assert store_bench.main(argv) == 0
    printed = capsys.readouterr().out
    assert "| store.commit after a step | 2 |" in printed
    assert "| store.commit after a step, tracked (written ranges given) | 2 |" in printed
    assert "| fragmented image: store.commit after a 100-block step | 5 |" in printed
    assert ("| fragmented image: store.commit after a 100-block step, tracked (written ranges "
            "given) | 5 |") in printed
    assert "(p50, tracked)" in printed
    assert "| fragmented image: whole-image reflink clone" in printed
    assert "in-place restore / reflink clone: " in printed
    result = json.loads(out.read_text())
    assert result["checks"] and all(c["identical"] for c in result["checks"])
    assert result["sizes"]["changed_bytes_steps"] >= 4 * store_bench.SEQUENTIAL
    assert any(c["what"].endswith("on the fragmented image") for c in result["checks"])
    # 16 MiB: 4,096 blocks, every other one rewritten, so about one extent per block
    assert result["sizes"]["frag_extents"] >= 2048
    assert len(result["rows"]["frag_restore"]["samples"]) == store_bench.FRAG_REPEAT
    assert len(result["rows"]["frag_restore_tracked"]["samples"]) == store_bench.FRAG_REPEAT
    assert all(d["ranges"] >= 1 for d in result["rows"]["frag_restore"]["detail"])
    assert not os.listdir(tmp_path / "scratch")      # nothing left mounted or behind
