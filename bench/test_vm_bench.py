"""A tiny end-to-end run of bench/vm_bench.py: a real VM under QEMU on a
scratch XFS (root, xfsprogs, QEMU and what the image builder needs). Like
everything in bench/, skipped unless --run-bench is given:

    pytest bench/test_vm_bench.py --run-bench
"""

from __future__ import annotations

import json
import shutil

import pytest
import vm_bench


@pytest.mark.bench
def test_end_to_end_tiny_run(tmp_path, capsys, scratch_xfs_possible):
    if shutil.which("qemu-system-x86_64") is None:
        pytest.skip("QEMU is not installed (bash .ci/setup installs it)")
    out = tmp_path / "out.json"
    assert vm_bench.main(["--steps", "12", "--disk-mib", "128", "--pool-mib", "16",
                          "--memory-steps", "6", "--json", str(out),
                          "--workdir", str(tmp_path / "work")]) == 0
    printed = capsys.readouterr().out
    assert "| checkpoint: VM paused |" in printed
    result = json.loads(out.read_text())
    assert result["checkpoint_paused"]["n"] == 12
    assert result["full_copy_paused"]["n"] == 2
    assert result["restore_swap"]["n"] == vm_bench.RESTORE_SAMPLES
    assert result["restore_undo"]["n"] == vm_bench.UNDO_SAMPLES
    # Every checkpoint but the first after the boot, and every swap, read the bitmap.
    assert result["checkpoints_tracked"] == 11
    assert result["swaps_tracked"] == result["swaps"] == 20
    assert result["changed_bytes"] >= 12 * vm_bench.MiB
    memory = result["memory"]
    assert "| restore to running, processes back |" in printed
    assert memory["paused"]["n"] == 6 and memory["fork"]["n"] == 6
    assert memory["restore"]["n"] == 5
    # A 100 MiB step stores about that much; a small one far less.
    assert memory["big_stored"]["p50"] > 90 * vm_bench.MiB > memory["stored"]["p50"]
    # Only pages whose extents moved are compared, and only those that differ kept.
    assert memory["compared"]["p50"] >= memory["stored"]["p50"] > 0
    # The page cache of what a step wrote points into the disk snapshot's layer.
    assert memory["borrowed"]["p50"] > 0
    assert memory["compared"]["p50"] >= memory["stored"]["p50"] + memory["borrowed"]["p50"]
    assert len(memory["fork_phases"]) == 6
    # What QEMU and the host ran while each fork's guest answered.
    assert len(vm_bench.guest_cpu(memory["fork_phases"], 1)) == 6
    assert "Forks' guests answered their resume in" in printed
    # Each restore waits for its own process's standby: every one takes it.
    assert memory["restore_standby"] == [True] * 5
    # ... and the QEMU started ahead on it, beside its preparation.
    assert memory["restore_prestarted"] == [True] * 5
    assert len(memory["fork_source"]) == 6
    assert set(memory["fork_source"]) <= {"spare", "standby copy", ""}
    # Forks of the checkpoint just taken, its spares ready, each take them.
    assert memory["fork_latest_source"] == ["spare"] * vm_bench.LATEST_FORKS
    assert ("the standby memory image was used by 5 of 5 restores, a QEMU started ahead "
            "by 5" in printed)
    # QEMU's own save holds every page the guest used (92-97 MB of 256 MiB
    # here, its zero pages left out), far more than a step stores.
    assert memory["qemu_saved_bytes"] > max(64 * vm_bench.MiB, 10 * memory["stored"]["p50"])
    assert not list((tmp_path / "work" / "scratch").iterdir())  # nothing left mounted
