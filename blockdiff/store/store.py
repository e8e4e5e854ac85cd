"""The snapshot store: a tree of disk-image snapshots, each committed in time
proportional to what the step changed and restorable in time proportional to
what differs. See docs/store.md for the layout and the reasoning, and its
"Guarantees" section for what is protected against whom.

Each snapshot is a *layer*: a read-only data file holding the blocks its step
changed (reflinked from the image, so no data is copied) and a read-only map
file with (a) its piece table, saying for every byte of the image which
layer's data file holds it, and (b) the image's extent map at commit time,
whose physical addresses stay meaningful because the layers keep every block
they name alive. Committing compares the image's extent map with the
parent's; restoring compares it with the target snapshot's and clones only
the ranges that differ. The catalog keeps a record of every layer file: the
CRC32C of each chunk of its data, checked before a restore hands bytes back.

Concurrency: files enter ``objects/`` only under the store's shared lock,
together with the catalog rows that name them, and leave it only under the
exclusive lock, after the rows are gone. Every operation that reads objects
holds the shared lock, so a sweep or a removal never pulls a file from under
a commit, a restore or an export.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import grp
import hashlib
import io
import json
import math
import os
import stat as stat_mode
import struct
import threading
import time
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from blockdiff import native
from blockdiff.engine import diff as engine
from blockdiff.engine import files
from blockdiff.engine import formats as fmt
from blockdiff.engine.extents import (
    DATA,
    ZERO,
    ExtentMap,
    PieceTable,
    RangeSet,
    changed_ranges,
    coalesce,
    differing_pieces,
    normalize_ranges,
    overlay,
    partition,
    pieces_within,
    remap,
    splice_pieces,
    subtract,
    union,
)
from blockdiff.errors import (
    AmbiguousId,
    ConstraintFailed,
    Damaged,
    DatabaseDamaged,
    ImageBusy,
    InvalidDiff,
    StoreError,
    UnknownSnapshot,
    Unsupported,
    UsageError,
)
from blockdiff.store.catalog import (
    Catalog,
    LayerRecord,
    Snapshot,
    candidates,
    id_prefix,
)
from blockdiff.store.retention import apply_policy, check_duration

BLOCK = 4096
LINEAGE_XATTR = "user.blockdiff.lineage"
EXPORT_MAGIC = b"BDEXPRT1"
STORE_ENV = "BLOCKDIFF_STORE"
MAP_CACHE = 4   # decoded maps kept per Store: the last commit's is the next one's parent
LAYER_CACHE = 4096   # layer records kept per Store
# A commit stores its map as a delta on its parent's, whole at least every
# MAP_CHAIN commits down a line: maps then take space in proportion to the
# steps, not to the image's extents times the steps, and reading one reads
# at most MAP_CHAIN files.
MAP_CHAIN = 8
# Layer data is checksummed in chunks of at most this many bytes, so that a
# restore checks what it rewrites by reading little more than that (a 4 KiB
# block of a big layer: 16 KiB), for a record of 4 bytes a chunk.
CHUNK = 16 * 1024
RUN_DTYPE = np.dtype([("pos", "<u8"), ("length", "<u8")])
PIECE_DTYPE = np.dtype([("offset", "<u8"), ("length", "<u8"), ("layer", "<i8"), ("pos", "<u8")])
# A fork or an export reads a layer whole to check it unless its file is
# unchanged since a whole check passed (at its commit, or by verify) at most
# this long ago.
VOUCH_SECONDS = 24 * 3600
# A preallocated file the store deletes to make room when the disk is full,
# so that rm and gc can still open the catalog and free space.
RESERVE = 4 << 20
# An export record is a small JSON object: anything longer is not one.
EXPORT_RECORD_MAX = 1 << 20
MESSAGE_MAX = 64 * 1024
# Timestamps an export may carry: the epoch to the end of year 9999.
TIME_MAX = 253402300799.0


@dataclass
class SnapshotMap:
    """What a snapshot's map file holds."""

    pieces: PieceTable
    extents: ExtentMap        # the image's extent map when it was committed
    own_layer: int = 0        # the layer this snapshot wrote (its own, or the one
                              # compaction wrote)
    chain: int = 0            # maps between this one and one stored whole (0: whole)


@dataclass(frozen=True)
class MapDelta:
    """A map stored as a delta: inside the intervals ``[starts, ends)`` its
    pieces and extents are its own, outside them those of ``base``'s map."""

    base: str                 # the snapshot whose map this one builds on
    starts: np.ndarray
    ends: np.ndarray


@dataclass
class RestoreResult:
    """What ``Store.restore`` did."""

    snapshot: str
    image: str
    ranges: int          # ranges of the image rewritten
    bytes: int
    forked: bool         # a new image rather than one restored in place
    tracked: bool = False  # the differences came from written ranges, not an extent map
    checked_bytes: int = 0   # layer bytes read to check the restored data


@dataclass
class ImportResult:
    """What ``Store.import_`` did."""

    ids: list[str]
    skipped: str = ""    # why nothing was added, if nothing was


# ``(offsets, lengths)`` of the byte ranges written to an image.
Written = tuple[np.ndarray, np.ndarray]


def _layer_number(snapshot_id: str) -> int:
    return int(snapshot_id, 16)


def _layer_name(layer: int) -> str:
    return f"{int(layer):016x}.layer"


def _new_id() -> str:
    # 63 random bits: a positive int64 names the layer inside piece tables.
    return f"{int.from_bytes(os.urandom(8), 'big') >> 1:016x}"


def _is_id(value) -> bool:
    return (isinstance(value, str) and len(value) == 16
            and all(c in "0123456789abcdef" for c in value) and value[0] in "01234567")


def _encode_map(m: SnapshotMap, delta: MapDelta | None = None) -> bytes:
    """A map file: the whole map, or with ``delta`` only its parts inside the
    delta's intervals."""
    pieces, extents, extra = m.pieces, m.extents, {}
    if delta is not None:
        pieces, _ = pieces_within(m.pieces, delta.starts, delta.ends)
        inside, _ = partition(m.extents, delta.starts, delta.ends)
        extents = ExtentMap(*inside, size=m.extents.size)
        extra = {"base": np.array(delta.base), "d_start": delta.starts, "d_end": delta.ends}
    buf = io.BytesIO()
    np.savez(buf, size=np.uint64(pieces.size), p_offset=pieces.offset,
             p_length=pieces.length, p_layer=pieces.layer, p_pos=pieces.pos,
             e_logical=extents.logical, e_physical=extents.physical,
             e_length=extents.length, e_flags=extents.flags, e_size=np.uint64(extents.size),
             own_layer=np.int64(m.own_layer), chain=np.int64(m.chain), **extra)
    return buf.getvalue()


# What decoding a map file that is not one can raise (numpy's npz reader and
# the zipfile module under it; RuntimeError covers its unsupported methods,
# versions and encryption).
MAP_ERRORS = (ValueError, KeyError, OSError, EOFError, struct.error, zipfile.BadZipFile,
              zlib.error, RuntimeError, MemoryError)


def _decode_map(raw: bytes) -> tuple[SnapshotMap, MapDelta | None]:
    """A map file's contents: for a delta, only its own parts, and the delta."""
    z = np.load(io.BytesIO(raw))   # never pickles: allow_pickle is off
    pieces = PieceTable(z["p_offset"], z["p_length"], z["p_layer"], z["p_pos"], int(z["size"]))
    extents = ExtentMap(z["e_logical"], z["e_physical"], z["e_length"], z["e_flags"],
                        int(z["e_size"]))
    chain = int(z["chain"]) if "chain" in z.files else 0   # maps before deltas: whole
    smap = SnapshotMap(pieces, extents, int(z["own_layer"]), chain)
    delta = None
    if "base" in z.files:
        delta = MapDelta(str(z["base"]), z["d_start"], z["d_end"])
    return smap, delta


def _pack_pieces(pieces: PieceTable) -> bytes:
    rows = np.empty(len(pieces), PIECE_DTYPE)
    rows["offset"], rows["length"] = pieces.offset, pieces.length
    rows["layer"], rows["pos"] = pieces.layer, pieces.pos
    return rows.tobytes()


def _unpack_pieces(rows: np.ndarray, size: int) -> PieceTable:
    """A piece table from PIECE_DTYPE rows."""
    return PieceTable(rows["offset"].astype(np.uint64), rows["length"].astype(np.uint64),
                      rows["layer"].astype(np.int64), rows["pos"].astype(np.uint64), size)


def _delta_on(parent: str, parent_map: SnapshotMap, changes, size: int) -> MapDelta:
    """Where a child's map differs from its parent's: the changed ranges,
    and the bytes between the two sizes. Elsewhere the pieces are the
    parent's, and so are the extents, as far as comparing them goes (the same
    addresses where there is data)."""
    starts, ends = changes.offset, changes.offset + changes.length
    psize = parent_map.pieces.size
    if psize != size:
        starts = np.append(starts, np.uint64(min(psize, size)))
        ends = np.append(ends, np.uint64(max(psize, size)))
    return MapDelta(parent, *union(starts, ends))


def _chunked(src: np.ndarray, dst: np.ndarray, length: np.ndarray, chunk: int = CHUNK):
    """Ranges cut into chunks of at most ``chunk`` bytes: ``(src, dst, length)``."""
    length = length.astype(np.uint64)
    count = ((length + np.uint64(chunk - 1)) // np.uint64(chunk)).astype(np.int64)
    index = np.repeat(np.arange(len(length)), count)
    first = np.cumsum(count) - count
    step = (np.arange(int(count.sum()), dtype=np.int64) - np.repeat(first, count))
    offset = step.astype(np.uint64) * np.uint64(chunk)
    part = np.minimum(np.uint64(chunk), length[index] - offset)
    return src[index] + offset, dst[index] + offset, part


def _chunk_record(layer: int, fd: int, path, src, dst, length, stat: str = "") -> LayerRecord:
    """The record of a layer whose data is the ranges ``src`` of an open file,
    to be kept at ``dst`` in the layer: each chunk's checksum, read from ``fd``."""
    order = np.argsort(dst, kind="stable")
    src, dst, length = src[order], dst[order], length[order]
    crcs = native.chunk_crcs(fd, src, length, CHUNK, path)
    runs = np.empty(len(dst), RUN_DTYPE)
    runs["pos"], runs["length"] = dst, length
    return LayerRecord(int(layer), runs.tobytes(), CHUNK, crcs.astype("<u4").tobytes(), None,
                       time.time(), stat)


_NO_CHUNKS = (np.zeros(0, np.uint64), np.zeros(0, np.uint64))


def _remember(cache: dict, key, value, limit: int) -> None:
    """Keep ``value`` in a bounded cache (the oldest entries go first)."""
    cache[key] = value
    while len(cache) > limit:
        del cache[next(iter(cache))]


class _Layer:
    """A layer's catalog record, decoded: its runs of data and their
    checksummed chunks, sorted by position, with what finding the chunks that
    hold some runs needs. ``ValueError`` if the record does not decode."""

    def __init__(self, record: LayerRecord):
        if (len(record.ranges) % RUN_DTYPE.itemsize or len(record.crcs) % 4
                or not 0 < record.chunk <= native.CHUNK_CRC_MAX
                or native.CHUNK_CRC_MAX % record.chunk):
            raise ValueError("malformed layer record")
        self.record = record
        runs = np.frombuffer(record.ranges, RUN_DTYPE)
        self.run_pos, self.run_length = runs["pos"], runs["length"]
        pos, _, length = _chunked(self.run_pos, self.run_pos, self.run_length, record.chunk)
        self.crc = np.frombuffer(record.crcs, "<u4")
        if len(self.crc) != len(pos) or np.any(pos[1:] < pos[:-1] + length[:-1]):
            raise ValueError("malformed layer record")
        self.pos, self.length = pos, length
        self.end = pos + length
        self.before = np.concatenate(([0], np.cumsum(length, dtype=np.uint64)))
        self.origin = None
        if record.origin is not None:
            self.origin = np.frombuffer(record.origin, PIECE_DTYPE)   # checked here too

    def holding(self, pos: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, int]:
        """Indices of the chunks holding the runs, and how many runs lie
        (partly) outside every chunk."""
        start, end = union(pos, pos + length)
        if not len(start):
            return np.zeros(0, np.int64), 0
        first = np.searchsorted(self.end, start, side="right")
        last = np.searchsorted(self.pos, end, side="left")
        spans = last > first
        safe_first = np.minimum(first, len(self.pos) - 1) if len(self.pos) else first
        safe_last = np.maximum(last - 1, 0)
        # Held when chunks [first, last) start at or before the run, end at or
        # after it, and touch one another (their lengths add up to their span).
        held = spans.copy()
        if len(self.pos):
            held &= ((self.pos[safe_first] <= start) & (self.end[safe_last] >= end)
                     & (self.before[last] - self.before[first]
                        == self.end[safe_last] - self.pos[safe_first]))
        count = np.where(held, last - first, 0)
        index = (np.repeat(first - np.cumsum(count) + count, count)
                 + np.arange(int(count.sum())))
        return np.unique(index), int((~held).sum())


def _file_identity(path: Path) -> str:
    """What changes whenever a file's content can have changed through the
    filesystem: a write, a truncation, a chmod, a rename over it."""
    st = os.stat(path)
    return f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def _by_layer(pieces: PieceTable):
    """``(layer, indices)`` of the pieces in each layer."""
    # Grouped by one stable sort, not one mask per layer: a deep line has
    # thousands of layers and a fragmented image many pieces.
    if len(pieces) == 0:
        return
    order = np.argsort(pieces.layer, kind="stable")
    layers = pieces.layer[order]
    starts = np.flatnonzero(np.concatenate(([True], layers[1:] != layers[:-1])))
    for first, last in zip(starts, np.append(starts[1:], len(order))):
        yield int(layers[first]), order[first:last]


def _compare_with_file(fd: int, path: str, base: Path | None):
    """Ranges where an open file differs from the file ``base`` (None: from
    nothing), found by reading both."""
    if base is None:
        return engine.compare_contents(fd, path, None)
    with open(base, "rb") as b:
        return engine.compare_contents(fd, path, b.fileno())


def _write_readonly(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Removal:
    """What ``Store.rm`` or ``Store.gc`` removed."""

    removed: list[str]
    bytes_freed: int     # allocated in the removed files; blocks shared with a
                         # live image are not freed on disk until it lets go
    reasons: dict


def _allocated(path: Path) -> int:
    try:
        return os.stat(path).st_blocks * 512
    except FileNotFoundError:
        return 0


def _unlink(path: Path) -> int:
    """Remove a file; the bytes it held (shared blocks count in full)."""
    size = _allocated(path)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
        return size
    return 0


class Store:
    """A snapshot store in a directory on a reflink filesystem."""

    def __init__(self, root: str | os.PathLike, *, freeing: bool = False):
        """Open the store at ``root``. ``freeing``: the caller is about to free
        space (rm, gc), so on a full disk the store's reserve may be used."""
        self.root = Path(root)
        path = self.root / "catalog.sqlite"
        if not path.exists():
            raise StoreError(f"{self.root} is not a blockdiff store; "
                             f"make one with: blockdiff init {self.root}")
        self.objects = self.root / "objects"
        self.staging = self.root / "staging"
        repair = ("nothing was changed. Put back a copy of it, or move the store away and "
                  "import its exports into a new one")
        try:
            try:
                self.catalog = Catalog(str(path))
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                if not (freeing and _unlink(self.root / "reserve")):
                    raise OSError(errno.ENOSPC, "No space left on device (blockdiff rm and gc "
                                  "can still free space in the store)", str(path)) from None
                self.catalog = Catalog(str(path))
        except DatabaseDamaged as e:
            raise DatabaseDamaged(f"{e}; {repair}") from None
        problems = self.catalog.store_problems()
        if problems:
            self.catalog.close()
            raise Damaged(f"{path} is damaged ({'; '.join(problems)}); {repair}")
        self.id = self.catalog.setting("store_id")
        # Without reflink the store copies data and compares contents.
        self.copy_mode = self.catalog.setting("mode") == "copy"
        group = self.catalog.setting("group")
        self.group = None if group is None else int(group)
        # Files readable by their owner only, or by the store's group too.
        self.file_mode = 0o600 if self.group is None else 0o640
        self.object_mode = self.file_mode & 0o444
        # Maps are named by their digest and never change, so a decoded map
        # can be reused for as long as the store is open; so can a layer's record.
        self._maps: dict[str, SnapshotMap] = {}
        self._layers: dict[int, _Layer] = {}
        self._maps_lock = threading.Lock()
        self._held = threading.local()
        self._adopt_unrecorded_layers()
        if not freeing:
            self.keep_reserve()

    @classmethod
    def init(cls, root: str | os.PathLike, *, allow_copy: bool = False,
             group: str | int | None = None) -> "Store":
        """Make a new, empty store in ``root`` (created if missing).

        The store is private to its owner; with ``group`` (a name or gid) that
        group may read it too. On a filesystem without reflink it refuses
        unless ``allow_copy``: then snapshots copy their data and commits
        compare contents, correct but slow (every commit reads the image and
        its parent in full)."""
        root = Path(root)
        gid = None
        if group is not None:
            try:
                gid = int(group) if str(group).isdigit() else grp.getgrnam(str(group)).gr_gid
            except KeyError:
                raise UsageError(f"no group {group!r} on this host") from None
        if (root / "catalog.sqlite").exists():
            raise StoreError(f"{root} is already a blockdiff store")
        made = [] if root.exists() else [root]
        for parent in list(root.parents):
            if parent.exists():
                break
            made.insert(0, parent)
        dir_mode = 0o700 if gid is None else 0o2750
        try:
            root.mkdir(parents=True, exist_ok=True)
            if gid is not None:
                os.chown(root, -1, gid)
            os.chmod(root, dir_mode)
            mode = cls._probe_reflink(root, allow_copy)
            os.close(os.open(root / "lock", os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC,
                             0o600 if gid is None else 0o640))
            for name in ("objects", "staging"):
                (root / name).mkdir(exist_ok=True)
                os.chmod(root / name, dir_mode)
            catalog = Catalog(str(root / "catalog.sqlite"), create=True,
                              mode=0o600 if gid is None else 0o640)
            try:
                catalog.set_setting("store_id", os.urandom(8).hex())
                catalog.set_setting("mode", mode)
                if gid is not None:
                    catalog.set_setting("group", str(gid))
            finally:
                catalog.close()
            _fsync_dir(root)
        except BaseException:
            # A failed init leaves nothing it made behind.
            for name in ("catalog.sqlite", "catalog.sqlite-wal", "catalog.sqlite-shm", "lock",
                         "reserve"):
                with contextlib.suppress(FileNotFoundError):
                    (root / name).unlink()
            for name in ("objects", "staging"):
                with contextlib.suppress(OSError):
                    (root / name).rmdir()
            for path in reversed(made):
                with contextlib.suppress(OSError):
                    path.rmdir()
            raise
        return cls(root)

    @staticmethod
    def _probe_reflink(root: Path, allow_copy: bool) -> str:
        probe = root / f".probe-{os.getpid()}"
        try:
            with open(probe, "w+b") as a, open(str(probe) + ".clone", "wb") as b:
                a.write(b"\0" * BLOCK)
                a.flush()
                native.clone_file(b.fileno(), a.fileno(), b.name)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EXDEV, errno.EINVAL, errno.ENOTTY):
                raise
            if not allow_copy:
                raise Unsupported(f"{root} is on a filesystem without reflink; make the store "
                                  f"on XFS (mkfs.xfs -m reflink=1) or btrfs, or pass "
                                  f"--allow-copy to copy data instead (slow)") from None
            return "copy"
        finally:
            for p in (probe, Path(str(probe) + ".clone")):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
        return "reflink"

    def close(self) -> None:
        self.catalog.close()

    def keep_reserve(self) -> None:
        """Make sure the store's reserve file is there, if there is room for it."""
        path = self.root / "reserve"
        if path.exists():
            return
        temp = self.root / f".reserve.{os.getpid()}"
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.posix_fallocate(fd, 0, RESERVE)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(temp, path)
        except OSError:
            with contextlib.suppress(OSError):
                temp.unlink()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------- locking

    @contextlib.contextmanager
    def _store_lock(self, kind: int):
        depth = getattr(self._held, "shared", 0)
        if kind == fcntl.LOCK_EX and depth:
            raise RuntimeError("the exclusive store lock was asked for under the shared one")
        # Read-only is enough for flock, and lets a group member take the lock.
        fd = os.open(self.root / "lock", os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, self.file_mode)
        try:
            fcntl.flock(fd, kind)
            if kind == fcntl.LOCK_SH:
                self._held.shared = depth + 1
            try:
                yield
            finally:
                if kind == fcntl.LOCK_SH:
                    self._held.shared = depth
        finally:
            os.close(fd)

    def _shared(self):
        """Held by every operation that reads objects or adds them."""
        return self._store_lock(fcntl.LOCK_SH)

    def _exclusive(self):
        """Held while objects leave ``objects/``: no reader is between a
        catalog row and the files it names."""
        return self._store_lock(fcntl.LOCK_EX)

    def _place(self, staged: Path, final: Path, placed: list[Path]) -> None:
        """Move a staged file into ``objects/``, never over an existing one."""
        try:
            os.link(staged, final)
        except FileExistsError:
            raise StoreError(f"{final} already exists; the store will not replace an "
                             f"object (run: blockdiff verify --store {self.root})") from None
        placed.append(final)
        os.unlink(staged)

    def _unplace(self, committed, placed: list[Path]) -> None:
        """After a failure: remove the files placed for catalog rows that did
        not commit (``committed()`` says whether they did after all)."""
        with contextlib.suppress(Exception):
            if placed and not committed():
                for path in placed:
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()

    # ------------------------------------------------------------- reading

    def get(self, snapshot_id: str) -> Snapshot:
        """The catalog entry of a snapshot, given by its id or by a unique
        prefix of it (at least ``PREFIX_MIN``, 4, hex digits, as git takes);
        ``UnknownSnapshot`` if none, ``AmbiguousId`` if the prefix begins
        more than one id. The entry holds the full id: use ``snap.id``, not
        what was given, from then on."""
        snap = self.catalog.get(snapshot_id)
        if snap is None and (prefix := id_prefix(snapshot_id)) is not None:
            ids, total = self.catalog.ids_with_prefix(prefix)
            if total > 1:
                raise AmbiguousId(f"snapshot id {snapshot_id!r} is ambiguous: {total} snapshots "
                                  f"in the store {self.root} begin with it "
                                  f"({candidates(ids, total)}); give more of its digits")
            snap = self.catalog.get(ids[0]) if ids else None
        if snap is None:
            short = (isinstance(snapshot_id, str) and 0 < len(snapshot_id) < 4
                     and all(c in "0123456789abcdefABCDEF" for c in snapshot_id))
            raise UnknownSnapshot(f"no snapshot {snapshot_id!r} in the store {self.root}"
                                  + (" (an id prefix needs at least 4 hex digits)"
                                     if short else "")
                                  + f"; list them with: blockdiff log --store {self.root}")
        return snap

    def resolve(self, snapshot_id: str) -> str:
        """The full id of the snapshot ``snapshot_id`` names (an id or a
        unique prefix of one, as for :meth:`get`)."""
        return self.get(snapshot_id).id

    def map_path(self, snap: Snapshot) -> Path:
        """Where a snapshot's map is: named by its digest, so a rewritten map
        (compaction) never replaces the old one under the same name."""
        return self.objects / f"{snap.id}.{snap.map_sha256[:16]}.map"

    def layer_path(self, layer: int) -> Path:
        """Where a layer's data file is."""
        return self.objects / _layer_name(layer)

    def load_map(self, snap: Snapshot, *, cached: bool = True) -> SnapshotMap:
        """A snapshot's map, checked against the digest the catalog recorded
        (when it is read: ``cached=False`` reads it even if it was read before)
        and against the catalog's size."""
        smap = self._read_map(snap, cached)
        if smap.pieces.size != snap.size or smap.extents.size != snap.size:
            raise Damaged(f"snapshot {snap.id}: the catalog says {snap.size} bytes, its map "
                          f"{smap.pieces.size}; run: blockdiff verify --store {self.root}")
        return smap

    def _read_map(self, snap: Snapshot, cached: bool) -> SnapshotMap:
        if cached:
            with self._maps_lock:
                known = self._maps.get(snap.map_sha256)
            if known is not None:
                return known
        damaged = Damaged(f"the map of snapshot {snap.id} is damaged; "
                          f"run: blockdiff verify --store {self.root}")
        raw = self.map_path(snap).read_bytes()
        if hashlib.sha256(raw).hexdigest() != snap.map_sha256:
            raise damaged
        try:
            smap, delta = _decode_map(raw)
        except MAP_ERRORS:
            raise damaged from None
        if delta is not None:
            if delta.base != snap.map_base:
                raise damaged
            base = self._read_map(self.get(delta.base), cached)
            own = smap
            extents, _ = remap(base.extents, delta.starts, delta.ends,
                               (own.extents.logical, own.extents.physical, own.extents.length,
                                own.extents.flags), size=own.extents.size)
            smap = dataclasses.replace(
                own, pieces=splice_pieces(base.pieces, delta.starts, delta.ends, own.pieces),
                extents=extents)
        self._remember_map(snap.map_sha256, smap)
        return smap

    def _layer(self, layer: int) -> _Layer:
        """The catalog's record of a layer, decoded (``Damaged`` if it has
        none or it does not decode)."""
        layer = int(layer)
        with self._maps_lock:
            known = self._layers.get(layer)
        if known is not None:
            return known
        record = self.catalog.layer(layer)
        if record is None:
            raise Damaged(f"layer {_layer_name(layer)} has no record in the catalog; "
                          f"run: blockdiff verify --store {self.root}")
        try:
            decoded = _Layer(record)
        except ValueError:
            raise Damaged(f"the catalog's record of layer {_layer_name(layer)} is damaged; "
                          f"run: blockdiff verify --store {self.root}") from None
        with self._maps_lock:
            _remember(self._layers, layer, decoded, LAYER_CACHE)
        return decoded

    def _forget_layer(self, layer: int) -> None:
        with self._maps_lock:
            self._layers.pop(int(layer), None)

    def _bad_chunks(self, layer: int, pos: np.ndarray,
                    length: np.ndarray) -> tuple[tuple, int, str]:
        """Check the chunks of a layer holding the runs ``pos``/``length``
        (found by binary search: the cost follows the runs, not the layer).
        Returns ``((position, length) of the bad chunks, bytes read, problem)``;
        ``problem`` names what makes the runs unreadable (a missing file,
        runs no chunk holds), else it is empty."""
        table = self._layer(layer)
        index, loose = table.holding(pos, length)
        if loose:
            return _NO_CHUNKS, 0, (f"{_layer_name(layer)}: {loose} range(s) in no "
                                   f"checksummed chunk")
        path = self.layer_path(layer)
        c_pos, c_len = table.pos[index], table.length[index]
        try:
            with open(path, "rb") as f:
                crcs, _ = native.transfer_ranges(f.fileno(), -1, c_pos, None, c_len, path,
                                                 checksums=True)
        except OSError as e:
            return _NO_CHUNKS, 0, f"{path.name}: {e.strerror or e}"
        bad = crcs != table.crc[index]
        return (c_pos[bad], c_len[bad]), int(c_len.sum()), ""

    def _check_whole(self, layer: int) -> tuple[tuple, int, str]:
        """Check every chunk of a layer, in one pass over its runs, and vouch
        for it when all match. Returns what :meth:`_bad_chunks` does."""
        table = self._layer(layer)
        path = self.layer_path(layer)
        try:
            identity = _file_identity(path)
            with open(path, "rb") as f:
                crcs = native.chunk_crcs(f.fileno(), table.run_pos, table.run_length,
                                         table.record.chunk, path)
        except OSError as e:
            return _NO_CHUNKS, 0, f"{path.name}: {e.strerror or e}"
        bad = crcs != table.crc
        if not bad.any():
            self.catalog.mark_checked(layer, time.time(), identity)
            self._forget_layer(layer)
        return (table.pos[bad], table.length[bad]), int(table.length.sum()), ""

    def _vouched(self, layer: int) -> bool:
        """Whether a layer's file is unchanged since a whole check passed
        recently enough (see VOUCH_SECONDS)."""
        record = self._layer(layer).record
        if not record.stat or time.time() - record.checked > VOUCH_SECONDS:
            return False
        try:
            return _file_identity(self.layer_path(layer)) == record.stat
        except OSError:
            return False

    def _check_pieces(self, snap: Snapshot, pieces: PieceTable, *, whole: bool) -> int:
        """Refuse (``Damaged``) to hand back pieces whose data fails its
        checksum. ``whole``: the pieces are a whole image (a fork, an export):
        layers vouched for are trusted, others are read whole and vouched for
        when they pass. Otherwise only the chunks holding the pieces are read.
        Returns the bytes read."""
        read = 0
        for layer, sel in _by_layer(pieces):
            if whole and self._vouched(layer):
                continue
            if whole:
                bad, n, problem = self._check_whole(layer)
            else:
                bad, n, problem = self._bad_chunks(layer, pieces.pos[sel], pieces.length[sel])
            read += n
            if problem or len(bad[0]):
                what = problem or (f"{_layer_name(layer)}: {len(bad[0])} chunk(s) fail their "
                                   f"checksum")
                raise Damaged(f"snapshot {snap.id} is damaged ({what}); nothing was "
                              f"written; run: blockdiff verify --store {self.root}")
        return read

    def _canonical(self, pieces: PieceTable) -> PieceTable:
        """Pieces with every run of a compaction layer replaced by the runs it
        was copied from, so that compaction changes no comparison."""
        for layer in np.unique(pieces.layer):
            origin = self._layer(int(layer)).origin
            if origin is None:
                continue
            # Compaction layers keep each byte at its offset in the image.
            mine = pieces.layer == layer
            starts, ends = pieces.offset[mine], pieces.offset[mine] + pieces.length[mine]
            inside, _ = pieces_within(_unpack_pieces(origin, pieces.size), starts, ends)
            pieces = splice_pieces(pieces, starts, ends, inside)
        return pieces

    def _remember_map(self, digest: str, smap: SnapshotMap) -> None:
        with self._maps_lock:
            _remember(self._maps, digest, smap, MAP_CACHE)

    def log(self, snapshot_id: str | None = None) -> list[Snapshot]:
        """The ancestry of a snapshot (or every snapshot), newest first."""
        if snapshot_id is None:
            return self.catalog.all()
        return self.catalog.ancestry(self.get(snapshot_id).id)

    def _lineage_record(self, image: str | os.PathLike) -> dict | None:
        try:
            raw = os.getxattr(image, LINEAGE_XATTR)
        except OSError as e:
            if e.errno in (errno.ENODATA, errno.ENOTSUP, errno.ENOENT):
                return None
            raise
        try:
            record = json.loads(raw)
        except ValueError:
            return None
        if record.get("store") != self.id or self.catalog.get(record.get("snapshot", "")) is None:
            return None   # another store's image, or a foreign one
        return record

    def lineage(self, image: str | os.PathLike) -> tuple[str | None, str]:
        """``(snapshot id, state)`` an image records for this store, else ``(None, "")``."""
        record = self._lineage_record(image)
        if record is None:
            return None, ""
        return record["snapshot"], record.get("state", "")

    def lineage_mark(self, image: str | os.PathLike) -> str | None:
        """A token that changes with every commit or restore of the image
        (None if it has no lineage here): a dirty-block tracker reset right
        after one of them can tell that no other came between."""
        record = self._lineage_record(image)
        return None if record is None else record.get("mark")

    def _set_lineage(self, fd: int, snapshot_id: str, state: str) -> None:
        os.setxattr(fd, LINEAGE_XATTR, json.dumps(
            {"store": self.id, "snapshot": snapshot_id, "state": state,
             "mark": os.urandom(8).hex()}).encode())

    # ------------------------------------------------------------- commit

    @contextlib.contextmanager
    def _locked(self, path: str, flags: int):
        # A restore never goes through a symbolic link: it would write into
        # whatever the link points at (as root: anything, this store included).
        nofollow = os.O_NOFOLLOW if flags & os.O_RDWR else 0
        try:
            fd = os.open(path, flags | os.O_CLOEXEC | nofollow)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UsageError(f"{path} is a symbolic link; give the image's own path "
                                 f"({os.path.realpath(path)})") from None
            raise
        try:
            st = os.fstat(fd)
            if not stat_mode.S_ISREG(st.st_mode):
                raise UsageError(f"{path} is not a regular file")
            if flags & os.O_RDWR and st.st_nlink > 1:
                raise UsageError(f"{path} has {st.st_nlink} hard links; a restore would change "
                                 f"the other names too (it could be a store's own file), so "
                                 f"restore into a new path instead")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ImageBusy(f"{path} is being committed or restored by another process; "
                                f"wait for it and retry") from None
            yield fd
        finally:
            os.close(fd)

    def commit(self, image: str | os.PathLike, *, parent: str | None = None, message: str = "",
               meta: dict | None = None, ttl: float | None = None,
               skip_unchanged: bool = False, written: Written | None = None,
               _imported: Snapshot | None = None) -> Snapshot:
        """Snapshot an image; returns the new snapshot (or its parent, when
        ``skip_unchanged`` and nothing changed). The image must not be written
        meanwhile (pause the VM). ``_imported`` keeps another store's id,
        time, message and metadata (used by ``import_``).

        ``written`` is ``(offsets, lengths)`` of every byte range written to
        the image since it was last committed or restored: what a dirty-block
        tracker such as QEMU's dirty bitmap reports. Only those ranges are
        then mapped, instead of the whole image, so the cost follows the step
        and not the image's fragmentation. The store trusts the ranges: they
        must cover every write. It maps the whole image anyway when the
        ranges cannot describe the change: the image's lineage is not a
        clean snapshot of this store, another parent is given, or its size
        changed."""
        if ttl is not None:
            ttl = check_duration(ttl, "ttl")
        image = os.fspath(image)
        with self._locked(image, os.O_RDONLY) as fd, self._shared():
            known, state = self.lineage(image)
            if state == "restoring":
                raise StoreError(f"{image} was being restored when that was interrupted; "
                                 f"finish with: blockdiff restore --store {self.root} {known} "
                                 f"{image}")
            parent = parent if parent is not None else known
            parent_snap = None if parent is None else self.get(parent)
            parent = None if parent_snap is None else parent_snap.id   # a prefix resolved
            parent_map = None if parent_snap is None else self.load_map(parent_snap)

            native.fsync(fd, image)
            size = os.fstat(fd).st_size
            if self.copy_mode:
                emap = ExtentMap.from_arrays([], [], [], [], size)
                with self._materialized(parent_snap) as parent_copy:
                    changes = _compare_with_file(fd, image, parent_copy)
            else:
                if native.fs_info(fd, image)[2] != os.stat(self.objects).st_dev:
                    raise Unsupported(f"{image} is not on the store's filesystem; keep images "
                                      f"beside the store ({self.root}) so snapshots are "
                                      f"reflinks")
                if (written is not None and parent_snap is not None and parent == known
                        and state == "clean" and size == parent_snap.size):
                    starts, ends = normalize_ranges(*written, size, BLOCK)
                    fresh = native.fiemap_ranges(fd, starts, ends, image)  # fsynced above
                    emap, (now, before) = remap(parent_map.extents, starts, ends, fresh)
                    now.check_supported(image)
                    changes = changed_ranges(now, before, BLOCK)
                else:
                    emap = ExtentMap.of_file(fd, image, sync=False)  # fsynced above
                    emap.check_supported(image)
                    changes = changed_ranges(
                        emap, None if parent_map is None else parent_map.extents, BLOCK)
            if (skip_unchanged and parent_snap is not None and len(changes) == 0
                    and emap.size == parent_snap.size):
                return parent_snap

            snap_id = _imported.id if _imported else _new_id()
            layer = _layer_number(snap_id)
            data_pos = fmt.layout_data(changes, version=2)
            is_data = changes.kind == DATA
            src, dst, length = changes.offset[is_data], data_pos[is_data], changes.length[is_data]
            layer_tmp = self.staging / f"{snap_id}.{os.getpid()}.layer"
            map_tmp = self.staging / f"{snap_id}.{os.getpid()}.map"
            layer_path = self.layer_path(layer)
            placed: list[Path] = []
            try:
                # Checksums come from the image's bytes (in the page cache
                # after the step), chunk by chunk; the data is reflinked.
                record = _chunk_record(layer, fd, image, src, dst, length)
                out = os.open(layer_tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                              self.object_mode)
                try:
                    native.transfer_ranges(fd, out, src, dst, length, layer_tmp)
                    native.fsync(out, layer_tmp)
                finally:
                    os.close(out)
                pieces = overlay(None if parent_map is None else parent_map.pieces, changes,
                                 data_pos, layer, emap.size)
                smap = SnapshotMap(pieces, emap, layer)
                delta = None
                if parent_map is not None and parent_map.chain + 1 < MAP_CHAIN:
                    delta = _delta_on(parent, parent_map, changes, emap.size)
                    smap.chain = parent_map.chain + 1
                raw = _encode_map(smap, delta)
                _write_readonly(map_tmp, raw, self.object_mode)
                digest = hashlib.sha256(raw).hexdigest()
                snap = Snapshot(0, snap_id, parent, time.time(), message, meta or {},
                                emap.size, changes.bytes_of(DATA) + changes.bytes_of(ZERO),
                                len(changes), None if ttl is None else time.time() + ttl,
                                digest, None if delta is None else parent)
                if _imported:
                    snap.created, snap.message = _imported.created, _imported.message
                    snap.meta, snap.expires = _imported.meta, _imported.expires
                self._place(layer_tmp, layer_path, placed)
                self._place(map_tmp, self.map_path(snap), placed)
                _fsync_dir(self.objects)
                record.stat = _file_identity(layer_path)
                try:
                    with self.catalog.transaction() as db:
                        if _imported and (self.catalog.retired(snap_id)
                                          or self.catalog.layer(layer) is not None):
                            raise StoreError(f"snapshot {snap_id} was in this store before; "
                                             f"it cannot come back under the same id")
                        snap.seq = self.catalog.add(db, snap, np.unique(pieces.layer), record)
                except ConstraintFailed as e:   # the parent was removed meanwhile
                    raise StoreError(f"cannot commit {image}: {e}; commit it again") from None
            except BaseException:
                for p in (layer_tmp, map_tmp):
                    with contextlib.suppress(FileNotFoundError):
                        p.unlink()
                self._unplace(lambda: self.catalog.get(snap_id) is not None, placed)
                raise
            self._set_lineage(fd, snap_id, "clean")
            self._remember_map(digest, smap)
            return snap

    # ------------------------------------------------------------ restore

    def _fill(self, out_fd: int, out_path: str, pieces: PieceTable, *, copy: bool = False) -> None:
        """Write pieces into a file at their offsets, one native call per layer:
        reflinked, or with ``copy`` copied through memory (asking for checksums
        forces that; copy_file_range would reflink within one filesystem)."""
        for layer, sel in _by_layer(pieces):
            with open(self.layer_path(layer), "rb") as f:
                native.transfer_ranges(f.fileno(), out_fd, pieces.pos[sel], pieces.offset[sel],
                                       pieces.length[sel], out_path, reflink=not copy,
                                       checksums=copy)

    def restore(self, snapshot_id: str, image: str | os.PathLike, *,
                written: Written | None = None) -> RestoreResult:
        """Make ``image`` byte-identical to a snapshot.

        An existing image is patched in place: only the ranges where it differs
        from the snapshot are rewritten. A new path becomes a fork, built from
        the snapshot's layers. Either way the data handed back is checked
        against its checksums first (``Damaged``, and nothing written, if it
        fails): in place, the chunks holding what is rewritten; for a fork,
        every layer it uses that is not vouched for (see ``VOUCH_SECONDS``).

        ``written`` is as for :meth:`commit`: every range written to the image
        since it was last committed or restored. With it, what differs is
        those ranges plus what differs between the two snapshots' maps, and
        the image is not mapped at all.
        """
        image = os.fspath(image)
        # A dangling link counts as there: it is refused, not written through.
        exists = os.path.lexists(image)
        elsewhere = exists and not os.path.islink(image) and (
            self.copy_mode or os.stat(image).st_dev != os.stat(self.objects).st_dev)
        if not exists or elsewhere:
            # Physical addresses compare only within one filesystem (and mean
            # nothing without reflink): such an image is rebuilt whole and
            # renamed over, never patched.
            with self._shared():
                snap = self.get(snapshot_id)
                smap = self.load_map(snap)
                checked = self._check_pieces(snap, smap.pieces, whole=True)
                with files.atomic_output(image) as (fd, temp):
                    native.truncate(fd, snap.size, temp)
                    self._fill(fd, temp, smap.pieces)
                    self._set_lineage(fd, snap.id, "clean")
            return RestoreResult(snap.id, image, len(smap.pieces),
                                 int(smap.pieces.length.sum()), forked=True,
                                 checked_bytes=checked)
        with self._locked(image, os.O_RDWR) as fd, self._shared():
            snap = self.get(snapshot_id)
            smap = self.load_map(snap)
            known, state = self.lineage(image)
            size = os.fstat(fd).st_size
            from_snap = self.get(known) if known is not None else None
            tracked = (written is not None and from_snap is not None and state == "clean"
                       and from_snap.size == size == snap.size)
            if tracked:
                # The image is its lineage snapshot except where it was written.
                between = changed_ranges(smap.extents, self.load_map(from_snap).extents, BLOCK)
                starts, ends = normalize_ranges(*written, size, BLOCK)
                starts, ends = union(np.concatenate((between.offset, starts)),
                                     np.concatenate((between.offset + between.length, ends)))
                ends = np.minimum(ends, np.uint64(size))   # never past the end of the file
            else:
                native.fsync(fd, image)
                current = ExtentMap.of_file(fd, image, sync=False)  # fsynced above
                differ = changed_ranges(smap.extents, current, BLOCK)
                starts, ends = differ.offset, differ.offset + differ.length
            # Within the ranges that differ, the snapshot's pieces are cloned
            # in and the rest, its zeros, punched; checked before anything is.
            pieces, (hole_start, hole_end) = pieces_within(smap.pieces, starts, ends)
            checked = self._check_pieces(snap, pieces, whole=False)
            # Marked first: a crash half-way leaves an image commit refuses.
            self._set_lineage(fd, snap.id, "restoring")
            if not tracked:
                native.truncate(fd, snap.size, image)
            self._fill(fd, image, pieces)
            native.zero_ranges(fd, hole_start, hole_end - hole_start, image)
            native.fsync(fd, image)
            self._set_lineage(fd, snap.id, "clean")
        return RestoreResult(snap.id, image, len(starts), int((ends - starts).sum()),
                             forked=False, tracked=tracked, checked_bytes=checked)

    @contextlib.contextmanager
    def _materialized(self, snap: Snapshot | None, *, on: tuple[Snapshot, Path] | None = None):
        """A temporary full image of a snapshot in the staging area (None: no
        file), checked like a fork. With ``on`` (an ancestor and its
        materialized image), it is a reflink copy of that image with only the
        ranges where the two snapshots hold other bytes rewritten, so that the
        two files share every block they have in common."""
        if snap is None:
            yield None
            return
        path = self.staging / f"{snap.id}.{os.getpid()}.{os.urandom(4).hex()}.img"
        try:
            smap = self.load_map(snap)
            self._check_pieces(snap, smap.pieces, whole=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                if on is None:
                    native.truncate(fd, snap.size, path)
                    self._fill(fd, str(path), smap.pieces)
                else:
                    base, base_path = on
                    with open(base_path, "rb") as src:
                        files.clone_or_copy(src.fileno(), fd, base.size, str(path))
                    native.truncate(fd, snap.size, path)
                    differ = self.differences(base, snap)
                    pieces, (hole_start, hole_end) = pieces_within(
                        smap.pieces, differ.offset, differ.offset + differ.length)
                    self._fill(fd, str(path), pieces)
                    native.zero_ranges(fd, hole_start, hole_end - hole_start, path)
            finally:
                os.close(fd)
            yield path
        finally:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def export(self, snapshot_id: str, out: str | os.PathLike,
               since: str | None = None) -> engine.CreateResult:
        """Write one portable file from which another store recreates a snapshot:
        on its own, or on top of ``since``, an ancestor the other store has."""
        out = os.fspath(out)
        with self._shared():
            snap = self.get(snapshot_id)
            base = None
            snapshot_id = snap.id   # a prefix resolved
            if since is not None:
                base = self.get(since)
                since = base.id
                if since not in {s.id for s in self.catalog.ancestry(snapshot_id)}:
                    raise UsageError(f"{since} is not an ancestor of {snapshot_id}; "
                                     f"see: blockdiff log --store {self.root} {snapshot_id}")
            record = {"format": "blockdiff-export", "version": 1, "store": self.id,
                      "base": since, "snapshot": {"id": snap.id, "created": snap.created,
                                                  "message": snap.message, "meta": snap.meta,
                                                  "expires": snap.expires}}
            trailer = json.dumps(record, sort_keys=True).encode()
            trailer += struct.pack("<Q", len(trailer)) + EXPORT_MAGIC
            # The diff and then the record go to a temporary name beside OUT,
            # renamed only once both are on it: a whole export or nothing.
            temp = files.temp_beside(out)
            try:
                with self._materialized(base) as base_path, self._materialized(
                        snap, on=None if base is None else (base, base_path)) as target:
                    result = engine.create_diff(temp, target, base_path,
                                                target_id=bytes.fromhex(snap.id) + bytes(8))
                with open(temp, "ab") as f:
                    f.write(trailer)
                    f.flush()
                    os.fsync(f.fileno())
                os.rename(temp, out)
                _fsync_dir(Path(os.path.dirname(os.path.abspath(out))))
            except OSError as e:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(temp)
                raise files.naming_final(e, temp, out) from None
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(temp)
                raise
        return result

    def import_(self, path: str | os.PathLike) -> ImportResult:
        """Recreate the snapshot an export file holds. The file is read and
        checked whole either way; a snapshot the store has already is skipped
        (``skipped`` says so), and an id this store once had and removed, or
        one naming an object it holds, is refused."""
        path = os.fspath(path)
        record = read_export_record(path)
        info = record["snapshot"]
        sid = info["id"]
        header = engine.read_diff(path)
        if header.version != 2 or header.target_id[:8] != bytes.fromhex(sid):
            raise InvalidDiff(f"{path}: its record names snapshot {sid} but its diff holds "
                              f"another; export it again")
        if self.catalog.get(sid) is not None:
            with open(path, "rb") as f:
                engine.verify_data(f.fileno(), header, path)
            return ImportResult([sid], skipped=f"snapshot {sid} is in the store already")
        # Refused here before the diff is applied; commit checks the same again
        # in the transaction that would add the snapshot, where no race can pass.
        if self.catalog.retired(sid):
            raise StoreError(f"snapshot {sid} was removed from this store; an import cannot "
                             f"bring it back under the same id (images restored from it may "
                             f"still name it)")
        if self.catalog.layer(_layer_number(sid)) is not None or self.layer_path(
                _layer_number(sid)).exists():
            raise StoreError(f"{path} names snapshot {sid}, which is the name of an object "
                             f"this store holds; it was not imported")
        base = None
        if record["base"] is not None:
            base = self.catalog.get(record["base"])
            if base is None:
                raise StoreError(f"{path} builds on snapshot {record['base']}, which this "
                                 f"store does not have; import that first")
        imported = Snapshot(0, sid, None, info["created"], info["message"], info["meta"],
                            expires=info["expires"])
        target = self.staging / f"{sid}.{os.getpid()}.import.img"
        with self._shared(), self._materialized(base) as base_path:
            try:
                engine.apply_diff(path, target, base_path)
                snap = self.commit(target, parent=None if base is None else base.id,
                                   _imported=imported)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    target.unlink()
        return ImportResult([snap.id])

    def compact(self, snapshot_id: str) -> Snapshot:
        """Rewrite a snapshot's data into one new, physically contiguous layer.

        Its content and id stay the same; its piece table shrinks to one piece
        per data extent, so forks of it take a few clones instead of one per
        fragment. Images restored from it before compaction no longer share its
        blocks: their next commit stores them whole, so restore them from the
        snapshot again (see docs/store.md).
        """
        layer = int(_new_id(), 16)
        layer_path = self.layer_path(layer)
        staged = self.staging / f"{layer:016x}.{os.getpid()}.layer"
        map_tmp = self.staging / f"{snapshot_id}.{os.getpid()}.compact.map"
        placed: list[Path] = []
        digest = ""
        with self._shared():
            snap = self.get(snapshot_id)
            snapshot_id = snap.id   # a prefix resolved
            smap = self.load_map(snap)
            try:
                self._check_pieces(snap, smap.pieces, whole=True)
                fd = os.open(staged, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                             self.object_mode)
                try:
                    # The layer is the image itself (position = offset), its
                    # data copied, not reflinked, so the filesystem lays it
                    # out afresh.
                    native.truncate(fd, snap.size, staged)
                    pieces = smap.pieces
                    self._fill(fd, str(staged), pieces, copy=True)
                    native.fsync(fd, staged)
                    compacted = PieceTable(*coalesce(pieces.offset, pieces.length,
                                                     np.full(len(pieces), layer, np.int64),
                                                     pieces.offset.copy()), size=snap.size)
                    record = _chunk_record(layer, fd, staged, compacted.pos, compacted.pos,
                                           compacted.length)
                    extents = ExtentMap.of_file(fd, staged, sync=False)  # fsynced above
                finally:
                    os.close(fd)
                # Where the bytes came from, so comparisons see the same runs.
                record.origin = _pack_pieces(self._canonical(pieces))
                raw = _encode_map(SnapshotMap(compacted, extents, layer))
                digest = hashlib.sha256(raw).hexdigest()
                _write_readonly(map_tmp, raw, self.object_mode)
                self._place(staged, layer_path, placed)
                self._place(map_tmp, self.objects / f"{snap.id}.{digest[:16]}.map", placed)
                _fsync_dir(self.objects)
                record.stat = _file_identity(layer_path)
                old_map = self.map_path(snap)
                # Maps that are deltas on the old one are written whole first.
                dependents, digests = self._whole_maps_of_dependents(snap, placed)
                with self.catalog.transaction() as db:
                    self._refuse_lost_references(db)
                    self._point_dependents_at_whole_maps(db, snap, digests)
                    self.catalog.add_layer(db, record)
                    unused = self.catalog.replace_map(db, snap, digest, [layer])
            except BaseException:
                for p in (staged, map_tmp):
                    with contextlib.suppress(FileNotFoundError):
                        p.unlink()
                self._unplace(lambda: (self.catalog.get(snapshot_id) or snap).map_sha256
                              == digest, placed)
                raise
        with self._exclusive():
            _unlink(old_map)
            for dep in dependents:
                _unlink(self.map_path(dep))
            for old in unused:
                _unlink(self.layer_path(old))
                self._forget_layer(old)
        return self.get(snapshot_id)

    # ------------------------------------------------------------ removal

    def rm(self, snapshot_id: str) -> Removal:
        """Delete one snapshot; its descendants stay restorable byte for byte."""
        snap = self.get(snapshot_id)
        result = self._remove([snap], {snap.id: "asked"})
        self.keep_reserve()
        return result

    def _whole_maps_of_dependents(self, snap: Snapshot,
                                  placed: list[Path]) -> tuple[list[Snapshot], dict[int, str]]:
        """Before ``snap``'s map goes or changes: the maps that are deltas on
        it, written whole (not yet in the catalog), under the shared lock.
        Returns those snapshots and, by seq, the digests of their new maps."""
        dependents = self.catalog.map_dependents(snap.id)
        digests = {}
        for dep in dependents:
            smap = dataclasses.replace(self.load_map(dep), chain=0)
            raw = _encode_map(smap)
            digest = hashlib.sha256(raw).hexdigest()
            staged = self.staging / f"{dep.id}.{os.getpid()}.whole.map"
            try:
                _write_readonly(staged, raw, self.object_mode)
                self._place(staged, self.objects / f"{dep.id}.{digest[:16]}.map", placed)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    staged.unlink()
                raise
            digests[dep.seq] = digest
            self._remember_map(digest, smap)
        if digests:
            _fsync_dir(self.objects)
        return dependents, digests

    def _point_dependents_at_whole_maps(self, db, snap: Snapshot, digests: dict[int, str]):
        """Inside the transaction that removes or rewrites ``snap``'s map."""
        now = {dep.seq for dep in self.catalog.map_dependents(snap.id, db)}
        if now != set(digests):
            raise StoreError(f"a snapshot was committed on {snap.id} meanwhile; try again")
        self.catalog.set_full_maps(db, digests)

    def _refuse_lost_references(self, db=None) -> None:
        """Before anything is deleted: the catalog must account for every layer
        a snapshot uses, or a layer still in use could go."""
        lost = self.catalog.lost_references(db)
        if lost:
            raise Damaged(f"the catalog has lost layer references of snapshot(s) "
                          f"{', '.join(lost[:5])}{' ...' if len(lost) > 5 else ''}; nothing "
                          f"was removed; run: blockdiff verify --store {self.root}")

    def _remove(self, snaps, reasons) -> Removal:
        freed = 0
        self._refuse_lost_references()
        for snap in snaps:
            placed: list[Path] = []
            with self._shared():
                try:
                    dependents, digests = self._whole_maps_of_dependents(snap, placed)
                    with self.catalog.transaction() as db:
                        self._refuse_lost_references(db)
                        self._point_dependents_at_whole_maps(db, snap, digests)
                        unused = self.catalog.remove(db, snap, _layer_number(snap.id))
                except BaseException:
                    self._unplace(lambda: self.catalog.get(snap.id) is None, placed)
                    raise
            # Files go after the catalog commit, under the exclusive lock: a
            # crash in between leaves only unreferenced files, which gc sweeps.
            with self._exclusive():
                for dep in dependents:
                    freed += _unlink(self.map_path(dep))
                freed += _unlink(self.map_path(snap))
                for layer in unused:
                    freed += _unlink(self.layer_path(layer))
                    self._forget_layer(layer)
        return Removal([s.id for s in snaps], freed, reasons)

    def gc(self, policy, *, now: float | None = None, dry_run: bool = False) -> Removal:
        """Remove expired snapshots and those the policy does not keep, then
        sweep files no snapshot uses (left by interrupted operations)."""
        _, remove, reasons = apply_policy(self.catalog.all(), policy,
                                          time.time() if now is None else now)
        reasons = {s.id: reasons[s.id] for s in remove}
        if dry_run:
            return Removal([s.id for s in remove], 0, reasons)
        result = self._remove(remove, reasons)
        result.bytes_freed += self._sweep()
        self.keep_reserve()
        return result

    def _sweep(self) -> int:
        """Remove the files of ``objects/`` no catalog row names, and staged
        files of processes that are gone. Under the exclusive lock, so no
        operation is between placing files and committing their rows."""
        freed = 0
        with self._exclusive():
            self._refuse_lost_references()
            maps = {self.map_path(s).name for s in self.catalog.all()}
            layers = {_layer_name(layer)
                      for layer in self.catalog.layer_ids() | self.catalog.layers_in_use()}
            for path in self.objects.iterdir():
                if path.name not in maps and path.name not in layers:
                    freed += _unlink(path)
            for path in self.staging.iterdir():
                pid = path.name.split(".")[1] if path.name.count(".") >= 2 else ""
                if pid.isdigit() and not native.process_alive(int(pid)):
                    freed += _unlink(path)
        return freed

    # ------------------------------------------------------------- checking

    def verify(self, snapshot_id: str | None = None) -> dict[str, list[str]]:
        """Problems found, by snapshot id ("catalog" for the catalog itself).

        Checks the catalog's integrity and that it accounts for every layer a
        snapshot uses; every map against its digest and the catalog's size;
        that snapshot files exist and are read-only; and every chunk of every
        layer a snapshot uses against its CRC32C. Damage in a layer is
        reported for every snapshot whose bytes it holds. Layers found whole
        are vouched for (see ``VOUCH_SECONDS``).
        """
        problems: dict[str, list[str]] = {}
        catalog = self.catalog.integrity_problems()
        lost = self.catalog.lost_references()
        catalog += [f"snapshot {sid}: its layer references are not all there" for sid in lost]
        if catalog:
            problems["catalog"] = catalog
        with self._shared():
            snaps = [self.get(snapshot_id)] if snapshot_id else self.catalog.all()
            checked: dict[int, tuple[list[str], tuple]] = {}
            for snap in snaps:
                found: list[str] = []
                path = self.map_path(snap)
                try:
                    smap = self.load_map(snap, cached=False)
                except (OSError, StoreError, Damaged, ValueError) as e:
                    problems[snap.id] = [f"map: {getattr(e, 'strerror', None) or e}"]
                    continue
                if os.stat(path).st_mode & 0o222:
                    found.append(f"{path.name} is writable")
                used = {int(layer) for layer in np.unique(smap.pieces.layer)}
                refs = self.catalog.layers_of(snap)
                if used - refs:
                    found.append(f"the catalog does not record its use of "
                                 f"{', '.join(_layer_name(x) for x in sorted(used - refs))}")
                for layer, sel in _by_layer(smap.pieces):
                    if layer not in checked:
                        checked[layer] = self._check_layer(layer)
                    layer_problems, bad = checked[layer]
                    found += layer_problems
                    if len(bad[0]):
                        hit = _overlapping(smap.pieces.pos[sel], smap.pieces.length[sel],
                                           *bad)
                        if hit:
                            found.append(f"{_layer_name(layer)}: {hit} of its bytes are in "
                                         f"chunks that fail their checksum")
                if found:
                    problems[snap.id] = sorted(set(found))
        return problems

    def _check_layer(self, layer: int) -> tuple[list[str], tuple]:
        """A layer's problems and its bad chunks; vouches for it if it has none."""
        path = self.layer_path(layer)
        if not path.exists():
            return [f"layer {path.name} is missing"], _NO_CHUNKS
        problems = [f"{path.name} is writable"] if os.stat(path).st_mode & 0o222 else []
        try:
            bad, _, problem = self._check_whole(layer)
        except Damaged as e:
            return problems + [str(e).split(";")[0]], _NO_CHUNKS
        return problems + ([problem] if problem else []), bad

    def differences(self, a: Snapshot, b: Snapshot) -> RangeSet:
        """The ranges where snapshot ``b`` holds other bytes than ``a``."""
        if self.copy_mode:
            with self._shared(), self._materialized(b) as path_b, \
                    self._materialized(a) as path_a:
                with open(path_b, "rb") as f:
                    return _compare_with_file(f.fileno(), str(path_b), path_a)
        # Pieces, not physical addresses: compaction moves data, not content.
        map_a, map_b = self.load_map(a), self.load_map(b)
        return differing_pieces(self._canonical(map_a.pieces), self._canonical(map_b.pieces))

    def diff(self, a: str, b: str) -> RangeSet:
        """The ranges where snapshot ``b`` differs from snapshot ``a``."""
        return self.differences(self.get(a), self.get(b))

    def _adopt_unrecorded_layers(self) -> None:
        """Stores made before layers had records: record each layer file a
        snapshot uses, its chunks checksummed as they are now."""
        unrecorded = self.catalog.unrecorded_layers()
        for layer in sorted(unrecorded):
            path = self.layer_path(layer)
            if not path.exists():
                continue   # verify names the snapshots that lack it
            with self._shared(), open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                zero = np.zeros(1, np.uint64)
                record = _chunk_record(layer, f.fileno(), path, zero, zero,
                                       np.full(1, size, np.uint64), _file_identity(path))
                with self.catalog.transaction() as db:
                    if self.catalog.layer(layer) is None:
                        self.catalog.add_layer(db, record)


def _overlapping(pos, length, bad_pos, bad_length) -> int:
    """Bytes of the runs ``pos``/``length`` inside the bad chunks."""
    starts, ends = union(pos, pos + length)
    outside_s, outside_e = subtract(starts, ends, bad_pos, bad_pos + bad_length)
    return int((ends - starts).sum() - (outside_e - outside_s).sum())


def _check_record(path: str, record) -> None:
    """An export record's shape, types and ranges (``InvalidDiff`` if wrong)."""
    def bad(why: str):
        raise InvalidDiff(f"{path} has a damaged export record ({why}); export it again")

    if not isinstance(record, dict) or record.get("format") != "blockdiff-export":
        bad("not a blockdiff export record")
    if record.get("version") != 1:
        bad(f"version {record.get('version')!r}, this blockdiff reads 1")
    if "base" not in record or not (record["base"] is None or _is_id(record["base"])):
        bad("its base is not a snapshot id")
    info = record.get("snapshot")
    if not isinstance(info, dict) or not _is_id(info.get("id")):
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


def open_store(path: str | os.PathLike | None, *, freeing: bool = False) -> Store:
    """The store at ``path``, or at $BLOCKDIFF_STORE (``freeing``: see ``Store``)."""
    path = path or os.environ.get(STORE_ENV)
    if not path:
        raise UsageError(f"no store given; pass --store DIR or set {STORE_ENV}")
    return Store(path, freeing=freeing)
