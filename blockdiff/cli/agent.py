"""The ``agent`` commands: threads, their checkpoints, approvals, rewind and fork."""

from __future__ import annotations

import click

from blockdiff.cli.options import dry_run_option, json_option, with_store
from blockdiff.cli.output import (
    as_dicts,
    emit_json,
    emit_records,
    human_size,
    printable,
    when,
)


@click.group()
def agent():
    """Agent checkpoints: threads, their history, approvals, rewind and fork.

    Encrypted state needs its key in BLOCKDIFF_AGENT_KEY (or a file named by
    BLOCKDIFF_AGENT_KEY_FILE).

    \b
    Example:
      blockdiff agent threads --store S
      blockdiff agent history --store S run-42
    """


def _agent_db(store, codec=None):
    """The store's agent tables, to open in a ``with``: closed with the command."""
    from blockdiff.agent.agent import AgentDB

    return AgentDB(store, codec)


def _checkpoint_id(store, checkpoint_id: str, thread: str) -> str:
    """The full id of the checkpoint an id or a unique prefix of one names
    (an error about it points to THREAD's history)."""
    from blockdiff.agent.agent import AgentDB

    with AgentDB(store) as db:
        return db.checkpoint(checkpoint_id, thread).id


@agent.command("threads")
@with_store()
@json_option
def agent_threads(store, as_json):
    """List the store's threads: status, head checkpoint, who runs it.

    \b
    Example:
      blockdiff agent threads --store S --json
    """
    with _agent_db(store) as db:
        threads = db.threads()
    if as_json:
        return emit_records(threads)
    for t in threads:
        extra = f"  forked from {printable(t.forked_from)}" if t.forked_from else ""
        who = f"  by {printable(t.owner)}" if t.owner else ""
        click.echo(f"{printable(t.id):24} {printable(t.status):17} {printable(t.head):16}"
                   f"{who}{extra}")


@agent.command("history")
@click.argument("thread")
@with_store()
@json_option
def agent_history(thread, store, as_json):
    """THREAD's checkpoints from its head back to its start, newest first.

    \b
    Example:
      blockdiff agent history --store S run-42
    """
    from blockdiff.agent.sealing import Codec

    # Sealed meta shows with the key (and as null without it) in --json only.
    with _agent_db(store, Codec() if as_json else None) as db:
        history = db.history(thread)
    if as_json:
        return emit_records(history)
    for c in history:
        disk = f"disk {printable(c.disk_snapshot)}" if c.disk_snapshot else "no disk"
        click.echo(f"{printable(c.id)}  step {c.step:<4} {when(c.created)}  "
                   f"{printable(c.reason):24} {disk}"
                   + (f"  ({printable(c.thread)})" if c.thread != thread else ""))


@agent.command("tree")
@with_store()
def agent_tree(store):
    """Every thread's checkpoints as one tree; forks and rewinds branch.

    \b
    Example:
      blockdiff agent tree --store S
    """
    with _agent_db(store) as db:
        click.echo(db.tree(label=printable))


@agent.command("show")
@click.argument("checkpoint_id", metavar="CHECKPOINT")
@with_store()
@json_option
def agent_show(checkpoint_id, store, as_json):
    """One checkpoint: its record, execution state and messages.

    \b
    Example:
      BLOCKDIFF_AGENT_KEY=... blockdiff agent show --store S 6050da99569807ab
    """
    import dataclasses
    import json

    from blockdiff.agent.sealing import Codec

    with _agent_db(store, Codec()) as db:
        cp = db.checkpoint(checkpoint_id)
        checkpoint_id = cp.id   # a prefix resolved
        state, messages = db.load(checkpoint_id)
        environment = db.environment(cp.environment_id)
    record = dataclasses.asdict(cp) | {
        "state": state, "messages": messages,
        "environment": environment.as_dict() if environment else None}
    if as_json:
        return emit_json(record)
    for key in ("id", "thread", "parent", "step", "reason", "disk_snapshot"):
        click.echo(f"{key + ':':15}" + printable(record[key]))
    # JSON, not Python's repr; ASCII, so nothing in it reaches the terminal raw.
    click.echo(f"{'meta:':15}" + ("(sealed; give the key to read it)" if cp.meta is None
                                  else json.dumps(cp.meta, sort_keys=True)))
    click.echo(f"{'created:':15}{when(cp.created)}   expires: {when(cp.expires)}")
    if environment is None:
        click.echo(f"{'environment:':15}(none recorded)")
    else:
        click.echo(f"{'environment:':15}{printable(cp.environment_id)}")
        for key, value in environment.as_dict().items():
            click.echo(f"  {key + ':':16}{json.dumps(value, sort_keys=True)}")
    click.echo("state:\n" + json.dumps(record["state"], indent=2))
    click.echo(f"messages: {len(record['messages'])}")
    for m in record["messages"][-10:]:
        click.echo(f"  {json.dumps(m)}")


def _value(value) -> str:
    """A stored JSON value on one line, ASCII (nothing reaches the terminal raw)."""
    import json

    return json.dumps(value, sort_keys=True)


def _echo_changes(title: str, changes) -> None:
    click.echo(f"{title}: " + ("unchanged" if not changes else f"{len(changes)} change(s)"))
    for c in changes:
        if c.kind == "added":
            click.echo(f"  + {printable(c.path)} = {_value(c.after)}")
        elif c.kind == "removed":
            click.echo(f"  - {printable(c.path)} (was {_value(c.before)})")
        else:
            click.echo(f"  ~ {printable(c.path)}: {_value(c.before)} -> {_value(c.after)}")


def _echo_calls(title: str, calls) -> None:
    click.echo(f"{title}: {len(calls)}")
    for e in calls:
        click.echo(f"  {printable(e.request_id)}  {printable(e.tool):16} {printable(e.status)}")


@agent.command("diff")
@click.argument("a", metavar="A")
@click.argument("b", metavar="B")
@with_store()
@json_option
def agent_diff(a, b, store, as_json):
    """What changed from checkpoint A to checkpoint B, of any threads.

    The state key by key, the messages B added, the environment field by
    field, the tool calls between them (or each one's since their common
    ancestor when they are on different lines) and the disk's changed
    ranges. A and B may be unique prefixes of their ids.

    \b
    Example:
      blockdiff agent diff --store S 6050da99 1f0e2d3c
    """
    import dataclasses

    from blockdiff.agent.diff import diff_checkpoints
    from blockdiff.agent.sealing import Codec

    with _agent_db(store, Codec()) as db:
        result = diff_checkpoints(db, a, b)
    if as_json:
        return emit_json(dataclasses.asdict(result))
    click.echo(f"a: {printable(result.a.id)}  [{printable(result.a.thread)}] step {result.a.step}")
    click.echo(f"b: {printable(result.b.id)}  [{printable(result.b.thread)}] step {result.b.step}")
    if result.descends:
        click.echo("lineage: b descends from a")
    elif result.common_ancestor == result.b.id:
        click.echo("lineage: a descends from b (b is behind it)")
    elif result.common_ancestor:
        click.echo(f"lineage: on different lines since {printable(result.common_ancestor)}")
    else:
        click.echo("lineage: on different lines, with no common ancestor kept")
    _echo_changes("state", result.state)
    click.echo(f"messages: {len(result.messages_added)} added, {result.messages_removed} of a's "
               f"not in b ({result.common_messages} in common)")
    for m in result.messages_added:
        click.echo(f"  + {_value(m)}")
    _echo_changes("environment", result.environment)
    if result.descends:
        _echo_calls("calls from a to b", result.calls_b)
    else:
        since = printable(result.common_ancestor or "its start")
        _echo_calls(f"calls on a's line since {since}", result.calls_a)
        _echo_calls(f"calls on b's line since {since}", result.calls_b)
    disk = result.disk
    if disk is None:
        click.echo("disk: none")
    elif disk.a_snapshot is None or disk.b_snapshot is None:
        click.echo(f"disk: only one has a snapshot (a: {printable(disk.a_snapshot)}, "
                   f"b: {printable(disk.b_snapshot)})")
    else:
        click.echo(f"disk: {printable(disk.a_snapshot)} -> {printable(disk.b_snapshot)}, "
                   f"{human_size(disk.changed_bytes)} in {len(disk.ranges)} range(s)")
        for r in disk.ranges:
            click.echo(f"  {r.offset:#x}+{r.length:#x} {r.kind}")


@agent.command("journal")
@click.argument("thread")
@with_store()
@json_option
def agent_journal(thread, store, as_json):
    """THREAD's tool calls, oldest first: request id, tool, status (and how
    a call left in doubt was settled).

    \b
    Example:
      blockdiff agent journal --store S run-42
    """
    with _agent_db(store) as db:
        entries = db.journal(thread)
    if as_json:
        return emit_records(entries)
    for e in entries:
        click.echo(f"{printable(e.request_id)}  {printable(e.tool):16} "
                   f"{printable(e.status):14} {when(e.started)}")
        if e.settled:
            click.echo(f"  settled: {printable(e.settled)}")


@agent.command("pending")
@with_store()
@json_option
def agent_pending(store, as_json):
    """Approvals waiting for a decision, in every thread.

    \b
    Example:
      blockdiff agent pending --store S
    """
    import json

    from blockdiff.agent.sealing import Codec

    with _agent_db(store) as db:
        approvals = db.approvals(pending_only=True, codec=Codec())
    if as_json:
        return emit_records(approvals)
    if not approvals:
        click.echo("no pending approvals")
    for a in approvals:
        click.echo(f"{printable(a.thread):24} {json.dumps(a.action)}  (asked {when(a.created)}, "
                   f"expires {when(a.expires)})")


def comment_option(command):
    """-m/--comment: why an approval was decided so."""
    return click.option("-m", "--comment", default="", help="Why.")(command)


def _decide(thread, store, decision, comment):
    with _agent_db(store) as db:
        approval = db.decide(thread, decision, comment=comment)
    click.echo(f"{printable(thread)}: {approval.decision}; the run continues when the agent "
               f"resumes it")


@agent.command("approve")
@click.argument("thread")
@with_store()
@comment_option
def agent_approve(thread, store, comment):
    """Approve THREAD's pending action.

    \b
    Example:
      blockdiff agent approve --store S run-42 -m "ok to charge"
    """
    _decide(thread, store, "approved", comment)


@agent.command("reject")
@click.argument("thread")
@with_store()
@comment_option
def agent_reject(thread, store, comment):
    """Reject THREAD's pending action.

    \b
    Example:
      blockdiff agent reject --store S run-42 -m "too expensive"
    """
    _decide(thread, store, "rejected", comment)


@agent.command("rewind")
@click.argument("thread")
@click.argument("checkpoint_id", metavar="CHECKPOINT")
@with_store()
@json_option
def agent_rewind(thread, checkpoint_id, store, as_json):
    """Put THREAD (state and disk) back to CHECKPOINT.

    Effects of tool calls made since are compensated newest first. Those
    whose compensation needs the agent's own tools are left pending and run
    when the agent next opens the thread; those that cannot be compensated
    are listed. CHECKPOINT may be a unique prefix of its id (4 hex digits or more).

    \b
    Example:
      blockdiff agent rewind --store S run-42 6050da99569807ab
    """
    import dataclasses

    from blockdiff.agent.agent import rewind_thread

    checkpoint_id = _checkpoint_id(store, checkpoint_id, thread)
    report = rewind_thread(store, thread, checkpoint_id)
    if as_json:
        return emit_json({"thread": thread, "checkpoint": checkpoint_id}
                         | dataclasses.asdict(report))
    click.echo(f"{printable(thread)}: rewound to {printable(checkpoint_id)}")
    for what, items in (("compensated", report.compensated),
                        ("compensation pending (runs when the agent resumes)", report.pending),
                        ("cannot be compensated", report.uncompensable)):
        for item in items:
            click.echo(f"  {what}: {printable(item)}")


@agent.command("fork")
@click.argument("thread")
@click.argument("checkpoint_id", metavar="CHECKPOINT")
@click.argument("new_thread", metavar="NEW_THREAD")
@with_store()
@json_option
def agent_fork(thread, checkpoint_id, new_thread, store, as_json):
    """Start NEW_THREAD from THREAD's CHECKPOINT, with a disk of its own.

    \b
    Example:
      blockdiff agent fork --store S run-42 6050da99569807ab run-42b
    """
    from blockdiff.agent.agent import fork_thread

    checkpoint_id = _checkpoint_id(store, checkpoint_id, thread)
    head = fork_thread(store, thread, checkpoint_id, new_thread)
    if as_json:
        return emit_json({"thread": new_thread, "forked_from": checkpoint_id, "head": head})
    click.echo(f"{printable(new_thread)}: forked from {printable(checkpoint_id)}; head {head}")


@agent.command("gc")
@with_store()
@dry_run_option
@json_option
def agent_gc(store, dry_run, as_json):
    """Remove expired checkpoints and the disk snapshots only they used.

    A thread's head and a checkpoint an approval waits at are kept.

    \b
    Example:
      blockdiff agent gc --store S --dry-run
    """
    with _agent_db(store) as db:
        removed = db.gc(dry_run=dry_run)
    if as_json:
        return emit_json({"removed": as_dicts(removed), "dry_run": dry_run})
    verb = "would remove" if dry_run else "removed"
    for c in removed:
        click.echo(f"{verb} {printable(c.id)}  [{printable(c.thread)}] step {c.step}: "
                   f"{printable(c.reason)}")
    click.echo(f"{verb} {len(removed)} expired checkpoint(s)")


@agent.command("keygen")
def agent_keygen():
    """Print a new key for encrypting agent state (AES-256-GCM).

    \b
    Example:
      export BLOCKDIFF_AGENT_KEY=$(blockdiff agent keygen)
    """
    from blockdiff.agent.sealing import new_key

    click.echo(new_key())


COMMANDS = (agent,)
