"""The main job (``blockdiff demo``) runs end to end and verifies itself: every
step it committed is restored and compared, and a check that fails stops it
with a clear error and a non-zero status, under ``python3 -O`` too."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from blockdiff.demo import session as demo

pytestmark = [pytest.mark.slow]


def test_demo_in_a_directory(xfs, btrfs):
    events = demo.run(xfs, size=64 * 1024 * 1024, steps=4)
    text = "\n".join(e.what for e in events)
    assert "step 4" in text and "fork b" in text and "import on btrfs" in text
    assert "restore every step 0-4 into a new file" in text
    assert events[-1].what.startswith("all snapshots")


def test_demo_command_on_its_own_scratch_filesystem(xfs):
    proc = subprocess.run([sys.executable, "-m", "blockdiff", "demo", "--size", "64",
                           "--steps", "3"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "restore every step 0-3" in proc.stdout
    assert "verified byte for byte" in proc.stdout


# A demo whose restore of step 2 comes back different: the digest of the
# check file is replaced when step 2's snapshot is being checked.
_LYING_DEMO = textwrap.dedent("""
    import sys
    from blockdiff import cli
    from blockdiff.demo import session as demo

    real, calls = demo.sha256_file, []

    def lying(path):
        calls.append(str(path))
        digest = real(path)
        if str(path).endswith("step-check.img") and calls.count(str(path)) == 3:
            return "0" * 64
        return digest

    demo.sha256_file = lying
    cli.main(["demo", "--dir", sys.argv[1], "--size", "16", "--steps", "3", "--no-vm"])
""")


def test_a_failed_check_stops_the_demo_even_under_python_O(xfs):
    proc = subprocess.run([sys.executable, "-O", "-c", _LYING_DEMO, str(xfs)],
                          capture_output=True, text=True)
    assert proc.returncode == 7, (proc.stdout, proc.stderr)
    assert proc.stderr.startswith("blockdiff: error: demo check failed: step 2 (")
    assert "restored differs from the disk it was committed from" in proc.stderr
    assert "all snapshots" not in proc.stdout


def test_demo_passes_under_python_O(xfs):
    proc = subprocess.run([sys.executable, "-O", "-m", "blockdiff", "demo", "--dir", str(xfs),
                           "--size", "16", "--steps", "3", "--no-vm"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "restore every step 0-3" in proc.stdout
    assert proc.stdout.rstrip().endswith("all snapshots, restores and forks verified byte for "
                                         "byte")


def test_a_scratch_filesystem_that_cannot_be_made_is_one_line_not_a_traceback(xfs, tmp_path):
    """The demo's own XFS fails to format (an mkfs.xfs that refuses, first on
    PATH): status 1, one line naming the tool, nothing mounted or left."""
    import os

    from blockdiff.demo import scratch

    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "mkfs.xfs").write_text("#!/bin/sh\necho 'no space for the log' >&2\nexit 1\n")
    (tools / "mkfs.xfs").chmod(0o755)
    work = tmp_path / "tmp"
    work.mkdir()
    env = dict(os.environ, PATH=f"{tools}{os.pathsep}{os.environ['PATH']}", TMPDIR=str(work))
    proc = subprocess.run([sys.executable, "-m", "blockdiff", "demo", "--size", "16",
                           "--steps", "1", "--no-vm"], capture_output=True, text=True, env=env)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert "mkfs.xfs" in proc.stderr and "no space for the log" in proc.stderr
    assert [p for p in work.rglob("*") if not p.is_dir()] == []      # no backing file left
    with open("/proc/mounts") as mounts:
        assert str(work) not in mounts.read()
    assert not scratch.cleanup_stale_mounts(work / "blockdiff-scratch")
