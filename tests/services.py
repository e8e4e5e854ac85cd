"""What the tests' throwaway servers (tests/objectstore.py's SeaweedFS,
tests/postgres.py's PostgreSQL) share: stopping one by its pid, and the end
of its log for an error message."""

from __future__ import annotations

import contextlib
import signal
import subprocess
from pathlib import Path


def stop_by_pid(process: subprocess.Popen, first: signal.Signals, seconds: float) -> None:
    """Send ``first`` to a server still running, and SIGKILL it if it has not
    ended within ``seconds``."""
    if process.poll() is None:
        process.send_signal(first)
        try:
            process.wait(seconds)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def log_tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a server's log ("" if it cannot be read)."""
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""
