"""What changed between two agent checkpoints, of one thread or of any two:
the state (key by key, recursively), the messages added, the environment
(field by field), the tool calls between them and the disk's ranges."""

from __future__ import annotations

from dataclasses import dataclass, field

from blockdiff.agent.model import AgentDB, Checkpoint, Environment, JournalEntry
from blockdiff.engine.extents import DATA


@dataclass(frozen=True)
class Change:
    """One value that differs: ``path`` (``orders[2].amount``), ``kind``
    (added, removed, changed), and the values before and after (None where
    there is none)."""

    path: str
    kind: str
    before: object = None
    after: object = None


def _key_path(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def json_changes(before, after, path: str = "") -> list[Change]:
    """Every difference between two JSON values: objects compared key by
    key and arrays item by item, recursively; anything else as a whole."""
    if isinstance(before, dict) and isinstance(after, dict):
        changes = []
        for key in sorted(before.keys() | after.keys(), key=str):
            where = _key_path(path, str(key))
            if key not in after:
                changes.append(Change(where, "removed", before=before[key]))
            elif key not in before:
                changes.append(Change(where, "added", after=after[key]))
            else:
                changes += json_changes(before[key], after[key], where)
        return changes
    if isinstance(before, list) and isinstance(after, list):
        changes = []
        for i in range(max(len(before), len(after))):
            where = f"{path}[{i}]"
            if i >= len(after):
                changes.append(Change(where, "removed", before=before[i]))
            elif i >= len(before):
                changes.append(Change(where, "added", after=after[i]))
            else:
                changes += json_changes(before[i], after[i], where)
        return changes
    if before == after and type(before) is type(after):
        return []
    return [Change(path, "changed", before, after)]


def environment_changes(before: Environment | None,
                        after: Environment | None) -> list[Change]:
    """The fields of two environments that differ (``model``,
    ``tools.fetch``, ``env.API_URL``); none recorded compares as empty."""
    return json_changes((before or Environment()).as_dict(), (after or Environment()).as_dict())


@dataclass(frozen=True)
class DiskRange:
    """A byte range where B's disk holds other bytes than A's; ``kind``:
    data, or zero (B reads zeros there)."""

    offset: int
    length: int
    kind: str


@dataclass(frozen=True)
class DiskDiff:
    """How two checkpoints' disk snapshots differ."""

    a_snapshot: str | None
    b_snapshot: str | None
    changed_bytes: int
    ranges: list[DiskRange] = field(default_factory=list)


@dataclass(frozen=True)
class CheckpointDiff:
    """What changed from checkpoint ``a`` to checkpoint ``b``.

    ``descends``: ``b`` is ``a`` or one of its descendants; then
    ``calls_b`` are the calls made on the way from ``a`` to ``b`` and
    ``calls_a`` is empty. Otherwise they are on different lines, and the
    calls are those each made since ``common_ancestor`` (None: no common
    ancestor, and the calls of each one's whole line). ``messages_added``:
    ``b``'s messages beyond those it shares with ``a`` from the start
    (``common_messages`` of them); ``messages_removed``: how many of ``a``'s
    are beyond them. ``disk``: None when neither has a disk snapshot."""

    a: Checkpoint
    b: Checkpoint
    descends: bool
    common_ancestor: str | None
    state: list[Change]
    common_messages: int
    messages_added: list
    messages_removed: int
    environment: list[Change]
    calls_a: list[JournalEntry]
    calls_b: list[JournalEntry]
    disk: DiskDiff | None


def _common_prefix(a: list, b: list) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# Meta that marks a checkpoint copied from its parent by a rewind or a fork,
# not made by a step that began there: the parent's calls led elsewhere.
_COPY_MARKS = ("rewound_from", "forked_from")


def _bases_until(line: list[Checkpoint], ancestor: str | None) -> list[str]:
    """Where the steps that led along ``line`` (newest first) from
    ``ancestor`` (or the line's start) to its newest checkpoint began."""
    bases = []
    for child, parent in zip(line, line[1:]):
        if not any(mark in (child.meta or {}) for mark in _COPY_MARKS):
            bases.append(parent.id)
        if parent.id == ancestor:
            break
    return bases


def disk_diff(store, a_snapshot: str | None, b_snapshot: str | None) -> DiskDiff | None:
    """The ranges where ``b_snapshot`` differs from ``a_snapshot``, from the
    store; None without either (nothing to compare)."""
    if a_snapshot is None or b_snapshot is None:
        if a_snapshot is None and b_snapshot is None:
            return None
        return DiskDiff(a_snapshot, b_snapshot, 0, [])
    ranges = store.diff(a_snapshot, b_snapshot)
    return DiskDiff(a_snapshot, b_snapshot, int(ranges.length.sum()),
                    [DiskRange(int(o), int(n), "data" if k == DATA else "zero")
                     for o, n, k in zip(ranges.offset, ranges.length, ranges.kind)])


def diff_checkpoints(db: AgentDB, a_id: str, b_id: str) -> CheckpointDiff:
    """What changed from checkpoint ``a_id`` to ``b_id`` (ids or unique
    prefixes, of any threads), read with ``db``'s codec (sealed checkpoints
    need the key)."""
    a, b = db.checkpoint(a_id), db.checkpoint(b_id)
    a_state, a_messages = db.load(a.id)
    b_state, b_messages = db.load(b.id)
    line_a, line_b = db.ancestry(a.id), db.ancestry(b.id)
    on_a = {c.id for c in line_a}
    common = next((c.id for c in line_b if c.id in on_a), None)
    descends = common == a.id
    shared = _common_prefix(a_messages, b_messages)
    return CheckpointDiff(
        a=a, b=b, descends=descends, common_ancestor=common,
        state=json_changes(a_state, b_state),
        common_messages=shared, messages_added=b_messages[shared:],
        messages_removed=len(a_messages) - shared,
        environment=environment_changes(db.environment(a.environment_id),
                                        db.environment(b.environment_id)),
        calls_a=[] if descends else db.calls_at(_bases_until(line_a, common)),
        calls_b=db.calls_at(_bases_until(line_b, common)) if common != b.id else [],
        disk=disk_diff(db.store, a.disk_snapshot, b.disk_snapshot))
