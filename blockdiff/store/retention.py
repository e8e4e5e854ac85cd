"""Which snapshots a garbage collection keeps: a pure function of the catalog.

Kept snapshots stay restorable whatever is removed around them (every
snapshot's piece table is complete), so the policy only decides, it never
has to protect ancestors.

A snapshot whose metadata names another under ``part-of`` (:data:`PART_OF`)
is a part of that one, its owner: a VM checkpoint's memory snapshot is a
part of its disk snapshot, which alone is the checkpoint. A part takes no
place of its own among the newest or the recent: it is kept while its owner
is, and goes with it, unless its own TTL runs out first. A part whose
owner is not in the store (imported before it) counts as a snapshot of its
own.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

from blockdiff.errors import UsageError

# The metadata key that makes a snapshot a part of another (see above).
PART_OF = "part-of"


@dataclass(frozen=True)
class Policy:
    """What to keep. Expired snapshots (past their TTL) always go.

    A negative, NaN or infinite window, or a negative count, is refused
    (:class:`~blockdiff.errors.UsageError`): a window of -5 days would keep
    nothing and remove every snapshot."""

    keep_last: int | None = None       # the N newest snapshots
    keep_within: float | None = None   # snapshots younger than this many seconds

    def __post_init__(self):
        if self.keep_last is not None and (
                isinstance(self.keep_last, bool) or not _is_index(self.keep_last)
                or self.keep_last < 0):
            raise UsageError(f"keep_last {self.keep_last!r} is not a number of snapshots "
                             f"(a whole number, 0 or more)")
        if self.keep_within is not None:
            check_duration(self.keep_within, "keep_within")


def _is_index(value) -> bool:
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def check_duration(seconds, what: str) -> float:
    """``seconds`` as a float if it is a finite length of time, not negative;
    otherwise :class:`~blockdiff.errors.UsageError` naming ``what``."""
    try:
        value = float(seconds)
    except (TypeError, ValueError):
        value = math.nan
    if isinstance(seconds, bool) or not math.isfinite(value) or value < 0:
        raise UsageError(f"{what} {seconds!r} is not a duration: give a finite number of "
                         f"seconds, 0 or more")
    return value


def owner_of(snap) -> str | None:
    """The id of the snapshot ``snap`` is a part of (see :data:`PART_OF`), if any."""
    owner = (getattr(snap, "meta", None) or {}).get(PART_OF)
    return owner if isinstance(owner, str) and owner != snap.id else None


def apply_policy(snapshots, policy: Policy, now: float):
    """Split snapshots into ``(keep, remove, reasons)``.

    ``snapshots`` are objects with ``id``, ``created`` and ``expires`` (and
    ``meta``, where parts are named); ``reasons`` maps each id to why it is
    kept or removed. With neither ``keep_last`` nor ``keep_within`` set,
    everything unexpired is kept.
    """
    by_id = {snap.id: snap for snap in snapshots}
    owner = {snap.id: _root_owner(snap, by_id) for snap in snapshots
             if owner_of(snap) is not None}
    # A part without its owner (one imported before it) counts as a
    # snapshot of its own.
    owned = [snap for snap in snapshots if owner.get(snap.id) is not None]
    alone = [snap for snap in snapshots if owner.get(snap.id) is None]
    newest_first = sorted(alone, key=lambda s: (s.created, s.id), reverse=True)
    keep, remove, reasons = [], [], {}
    selective = policy.keep_last is not None or policy.keep_within is not None
    rank = 0  # among unexpired snapshots: an expired one never takes a "last N" place
    for snap in newest_first:
        if snap.expires is not None and snap.expires <= now:
            remove.append(snap)
            reasons[snap.id] = "expired"
            continue
        if not selective:
            keep.append(snap)
            reasons[snap.id] = "no policy"
        elif policy.keep_last is not None and rank < policy.keep_last:
            keep.append(snap)
            reasons[snap.id] = f"among the last {policy.keep_last}"
        elif policy.keep_within is not None and now - snap.created <= policy.keep_within:
            keep.append(snap)
            reasons[snap.id] = "within the keep window"
        else:
            remove.append(snap)
            reasons[snap.id] = "outside the policy"
        rank += 1
    kept = {snap.id for snap in keep}
    for snap in owned:
        of = owner[snap.id].id
        if snap.expires is not None and snap.expires <= now:
            remove.append(snap)
            reasons[snap.id] = "expired"
        elif of in kept:
            keep.append(snap)
            reasons[snap.id] = f"a part of {of}"
        else:
            remove.append(snap)
            reasons[snap.id] = f"a part of {of}, which goes"
    return keep, remove, reasons


def _root_owner(snap, by_id: dict):
    """The snapshot that is no part and that ``snap`` is a part of, through
    parts of parts; None if there is none (an owner gone, or a cycle)."""
    seen = {snap.id}
    while (owner_id := owner_of(snap)) is not None:
        snap = by_id.get(owner_id)
        if snap is None or snap.id in seen:
            return None
        seen.add(snap.id)
    return snap
