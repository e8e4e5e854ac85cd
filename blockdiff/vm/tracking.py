"""The record of which QEMU dirty bitmap holds the guest's disk writes, and since when.

QEMU marks every block the guest writes or discards in a dirty bitmap. At
each pause for a checkpoint or a restore, a new bitmap takes over and the old
one says what was written since the previous pause. That is only worth
anything if the disk was, at that previous pause, the snapshot the store now
compares it with; so ``dirty-tracking.json`` in the VM's directory records,
beside the bitmap's name and the QEMU process it lives in, the image's
*lineage mark* (:meth:`Store.lineage_mark`) when the bitmap started. The mark
changes with every commit and restore, so while it still holds, the bitmap has
every write since the image was its lineage snapshot.

The record is written before and after each step that could break that
promise (see :meth:`Machine.paused`): a process that dies anywhere leaves a
record that is either true or untrusted (``mark`` None), never one that
names a bitmap missing writes.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

TRACKING = "dirty-tracking.json"


@dataclass(frozen=True)
class Generation:
    """One dirty bitmap of one QEMU process, and the disk's lineage mark when
    it started (None: what it holds is not to be trusted)."""

    pid: int
    bitmap: str
    mark: str | None = None

    def untrusted(self) -> "Generation":
        """The same bitmap, no longer vouched for."""
        return replace(self, mark=None)


class DirtyTracking:
    """``dirty-tracking.json`` of one VM's directory."""

    def __init__(self, directory: Path):
        self.path = directory / TRACKING

    def current(self, pid: int | None) -> Generation | None:
        """The generation of QEMU process ``pid``; None if there is none (no
        tracking, or a record left by another process)."""
        try:
            record = json.loads(self.path.read_text())
            generation = Generation(record["pid"], record["bitmap"], record["mark"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return generation if pid is not None and generation.pid == pid else None

    def write(self, generation: Generation) -> None:
        """Replace the record, atomically: a reader sees the old one or the new one."""
        tmp = self.path.with_name(f"{TRACKING}.tmp")
        tmp.write_text(json.dumps({"pid": generation.pid, "bitmap": generation.bitmap,
                                   "mark": generation.mark}))
        os.replace(tmp, self.path)

    def clear(self) -> None:
        """No tracking until QEMU starts again."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
