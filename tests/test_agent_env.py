"""The environment an agent checkpoint was taken under (model, system prompt,
tools, environment variables), and ``agent diff`` between two checkpoints."""

from __future__ import annotations

import gc
import os
import sqlite3

import pytest
from clirun import as_json, cli, error_line, short_prefix

from blockdiff.agent import model
from blockdiff.agent.agent import Agent, AgentDB, Tool, fork_thread
from blockdiff.agent.diff import Change, diff_checkpoints, json_changes
from blockdiff.agent.disks import ImageDisk
from blockdiff.agent.model import Environment
from blockdiff.agent.sealing import Codec, new_key
from blockdiff.errors import EnvironmentChanged, SealingError, UsageError
from blockdiff.store.store import Store

MiB = 1 << 20
BLOCK = 4096
SECRET = "sk-live-0123456789abcdef"
ENV = {"model": "claude-x", "model_version": "2026-01", "system_prompt": "You are careful.",
       "tools": {"browser": "1.2"}, "env": {"API_URL": "https://api.example", "API_TOKEN": SECRET}}


def tools():
    return [Tool("charge", lambda args, rid: {"charged": args["amount"], "id": rid},
                 idempotent=True, version="3.1"),
            Tool("email", lambda args, rid: {"sent": args["to"]}, idempotent=True)]


@pytest.fixture
def store(xfs):
    store = Store.init(xfs / "store")
    yield store
    store.close()
    gc.collect()  # AgentDB connections the tests dropped: the mount must unmount


def environment_rows(store) -> int:
    with AgentDB(store) as db:  # no codec: only counted
        return db.db.execute("SELECT count(*) FROM environments").fetchone()[0]


def database_bytes(store) -> bytes:
    root = store.root / model.DB_NAME
    return b"".join(p.read_bytes() for p in (root, root.with_name(root.name + "-wal"))
                    if p.exists())


def run_steps(a: Agent, count: int) -> list[str]:
    ids = []
    for _ in range(count):
        with a.step("count") as s:
            s.state["n"] = s.state.get("n", 0) + 1
        ids.append(a.head)
    return ids


# ---------------------------------------------------------- environment


def test_the_environment_is_stored_once_for_the_checkpoints_that_share_it(store):
    with Agent(store, "t", tools=tools(), secrets={"API_TOKEN"}, environment=ENV) as a:
        ids = run_steps(a, 5)
        assert a.environment.tools == {"charge": "3.1", "email": None, "browser": "1.2"}
    assert environment_rows(store) == 1
    with AgentDB(store, Codec()) as db:
        recorded = {db.checkpoint(i).environment_id for i in ids}
        assert len(recorded) == 1 and None not in recorded
        environment = db.environment(recorded.pop())
    assert environment == Environment("claude-x", "2026-01", "You are careful.",
                                      {"charge": "3.1", "email": None, "browser": "1.2"},
                                      {"API_URL": "https://api.example",
                                       "API_TOKEN": "[redacted]"})
    # Another environment variable and another tool version: reported, not
    # refused, and the next checkpoint records the new environment although
    # the state did not change.
    changed = ENV | {"tools": {"browser": "1.3"}, "env": {"API_URL": "https://b.example"}}
    with Agent(store, "t", tools=tools(), secrets={"API_TOKEN"}, environment=changed) as a:
        assert a.environment_changes == [
            Change("env.API_TOKEN", "removed", before="[redacted]"),
            Change("env.API_URL", "changed", "https://api.example", "https://b.example"),
            Change("tools.browser", "changed", "1.2", "1.3")]
        result = a.checkpoint("environment only")
        assert not result.skipped
        again = a.checkpoint("nothing")
        assert again.skipped
    assert environment_rows(store) == 2
    # An Agent given no environment keeps the head's: nothing compared, nothing new.
    with Agent(store, "t", tools=tools()) as a:
        assert a.environment is None and a.environment_changes == []
        run_steps(a, 2)
    assert environment_rows(store) == 2
    with AgentDB(store, Codec()) as db:
        kept = [c.environment_id for c in db.history("t")]
        assert kept[:3] == [kept[0]] * 3 and kept[3] != kept[0]


def test_an_environment_field_it_does_not_have_is_refused(store):
    with pytest.raises(UsageError, match="has no temperature"):
        Agent(store, "t", environment={"model": "m", "temperature": 0.2})
    with Agent(store, "t", tools=tools(), environment={"tools": ["browser"]}) as a:
        assert a.environment.tools == {"charge": "3.1", "email": None, "browser": None}


@pytest.mark.parametrize("field, value", [("model", "claude-y"), ("model_version", "2026-06"),
                                          ("system_prompt", "You are reckless.")])
def test_a_changed_model_or_prompt_is_refused_on_resume_unless_allowed(store, field, value):
    with Agent(store, "t", tools=tools(), environment=ENV) as a:
        run_steps(a, 2)
        head = a.head
    changed = ENV | {field: value}
    named = "the system prompt" if field == "system_prompt" else f"{field} '{ENV[field]}' \\(now"
    with pytest.raises(EnvironmentChanged, match=f"another environment .*: {named}"):
        Agent(store, "t", tools=tools(), environment=changed)
    # The refused open let go of the thread: the old environment runs it on.
    with Agent(store, "t", tools=tools(), environment=ENV) as a:
        assert a.head == head and a.environment_changes == []
    with Agent(store, "t", tools=tools(), environment=changed,
               allow_environment_change=True) as a:
        assert [c.path for c in a.environment_changes] == [field]
        run_steps(a, 1)
        new_head = a.head
    with AgentDB(store, Codec()) as db:
        assert getattr(db.environment(db.checkpoint(new_head).environment_id), field) == value
        assert getattr(db.environment(db.checkpoint(head).environment_id), field) == ENV[field]


def test_secret_environment_variables_are_not_written(store):
    with Agent(store, "t", secrets={"API_TOKEN"}, environment=ENV) as a:
        run_steps(a, 2)
    # Another value of the secret is no change: what is compared is what is written.
    other = ENV | {"env": ENV["env"] | {"API_TOKEN": "sk-live-other"}}
    with Agent(store, "t", secrets={"API_TOKEN"}, environment=other) as a:
        assert a.environment_changes == []
        run_steps(a, 1)
    assert environment_rows(store) == 1
    data = database_bytes(store)
    assert SECRET.encode() not in data and b"sk-live-other" not in data
    assert b"https://api.example" in data   # what is not secret is written in the clear


def test_a_sealed_environment_needs_the_key(store, monkeypatch):
    monkeypatch.delenv("BLOCKDIFF_AGENT_KEY", raising=False)
    key = new_key()
    with Agent(store, "t", key=key, environment=ENV) as a:
        run_steps(a, 1)
        head = a.head
    data = database_bytes(store)
    for clear in (b"claude-x", b"You are careful.", b"https://api.example", SECRET.encode()):
        assert clear not in data
    with AgentDB(store, Codec(key)) as db:
        assert db.environment(db.checkpoint(head).environment_id).model == "claude-x"
    with AgentDB(store, Codec(None)) as db:
        with pytest.raises(SealingError, match="is encrypted"):
            db.environment(db.checkpoint(head).environment_id)
    with AgentDB(store, Codec(new_key())) as db:
        with pytest.raises(SealingError, match="key is wrong"):
            db.environment(db.checkpoint(head).environment_id)
    # A changed model is refused under the seal as well.
    with pytest.raises(EnvironmentChanged):
        Agent(store, "t", key=key, environment=ENV | {"model": "claude-y"})
    env = dict(os.environ, BLOCKDIFF_AGENT_KEY=key)
    shown = as_json("agent", "show", "--store", store.root, head, env=env)
    assert shown["environment"]["system_prompt"] == "You are careful."
    without = dict(os.environ)
    without.pop("BLOCKDIFF_AGENT_KEY", None)
    refused = cli("agent", "show", "--store", store.root, head, code=11, env=without)
    assert "is encrypted" in refused.stderr and refused.stdout == ""


def test_agent_show_prints_the_environment(store, monkeypatch):
    monkeypatch.delenv("BLOCKDIFF_AGENT_KEY", raising=False)
    with Agent(store, "old") as a:
        run_steps(a, 1)
        old = a.head
    prompt = "Line one\n\x1b[2Jline two"
    with Agent(store, "t", tools=tools(), secrets={"API_TOKEN"},
               environment=ENV | {"system_prompt": prompt}) as a:
        run_steps(a, 1)
        head = a.head
    shown = as_json("agent", "show", "--store", store.root, head)
    assert shown["environment"] == {
        "model": "claude-x", "model_version": "2026-01", "system_prompt": prompt,
        "tools": {"browser": "1.2", "charge": "3.1", "email": None},
        "env": {"API_URL": "https://api.example", "API_TOKEN": "[redacted]"}}
    assert shown["environment_id"].startswith("sha256:")
    human = cli("agent", "show", "--store", store.root, head).stdout
    assert f"environment:   {shown['environment_id']}" in human
    assert '  model:          "claude-x"' in human
    assert '  system_prompt:  "Line one\\n\\u001b[2Jline two"' in human
    assert "\x1b" not in human
    assert '"API_TOKEN": "[redacted]"' in human and SECRET not in human
    assert as_json("agent", "show", "--store", store.root, old)["environment"] is None
    assert "environment:   (none recorded)" in cli("agent", "show", "--store", store.root,
                                                   old).stdout


def test_a_database_made_before_environments_migrates(store):
    with Agent(store, "t") as a:
        run_steps(a, 2)
        old = a.head
    # Back to the schema before environments were kept.
    raw = sqlite3.connect(store.root / model.DB_NAME, isolation_level=None)
    raw.execute("DROP INDEX checkpoints_environment")
    raw.execute("ALTER TABLE checkpoints DROP COLUMN environment")
    raw.execute("DROP TABLE environments")
    raw.execute("ALTER TABLE threads DROP COLUMN lease_token")
    raw.execute("ALTER TABLE journal DROP COLUMN owner")
    raw.execute("ALTER TABLE journal DROP COLUMN settled")
    raw.execute("UPDATE schema_versions SET version = 2 WHERE name = 'agent'")
    raw.execute("PRAGMA user_version = 2")
    raw.close()
    with Agent(store, "t", environment=ENV | {"model": "claude-y"}) as a:
        assert a.head == old and a.environment_changes == []   # none to compare with
        run_steps(a, 1)
        new = a.head
    with AgentDB(store, Codec()) as db:
        assert db.checkpoint(old).environment_id is None
        assert db.environment(db.checkpoint(new).environment_id).model == "claude-y"
        version = db.db.execute("SELECT version FROM schema_versions WHERE name = 'agent'"
                                ).fetchone()[0]
    assert version == len(model.MIGRATIONS)


def test_gc_removes_environments_no_checkpoint_uses(store):
    with Agent(store, "t", ttl=0.001, environment=ENV) as a:
        run_steps(a, 1)
    with Agent(store, "t", ttl=0.001, environment=ENV | {"model": "claude-y"},
               allow_environment_change=True) as a:
        run_steps(a, 2)
    assert environment_rows(store) == 2
    with AgentDB(store, Codec()) as db:
        db.gc(now=2**40)
    assert environment_rows(store) == 1


# ----------------------------------------------------------------- diff


def test_json_changes_name_paths_into_objects_and_arrays():
    before = {"orders": [{"amount": 1}, {"amount": 2}, {"amount": 3}], "gone": True, "n": 1}
    after = {"orders": [{"amount": 1}, {"amount": 2}, {"amount": 30}, {"amount": 4}],
             "new": {"x": None}, "n": 1.0}
    assert json_changes(before, after) == [
        Change("gone", "removed", before=True),
        Change("n", "changed", 1, 1.0),
        Change("new", "added", after={"x": None}),
        Change("orders[2].amount", "changed", 3, 30),
        Change("orders[3]", "added", after={"amount": 4})]
    assert json_changes(before, before) == []


def order_steps(a: Agent, amounts):
    for amount in amounts:
        with a.step("order") as s:
            receipt = s.call("charge", {"amount": amount})
            s.state.setdefault("orders", []).append({"amount": amount, "id": receipt["id"]})
            s.messages.append({"role": "tool", "content": f"charged {amount}"})
    return a.head


def test_diff_of_two_checkpoints_of_one_thread(store):
    with Agent(store, "t", tools=tools(), environment=ENV) as a:
        first = order_steps(a, [10])
        with AgentDB(store, Codec()) as db:
            start = db.checkpoint(first).parent
        last = order_steps(a, [20, 30])
        calls = [e.request_id for e in a.db.journal("t")]
    with Agent(store, "t", tools=tools(), environment=ENV | {"model": "claude-y"},
               allow_environment_change=True) as a:
        with a.step("amend") as s:
            s.state["orders"][2]["amount"] = 31
        amended = a.head
    with AgentDB(store, Codec()) as db:
        result = diff_checkpoints(db, first, last)
        assert result.descends and result.common_ancestor == first
        assert [c.path for c in result.state] == ["orders[1]", "orders[2]"]
        assert result.common_messages == 1 and result.messages_removed == 0
        assert result.messages_added == [{"role": "tool", "content": "charged 20"},
                                         {"role": "tool", "content": "charged 30"}]
        assert [e.request_id for e in result.calls_b] == calls[1:] and result.calls_a == []
        assert result.environment == [] and result.disk is None
        whole = diff_checkpoints(db, start, amended)
        assert [e.request_id for e in whole.calls_b] == calls
        assert whole.environment == [Change("model", "changed", "claude-x", "claude-y")]
        back = diff_checkpoints(db, amended, last)
        assert not back.descends and back.common_ancestor == last
        assert back.state == [Change("orders[2].amount", "changed", 31, 30)]
        assert back.calls_b == [] and back.calls_a == []   # the amend step made no calls


def test_diff_of_two_forked_threads(store):
    with Agent(store, "t", tools=tools()) as a:
        fork_point = order_steps(a, [10])
        head_t = order_steps(a, [20])
        t_calls = [e.request_id for e in a.db.journal("t")]
    fork_thread(store, "t", fork_point, "u")
    with Agent(store, "u", tools=tools()) as b:
        with b.step("email") as s:
            s.call("email", {"to": "ops"})
            s.state["emailed"] = True
            s.messages.append({"role": "tool", "content": "emailed"})
        head_u = b.head
        u_calls = [e.request_id for e in b.db.journal("u")]
    with AgentDB(store, Codec()) as db:
        result = diff_checkpoints(db, head_t, head_u)
    assert not result.descends and result.common_ancestor == fork_point
    assert [e.request_id for e in result.calls_a] == t_calls[1:]
    assert [e.request_id for e in result.calls_b] == u_calls
    assert result.common_messages == 1
    assert result.messages_added == [{"role": "tool", "content": "emailed"}]
    assert result.messages_removed == 1
    assert {c.path: c.kind for c in result.state} == {"emailed": "added", "orders[1]": "removed"}
    human = cli("agent", "diff", "--store", store.root, head_t, head_u).stdout
    assert f"lineage: on different lines since {fork_point}" in human
    assert "+ emailed = true" in human and "- orders[1] (was" in human


def write_blocks(image, blocks, byte):
    fd = os.open(image, os.O_RDWR)
    try:
        for index in blocks:
            os.pwrite(fd, bytes([byte]) * BLOCK, index * BLOCK)
        os.fsync(fd)
    finally:
        os.close(fd)


def test_diff_reports_the_disk_ranges_written_between_them(store, xfs):
    image = xfs / "disk.img"
    with open(image, "wb") as f:
        f.truncate(4 * MiB)
    with Agent(store, "t", disk=ImageDisk(store, image)) as a:
        with a.step("first") as s:
            write_blocks(image, [1], 0x11)
            s.state["n"] = 1
        first = a.head
        with a.step("second") as s:
            write_blocks(image, [5, 6, 7, 300], 0x22)
            s.state["n"] = 2
        second = a.head
    with AgentDB(store, Codec()) as db:
        disk = diff_checkpoints(db, first, second).disk
        snapshots = db.checkpoint(first).disk_snapshot, db.checkpoint(second).disk_snapshot
    assert (disk.a_snapshot, disk.b_snapshot) == snapshots
    assert [(r.offset, r.length, r.kind) for r in disk.ranges] == [
        (5 * BLOCK, 3 * BLOCK, "data"), (300 * BLOCK, BLOCK, "data")]
    assert disk.changed_bytes == 4 * BLOCK
    shown = as_json("agent", "diff", "--store", store.root, first, second)
    assert shown["disk"] == {"a_snapshot": snapshots[0], "b_snapshot": snapshots[1],
                             "changed_bytes": 4 * BLOCK,
                             "ranges": [{"offset": 5 * BLOCK, "length": 3 * BLOCK,
                                         "kind": "data"},
                                        {"offset": 300 * BLOCK, "length": BLOCK,
                                         "kind": "data"}]}
    human = cli("agent", "diff", "--store", store.root, first, second).stdout
    assert "16.0 KiB in 2 range(s)" in human and "0x5000+0x3000 data" in human


def test_agent_diff_takes_prefixes_and_refuses_unknown_ids(store, monkeypatch):
    monkeypatch.delenv("BLOCKDIFF_AGENT_KEY", raising=False)
    with Agent(store, "t", tools=tools(), environment=ENV) as a:
        ids = [order_steps(a, [amount]) for amount in (1, 2, 3)]
    with AgentDB(store, Codec()) as db:
        every = [c.id for c in db.all_checkpoints("t")]
    shown = as_json("agent", "diff", "--store", store.root, short_prefix(ids[0], every),
                    short_prefix(ids[2], every).upper())
    assert set(shown) == {"a", "b", "descends", "common_ancestor", "state", "common_messages",
                          "messages_added", "messages_removed", "environment", "calls_a",
                          "calls_b", "disk"}
    assert shown["a"]["id"] == ids[0] and shown["b"]["id"] == ids[2]
    assert set(shown["a"]) == {"id", "thread", "parent", "step", "version", "created",
                               "expires", "reason", "disk_snapshot", "meta", "content_hash",
                               "environment_id"}
    assert shown["descends"] is True and shown["disk"] is None
    assert shown["state"][0] == {"path": "orders[1]", "kind": "added", "before": None,
                                 "after": shown["state"][0]["after"]}
    assert [set(c) for c in shown["calls_b"]] == [
        {"request_id", "thread", "base", "position", "tool", "status", "started", "finished",
         "compensable", "external", "error", "owner", "settled"}] * 2
    message = error_line("agent", "diff", "--store", store.root, ids[0], "ffff", code=10)
    assert "no checkpoint 'ffff'" in message
    error_line("agent", "diff", "--store", store.root, "nothex", ids[0], code=10)
