"""What a VM's standby and spares hold, checked: before a guest resumes from
them, and by ``blockdiff verify``.

The standby memory image and the spares (blockdiff.vm.standby) are copies
of snapshots kept beside a VM. Their lineage names the snapshot each is
clean at, but a lineage vouches for nothing (docs/store.md): a disk error,
another process or a mistaken operator may have written the file since.
What does vouch for them is their extents. Each is built from the layers
by reflink and moved by reflink, so it shares every data block with the
layers of its snapshot, and its extent map is the snapshot's own (see
blockdiff.store.views). A write to a shared block goes to a new block
(copy on write), a punched hole is a hole and a write into a hole is data:
comparing the file's extent map with the snapshot's finds every byte
written since it was made, without reading the data, in one FIEMAP
(about a millisecond for a 272 MiB memory image after a few steps). So
every restore or fork that brings one to a checkpoint compares them (an
in-place ``Store.restore`` without ``written``): the ranges that differ are
rewritten from the layers with those where the two snapshots differ, each
chunk checked against its CRC32C first, and a standby's or spare's bytes
are never resumed on the strength of its lineage. A byte that rots on
the disk in a block the image shares with a layer is in the layer too:
the store's verify finds it there, and names the snapshots it affects.

``verify`` reports the copies that differ from their snapshot (the next
restore or fork that takes one rewrites what differs).
"""

from __future__ import annotations

from pathlib import Path

from blockdiff.store.store import Store
from blockdiff.vm.registry import Registry
from blockdiff.vm.standby import STANDBY_LOCK, Standby, locked


def copies(store: Store, directory: Path) -> list[tuple[Path, Path]]:
    """The standby and the spares of the VM in ``directory``, each with
    the lock that whoever moves it holds."""
    standby = Standby(store, directory)
    found = [(standby.path, directory / STANDBY_LOCK)]
    for pair in standby.pairs:
        found += [(spare.path, spare.lock_path) for spare in (pair.memory, pair.disk)]
    return found


def verify_vms(store: Store, snapshot_id: str | None = None) -> dict[str, list[str]]:
    """Problems found in the standbys and spares of the store's VMs (of the
    copies of ``snapshot_id`` only, if given), by "vm NAME": each copy whose
    extents are not its snapshot's. Copies being moved (their lock held),
    and copies clean at no snapshot (which nothing takes), are left out."""
    problems: dict[str, list[str]] = {}
    registry = Registry(store)
    for name in registry.names():
        found = []
        for path, lock in copies(store, registry.entry(name).directory):
            with locked(lock, wait=False, shared=True) as had:
                if not had or not path.exists():
                    continue
                known, state = store.lineage(path)
                if known is None or state != "clean" or snapshot_id not in (None, known):
                    continue
                unlike = store.unlike(known, path)
            if unlike:
                found.append(f"{path.name}: {unlike} bytes are not those of snapshot "
                             f"{known} (written since it was made); the next restore or "
                             f"fork that takes it rewrites them from the layers")
        if found:
            problems[f"vm {name}"] = found
    return problems
