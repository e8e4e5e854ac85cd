"""Images into the store and back: commit, restore (in place or into a new
path), temporary images of snapshots in staging, and comparing snapshots.

Committing compares the image's extent map with the parent's; restoring
compares it with the target snapshot's and clones only the ranges that
differ. Without reflink (a store made with ``allow_copy``) both compare
contents instead, against images of the snapshots rebuilt in staging.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
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
    RangeSet,
    changed_ranges,
    differing_pieces,
    normalize_ranges,
    overlay,
    partition,
    pieces_within,
    remap,
    union,
)
from blockdiff.errors import ConstraintFailed, Damaged, StoreError, Unsupported
from blockdiff.progress import NO_PROGRESS, Progress
from blockdiff.store.catalog import Snapshot
from blockdiff.store.ids import layer_number, new_id
from blockdiff.store.layers import chunk_record, file_identity
from blockdiff.store.lineage import image_locked, set_lineage
from blockdiff.store.maps import MAP_CHAIN, SnapshotMap, delta_on, encode_map
from blockdiff.store.retention import check_duration, owner_of
from blockdiff.store.state import StoreState
from blockdiff.store.views import host_extents, record_view

BLOCK = 4096
# Pages compared at a time with the parent's (see Capture._keep_changed_pages).
COMPARED_PAGES = 4096

# ``(offsets, lengths)`` of the byte ranges written to an image.
Written = tuple[np.ndarray, np.ndarray]


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
    fetched_bytes: int = 0   # layer bytes downloaded from the object store (a shared store)


def compare_with_file(fd: int, path: str, base: Path | None):
    """Ranges where an open file differs from the file ``base`` (None: from
    nothing), found by reading both."""
    if base is None:
        return engine.compare_contents(fd, path, None)
    with open(base, "rb") as b:
        return engine.compare_contents(fd, path, b.fileno())


def commit(store: StoreState, image: str | os.PathLike, *, parent: str | None = None,
           message: str = "", meta: dict | None = None, ttl: float | None = None,
           skip_unchanged: bool = False, written: Written | None = None,
           imported: Snapshot | None = None, progress: Progress = NO_PROGRESS) -> Snapshot:
    """See ``Store.commit``; ``imported`` is its ``_imported``."""
    if ttl is not None:
        ttl = check_duration(ttl, "ttl")
    with capturing(store, image, parent=parent, written=written, imported=imported,
                   checksum_image=True, progress=progress) as capture:
        if skip_unchanged and capture.unchanged:
            return capture.parent
        return capture.finish(message=message, meta=meta, ttl=ttl)


@contextlib.contextmanager
def capturing(store: StoreState, image: str | os.PathLike, *, parent: str | None = None,
              written: Written | None = None, imported: Snapshot | None = None,
              checksum_image: bool = False, only_changed_pages: bool = False,
              progress: Progress = NO_PROGRESS):
    """A commit in two halves (see ``Store.capturing``). On entering, the
    image's changes since its parent are found and cloned into a staged
    layer: all that needs the image to hold still. Yields the
    :class:`Capture`, whose ``finish`` commits it. Nothing is committed, and
    the staged files go, if the block ends before that.

    ``checksum_image``: the chunk checksums are read from the image on
    entering (in the page cache after a step) instead of from the staged
    layer in ``finish`` (a read the image's later writes cannot disturb).

    ``only_changed_pages``: ``finish`` compares what was captured with the
    parent page by page and stores only the pages whose bytes differ (see
    ``Store.capturing``)."""
    image = os.fspath(image)
    with image_locked(image, os.O_RDONLY) as fd, store.lock.shared():
        capture = Capture(store, fd, image, parent, imported)
        capture.only_changed_pages = only_changed_pages
        try:
            capture.take(written, checksum_image, progress)
            yield capture
        finally:
            capture.discard()


class Capture:
    """The first half of a commit: an image's changes cloned into a staged
    layer (see :func:`capturing`)."""

    def __init__(self, store: StoreState, fd: int, image: str, parent: str | None,
                 imported: Snapshot | None):
        self.store, self.fd, self.image, self.imported = store, fd, image, imported
        known, state = store.lineage(image)
        if state == "restoring":
            raise StoreError(f"{image} was being restored when that was interrupted; "
                             f"finish with: blockdiff restore --store {store.root} {known} "
                             f"{image}")
        parent = parent if parent is not None else known
        self.parent = None if parent is None else store.get(parent)
        self.parent_map = None if self.parent is None else store.load_map(self.parent)
        # The parent's extent map as it holds on this host (a shared store's
        # may hold elsewhere only: blockdiff.store.views), else None.
        self.basis = (None if self.parent is None
                      else host_extents(store, self.parent, self.parent_map))
        # Written ranges describe the change only from the snapshot the image
        # is a clean copy of, at its size.
        self._clean_copy = (self.parent is not None and self.parent.id == known
                            and state == "clean")
        self.snap_id = imported.id if imported else new_id()
        self.layer = layer_number(self.snap_id)
        self.layer_tmp: Path | None = store.object_files.staged(self.snap_id, "layer")
        # Each capture's changes and where their data went in the layer.
        self.rounds: list[tuple[RangeSet, np.ndarray]] = []
        self.record = None   # the chunk checksums, once read
        self.only_changed_pages = False
        self.compared = 0    # bytes compared with the parent's by only_changed_pages
        self.borrowed = 0    # bytes whose pieces point into another snapshot's layer
        self.lent = None     # (those ranges, their positions there, that layer)
        # The shared store lock held from the capture on keeps a removed
        # lender's layer file until the commit; the catalog refuses the
        # commit if the lender's row is gone by then (Catalog.add).
        self.snap: Snapshot | None = None
        # Called with the snapshot once committed (a shared store uploads it).
        self.on_commit = None

    @property
    def unchanged(self) -> bool:
        """Whether the image is its parent, byte for byte."""
        return (self.parent is not None and len(self.changes) == 0
                and self.emap.size == self.parent.size)

    def _data(self) -> tuple[np.ndarray, np.ndarray]:
        """``(position in the layer, length)`` of the data of every round."""
        runs = [(pos[c.kind == DATA], c.length[c.kind == DATA]) for c, pos in self.rounds]
        return (np.concatenate([r[0] for r in runs]).astype(np.uint64),
                np.concatenate([r[1] for r in runs]).astype(np.uint64))

    def _clone(self, changes: RangeSet, base: int, record: bool = False,
               progress: Progress = NO_PROGRESS) -> None:
        """A round: the image's DATA changes cloned into the staged layer from
        ``base`` on (each block-aligned, in order); with ``record``, their
        checksums read from the image first (in the page cache after a step)."""
        data_pos = fmt.layout_data(changes, version=2)
        is_data = changes.kind == DATA
        data_pos[is_data] += np.uint64(base)
        src, dst, length = changes.offset[is_data], data_pos[is_data], changes.length[is_data]
        if record:
            self.record = chunk_record(self.layer, self.fd, self.image, src, dst, length,
                                       progress=progress)
        out = (self.store.object_files.create(self.layer_tmp) if not self.rounds
               else os.open(self.layer_tmp, os.O_RDWR | os.O_CLOEXEC))
        try:
            native.transfer_ranges(self.fd, out, src, dst, length, self.layer_tmp)
        finally:
            os.close(out)
        self.rounds.append((changes, data_pos))

    def take(self, written: Written | None, checksum_image: bool, progress: Progress) -> None:
        store, fd, image = self.store, self.fd, self.image
        native.fsync(fd, image)
        size = os.fstat(fd).st_size
        if not (self._clean_copy and size == self.parent.size):
            written = None
        if self.parent is not None and self.basis is None and not store.copy_mode:
            written = None
        self.emap, self.changes = _changes(store, fd, image, size, self.parent,
                                           self.parent_map, self.basis, written)
        self._clone(self.changes, 0, record=checksum_image, progress=progress)

    def take_more(self, within: Written | None = None) -> None:
        """Capture what the image changed since it was captured (or since
        the last call), adding it to the staged layer: a capture taken while
        the image still changed, topped up once it holds still, so that the
        hold lasts only for the remainder. Needs reflink: the changes are
        found by comparing the image's extent map with the one captured.

        ``within``: ``(offsets, lengths)`` of the only ranges that changed
        (or that are to be captured: the rest of the image may go on
        changing), which are then the only ones mapped."""
        if self.store.copy_mode:
            raise Unsupported("a capture is topped up by extent maps, which need reflink")
        fd, image = self.fd, self.image
        if os.fstat(fd).st_size != self.emap.size:
            raise StoreError(f"{image} changed size while it was being committed; "
                             f"commit it again")
        # Written out, not fsynced: the extent map is then final, and the
        # layer's fsync in finish() makes the data it shares durable.
        if within is None:
            native.write_out(fd, image)
            emap = ExtentMap.of_file(fd, image, sync=False)   # written out above
            emap.check_supported(image)
            more = changed_ranges(emap, self.emap, BLOCK)
        else:
            starts, ends = normalize_ranges(*within, self.emap.size, BLOCK)
            if not len(starts):
                return
            native.write_out(fd, image, int(starts[0]), int(ends[-1] - starts[0]))
            fresh = native.fiemap_ranges(fd, starts, ends, image)
            emap, (now, before) = remap(self.emap, starts, ends, fresh)
            now.check_supported(image)
            more = changed_ranges(now, before, BLOCK)
        self.emap = emap
        if not len(more):
            return
        pos, length = self._data()
        used = int((pos + length).max()) if len(pos) else 0
        if used % BLOCK:
            more = _with_short_tail(more, emap.size)
        self._clone(more, -(-used // BLOCK) * BLOCK)   # behind what the layer holds
        self.record = None   # the checksums are read back from the layer
        starts, ends = union(np.concatenate((self.changes.offset, more.offset)),
                             np.concatenate((self.changes.offset + self.changes.length,
                                             more.offset + more.length)))
        self.changes = RangeSet(starts, ends - starts, np.full(len(starts), DATA, np.uint8))

    def finish(self, *, message: str = "", meta: dict | None = None,
               ttl: float | None = None, borrow_from: Snapshot | None = None) -> Snapshot:
        """Commit what was captured: the snapshot, in the catalog.

        ``borrow_from`` (with ``only_changed_pages``): a snapshot of another
        image whose own layer may hold some of the changed pages, byte for
        byte (a VM's disk blocks in its page cache). Those pages are then
        not stored again: their pieces point into that layer, and the image
        is made to share its blocks (see ``_keep_changed_pages``)."""
        if self.snap is not None or self.layer_tmp is None:
            raise StoreError(f"the capture of {self.image} was finished or discarded already")
        if ttl is not None:
            ttl = check_duration(ttl, "ttl")
        store, parent_snap, parent_map = self.store, self.parent, self.parent_map
        changes, emap, layer, snap_id = self.changes, self.emap, self.layer, self.snap_id
        parent = None if parent_snap is None else parent_snap.id
        layer_tmp = self.layer_tmp
        map_tmp = store.object_files.staged(snap_id, "map")
        layer_path = store.layer_path(layer)
        placed: list[Path] = []
        try:
            if self.only_changed_pages:
                self._keep_changed_pages(borrow_from)
                changes, emap = self.changes, self.emap
            with open(layer_tmp, "rb") as out:
                if self.record is None:
                    pos, length = self._data()
                    self.record = chunk_record(layer, out.fileno(), layer_tmp, pos, pos,
                                               length)
                native.fsync(out.fileno(), layer_tmp)
            pieces = None if parent_map is None else parent_map.pieces
            for round_changes, data_pos in self.rounds:
                pieces = overlay(pieces, round_changes, data_pos, layer, emap.size)
            if self.lent is not None:
                lent, lent_pos, lender_layer = self.lent
                pieces = overlay(pieces, lent, lent_pos, lender_layer, emap.size)
            smap = SnapshotMap(pieces, emap, layer)
            delta = None
            # A delta takes the parent's extents outside the change: only
            # where they are the ones that hold here.
            if (parent_map is not None and self.basis is parent_map.extents
                    and parent_map.chain + 1 < MAP_CHAIN):
                delta = delta_on(parent, parent_map, changes, emap.size)
                smap.chain = parent_map.chain + 1
            raw = encode_map(smap, delta)
            store.object_files.write(map_tmp, raw)
            digest = hashlib.sha256(raw).hexdigest()
            snap = Snapshot(0, snap_id, parent, time.time(), message, meta or {},
                            emap.size, changes.bytes_of(DATA) + changes.bytes_of(ZERO),
                            len(changes), None if ttl is None else time.time() + ttl,
                            digest, None if delta is None else parent)
            imported = self.imported
            if imported:
                snap.created, snap.message = imported.created, imported.message
                snap.meta, snap.expires = imported.meta, imported.expires
            store.object_files.place(layer_tmp, layer_path, placed)
            self.layer_tmp = None
            store.object_files.place(map_tmp, store.map_path(snap), placed)
            store.object_files.sync()
            self.record.stat = file_identity(layer_path)
            try:
                with store.catalog.transaction() as db:
                    if imported and (store.catalog.retired(snap_id)
                                     or store.catalog.layer(layer) is not None):
                        raise StoreError(f"snapshot {snap_id} was in this store before; "
                                         f"it cannot come back under the same id")
                    # An import may come before its owner (the link is by id).
                    owner = None if imported else owner_of(snap)
                    snap.seq = store.catalog.add(
                        db, snap, np.unique(pieces.layer), self.record,
                        needed=((borrow_from.id,) if self.lent is not None else ())
                        + ((owner,) if owner else ()))
            except ConstraintFailed as e:   # its parent, lender or owner was removed meanwhile
                raise StoreError(f"cannot commit {self.image}: {e}; commit it again") from None
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                map_tmp.unlink()
            store.object_files.unplace(lambda: store.catalog.get(snap_id) is not None, placed)
            raise
        set_lineage(self.fd, store.id, snap_id, "clean")
        store.maps.remember(digest, smap)
        self.snap = snap
        if self.on_commit is not None:
            self.on_commit(snap)
        return snap

    def _keep_changed_pages(self, lender: Snapshot | None) -> None:
        """Leave out of the staged layer every page whose bytes are the
        parent's, or are in the own layer of ``lender``: the rounds become
        one, of the pages stored, in a new layer cloned from the old one, and
        the changes are the pages that differ from the parent.

        The pages left out keep the parent's pieces and extents. Not the
        image's: their blocks are in no layer now, so the image writes them
        in place, which only a change of extent would have shown; recorded
        as the parent's, they count as changed again at the next commit.

        A page found in the lender's layer takes a piece there and the
        lender's extent, and the image shares the lender's block from then
        on (the kernel dedupes it, having compared the bytes under its
        locks), so that a later write moves it as any other. Should the
        image have written the page meanwhile, its block is another than the
        one recorded, and the next commit sees it."""
        if self.parent is None or self.basis is None or not self.rounds:
            return
        page, kind, pos, length = _final_pages(self.rounds)
        same = np.zeros(len(page), bool)
        # A short last page is kept as it is.
        at = np.flatnonzero(length == BLOCK)
        for first in range(0, len(at), COMPARED_PAGES):   # bounded buffers
            part = at[first:first + COMPARED_PAGES]
            same[part] = _same_as_parent(self.store, self.parent_map, self.layer_tmp,
                                         page[part], pos[part], kind[part] == ZERO)
        self.compared = len(at) * BLOCK
        lent = np.zeros(len(page), bool)
        lent_pos = np.zeros(len(page), np.uint64)
        if lender is not None:
            candidates = np.flatnonzero(~same & (kind == DATA) & (length == BLOCK))
            found, where = _in_layer_of(self.store, lender, self.layer_tmp, pos[candidates])
            lent[candidates[found]], lent_pos[candidates[found]] = True, where[found]
        if not same.any() and not lent.any():
            return
        differ = ~same
        stored = differ & ~lent
        kept, first = _runs(page[stored], kind[stored], pos[stored], length[stored])
        spos = pos[stored][first]
        data_pos = fmt.layout_data(kept, version=2)
        is_data = kept.kind == DATA
        fresh = self.store.object_files.staged(self.snap_id, "pages")
        out = self.store.object_files.create(fresh)
        b = np.uint64(BLOCK)
        try:
            with open(self.layer_tmp, "rb") as old:
                src = spos[is_data]
                # Whole blocks, so that even the image's short last page is
                # cloned (a partial block clones only at both files' ends).
                span = np.minimum((kept.length[is_data] + b - np.uint64(1)) // b * b,
                                  np.uint64(os.fstat(old.fileno()).st_size) - src)
                _, cloned = native.transfer_ranges(old.fileno(), out, src, data_pos[is_data],
                                                   span, fresh)
        except BaseException:
            os.close(out)
            fresh.unlink()
            raise
        os.close(out)
        if cloned != len(src):
            # A copied block is the image's alone, which writes it in place
            # where no change of extent shows: keep the layer as it is.
            fresh.unlink()
            return
        starts, ends = kept.offset, kept.offset + kept.length
        inside, _ = partition(self.emap, starts, ends)
        emap, _ = remap(self.basis, starts, ends, inside, size=self.emap.size)
        if lent.any():
            ranges, first = _runs(page[lent], kind[lent], lent_pos[lent], length[lent])
            lender_layer = self.store.load_map(lender).own_layer
            emap = self._share_lent(lender_layer, ranges, lent_pos[lent][first], emap)
            self.lent = (ranges, lent_pos[lent][first], lender_layer)
            self.borrowed = ranges.bytes_of(DATA)
        os.replace(fresh, self.layer_tmp)
        self.rounds = [(kept, data_pos)]
        self.record = None   # read back from the new layer
        self.emap = emap
        self.changes, _ = _runs(page[differ], kind[differ], None, length[differ])

    def _share_lent(self, lender_layer: int, ranges: RangeSet, lent_pos: np.ndarray,
                    emap: ExtentMap) -> ExtentMap:
        """Have the image share the blocks of ``ranges`` that the lender's
        layer ``lender_layer`` holds at ``lent_pos``; returns ``emap`` with the lender's extents
        there. Also where the image wrote a page before it could share it:
        an extent map may name only blocks that hold the snapshot's bytes
        (an in-place restore skips a page whose block is the one named), and
        the image's block there is another, so the next commit sees it."""
        path = self.store.layer_path(lender_layer)
        b = np.uint64(BLOCK)
        with open(path, "rb") as src:
            native.dedupe_ranges(src.fileno(), self.fd, lent_pos, ranges.offset,
                                 ranges.length, self.image)
            which, within = _by_page(ranges.length)
            offset = ranges.offset[which] + within * b   # sorted
            theirs = lent_pos[which] + within * b        # some may repeat
            unique = np.unique(theirs)
            starts, ends = union(unique, unique + b)
            logical, physical, length, flags = native.fiemap_ranges(src.fileno(), starts, ends,
                                                                    path)
        # Each page's block in the layer, at the page's offset in the image.
        ext = np.searchsorted(logical, theirs, side="right") - 1
        found = ext >= 0
        found[found] = theirs[found] < logical[ext[found]] + length[ext[found]]
        if not found.all():   # the layer holds data there: it was read above
            raise Damaged(f"layer {path} has no extent for a page it was read from")
        fresh = (offset, physical[ext] + (theirs - logical[ext]), np.full(len(offset), b),
                 flags[ext])
        emap, _ = remap(emap, offset, offset + b, fresh, size=emap.size)
        return emap

    def discard(self) -> None:
        """The staged layer of a capture never finished goes."""
        if self.layer_tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                self.layer_tmp.unlink()
            self.layer_tmp = None


def _with_short_tail(changes: RangeSet, size: int) -> RangeSet:
    """The changes with the image's short last block as data. A layer that
    ends in that block, cloned from the image, has it shared only while
    nothing is cloned behind it: the kernel first zeroes the rest of the
    block, which copies it, and the image's then is its own, written in
    place where no change of extent shows. Taken again, last, it is shared
    once more."""
    tail = size // BLOCK * BLOCK
    if len(changes) and int(changes.offset[-1] + changes.length[-1]) == size \
            and changes.kind[-1] == DATA and int(changes.offset[-1]) <= tail:
        return changes
    keep = changes.offset < np.uint64(tail)
    offset, length, kind = changes.offset[keep], changes.length[keep], changes.kind[keep]
    length = np.minimum(length, np.uint64(tail) - offset)
    return RangeSet(np.append(offset, np.uint64(tail)), np.append(length, np.uint64(size - tail)),
                    np.append(kind, np.uint8(DATA)))


def _runs(page: np.ndarray, kind: np.ndarray, pos: np.ndarray | None,
          length: np.ndarray) -> tuple[RangeSet, np.ndarray]:
    """Sorted pages as ranges: one per run of consecutive pages of one kind
    (whose data, with ``pos``, also runs on), and each range's first page."""
    b = np.uint64(BLOCK)
    cut = np.ones(len(page), bool)
    cut[1:] = (page[1:] != page[:-1] + 1) | (kind[1:] != kind[:-1])
    if pos is not None:
        cut[1:] |= (kind[1:] == DATA) & (pos[1:] != pos[:-1] + b)
    first = np.flatnonzero(cut)
    if not len(page):
        return RangeSet.empty(), first
    return RangeSet(page[first] * b, np.add.reduceat(length, first).astype(np.uint64),
                    kind[first]), first


def _by_page(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For ranges of ``lengths`` bytes, each starting at a page: the range
    each of their pages is in, and the page's number within it."""
    counts = ((lengths + np.uint64(BLOCK - 1)) // np.uint64(BLOCK)).astype(np.int64)
    which = np.repeat(np.arange(len(lengths)), counts)
    within = np.arange(int(counts.sum()), dtype=np.uint64) - np.repeat(
        (np.cumsum(counts) - counts).astype(np.uint64), counts)
    return which, within


def _final_pages(rounds) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(page number, kind, position in the layer, bytes)`` of every page
    the rounds of a capture change, sorted, each as its last round leaves it
    (the image's last page may be short)."""
    b = np.uint64(BLOCK)
    pages, kinds, positions, lengths, order = [], [], [], [], []
    for r, (changes, data_pos) in enumerate(rounds):
        which, within = _by_page(changes.length)
        pages.append(changes.offset[which] // b + within)
        kinds.append(changes.kind[which])
        positions.append(data_pos.astype(np.uint64)[which] + within * b)
        lengths.append(np.minimum(changes.length[which] - within * b, b))
        order.append(np.full(len(which), r))
    page, kind, pos, length = (np.concatenate(x) for x in (pages, kinds, positions, lengths))
    by = np.lexsort((np.concatenate(order), page))
    page, kind, pos, length = page[by], kind[by], pos[by], length[by]
    last = np.ones(len(page), bool)
    last[:-1] = page[1:] != page[:-1]
    return page[last], kind[last], pos[last], length[last]


def _read_pages(path: Path, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 4 KiB pages of a file at ``positions``, one native call, and
    which of them the file holds whole (the rest read short, as zeros)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        raw = native.read_blocks(f.fileno(), positions, BLOCK, path)
    return (np.frombuffer(raw, np.uint8).reshape(-1, BLOCK),
            positions + np.uint64(BLOCK) <= np.uint64(size))


def _same_as_parent(store: StoreState, parent_map: SnapshotMap, layer_path: Path,
                    page: np.ndarray, pos: np.ndarray, zero: np.ndarray) -> np.ndarray:
    """Which of the pages (sorted numbers; zeros where ``zero``, else their
    data at ``pos`` in the layer at ``layer_path``) hold the parent's bytes,
    read from its layers. A page the parent's layers do not hold whole here
    (a shared store's layer held elsewhere, a short layer, a piece that is
    not whole pages) counts as different."""
    b = np.uint64(BLOCK)
    n = len(page)
    new = np.zeros((n, BLOCK), np.uint8)
    old = np.zeros((n, BLOCK), np.uint8)
    known = np.ones(n, bool)
    data = np.flatnonzero(~zero)
    new[data], known[data] = _read_pages(layer_path, pos[data])
    # The parent's pieces over runs of consecutive pages, page by page.
    run = np.flatnonzero(np.r_[True, page[1:] != page[:-1] + 1])
    ends = np.append(run[1:], n)
    pieces, _ = pieces_within(parent_map.pieces, page[run] * b, (page[ends - 1] + 1) * b)
    which, within = _by_page(pieces.length)
    row = np.searchsorted(page, pieces.offset[which] // b) + within.astype(np.int64)
    whole = ((pieces.offset % b == 0) & (pieces.length % b == 0))[which]
    known[row[~whole]] = False
    row, which, within = row[whole], which[whole], within[whole]
    layer = pieces.layer[which]
    at = pieces.pos[which] + within * b
    for each in np.unique(layer):
        mine = layer == each
        try:
            old[row[mine]], held = _read_pages(store.layer_path(int(each)), at[mine])
        except FileNotFoundError:   # a shared store's layer held elsewhere
            held = np.zeros(int(mine.sum()), bool)
        known[row[mine][~held]] = False
    return known & (new == old).all(axis=1)


def _in_layer_of(store: StoreState, lender: Snapshot, layer_path: Path,
                 positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Which of the pages at ``positions`` in the staged layer at
    ``layer_path`` are, byte for byte, whole pages of ``lender``'s own layer,
    and where there: matched by CRC32C, then compared."""
    none = np.zeros(len(positions), bool), np.zeros(len(positions), np.uint64)
    lender_map = store.load_map(lender)
    pieces = lender_map.pieces
    own = pieces.layer == lender_map.own_layer
    if not len(positions) or not own.any():
        return none
    b = np.uint64(BLOCK)
    which, within = _by_page(pieces.length[own])
    whole = pieces.length[own][which] - within * b >= b
    theirs = (pieces.pos[own][which] + within * b)[whole & (pieces.pos[own][which] % b == 0)]
    if not len(theirs):
        return none
    page_length = np.full(len(theirs), b, np.uint64)
    lender_path = store.layer_path(lender_map.own_layer)
    try:
        with open(lender_path, "rb") as f:
            their_crcs = native.chunk_crcs(f.fileno(), theirs, page_length, BLOCK, lender_path)
    except OSError:   # held elsewhere, or unreadable: nothing is borrowed from it
        return none
    with open(layer_path, "rb") as f:
        our_crcs = native.chunk_crcs(f.fileno(), positions,
                                     np.full(len(positions), b, np.uint64), BLOCK, layer_path)
    order = np.argsort(their_crcs, kind="stable")
    their_crcs, theirs = their_crcs[order], theirs[order]
    at = np.minimum(np.searchsorted(their_crcs, our_crcs), len(theirs) - 1)
    match = np.flatnonzero(their_crcs[at] == our_crcs)
    if not len(match):
        return none
    ours, held = _read_pages(layer_path, positions[match])
    lent, held_too = _read_pages(lender_path, theirs[at[match]])
    equal = held & held_too & (ours == lent).all(axis=1)
    found, where = none
    found[match[equal]] = True
    where[match[equal]] = theirs[at[match[equal]]]
    return found, where


def _changes(store: StoreState, fd: int, image: str, size: int, parent_snap: Snapshot | None,
             parent_map: SnapshotMap | None, basis: ExtentMap | None,
             written: Written | None):
    """``(extent map, changed ranges)`` of an fsynced image against its
    parent: from the ranges ``written`` since the parent, if given, else from
    the whole image's extent map compared with ``basis``, the parent's extent
    map where it holds here (or from the contents, without reflink or without
    such a map)."""
    if store.copy_mode:
        emap = ExtentMap.from_arrays([], [], [], [], size)
        with materialized(store, parent_snap) as parent_copy:
            return emap, compare_with_file(fd, image, parent_copy)
    if native.fs_info(fd, image)[2] != os.stat(store.objects).st_dev:
        raise Unsupported(f"{image} is not on the store's filesystem; keep images "
                          f"beside the store ({store.root}) so snapshots are "
                          f"reflinks")
    if parent_snap is not None and basis is None:
        return _changes_by_contents(store, fd, image, size, parent_snap, parent_map)
    if written is not None:
        starts, ends = normalize_ranges(*written, size, BLOCK)
        fresh = native.fiemap_ranges(fd, starts, ends, image)  # fsynced by the caller
        emap, (now, before) = remap(basis, starts, ends, fresh)
        now.check_supported(image)
        return emap, changed_ranges(now, before, BLOCK)
    emap = ExtentMap.of_file(fd, image, sync=False)  # fsynced by the caller
    emap.check_supported(image)
    return emap, changed_ranges(emap, basis, BLOCK)


def _changes_by_contents(store: StoreState, fd: int, image: str, size: int,
                         parent_snap: Snapshot, parent_map: SnapshotMap):
    """The changes of an image whose parent has no extent map that holds on
    this host: found by comparing contents with the parent rebuilt from this
    host's layers. The unchanged ranges are then cloned in again from those
    layers (the same bytes), so that the image shares their blocks and the
    extent map this commit records holds here from now on."""
    with materialized(store, parent_snap) as parent_copy:
        changes = compare_with_file(fd, image, parent_copy)
    # The ranges between the changes (which come sorted and apart).
    starts = np.concatenate(([0], changes.offset + changes.length)).astype(np.uint64)
    ends = np.concatenate((changes.offset, [size])).astype(np.uint64)
    keep = ends > starts
    pieces, (hole_start, hole_end) = pieces_within(parent_map.pieces, starts[keep], ends[keep])
    # The commit holds the image open to read; this needs to write.
    writable = os.open(image, os.O_RDWR | os.O_CLOEXEC)
    try:
        store.layers.fill(writable, image, pieces)
        native.zero_ranges(writable, hole_start, hole_end - hole_start, image)
        native.fsync(writable, image)
    finally:
        os.close(writable)
    emap = ExtentMap.of_file(fd, image, sync=False)
    emap.check_supported(image)
    return emap, changes


def restore(store: StoreState, snapshot_id: str, image: str | os.PathLike, *,
            written: Written | None = None, progress: Progress = NO_PROGRESS) -> RestoreResult:
    """See ``Store.restore``."""
    image = os.fspath(image)
    # A dangling link counts as there: it is refused, not written through.
    exists = os.path.lexists(image)
    elsewhere = exists and not os.path.islink(image) and (
        store.copy_mode or os.stat(image).st_dev != os.stat(store.objects).st_dev)
    if not exists or elsewhere:
        return _fork(store, snapshot_id, image, progress)
    return _restore_in_place(store, snapshot_id, image, written, progress)


def _fork(store: StoreState, snapshot_id: str, image: str, progress: Progress) -> RestoreResult:
    """Build an image of the snapshot whole and rename it over ``image``."""
    # Physical addresses compare only within one filesystem (and mean
    # nothing without reflink): such an image is rebuilt whole and
    # renamed over, never patched.
    with store.lock.shared():
        snap = store.get(snapshot_id)
        smap = store.load_map(snap)
        fetched = store.layers.ensure_local(np.unique(smap.pieces.layer))
        checked = store.layers.check_pieces(snap, smap.pieces, whole=True, progress=progress)
        with files.atomic_output(image) as (fd, temp):
            native.truncate(fd, snap.size, temp)
            store.layers.fill(fd, temp, smap.pieces)
            if host_extents(store, snap, smap) is None:
                record_view(store, snap, smap, fd, temp)
            set_lineage(fd, store.id, snap.id, "clean")
    return RestoreResult(snap.id, image, len(smap.pieces),
                         int(smap.pieces.length.sum()), forked=True,
                         checked_bytes=checked, fetched_bytes=fetched)


def _restore_in_place(store: StoreState, snapshot_id: str, image: str,
                      written: Written | None, progress: Progress) -> RestoreResult:
    """Rewrite only the ranges where ``image`` differs from the snapshot. An
    image of no snapshot (a new, empty one: a VM's fork filled in place) is
    checked as a fork is, its layers whole unless vouched for, a phase of
    ``progress``."""
    with image_locked(image, os.O_RDWR) as fd, store.lock.shared():
        snap = store.get(snapshot_id)
        smap = store.load_map(snap)
        known, state = store.lineage(image)
        size = os.fstat(fd).st_size
        from_snap = store.get(known) if known is not None else None
        # Extent maps compare only where they hold on this host
        # (blockdiff.store.views); without them the image is rewritten whole.
        target_extents = host_extents(store, snap, smap)
        from_extents = None
        if written is not None and from_snap is not None and state == "clean":
            from_extents = host_extents(store, from_snap)
        whole = target_extents is None
        tracked = (not whole and from_extents is not None
                   and from_snap.size == size == snap.size)
        if whole:
            starts, ends = np.zeros(1, np.uint64), np.full(1, snap.size, np.uint64)
        elif tracked:
            # The image is its lineage snapshot except where it was written.
            between = changed_ranges(target_extents, from_extents, BLOCK)
            starts, ends = normalize_ranges(*written, size, BLOCK)
            starts, ends = union(np.concatenate((between.offset, starts)),
                                 np.concatenate((between.offset + between.length, ends)))
            ends = np.minimum(ends, np.uint64(size))   # never past the end of the file
        else:
            native.write_out(fd, image)   # its extent map final; nothing to make durable
            current = ExtentMap.of_file(fd, image, sync=False)  # written out above
            differ = changed_ranges(target_extents, current, BLOCK)
            starts, ends = differ.offset, differ.offset + differ.length
            if not len(starts) and (known, state, size) == (snap.id, "clean", snap.size):
                # Already the snapshot, by its extents: nothing to write or
                # make durable (a VM's spare at its fork's checkpoint).
                return RestoreResult(snap.id, image, 0, 0, forked=False)
        # Within the ranges that differ, the snapshot's pieces are cloned
        # in and the rest, its zeros, punched; checked before anything is.
        pieces, (hole_start, hole_end) = pieces_within(smap.pieces, starts, ends)
        fetched = store.layers.ensure_local(np.unique(pieces.layer))
        checked = store.layers.check_pieces(snap, pieces, whole=known is None,
                                            progress=progress)
        # Marked first: a crash half-way leaves an image commit refuses.
        set_lineage(fd, store.id, snap.id, "restoring")
        if not tracked:
            native.truncate(fd, snap.size, image)
        store.layers.fill(fd, image, pieces)
        native.zero_ranges(fd, hole_start, hole_end - hole_start, image)
        native.fsync(fd, image)
        if whole:
            record_view(store, snap, smap, fd, image)
        set_lineage(fd, store.id, snap.id, "clean")
    return RestoreResult(snap.id, image, len(starts), int((ends - starts).sum()),
                         forked=False, tracked=tracked, checked_bytes=checked,
                         fetched_bytes=fetched)


def unlike(store: StoreState, snapshot_id: str, image: str | os.PathLike) -> int | None:
    """Bytes of ``image`` (a copy of the snapshot that no one should write:
    a VM's standby or spare) whose extents are not the snapshot's: written
    since, or never the snapshot's (compared as an in-place restore does;
    see blockdiff.store.views). None where no extent map of the snapshot
    holds on this host (a restore then rewrites the image whole)."""
    image = os.fspath(image)
    if store.copy_mode:
        return None     # no shared blocks: extents say nothing of contents
    with store.lock.shared():
        snap = store.get(snapshot_id)
        target = host_extents(store, snap)
        if target is None:
            return None
        fd = os.open(image, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            native.write_out(fd, image)   # its extent map final
            current = ExtentMap.of_file(fd, image, sync=False)
        finally:
            os.close(fd)
    if current.size != snap.size:
        return max(current.size, snap.size)
    return int(changed_ranges(target, current, BLOCK).length.sum())


@contextlib.contextmanager
def materialized(store: StoreState, snap: Snapshot | None, *,
                 on: tuple[Snapshot, Path] | None = None, progress: Progress = NO_PROGRESS):
    """A temporary full image of a snapshot in the staging area (None: no
    file), checked like a fork. With ``on`` (an ancestor and its
    materialized image), it is a reflink copy of that image with only the
    ranges where the two snapshots hold other bytes rewritten, so that the
    two files share every block they have in common. The check is a phase
    of ``progress``."""
    if snap is None:
        yield None
        return
    path = store.object_files.staged(snap.id, f"{os.urandom(4).hex()}.img")
    try:
        smap = store.load_map(snap)
        store.layers.ensure_local(np.unique(smap.pieces.layer))
        store.layers.check_pieces(snap, smap.pieces, whole=True, progress=progress)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            if on is None:
                native.truncate(fd, snap.size, path)
                store.layers.fill(fd, str(path), smap.pieces)
            else:
                base, base_path = on
                with open(base_path, "rb") as src:
                    files.clone_or_copy(src.fileno(), fd, base.size, str(path))
                native.truncate(fd, snap.size, path)
                differ = differences(store, base, snap)
                pieces, (hole_start, hole_end) = pieces_within(
                    smap.pieces, differ.offset, differ.offset + differ.length)
                store.layers.fill(fd, str(path), pieces)
                native.zero_ranges(fd, hole_start, hole_end - hole_start, path)
        finally:
            os.close(fd)
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def differences(store: StoreState, a: Snapshot, b: Snapshot) -> RangeSet:
    """The ranges where snapshot ``b`` holds other bytes than ``a``."""
    if store.copy_mode:
        with store.lock.shared(), materialized(store, b) as path_b, \
                materialized(store, a) as path_a:
            with open(path_b, "rb") as f:
                return compare_with_file(f.fileno(), str(path_b), path_a)
    # Pieces, not physical addresses: compaction moves data, not content.
    layers = store.layers
    map_a, map_b = store.load_map(a), store.load_map(b)
    return differing_pieces(layers.canonical(map_a.pieces), layers.canonical(map_b.pieces))
