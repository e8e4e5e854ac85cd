"""Human output never passes a stored string to the terminal raw: a newline
or an escape sequence in a message, meta value, thread, reason or tool name
comes out escaped (``\\n``, ``\\x1b``), so it cannot clear the screen or fake
lines; ``--json`` output keeps every string exact."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

BLOCK = 4096
# What a terminal acts on: C0 but the newline ending each line, DEL, C1, the
# line and paragraph separators, and bidirectional overrides.
RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")

HOSTILE = {
    "clear": "\x1b[2J",
    "lines": "a\nb",
    "return": "over\rwritten",
    "title": "\x1b]0;owned\x07",
    "c1": "csi\x9b31m",
    "separator": "line\u2028para\u2029",
    "bidi": "\u202etxt.exe",
    "del": "rub\x7fout",
}
ESCAPED = {
    "clear": "\\x1b[2J",
    "lines": "a\\nb",
    "return": "over\\rwritten",
    "title": "\\x1b]0;owned\\x07",
    "c1": "csi\\x9b31m",
    "separator": "line\\u2028para\\u2029",
    "bidi": "\\u202etxt.exe",
    "del": "rub\\x7fout",
}


def cli(*args, env=None) -> str:
    """stdout of a command that must succeed, as the bytes it wrote (no newline
    translation), decoded."""
    done = subprocess.run([sys.executable, "-m", "blockdiff", *map(str, args)],
                          capture_output=True, env=env)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    return done.stdout.decode("utf-8")


def assert_printable(text: str) -> list[str]:
    """Every line of human output free of what a terminal acts on."""
    lines = text.split("\n")
    assert lines[-1] == "", "output ends with a newline"
    for line in lines[:-1]:
        assert not RAW.search(line), repr(line)
    return lines[:-1]


@pytest.fixture
def store(xfs):
    root = xfs / "store"
    cli("init", root)
    image = xfs / "disk.img"
    ids = []
    for i, (name, value) in enumerate(HOSTILE.items()):
        with open(image, "wb") as f:
            f.write(bytes([i + 1]) * BLOCK)
        out = cli("commit", "--store", root, image, "-m", f"{name} {value}",
                  "--meta", f"{name}={value}")
        ids.append(out.split()[-1])
    return root, ids


def test_log_and_tree_escape_messages_and_meta(store):
    root, ids = store
    lines = assert_printable(cli("log", "--store", root))
    assert len(lines) == len(HOSTILE)           # one line per snapshot, none faked
    for line, name in zip(lines, reversed(list(HOSTILE))):
        assert f"{name} {ESCAPED[name]}" in line and f" {name}={ESCAPED[name]}" in line, line
    tree = assert_printable(cli("tree", "--store", root))
    assert len(tree) == len(HOSTILE)
    for line, (name, escaped) in zip(tree, ESCAPED.items()):
        assert line.endswith(f"{name} {escaped}"), line
    # JSON is exact: json.dumps escapes the control characters itself.
    text = cli("log", "--store", root, "--json")
    assert not RAW.search(text.replace("\n", ""))
    records = json.loads(text)
    assert [r["message"] for r in reversed(records)] == [f"{n} {v}" for n, v in HOSTILE.items()]
    assert [r["meta"] for r in reversed(records)] == [{n: v} for n, v in HOSTILE.items()]


def test_agent_commands_escape_what_the_agent_stored(store):
    from blockdiff.agent.agent import Agent, Tool
    from blockdiff.store.store import Store

    root, _ = store
    thread = "run\x1b[2J\nfake"
    tool = "pay\x1b[31m"
    with Store(root) as opened:
        with Agent(opened, thread, tools=[Tool(tool, lambda args, rid: {"ok": True})]) as a:
            with a.step("charge\nstep", meta={"note": HOSTILE["separator"]}) as s:
                s.call(tool, {"to": HOSTILE["title"]})
                s.state["done"] = True
            a.state["more"] = 1
            a.checkpoint(f"reason {HOSTILE['clear']} {HOSTILE['lines']}",
                          {"why": HOSTILE["bidi"]})
            head = a.head
            try:
                a.approval({"deploy": HOSTILE["clear"]})
            except Exception as e:
                assert type(e).__name__ == "ApprovalPending"
    env = dict(os.environ, BLOCKDIFF_STORE=str(root))
    env.pop("BLOCKDIFF_AGENT_KEY", None)
    escaped_thread = "run\\x1b[2J\\nfake"

    threads = assert_printable(cli("agent", "threads", env=env))
    assert len(threads) == 1 and threads[0].startswith(escaped_thread)
    history = assert_printable(cli("agent", "history", thread, env=env))
    assert len(history) == 3               # start, the step, the checkpoint (approval: unchanged)
    assert any(f"reason {ESCAPED['clear']} {ESCAPED['lines']}" in line for line in history)
    tree = assert_printable(cli("agent", "tree", env=env))
    assert len(tree) == 3 and all(f"[{escaped_thread}]" in line for line in tree)
    shown = assert_printable(cli("agent", "show", head, env=env))
    assert f"thread:        {escaped_thread}" in shown
    assert any(line.startswith("reason:") and ESCAPED["lines"] in line for line in shown)
    assert any(line.startswith("meta:") and "\\u202e" in line for line in shown)
    pending = assert_printable(cli("agent", "pending", env=env))
    assert len(pending) == 1 and pending[0].startswith(escaped_thread)
    journal = assert_printable(cli("agent", "journal", thread, env=env))
    assert len(journal) == 1 and "pay\\x1b[31m" in journal[0]

    # --json keeps every string exactly as stored.
    assert json.loads(cli("agent", "threads", "--json", env=env))[0]["id"] == thread
    records = json.loads(cli("agent", "history", thread, "--json", env=env))
    assert records[0]["reason"] == f"reason {HOSTILE['clear']} {HOSTILE['lines']}"
    assert records[0]["meta"] == {"why": HOSTILE["bidi"]}
    assert {"note": HOSTILE["separator"], "step": "charge\nstep"}.items() <= \
        records[1]["meta"].items()
    record = json.loads(cli("agent", "show", head, "--json", env=env))
    assert record["thread"] == thread and record["meta"] == {"why": HOSTILE["bidi"]}
    assert json.loads(cli("agent", "journal", thread, "--json", env=env))[0]["tool"] == tool
    approval = json.loads(cli("agent", "pending", "--json", env=env))[0]
    assert approval["thread"] == thread and approval["action"] == {"deploy": HOSTILE["clear"]}
