"""Snapshot maps: the piece table and extent map a snapshot's map file holds,
their encoding, and maps stored as deltas on their parent's.

A commit stores its map as a delta on its parent's, whole at least every
``MAP_CHAIN`` commits down a line: maps then take space in proportion to the
steps, not to the image's extents times the steps, and reading one reads at
most ``MAP_CHAIN`` files. Map files are named by their digest and never
change, so a decoded map is kept for as long as the store is open.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import re
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from blockdiff.engine.extents import (
    ExtentMap,
    PieceTable,
    partition,
    pieces_within,
    remap,
    splice_pieces,
    union,
)
from blockdiff.errors import (
    BlockdiffError,
    Conflict,
    Damaged,
    RemoteError,
    StoreError,
    UnknownSnapshot,
)
from blockdiff.store.catalog import Catalog, Snapshot
from blockdiff.store.ids import find_snapshot
from blockdiff.store.objects import DecodedCache, ObjectFiles

MAP_CHAIN = 8
# How many times a map read starts again on a newer catalog row: a row
# changes when a snapshot's map is rewritten (its base removed, it or its
# base compacted), a handful of times in its life at most.
MAP_REREADS = 8
# Decoded maps kept per store, the least recently used going first. A VM's
# restore or fork reads the maps of four snapshots (the memory image's and
# the disk's, where each is and where each goes), each a delta on a chain
# of others: a decode costs 10-20 ms each time, which the cache saves.
MAP_CACHE = 256
MAP_CACHE_BYTES = 64 << 20
PIECE_DTYPE = np.dtype([("offset", "<u8"), ("length", "<u8"), ("layer", "<i8"), ("pos", "<u8")])
# What decoding a map file that is not one can raise (numpy's npz reader and
# the zipfile module under it; RuntimeError covers its unsupported methods,
# versions and encryption).
MAP_ERRORS = (ValueError, KeyError, OSError, EOFError, struct.error, zipfile.BadZipFile,
              zlib.error, RuntimeError, MemoryError)


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


def map_bytes(m: SnapshotMap) -> int:
    """What a decoded map holds in memory, about."""
    return sum(array.nbytes for array in (
        m.pieces.offset, m.pieces.length, m.pieces.layer, m.pieces.pos,
        m.extents.logical, m.extents.physical, m.extents.length, m.extents.flags))


def encode_map(m: SnapshotMap, delta: MapDelta | None = None) -> bytes:
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


def decode_map(raw: bytes) -> tuple[SnapshotMap, MapDelta | None]:
    """A map file's contents: for a delta, only its own parts, and the delta.
    Raises one of ``MAP_ERRORS`` if ``raw`` is not a map file."""
    try:
        z = _arrays(raw)
    except ValueError:   # not as np.savez writes maps now: numpy reads it, or refuses
        loaded = np.load(io.BytesIO(raw))   # never pickles: allow_pickle is off
        z = {key: loaded[key] for key in loaded.files}
    pieces = PieceTable(z["p_offset"], z["p_length"], z["p_layer"], z["p_pos"], int(z["size"]))
    extents = ExtentMap(z["e_logical"], z["e_physical"], z["e_length"], z["e_flags"],
                        int(z["e_size"]))
    chain = int(z["chain"]) if "chain" in z else 0   # maps before deltas: whole
    smap = SnapshotMap(pieces, extents, int(z["own_layer"]), chain)
    delta = None
    if "base" in z:
        delta = MapDelta(str(z["base"]), z["d_start"], z["d_end"])
    return smap, delta


# The .npy header of a member, as np.save writes it for these arrays.
_NPY_HEADER = re.compile(
    rb"\{'descr': '([<|][a-zA-Z]\d{1,2})', 'fortran_order': False, 'shape': \((\d*),?\), \}")
_MAP_NUMBERS = frozenset(("<u8", "<i8", "<u4", "<i4", "|u1"))


def _arrays(raw: bytes) -> dict[str, np.ndarray]:
    """The arrays of a map file (an uncompressed .npz of one-dimensional or
    scalar arrays of the dtypes maps use), parsed directly: ``np.load``
    evaluates each member's header as a Python literal, which cost most of a
    map's decoding. Anything else raises ValueError (or what zipfile raises)."""
    out = {}
    with zipfile.ZipFile(io.BytesIO(raw)) as z:
        for info in z.infolist():
            if not info.filename.endswith(".npy") or info.compress_type != zipfile.ZIP_STORED:
                raise ValueError(f"not a map member: {info.filename!r}")
            member = z.read(info)
            if member[:8] != b"\x93NUMPY\x01\x00" or len(member) < 10:
                raise ValueError("not a .npy member")
            (header_len,) = struct.unpack_from("<H", member, 8)
            header = member[10:10 + header_len].rstrip(b" \n")
            found = _NPY_HEADER.fullmatch(header)
            descr = found[1].decode() if found is not None else ""
            if not (descr in _MAP_NUMBERS or descr.startswith("<U")):   # a string: the base
                raise ValueError(f"unexpected .npy header in {info.filename!r}")
            dtype = np.dtype(descr)
            count = int(found[2]) if found[2] else 1
            data = memoryview(member)[10 + header_len:]
            if len(data) != count * dtype.itemsize:
                raise ValueError(f"{info.filename!r} holds {len(data)} bytes, not "
                                 f"{count * dtype.itemsize}")
            array = np.frombuffer(bytearray(data), dtype)
            out[info.filename[:-4]] = array if found[2] else array.reshape(())
    return out


def pack_pieces(pieces: PieceTable) -> bytes:
    """A piece table as PIECE_DTYPE rows."""
    rows = np.empty(len(pieces), PIECE_DTYPE)
    rows["offset"], rows["length"] = pieces.offset, pieces.length
    rows["layer"], rows["pos"] = pieces.layer, pieces.pos
    return rows.tobytes()


def unpack_pieces(rows: np.ndarray, size: int) -> PieceTable:
    """A piece table from PIECE_DTYPE rows."""
    return PieceTable(rows["offset"].astype(np.uint64), rows["length"].astype(np.uint64),
                      rows["layer"].astype(np.int64), rows["pos"].astype(np.uint64), size)


def delta_on(parent: str, parent_map: SnapshotMap, changes, size: int) -> MapDelta:
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


class Maps:
    """The store's map files, read through their chains of deltas and
    checked against the catalog."""

    def __init__(self, catalog: Catalog, files: ObjectFiles):
        self.catalog = catalog
        self.files = files
        self._decoded = DecodedCache(MAP_CACHE, weigh=map_bytes, budget=MAP_CACHE_BYTES)
        # In a shared store, what brings the maps this host lacks
        # (blockdiff.store.shared.Fetcher); None in a store of one host.
        self.fetcher = None

    def path(self, snap: Snapshot) -> Path:
        """Where a snapshot's map is."""
        return self.files.map_path(snap.id, snap.map_sha256)

    def load(self, snap: Snapshot, *, cached: bool = True, refetch: bool = True
             ) -> SnapshotMap:
        """A snapshot's map, checked against the digest the catalog recorded
        (when it is read: ``cached=False`` reads it even if it was read before)
        and against the catalog's size. In a shared store, a local copy that
        fails its digest is replaced by the object store's, unless not
        ``refetch``."""
        smap = self._read(snap, cached, refetch)
        if smap.pieces.size != snap.size or smap.extents.size != snap.size:
            raise Damaged(f"snapshot {snap.id}: the catalog says {snap.size} bytes, its map "
                          f"{smap.pieces.size}; run: blockdiff verify --store {self.files.root}")
        return smap

    def _read(self, snap: Snapshot, cached: bool, refetch: bool = True) -> SnapshotMap:
        """``snap``'s map, read again from the catalog's current row if the
        one read fails because the row changed meanwhile: another host or
        process removing its base rewrites it whole and deletes the old
        objects (blockdiff.store.removal), which a reader holding the old
        row can find gone. The content is the same either way."""
        for _ in range(MAP_REREADS):
            try:
                return self._read_row(snap, cached, refetch)
            except (StoreError, RemoteError, FileNotFoundError):
                now = self.catalog.get(snap.id)
                if now is not None and (now.map_sha256, now.map_base) == (snap.map_sha256,
                                                                           snap.map_base):
                    raise          # not moved: the failure is what it says
                if now is None:
                    raise UnknownSnapshot(f"snapshot {snap.id} was removed from the store "
                                          f"while its map was being read") from None
                snap = now
        raise Conflict(f"the map of snapshot {snap.id} was rewritten {MAP_REREADS} times "
                       f"while it was being read; try again")

    def _read_row(self, snap: Snapshot, cached: bool, refetch: bool) -> SnapshotMap:
        if cached:
            known = self._decoded.get(snap.map_sha256)
            if known is not None:
                return known
        damaged = Damaged(f"the map of snapshot {snap.id} is damaged; "
                          f"run: blockdiff verify --store {self.files.root}")
        path = self.path(snap)
        if self.fetcher is not None and not path.exists():
            self.fetcher.map(snap)
        raw = path.read_bytes()
        if (hashlib.sha256(raw).hexdigest() != snap.map_sha256 and refetch
                and self.fetcher is not None and self.fetcher.uploaded_map(snap)):
            # This host's copy is damaged: the object store's, checked, replaces it.
            try:
                self.fetcher.map(snap, replace=True)
            except (BlockdiffError, OSError) as e:
                raise Damaged(f"the map of snapshot {snap.id} is damaged here, and fetching "
                              f"it again failed: {str(e).split(';')[0]}; run: blockdiff "
                              f"verify --store {self.files.root}") from None
            raw = path.read_bytes()
        if hashlib.sha256(raw).hexdigest() != snap.map_sha256:
            raise damaged
        try:
            smap, delta = decode_map(raw)
        except MAP_ERRORS:
            raise damaged from None
        if delta is not None:
            if delta.base != snap.map_base:
                raise damaged
            base = self._read(find_snapshot(self.catalog, self.files.root, delta.base), cached,
                              refetch)
            own = smap
            extents, _ = remap(base.extents, delta.starts, delta.ends,
                               (own.extents.logical, own.extents.physical, own.extents.length,
                                own.extents.flags), size=own.extents.size)
            smap = dataclasses.replace(
                own, pieces=splice_pieces(base.pieces, delta.starts, delta.ends, own.pieces),
                extents=extents)
        self.remember(snap.map_sha256, smap)
        return smap

    def remember(self, digest: str, smap: SnapshotMap) -> None:
        """Keep a map just written (with that digest) for the next reader."""
        self._decoded.put(digest, smap)

    def write_dependents_whole(self, snap: Snapshot,
                               placed: list[Path]) -> tuple[list[Snapshot], dict[int, str]]:
        """Before ``snap``'s map goes or changes: the maps that are deltas on
        it, written whole (not yet in the catalog), under the shared lock.
        Returns those snapshots and, by seq, the digests of their new maps."""
        dependents = self.catalog.map_dependents(snap.id)
        digests = {}
        for dep in dependents:
            smap = dataclasses.replace(self.load(dep), chain=0)
            raw = encode_map(smap)
            digest = hashlib.sha256(raw).hexdigest()
            staged = self.files.staged(dep.id, "whole.map")
            try:
                self.files.write(staged, raw)
                self.files.place(staged, self.files.map_path(dep.id, digest), placed)
            except BaseException:
                staged.unlink(missing_ok=True)
                raise
            digests[dep.seq] = digest
            self.remember(digest, smap)
        if digests:
            self.files.sync()
        return dependents, digests

    def point_dependents_at_whole(self, db, snap: Snapshot, dependents: list[Snapshot],
                                  digests: dict[int, str]) -> None:
        """Inside the transaction that removes or rewrites ``snap``'s map: the
        rows of its dependents name the maps :meth:`write_dependents_whole`
        wrote. ``Conflict`` if the dependents are not those it read, naming
        the maps it read: one was committed on ``snap`` meanwhile, removed,
        or given another map (by another host or process), and pointing it
        at the map written from the old one could undo that."""
        now = {dep.seq: dep.map_sha256 for dep in self.catalog.map_dependents(snap.id, db)}
        if now != {dep.seq: dep.map_sha256 for dep in dependents}:
            raise Conflict(f"the snapshots whose maps build on {snap.id}'s changed meanwhile "
                           f"(another process or host committed, removed or rewrote one); "
                           f"nothing was changed: try again")
        self.catalog.set_full_maps(db, digests)
