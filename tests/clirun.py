"""Running ``blockdiff`` from a test.

``cli`` runs the command in this process (click's test runner), which costs
milliseconds where a new interpreter costs about 0.4 s: use it where the
command's output and exit status are what is checked. ``cli_process`` runs
``python3 -m blockdiff`` as a process of its own: use it where the process
is what is tested (a traceback on stderr, a signal, ``-O``, the umask, a
command run beside another, one killed half-way).

Both return a ``subprocess.CompletedProcess`` and check the exit status
(``code``) and that nothing escaped as a traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback

from click.testing import CliRunner

from blockdiff.cli import main


def cli(*args, code: int | None = 0, env: dict | None = None) -> subprocess.CompletedProcess:
    """``blockdiff ARGS`` in this process; ``env`` replaces the environment
    for the command, as a process's would."""
    argv = [str(a) for a in args]
    overlay = None
    if env is not None:
        overlay = {k: None for k in os.environ if k not in env}
        overlay.update(env)
    result = CliRunner().invoke(main, argv, env=overlay, catch_exceptions=True)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"blockdiff {' '.join(argv)} raised:\n" + "".join(
            traceback.format_exception(result.exception)))
    done = subprocess.CompletedProcess(["blockdiff", *argv], result.exit_code,
                                       result.stdout, result.stderr)
    if code is not None:
        assert done.returncode == code, (argv, done.returncode, done.stderr)
    return done


def cli_process(*args, code: int | None = 0, env: dict | None = None,
                timeout: float = 300) -> subprocess.CompletedProcess:
    """``python3 -m blockdiff ARGS`` as a process of its own."""
    done = subprocess.run([sys.executable, "-m", "blockdiff", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=timeout)
    if code is not None:
        assert done.returncode == code, (args, done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    return done


def as_json(*args, code: int = 0, env: dict | None = None):
    """The one JSON document ``blockdiff ARGS --json`` prints, and nothing
    else on stdout (json.loads refuses anything around it)."""
    return json.loads(cli(*args, "--json", code=code, env=env).stdout)


def error_line(*args, code: int, env: dict | None = None) -> str:
    """The single error line of a command that must fail with ``code``."""
    done = cli(*args, code=code, env=env)
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("blockdiff: error: "), done.stderr
    assert done.stdout == ""
    return lines[0]


def short_prefix(full: str, others) -> str:
    """The shortest prefix of ``full``, at least 4 digits, no other id begins with."""
    for n in range(4, 17):
        if not any(o != full and o.startswith(full[:n]) for o in others):
            return full[:n]
    raise AssertionError(full)
