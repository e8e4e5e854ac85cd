"""Export and import: one portable file from which another store recreates a
snapshot under the same id.

An export is a BDIFFv2 diff of the snapshot (whole, or against an ancestor
the other store has) followed by a JSON record of the snapshot and
``u64 length, "BDEXPRT1"``; any v2 reader can apply it as a plain diff. The
record is untrusted input: its shape, types and ranges are checked before
anything else of the file is read.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from blockdiff.engine import diff as engine
from blockdiff.engine import files
from blockdiff.errors import InvalidDiff, StoreError, UsageError
from blockdiff.progress import NO_PROGRESS, Progress
from blockdiff.store.catalog import Snapshot
from blockdiff.store.ids import is_id, layer_number
from blockdiff.store.images import commit, materialized
from blockdiff.store.objects import fsync_dir
from blockdiff.store.state import StoreState

EXPORT_MAGIC = b"BDEXPRT1"
# An export record is a small JSON object: anything longer is not one.
EXPORT_RECORD_MAX = 1 << 20
MESSAGE_MAX = 64 * 1024
# Timestamps an export may carry: the epoch to the end of year 9999.
TIME_MAX = 253402300799.0


@dataclass
class ImportResult:
    """What ``Store.import_`` did."""

    ids: list[str]
    skipped: str = ""    # why nothing was added, if nothing was


def export(store: StoreState, snapshot_id: str, out: str | os.PathLike,
           since: str | None = None, progress: Progress = NO_PROGRESS) -> engine.CreateResult:
    """See ``Store.export``."""
    out = os.fspath(out)
    with store.lock.shared():
        snap = store.get(snapshot_id)
        base = None
        snapshot_id = snap.id   # a prefix resolved
        if since is not None:
            base = store.get(since)
            since = base.id
            if since not in {s.id for s in store.catalog.ancestry(snapshot_id)}:
                raise UsageError(f"{since} is not an ancestor of {snapshot_id}; "
                                 f"see: blockdiff log --store {store.root} {snapshot_id}")
        record = {"format": "blockdiff-export", "version": 1, "store": store.id,
                  "base": since, "snapshot": {"id": snap.id, "created": snap.created,
                                              "message": snap.message, "meta": snap.meta,
                                              "expires": snap.expires}}
        trailer = json.dumps(record, sort_keys=True).encode()
        trailer += struct.pack("<Q", len(trailer)) + EXPORT_MAGIC
        # The diff and then the record go to a temporary name beside OUT,
        # renamed only once both are on it: a whole export or nothing.
        temp = files.temp_beside(out)
        try:
            with materialized(store, base, progress=progress) as base_path, materialized(
                    store, snap, on=None if base is None else (base, base_path),
                    progress=progress) as target:
                result = engine.create_diff(temp, target, base_path,
                                            target_id=bytes.fromhex(snap.id) + bytes(8),
                                            progress=progress)
            with open(temp, "ab") as f:
                f.write(trailer)
                f.flush()
                os.fsync(f.fileno())
            os.rename(temp, out)
            fsync_dir(Path(os.path.dirname(os.path.abspath(out))))
        except OSError as e:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
            raise files.naming_final(e, temp, out) from None
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
            raise
    return result


def import_(store: StoreState, path: str | os.PathLike,
            progress: Progress = NO_PROGRESS) -> ImportResult:
    """See ``Store.import_``."""
    path = os.fspath(path)
    record = read_export_record(path)
    info = record["snapshot"]
    sid = info["id"]
    header = engine.read_diff(path)
    if header.version != 2 or header.target_id[:8] != bytes.fromhex(sid):
        raise InvalidDiff(f"{path}: its record names snapshot {sid} but its diff holds "
                          f"another; export it again")
    catalog = store.catalog
    if catalog.get(sid) is not None:
        with open(path, "rb") as f:
            engine.verify_data(f.fileno(), header, path, progress)
        return ImportResult([sid], skipped=f"snapshot {sid} is in the store already")
    # Refused here before the diff is applied; commit checks the same again
    # in the transaction that would add the snapshot, where no race can pass.
    if catalog.retired(sid):
        raise StoreError(f"snapshot {sid} was removed from this store; an import cannot "
                         f"bring it back under the same id (images restored from it may "
                         f"still name it)")
    if catalog.layer(layer_number(sid)) is not None or store.layer_path(
            layer_number(sid)).exists():
        raise StoreError(f"{path} names snapshot {sid}, which is the name of an object "
                         f"this store holds; it was not imported")
    base = None
    if record["base"] is not None:
        base = catalog.get(record["base"])
        if base is None:
            raise StoreError(f"{path} builds on snapshot {record['base']}, which this "
                             f"store does not have; import that first")
    imported = Snapshot(0, sid, None, info["created"], info["message"], info["meta"],
                        expires=info["expires"])
    target = store.object_files.staged(sid, "import.img")
    with store.lock.shared(), materialized(store, base, progress=progress) as base_path:
        try:
            engine.apply_diff(path, target, base_path, progress=progress)
            snap = commit(store, target, parent=None if base is None else base.id,
                          imported=imported, progress=progress)
        finally:
            with contextlib.suppress(FileNotFoundError):
                target.unlink()
    return ImportResult([snap.id])


def _check_record(path: str, record) -> None:
    """An export record's shape, types and ranges (``InvalidDiff`` if wrong)."""
    def bad(why: str):
        raise InvalidDiff(f"{path} has a damaged export record ({why}); export it again")

    if not isinstance(record, dict) or record.get("format") != "blockdiff-export":
        bad("not a blockdiff export record")
    if record.get("version") != 1:
        bad(f"version {record.get('version')!r}, this blockdiff reads 1")
    if "base" not in record or not (record["base"] is None or is_id(record["base"])):
        bad("its base is not a snapshot id")
    info = record.get("snapshot")
    if not isinstance(info, dict) or not is_id(info.get("id")):
        bad("its snapshot id is not 16 hex digits")
    if record["base"] == info["id"]:
        bad("the snapshot builds on itself")
    created = info.get("created")
    if isinstance(created, bool) or not isinstance(created, (int, float)) or not (
            math.isfinite(created) and 0 <= created <= TIME_MAX):
        bad(f"created {created!r} is not a time")
    expires = info.get("expires")
    if expires is not None and (isinstance(expires, bool) or not isinstance(
            expires, (int, float)) or not (math.isfinite(expires) and 0 <= expires <= TIME_MAX)):
        bad(f"expires {expires!r} is not a time")
    message = info.get("message")
    if not isinstance(message, str) or len(message) > MESSAGE_MAX:
        bad("its message is not a string (of at most 64 KiB)")
    meta = info.get("meta")
    if not isinstance(meta, dict) or not all(
            isinstance(k, str) and (v is None or isinstance(v, (str, int, float, bool)))
            for k, v in meta.items()):
        bad("its metadata is not a mapping of names to plain values")
    if any(isinstance(v, float) and not math.isfinite(v) for v in meta.values()):
        bad("its metadata holds a number that is not finite")


def read_export_record(path: str) -> dict:
    """The record at the end of an export file, checked for shape, types and
    ranges before anything else is read."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        end = f.tell()
        if end < 16:
            raise InvalidDiff(f"{path} is not a blockdiff export (too short)")
        f.seek(end - 16)
        length, magic = struct.unpack("<Q8s", f.read(16))
        if magic != EXPORT_MAGIC or length > end - 16:
            raise InvalidDiff(f"{path} is not a blockdiff export; make one with: "
                              f"blockdiff export --store S ID OUT")
        if length > EXPORT_RECORD_MAX:
            raise InvalidDiff(f"{path} has a damaged export record (it claims {length} bytes); "
                              f"export it again")
        f.seek(end - 16 - length)
        try:
            record = json.loads(f.read(length))
        except (ValueError, RecursionError):
            raise InvalidDiff(f"{path} has a damaged export record (not JSON); "
                              f"export it again") from None
    _check_record(path, record)
    record["snapshot"].setdefault("expires", None)
    return record
