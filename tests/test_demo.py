"""The main job (``blockdiff demo``) runs end to end and verifies itself."""

from __future__ import annotations

import subprocess
import sys

from blockdiff import demo


def test_demo_in_a_directory(xfs, btrfs):
    events = demo.run(xfs, size=64 * 1024 * 1024, steps=4)
    text = "\n".join(e.what for e in events)
    assert "step 4" in text and "fork b" in text and "import on btrfs" in text
    assert events[-1].what.startswith("all snapshots")


def test_demo_command_on_its_own_scratch_filesystem(xfs):
    proc = subprocess.run([sys.executable, "-m", "blockdiff", "demo", "--size", "64",
                           "--steps", "3"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "verified byte for byte" in proc.stdout
