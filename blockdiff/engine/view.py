"""Descriptions of diffs and extent maps for ``blockdiff view``.

``describe`` returns plain data (for ``--json``); ``render`` turns it into
text. Neither prints.
"""

from __future__ import annotations

import os

import numpy as np

from blockdiff import native
from blockdiff.engine import diff as engine
from blockdiff.engine import formats as fmt
from blockdiff.engine.extents import DATA, ZERO
from blockdiff.engine.units import human_size

# Ranges shown on each side of the one containing the requested offset.
CONTEXT = 3


def _is_diff(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(len(fmt.MAGIC_PREFIX)) == fmt.MAGIC_PREFIX or path.endswith(".bdiff")


def _window(starts: np.ndarray, lengths: np.ndarray, around: int | None):
    """Indices to show, and the index containing ``around`` (or None)."""
    if around is None:
        return range(len(starts)), None
    if not 0 <= around < 1 << 64:
        return range(0), None        # no file has such an offset
    hit = np.flatnonzero((starts <= np.uint64(around)) & (starts + lengths > np.uint64(around)))
    if not len(hit):
        return range(0), None
    i = int(hit[0])
    return range(max(0, i - CONTEXT), min(len(starts), i + CONTEXT + 1)), i


def describe(path: str | os.PathLike, around: int | None = None) -> dict:
    """A dict describing a diff (header and ranges) or a raw file's extent map."""
    path = os.fspath(path)
    if _is_diff(path):
        return _describe_diff(path, around)
    return _describe_map(path, around)


def _describe_diff(path: str, around: int | None) -> dict:
    h = engine.read_diff(path)
    form = fmt.of(h)
    r = h.ranges
    shown, hit = _window(r.offset, r.length, around)
    ranges = []
    for i in shown:
        entry = {"index": i, "offset": int(r.offset[i]), "length": int(r.length[i]),
                 "kind": "data" if r.kind[i] == DATA else "zero"}
        if r.kind[i] == DATA:
            entry["data_offset"] = h.data_offset + int(h.data_pos[i])
            if h.crc is not None:
                entry["crc32c"] = f"{int(h.crc[i]):08x}"
        ranges.append(entry)
    report = {
        "type": "diff", "path": path, "format": form.label,
        "target_size": h.target_size, "base_size": h.base_size, "has_base": h.has_base,
        "range_count": len(r), "data_bytes": r.bytes_of(DATA),
        "zero_bytes": r.bytes_of(ZERO), "data_offset": h.data_offset,
        "around": around, "containing": hit, "ranges": ranges,
    }
    if form.records_base_identity:
        report.update(base_fingerprint=h.base_fingerprint.hex(),
                      base_id=None if h.base_id == fmt.NO_ID else h.base_id.hex(),
                      target_id=None if h.target_id == fmt.NO_ID else h.target_id.hex())
    return report


def _flag_names(flags: int) -> list[str]:
    return [name for bit, name in native.EXTENT_FLAG_NAMES.items() if flags & bit]


def _describe_map(path: str, around: int | None) -> dict:
    m = engine.map_file(path)
    shown, hit = _window(m.logical, m.length, around)
    return {
        "type": "extent_map", "path": path, "size": m.size, "extent_count": len(m),
        "mapped_bytes": int(m.length.sum(dtype=np.uint64)),
        "around": around, "containing": hit,
        "extents": [{"index": i, "logical": int(m.logical[i]), "physical": int(m.physical[i]),
                     "length": int(m.length[i]), "flags": _flag_names(int(m.flags[i]))}
                    for i in shown],
    }


def _no_match(report: dict, what: str) -> list[str]:
    if report["around"] is not None and report["containing"] is None:
        return [f"  no {what} contains offset {report['around']:#x}"]
    return []


def render(report: dict) -> str:
    """Human-readable text for a ``describe`` result."""
    if report["type"] == "diff":
        lines = [f"Diff: {report['path']}",
                 f"Format: {report['format']}",
                 f"Target size: {human_size(report['target_size'])} "
                 f"({report['target_size']} bytes)",
                 f"Base size: {human_size(report['base_size'])} ({report['base_size']} bytes)"
                 + ("" if report["has_base"] else " (no base)")]
        if "base_fingerprint" in report:
            lines += [f"Base fingerprint: {report['base_fingerprint']}",
                      f"Base snapshot: {report['base_id'] or 'unknown'}",
                      f"Target snapshot: {report['target_id'] or 'unknown'}"]
        lines += [f"Ranges: {report['range_count']}",
                  f"Data: {human_size(report['data_bytes'])}, "
                  f"zeros: {human_size(report['zero_bytes'])}",
                  "", "Ranges:"]
        for e in report["ranges"]:
            mark = ">" if e["index"] == report["containing"] else " "
            extra = f" crc32c={e['crc32c']}" if "crc32c" in e else ""
            lines.append(f" {mark}{e['index']}: offset={e['offset']:#x} length={e['length']:#x} "
                         f"({human_size(e['length'])}) {e['kind']}{extra}")
        return "\n".join(lines + _no_match(report, "range"))
    lines = [f"File: {report['path']}",
             f"Size: {human_size(report['size'])} ({report['size']} bytes)",
             f"Mapped: {human_size(report['mapped_bytes'])} in {report['extent_count']} extents",
             "", "Extents:"]
    for e in report["extents"]:
        mark = ">" if e["index"] == report["containing"] else " "
        lines.append(f" {mark}{e['index']}: logical={e['logical']:#x} physical={e['physical']:#x} "
                     f"length={e['length']:#x} ({human_size(e['length'])}) "
                     f"flags={','.join(e['flags']) or '-'}")
    return "\n".join(lines + _no_match(report, "extent"))


def render_tree(snapshots) -> str:
    """The snapshot tree as text, oldest first, branches drawn with lines."""
    children: dict[str | None, list] = {}
    for snap in sorted(snapshots, key=lambda s: s.seq):
        children.setdefault(snap.parent, []).append(snap)
    lines: list[str] = []

    def walk(snap, prefix: str, last: bool, root: bool) -> None:
        # Iterative along single-child chains so a 10,000-step line does not recurse.
        while True:
            branch = "" if root else ("└─ " if last else "├─ ")
            lines.append(f"{prefix}{branch}{snap.id}  {snap.message}".rstrip())
            prefix += "" if root else ("   " if last else "│  ")
            kids = children.get(snap.id, [])
            if len(kids) == 1:
                snap, last, root = kids[0], True, True
                continue
            for i, kid in enumerate(kids):
                walk(kid, prefix, i == len(kids) - 1, False)
            return

    roots = children.get(None, [])
    for snap in roots:
        walk(snap, "", True, True)
    return "\n".join(lines) if lines else "(no snapshots)"
