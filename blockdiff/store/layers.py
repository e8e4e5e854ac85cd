"""Layers: the data files snapshots' pieces point into, and the catalog's
record of each, the CRC32C of every chunk of its data, checked before a
restore hands bytes back.

Chunks are at most ``CHUNK`` bytes, so that a restore checks what it
rewrites by reading little more than that (a 4 KiB block of a big layer:
16 KiB), for a record of 4 bytes a chunk. A fork or an export reads a layer
whole to check it unless its file is unchanged since a whole check passed
(at its commit, or by verify) at most ``VOUCH_SECONDS`` ago.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from blockdiff import native
from blockdiff.engine.extents import PieceTable, pieces_within, splice_pieces, union
from blockdiff.errors import BlockdiffError, Damaged
from blockdiff.progress import NO_PROGRESS, Progress
from blockdiff.store.catalog import Catalog, LayerRecord, Snapshot
from blockdiff.store.maps import PIECE_DTYPE, unpack_pieces
from blockdiff.store.objects import DecodedCache, ObjectFiles, StoreLock, layer_name

CHUNK = 16 * 1024
VOUCH_SECONDS = 24 * 3600
LAYER_CACHE = 4096   # decoded layer records kept per store
FETCH_CONCURRENCY = 4   # layers fetched at once (each with its own parallel ranged GETs)
RUN_DTYPE = np.dtype([("pos", "<u8"), ("length", "<u8")])
NO_CHUNKS = (np.zeros(0, np.uint64), np.zeros(0, np.uint64))


def chunked(src: np.ndarray, dst: np.ndarray, length: np.ndarray, chunk: int = CHUNK):
    """Ranges cut into chunks of at most ``chunk`` bytes: ``(src, dst, length)``."""
    length = length.astype(np.uint64)
    count = ((length + np.uint64(chunk - 1)) // np.uint64(chunk)).astype(np.int64)
    index = np.repeat(np.arange(len(length)), count)
    first = np.cumsum(count) - count
    step = (np.arange(int(count.sum()), dtype=np.int64) - np.repeat(first, count))
    offset = step.astype(np.uint64) * np.uint64(chunk)
    part = np.minimum(np.uint64(chunk), length[index] - offset)
    return src[index] + offset, dst[index] + offset, part


def chunk_record(layer: int, fd: int, path, src, dst, length, stat: str = "", *,
                 progress: Progress | None = None) -> LayerRecord:
    """The record of a layer whose data is the ranges ``src`` of an open file,
    to be kept at ``dst`` in the layer: each chunk's checksum, read from ``fd``
    (a phase of ``progress``, if given)."""
    order = np.argsort(dst, kind="stable")
    src, dst, length = src[order], dst[order], length[order]
    if progress is not None:
        progress.start(int(length.sum()), "B", "checksumming")
    crcs = native.chunk_crcs(fd, src, length, CHUNK, path, progress=progress)
    runs = np.empty(len(dst), RUN_DTYPE)
    runs["pos"], runs["length"] = dst, length
    return LayerRecord(int(layer), runs.tobytes(), CHUNK, crcs.astype("<u4").tobytes(), None,
                       time.time(), stat)


def file_identity(path: Path) -> str:
    """What changes whenever a file's content can have changed through the
    filesystem: a write, a truncation, a chmod, a rename over it."""
    st = os.stat(path)
    return f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def by_layer(pieces: PieceTable):
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


class DecodedLayer:
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
        pos, _, length = chunked(self.run_pos, self.run_pos, self.run_length, record.chunk)
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


class Layers:
    """The store's layers: their files, their decoded records (kept while
    the store is open, until a check changes them) and the checks of their
    data against the records."""

    def __init__(self, catalog: Catalog, files: ObjectFiles):
        self.catalog = catalog
        self.files = files
        self._decoded = DecodedCache(LAYER_CACHE)
        # In a shared store, what brings the layers this host lacks
        # (blockdiff.store.shared.Fetcher); None in a store of one host.
        self.fetcher = None

    def ensure_local(self, layers) -> int:
        """In a shared store: fetch those of ``layers`` this host lacks,
        several at once, each checked chunk by chunk as it lands; the bytes
        downloaded. A store of one host has every layer it names."""
        if self.fetcher is None:
            return 0
        layers = sorted({int(x) for x in layers})
        missing = [x for x in layers if not self.files.layer_path(x).exists()]

        def fetch(layer: int) -> int:
            table = self.decoded(layer)
            return self.fetcher.layer(layer, table.run_pos, table.run_length,
                                      table.record.chunk, table.crc)

        if len(missing) <= 1:
            fetched = sum(fetch(layer) for layer in missing)
        else:
            with ThreadPoolExecutor(min(FETCH_CONCURRENCY, len(missing)),
                                    thread_name_prefix="layer-fetch") as pool:
                fetched = sum(pool.map(fetch, missing))
        # What was used last is evicted last (see blockdiff.store.replication).
        self.catalog.touch_copies(layers)
        return fetched

    def fetch_again(self, layer: int) -> bool:
        """In a shared store: replace this host's copy of a layer, found
        damaged, by the object store's (checked chunk by chunk first); False
        where there is none to fetch (a store of one host, a layer not
        uploaded)."""
        if self.fetcher is None or not self.fetcher.uploaded_layer(layer):
            return False
        table = self.decoded(layer)
        self.fetcher.layer(layer, table.run_pos, table.run_length, table.record.chunk,
                           table.crc, replace=True)
        self.forget(layer)
        return True

    def decoded(self, layer: int) -> DecodedLayer:
        """The catalog's record of a layer, decoded (``Damaged`` if it has
        none or it does not decode)."""
        layer = int(layer)
        known = self._decoded.get(layer)
        if known is not None:
            return known
        record = self.catalog.layer(layer)
        if record is None:
            raise Damaged(f"layer {layer_name(layer)} has no record in the catalog; "
                          f"run: blockdiff verify --store {self.files.root}")
        try:
            decoded = DecodedLayer(record)
        except ValueError:
            raise Damaged(f"the catalog's record of layer {layer_name(layer)} is damaged; "
                          f"run: blockdiff verify --store {self.files.root}") from None
        self._decoded.put(layer, decoded)
        return decoded

    def forget(self, layer: int) -> None:
        """Drop a layer's decoded record (it changed, or the layer is gone)."""
        self._decoded.pop(int(layer))

    def bad_chunks(self, layer: int, pos: np.ndarray,
                   length: np.ndarray) -> tuple[tuple, int, str]:
        """Check the chunks of a layer holding the runs ``pos``/``length``
        (found by binary search: the cost follows the runs, not the layer).
        Returns ``((position, length) of the bad chunks, bytes read, problem)``;
        ``problem`` names what makes the runs unreadable (a missing file,
        runs no chunk holds), else it is empty."""
        table = self.decoded(layer)
        index, loose = table.holding(pos, length)
        if loose:
            return NO_CHUNKS, 0, (f"{layer_name(layer)}: {loose} range(s) in no "
                                  f"checksummed chunk")
        path = self.files.layer_path(layer)
        c_pos, c_len = table.pos[index], table.length[index]
        try:
            with open(path, "rb") as f:
                crcs, _ = native.transfer_ranges(f.fileno(), -1, c_pos, None, c_len, path,
                                                 checksums=True)
        except OSError as e:
            return NO_CHUNKS, 0, f"{path.name}: {e.strerror or e}"
        bad = crcs != table.crc[index]
        return (c_pos[bad], c_len[bad]), int(c_len.sum()), ""

    def check_whole(self, layer: int, progress: Progress = NO_PROGRESS
                    ) -> tuple[tuple, int, str]:
        """Check every chunk of a layer, in one pass over its runs, and vouch
        for it when all match; the bytes read advance ``progress``. Returns
        what :meth:`bad_chunks` does."""
        table = self.decoded(layer)
        path = self.files.layer_path(layer)
        try:
            identity = file_identity(path)
            with open(path, "rb") as f:
                crcs = native.chunk_crcs(f.fileno(), table.run_pos, table.run_length,
                                         table.record.chunk, path, progress=progress)
        except OSError as e:
            return NO_CHUNKS, 0, f"{path.name}: {e.strerror or e}"
        bad = crcs != table.crc
        if not bad.any():
            self.catalog.mark_checked(layer, time.time(), identity)
            self.forget(layer)
        return (table.pos[bad], table.length[bad]), int(table.length.sum()), ""

    def vouched(self, layer: int) -> bool:
        """Whether a layer's file is unchanged since a whole check passed
        recently enough (see VOUCH_SECONDS)."""
        record = self.decoded(layer).record
        # A check "in the future" is one from before this host's clock
        # stepped back: not trusted, so that no step makes a vouch last longer.
        if not record.stat or not 0 <= time.time() - record.checked <= VOUCH_SECONDS:
            return False
        try:
            return file_identity(self.files.layer_path(layer)) == record.stat
        except OSError:
            return False

    def whole_bytes(self, layers) -> int:
        """The bytes :meth:`check_whole` reads to check these layers (those
        with a file and a record that decodes: the others fail at once)."""
        total = 0
        for layer in layers:
            try:
                if self.files.layer_path(layer).exists():
                    total += int(self.decoded(layer).run_length.sum())
            except Damaged:
                pass
        return total

    def check_pieces(self, snap: Snapshot, pieces: PieceTable, *, whole: bool,
                     progress: Progress = NO_PROGRESS) -> int:
        """Refuse (``Damaged``) to hand back pieces whose data fails its
        checksum. ``whole``: the pieces are a whole image (a fork, an export):
        layers vouched for are trusted, others are read whole and vouched for
        when they pass, a phase of ``progress``. Otherwise layers vouched for
        are trusted too, and of the others only the chunks holding the
        pieces are read. Returns the bytes read."""
        read = 0
        groups = [(layer, sel) for layer, sel in by_layer(pieces) if not self.vouched(layer)]
        if whole:
            progress.start(self.whole_bytes(layer for layer, _ in groups), "B",
                           "checking layers")
        for layer, sel in groups:
            again = ""
            for attempt in range(2):
                if whole:
                    bad, n, problem = self.check_whole(layer, progress)
                else:
                    bad, n, problem = self.bad_chunks(layer, pieces.pos[sel],
                                                      pieces.length[sel])
                read += n
                if problem or not len(bad[0]) or attempt:
                    break
                # This host's copy is damaged: the object store's, if any, replaces it.
                try:
                    if not self.fetch_again(layer):
                        break
                except (BlockdiffError, OSError) as e:
                    again = f"; fetching it again failed: {str(e).split(';')[0]}"
                    break
            if problem or len(bad[0]):
                what = problem or (f"{layer_name(layer)}: {len(bad[0])} chunk(s) fail their "
                                   f"checksum{again}")
                raise Damaged(f"snapshot {snap.id} is damaged ({what}); nothing was "
                              f"written; run: blockdiff verify --store {self.files.root}")
        return read

    def canonical(self, pieces: PieceTable) -> PieceTable:
        """Pieces with every run of a compaction layer replaced by the runs it
        was copied from, so that compaction changes no comparison."""
        for layer in np.unique(pieces.layer):
            origin = self.decoded(int(layer)).origin
            if origin is None:
                continue
            # Compaction layers keep each byte at its offset in the image.
            mine = pieces.layer == layer
            starts, ends = pieces.offset[mine], pieces.offset[mine] + pieces.length[mine]
            inside, _ = pieces_within(unpack_pieces(origin, pieces.size), starts, ends)
            pieces = splice_pieces(pieces, starts, ends, inside)
        return pieces

    def fill(self, out_fd: int, out_path: str, pieces: PieceTable, *, copy: bool = False,
             progress: Progress | None = None) -> None:
        """Write pieces into a file at their offsets, one native call per layer:
        reflinked, or with ``copy`` copied through memory (asking for checksums
        forces that; copy_file_range would reflink within one filesystem).
        The bytes written advance ``progress``, if given."""
        for layer, sel in by_layer(pieces):
            pos, offset, length = pieces.pos[sel], pieces.offset[sel], pieces.length[sel]
            if progress is not None:
                # Checksums of the whole pieces are not wanted: cut long
                # pieces so that the progress moves while one is copied.
                pos, offset, length = chunked(pos, offset, length, native.PROGRESS_BATCH)
            with open(self.files.layer_path(layer), "rb") as f:
                native.transfer_ranges(f.fileno(), out_fd, pos, offset, length, out_path,
                                       reflink=not copy, checksums=copy, progress=progress)

    def adopt_unrecorded(self, lock: StoreLock, unrecorded: set[int]) -> None:
        """Stores made before layers had records: record each layer file a
        snapshot uses (``unrecorded``: the catalog's ``unrecorded_layers()``),
        its chunks checksummed as they are now."""
        for layer in sorted(unrecorded):
            path = self.files.layer_path(layer)
            if not path.exists():
                continue   # verify names the snapshots that lack it
            with lock.shared(), open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                zero = np.zeros(1, np.uint64)
                record = chunk_record(layer, f.fileno(), path, zero, zero,
                                      np.full(1, size, np.uint64), file_identity(path))
                with self.catalog.transaction() as db:
                    if self.catalog.layer(layer) is None:
                        self.catalog.add_layer(db, record)
