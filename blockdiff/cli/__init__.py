"""The ``blockdiff`` command line: parse, call one library function, report.

Library errors become one line on stderr and an exit status; the engine and
numpy are imported only inside the commands, so start-up stays lean.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import re
import sys

import click

_OS_HINTS = {
    errno.ENOENT: "check the path",
    errno.EACCES: "check the file's permissions or run as a user who may access it",
    errno.EPERM: "check the file's permissions and attributes",
    errno.ENOSPC: "free some space or write to another filesystem",
    errno.EDQUOT: "free some space or raise the quota",
    errno.EROFS: "write to a writable filesystem",
    errno.EISDIR: "give a file, not a directory",
    errno.EXDEV: "put both files on one filesystem",
}


def _fail(message: str, code: int) -> None:
    click.echo(f"blockdiff: error: {message}", err=True)
    sys.exit(code)


def reports_errors(command):
    """Turn library errors into one line on stderr and a non-zero exit status."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        from blockdiff.errors import BlockdiffError

        try:
            return command(*args, **kwargs)
        except BlockdiffError as e:
            _fail(str(e), e.exit_code)
        except OSError as e:
            where = f": {e.filename}" if e.filename else ""
            hint = _OS_HINTS.get(e.errno)
            _fail(f"{e.strerror or e}{where}" + (f" ({hint})" if hint else ""), 1)
        except KeyboardInterrupt:
            _fail("interrupted; nothing was left under the final name", 130)
        except Exception as e:
            # A store's catalog that SQLite cannot use (locked for too long,
            # damaged): a state to report, not a bug in blockdiff.
            sqlite3 = sys.modules.get("sqlite3")
            if sqlite3 is not None and isinstance(e, sqlite3.Error):
                _fail(f"the store's catalog: {e}; check the store with: blockdiff verify", 13)
            raise

    return wrapper


# What a terminal acts on instead of showing: C0 controls, DEL, C1 controls,
# line and paragraph separators, and the bidirectional marks and overrides
# that reorder what is shown.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e"
                          "\u2066-\u2069]")
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match) -> str:
    char = match.group()
    code = ord(char)
    return _ESCAPES.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def _printable(value) -> str:
    """``value`` as text to print for a human: every character a terminal
    would act on (a newline, an escape sequence) written as an escape
    (``\\n``, ``\\x1b``, ``\\u2028``), so that a stored message, name or meta
    value cannot clear the screen, retitle the window or fake lines of
    output. Used wherever human output shows stored strings; ``--json``
    output needs no escaping beyond JSON's own."""
    return _UNPRINTABLE.sub(_escape, "-" if value is None else str(value))


def _notes(notes) -> None:
    for note in notes:
        click.echo(f"blockdiff: note: {note}", err=True)


def _json_value(value):
    """What json cannot write itself: numpy numbers (counts from arrays)."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _emit_json(value) -> None:
    """The one way a command writes its --json output: one JSON document on
    stdout and nothing else there (notes and errors go to stderr). The shape
    of each command's document is in docs/cli.md."""
    click.echo(json.dumps(value, indent=2, default=_json_value))


def json_option(command):
    """The --json option of a command whose output a program may read."""
    return click.option("--json", "as_json", is_flag=True,
                        help="Print one JSON document on stdout (see docs/cli.md).")(command)


def _hex(value: str) -> int:
    try:
        return int(value, 16)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a hexadecimal offset (e.g. 0x1000)")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="blockdiff")
def main():
    """Block-level copy-on-write diffs of disk images on reflink filesystems.

    \b
    Example:
      blockdiff create step1.bdiff disk.img --base disk-step0.img
      blockdiff apply step1.bdiff restored.img --base disk-step0.img
    """


@main.command()
@click.argument("out", type=click.Path(dir_okay=False))
@click.argument("target", type=click.Path(dir_okay=False))
@click.option("--base", type=click.Path(dir_okay=False),
              help="Image to diff against; without it the diff holds TARGET's data (compaction).")
@click.option("--format", "fmt", type=click.Choice(["v1", "v2"]), default="v2", show_default=True,
              help="v2: checksums, zero ranges, base identity. v1: CognitionAI's BDIFFv1.")
@click.option("--base-digest", is_flag=True,
              help="v2: also record a digest of the whole base (read in full), which "
                   "apply --verify-base checks.")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing on success.")
@reports_errors
def create(out, target, base, fmt, base_digest, quiet):
    """Write a diff of TARGET against BASE to OUT.

    Changed blocks are found from the filesystem's extent maps and reflinked
    into OUT, so this takes milliseconds on XFS or btrfs.

    \b
    Example:
      blockdiff create step1.bdiff disk.img --base disk-step0.img
    """
    from blockdiff.engine.diff import create_diff
    from blockdiff.engine.view import human_size as _size

    result = create_diff(out, target, base, format=fmt, base_digest=base_digest)
    _notes(result.notes)
    if not quiet:
        click.echo(f"{out}: {fmt}, {result.ranges} ranges, {_size(result.data_bytes)} data, "
                   f"{_size(result.zero_bytes)} zeros, target {_size(result.target_size)} "
                   f"({result.method}, {result.reflinked} ranges reflinked)")


@main.command()
@click.argument("diff", metavar="IN", type=click.Path(dir_okay=False))
@click.argument("target", type=click.Path(dir_okay=False))
@click.option("--base", type=click.Path(dir_okay=False),
              help="The image the diff was made against (never modified).")
@click.option("--verify-base", is_flag=True,
              help="Also read the whole base and compare it with the digest the diff records "
                   "(a diff made with create --base-digest).")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing on success.")
@reports_errors
def apply(diff, target, base, verify_base, quiet):
    """Rebuild TARGET from BASE and the diff IN.

    The diff (checksums) and the base (size, sampled fingerprint, snapshot id;
    all of it with --verify-base) are checked before anything is written;
    TARGET is replaced atomically.

    \b
    Example:
      blockdiff apply step1.bdiff restored.img --base disk-step0.img
    """
    from blockdiff.engine.diff import apply_diff
    from blockdiff.engine.view import human_size as _size

    result = apply_diff(diff, target, base, verify_base=verify_base)
    _notes(result.notes)
    if not quiet:
        click.echo(f"{target}: {_size(result.target_size)} from v{result.version} diff, "
                   f"{result.ranges} ranges ({result.reflinked} reflinked)")


@main.command()
@click.argument("path", metavar="IN", type=click.Path(dir_okay=False))
@click.argument("offset", required=False)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@reports_errors
def view(path, offset, as_json):
    """Show a diff's header and ranges, or a raw image's extent map.

    With OFFSET (hexadecimal), show only the ranges around it.

    \b
    Example:
      blockdiff view step1.bdiff
      blockdiff view disk.img 0x100000 --json
    """
    from blockdiff.engine import view as view_module

    around = None if offset is None else _hex(offset)
    report = view_module.describe(path, around)
    if as_json:
        _emit_json(report)
    else:
        click.echo(view_module.render(report))


@main.command()
@click.option("--dir", "workdir", type=click.Path(file_okay=False, exists=True),
              help="Run in this directory on a reflink filesystem instead of a scratch XFS "
                   "(which needs root and loop devices).")
@click.option("--size", default=512, show_default=True, help="Disk image size in MiB.")
@click.option("--steps", default=6, show_default=True, help="Agent steps to snapshot.")
@click.option("--no-vm", is_flag=True, help="Leave out the sandbox VM part.")
@click.option("--vm-image", type=click.Path(file_okay=False),
              help="Where the sandbox VM image is built and cached "
                   "(default: ~/.cache/blockdiff/vm-image).")
@reports_errors
def demo(workdir, size, steps, no_vm, vm_image):
    """Snapshot a disk image through agent steps, then restore, fork and move it.

    Every snapshot and restore is verified byte for byte.

    \b
    Example:
      sudo blockdiff demo --size 1024 --steps 8
    """
    from blockdiff.demo import session as demo_module

    def show(event):
        timing = f"{event.seconds * 1000:8.1f} ms" if event.seconds else " " * 11
        click.echo(f"{timing}  {event.what}" + (f"\n{'':13}{event.detail}" if event.detail else ""))

    demo_module.run(workdir, size=size * 1024 * 1024, steps=steps, vm=not no_vm,
                    vm_image=vm_image, report=show)


# ------------------------------------------------------------------ store

def store_option(command):
    """The --store option every store command takes."""
    return click.option("--store", "store_path", type=click.Path(file_okay=False),
                        envvar="BLOCKDIFF_STORE", show_envvar=True,
                        help="The snapshot store directory.")(command)


def _open_store(path, *, freeing: bool = False):
    from blockdiff.store.store import open_store

    return open_store(path, freeing=freeing)


def _duration(value: str | None, option: str = "--ttl") -> float | None:
    """'90s', '15m', '2h', '7d' or plain seconds, in seconds: finite and not negative."""
    import math

    from blockdiff.errors import UsageError

    if value is None:
        return None
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    try:
        if value[-1:] in units:
            seconds = float(value[:-1]) * units[value[-1]]
        else:
            seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0:
        raise UsageError(f"{option} {value!r} is not a duration: give a length of time that is "
                         f"not negative (e.g. 90s, 15m, 2h, 7d)")
    return seconds


def _pairs(items) -> dict[str, str]:
    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--meta")
        pairs[key] = value
    return pairs


def _written(source) -> tuple | None:
    """``--written FILE``: one ``OFFSET LENGTH`` pair (bytes, decimal) per line."""
    if source is None:
        return None
    offsets, lengths = [], []
    for number, line in enumerate(source, 1):
        fields = line.split()
        if not fields:
            continue
        try:
            offset, length = (int(f) for f in fields)
            if offset < 0 or length < 0:
                raise ValueError
        except ValueError:
            raise click.BadParameter(f"line {number} of {source.name} is not 'OFFSET LENGTH' "
                                     f"(two non-negative byte counts)", param_hint="--written")
        offsets.append(offset)
        lengths.append(length)
    return offsets, lengths


_WRITTEN_HELP = ("Ranges written to IMAGE since it was last committed or restored, one "
                 "'OFFSET LENGTH' per line ('-': stdin), as a dirty-block tracker reports "
                 "them: only those are mapped. They must cover every write.")


@main.command()
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--allow-copy", is_flag=True,
              help="On a filesystem without reflink, copy data instead (slow: every commit "
                   "reads the image and its parent in full).")
@click.option("--group", metavar="GROUP",
              help="Let this group read the store too (it is private to its owner otherwise).")
@reports_errors
def init(directory, allow_copy, group):
    """Make a snapshot store in DIRECTORY (on XFS with reflink, or btrfs).

    The store is readable by its owner only, unless --group is given.

    \b
    Example:
      blockdiff init /var/lib/sandboxes/store
    """
    from blockdiff.store.store import Store

    Store.init(directory, allow_copy=allow_copy, group=group).close()
    click.echo(f"initialised store {directory}")


@main.command()
@store_option
@click.argument("image", type=click.Path(dir_okay=False))
@click.option("--parent", help="Snapshot the image descends from (default: what it was last "
                               "committed as or restored from).")
@click.option("-m", "--message", default="", help="What this step did.")
@click.option("--meta", multiple=True, metavar="KEY=VALUE", help="Metadata; repeatable.")
@click.option("--ttl", help="Expire after this long (e.g. 30m, 2h, 7d).")
@click.option("--skip-unchanged", is_flag=True,
              help="If nothing changed since the parent, print the parent's id instead.")
@click.option("--written", type=click.File("r"), metavar="FILE", help=_WRITTEN_HELP)
@json_option
@reports_errors
def commit(store_path, image, parent, message, meta, ttl, skip_unchanged, written, as_json):
    """Snapshot IMAGE; print the new snapshot's id as the last line.

    PARENT may be given by a unique prefix of its id (at least 4 hex digits).

    \b
    Example:
      blockdiff commit --store S disk.img -m "pip install" --meta step=3
    """
    with _open_store(store_path) as store:
        before = None
        if skip_unchanged:   # what the commit compares with: its id back means unchanged
            before = store.resolve(parent) if parent is not None else store.lineage(image)[0]
        snap = store.commit(image, parent=parent, message=message, meta=_pairs(meta),
                            ttl=_duration(ttl), skip_unchanged=skip_unchanged,
                            written=_written(written))
    if as_json:
        return _emit_json(_snapshot_dict(snap) | {"unchanged": snap.id == before})
    click.echo(snap.id)


@main.command()
@store_option
@click.argument("snapshot_id", metavar="ID")
@click.argument("image", type=click.Path(dir_okay=False))
@click.option("--written", type=click.File("r"), metavar="FILE", help=_WRITTEN_HELP)
@json_option
@reports_errors
def restore(store_path, snapshot_id, image, written, as_json):
    """Make IMAGE byte-identical to snapshot ID (a new path is a fork).

    ID may be a unique prefix of the snapshot's id (at least 4 hex digits).

    \b
    Example:
      blockdiff restore --store S 3f2a9c0d1e2b4a5c disk.img
      blockdiff restore --store S 3f2a branch-b.img
    """
    with _open_store(store_path) as store:
        result = store.restore(snapshot_id, image, written=_written(written))
    if as_json:
        return _emit_json(dataclasses.asdict(result))
    if result.forked:
        click.echo(f"{image}: forked from {result.snapshot} ({result.ranges} pieces cloned)")
    else:
        click.echo(f"{image}: restored in place to {result.snapshot} "
                   f"({result.ranges} ranges rewritten)")


def _echo_records(records) -> None:
    """A list of the library's records (dataclasses) as a JSON array."""
    _emit_json([dataclasses.asdict(r) for r in records])


def _snapshot_dict(snap) -> dict:
    return {"id": snap.id, "parent": snap.parent, "created": snap.created,
            "message": snap.message, "meta": snap.meta, "size": snap.size,
            "changed_bytes": snap.changed_bytes, "ranges": snap.ranges, "expires": snap.expires}


@main.command()
@store_option
@click.argument("snapshot_id", metavar="[ID]", required=False)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@reports_errors
def log(store_path, snapshot_id, as_json):
    """The ancestry of ID (default: every snapshot), newest first.

    \b
    Example:
      blockdiff log --store S 3f2a9c0d1e2b4a5c
    """
    import time as _time

    from blockdiff.engine.view import human_size

    with _open_store(store_path) as store:
        snaps = store.log(snapshot_id)
    if as_json:
        return _emit_json([_snapshot_dict(s) for s in snaps])
    for s in snaps:
        when = _time.strftime("%Y-%m-%d %H:%M:%S", _time.localtime(s.created))
        extra = "".join(f" {_printable(k)}={_printable(v)}" for k, v in sorted(s.meta.items()))
        expiry = (f" expires {_time.strftime('%Y-%m-%d %H:%M', _time.localtime(s.expires))}"
                  if s.expires else "")
        click.echo(f"{_printable(s.id)}  parent {_printable(s.parent):16}  {when}  "
                   f"{human_size(s.changed_bytes):>10} changed{expiry}  "
                   f"{_printable(s.message)}{extra}")


@main.command()
@store_option
@reports_errors
def tree(store_path):
    """Draw the whole snapshot tree.

    \b
    Example:
      blockdiff tree --store S
    """
    from types import SimpleNamespace

    from blockdiff.engine.view import render_tree

    with _open_store(store_path) as store:
        snapshots = store.log()
    click.echo(render_tree([
        SimpleNamespace(seq=s.seq, id=_printable(s.id), message=_printable(s.message),
                        parent=None if s.parent is None else _printable(s.parent))
        for s in snapshots]))


@main.command()
@store_option
@click.argument("snapshot_id", metavar="ID")
@json_option
@reports_errors
def rm(store_path, snapshot_id, as_json):
    """Delete snapshot ID; its descendants stay restorable.

    \b
    Example:
      blockdiff rm --store S 3f2a9c0d1e2b4a5c
    """
    from blockdiff.engine.view import human_size

    with _open_store(store_path, freeing=True) as store:
        result = store.rm(snapshot_id)
    if as_json:
        return _emit_json(_removal_dict(result, dry_run=False))
    click.echo(f"removed {result.removed[0]}; its files held {human_size(result.bytes_freed)} "
               f"(blocks an image still shares stay in use)")


def _removal_dict(result, *, dry_run: bool) -> dict:
    """What rm and gc print with --json (bytes_freed is null for a dry run)."""
    return {"removed": list(result.removed),
            "reasons": {sid: result.reasons[sid] for sid in result.removed},
            "bytes_freed": None if dry_run else result.bytes_freed, "dry_run": dry_run}


@main.command()
@store_option
@click.option("--keep-last", type=click.IntRange(min=0), help="Keep the N newest snapshots.")
@click.option("--keep-within", help="Keep snapshots younger than this (e.g. 2h, 7d).")
@click.option("--dry-run", is_flag=True, help="Say what would go, remove nothing.")
@json_option
@reports_errors
def gc(store_path, keep_last, keep_within, dry_run, as_json):
    """Remove expired snapshots and those the policy does not keep.

    Without --keep-last or --keep-within only expired snapshots (TTL) go.
    Files left by interrupted operations are swept too.

    \b
    Example:
      blockdiff gc --store S --keep-last 50 --keep-within 1d
    """
    from blockdiff.engine.view import human_size
    from blockdiff.store.retention import Policy

    policy = Policy(keep_last=keep_last, keep_within=_duration(keep_within, "--keep-within"))
    with _open_store(store_path, freeing=not dry_run) as store:
        result = store.gc(policy, dry_run=dry_run)
    if as_json:
        return _emit_json(_removal_dict(result, dry_run=dry_run))
    verb = "would remove" if dry_run else "removed"
    for snapshot_id in result.removed:
        click.echo(f"{verb} {snapshot_id} ({result.reasons[snapshot_id]})")
    if dry_run and not result.removed:
        click.echo("nothing to remove")
    if not dry_run:
        click.echo(f"removed files held {human_size(result.bytes_freed)} "
                   f"(blocks an image still shares stay in use)")


@main.command()
@store_option
@click.argument("snapshot_id", metavar="[ID]", required=False)
@json_option
@reports_errors
def verify(store_path, snapshot_id, as_json):
    """Check the catalog and every checksum (of ID, or of every snapshot).

    Exits non-zero (7) and names each damaged snapshot on stderr.

    \b
    Example:
      blockdiff verify --store S
    """
    with _open_store(store_path) as store:
        problems = store.verify(snapshot_id)
    if as_json:
        _emit_json({"consistent": not problems, "problems": problems})
    if not problems:
        if not as_json:
            click.echo("store is consistent; every checksum matches")
        return
    for name, found in problems.items():
        for problem in found:
            click.echo(f"blockdiff: damaged: {name}: {problem}", err=True)
    sys.exit(7)


@main.command(name="diff")
@store_option
@click.argument("a")
@click.argument("b")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@reports_errors
def diff_command(store_path, a, b, as_json):
    """The ranges where snapshot B differs from snapshot A.

    \b
    Example:
      blockdiff diff --store S 3f2a9c0d1e2b4a5c 77e0a1b2c3d4e5f6
    """
    from blockdiff.engine.extents import DATA
    from blockdiff.engine.view import human_size

    with _open_store(store_path) as store:
        a, b = store.resolve(a), store.resolve(b)
        ranges = store.diff(a, b)
    entries = [{"offset": int(o), "length": int(n), "kind": "data" if k == DATA else "zero"}
               for o, n, k in zip(ranges.offset, ranges.length, ranges.kind)]
    total = int(ranges.length.sum())
    if as_json:
        return _emit_json({"a": a, "b": b, "bytes": total, "ranges": entries})
    for e in entries:
        click.echo(f"offset={e['offset']:#x} length={e['length']:#x} {e['kind']}")
    click.echo(f"{len(entries)} ranges, {human_size(total)} differ")


@main.command()
@store_option
@click.argument("snapshot_id", metavar="ID")
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--since", metavar="ANCESTOR",
              help="Export only what changed since this ancestor (the other host has it).")
@json_option
@reports_errors
def export(store_path, snapshot_id, out, since, as_json):
    """Write one portable file from which another store recreates ID.

    The file is a BDIFFv2 diff (of the whole image, or against ANCESTOR) with
    the snapshot's record at its end.

    \b
    Example:
      blockdiff export --store S 3f2a9c0d1e2b4a5c step7.bdx --since 77e0a1b2c3d4e5f6
    """
    from blockdiff.engine.view import human_size

    with _open_store(store_path) as store:
        snapshot_id = store.resolve(snapshot_id)
        since = None if since is None else store.resolve(since)
        result = store.export(snapshot_id, out, since)
    if as_json:
        return _emit_json({"id": snapshot_id, "since": since, "out": out,
                           "ranges": result.ranges, "data_bytes": result.data_bytes,
                           "zero_bytes": result.zero_bytes, "size": result.target_size})
    click.echo(f"{out}: {snapshot_id}, {result.ranges} ranges, {human_size(result.data_bytes)}")


@main.command(name="import")
@store_option
@click.argument("path", metavar="FILE", type=click.Path(dir_okay=False))
@json_option
@reports_errors
def import_command(store_path, path, as_json):
    """Recreate the snapshot an export FILE holds; print its id.

    The file is read and checked whole; a snapshot the store has already is
    skipped, and says so on stderr.

    \b
    Example:
      blockdiff import --store S step7.bdx
    """
    with _open_store(store_path) as store:
        result = store.import_(path)
    if result.skipped:
        click.echo(f"skipped: {result.skipped} (the export checks out)", err=True)
    if as_json:
        return _emit_json({"ids": list(result.ids), "skipped": result.skipped or None})
    for snapshot_id in result.ids:
        click.echo(snapshot_id)


@main.command()
@store_option
@click.argument("snapshot_id", metavar="ID")
@json_option
@reports_errors
def compact(store_path, snapshot_id, as_json):
    """Rewrite snapshot ID's data into one contiguous layer.

    For a snapshot forked from often whose data is scattered over many
    layers: forks of it then take a few clones instead of one per fragment.
    Restore images from it again afterwards (see docs/store.md).

    \b
    Example:
      blockdiff compact --store S 3f2a9c0d1e2b4a5c
    """
    with _open_store(store_path) as store:
        before = len(store.load_map(store.get(snapshot_id)).pieces)
        snap = store.compact(snapshot_id)
        after = len(store.load_map(snap).pieces)
    if as_json:
        return _emit_json({"id": snap.id, "pieces_before": before, "pieces_after": after})
    click.echo(f"{snap.id}: {before} pieces -> {after}")


# ------------------------------------------------------------- sandboxes

@main.group()
def vm():
    """Sandbox VMs (QEMU) whose disks are snapshotted into a store.

    \b
    Example:
      export BLOCKDIFF_STORE=/srv/sandboxes/store
      blockdiff vm build-image /srv/sandboxes/image
      blockdiff vm create box --image /srv/sandboxes/image/rootfs.img
      blockdiff vm start box
      blockdiff vm exec box -- sh -c 'echo v1 > /root/app'
      blockdiff vm snapshot box -m "write app"
    """


def _sandbox(store_path, name):
    from blockdiff.vm.sandbox import Sandbox

    return Sandbox(_open_store(store_path), name)


@vm.command("build-image")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--kernel-package", default="linux-image-cloud-amd64", show_default=True,
              help="Debian kernel package to boot.")
@click.option("--kernel-image", type=click.Path(dir_okay=False, exists=True),
              help="A kernel of your own (bzImage) instead of a Debian package.")
@click.option("--modules", type=click.Path(file_okay=False, exists=True),
              help="With --kernel-image: its lib/modules/<release> directory (drivers not "
                   "found there are taken to be built in).")
@click.option("--disk-size", default=1024, show_default=True, help="Root disk size in MiB.")
@click.option("--force", is_flag=True, help="Rebuild even if the inputs have not changed.")
@reports_errors
def vm_build_image(directory, kernel_package, kernel_image, modules, disk_size, force):
    """Build a bootable sandbox image in DIRECTORY from Debian packages.

    Writes vmlinuz, initrd.img, rootfs.img (raw ext4) and manifest.json. Cached:
    nothing is rebuilt while the inputs stay the same.

    \b
    Example:
      blockdiff vm build-image ~/.cache/blockdiff/vm
    """
    from blockdiff.vm.image import build_image

    built = build_image(directory, kernel_package=kernel_package, kernel_image=kernel_image,
                        modules=modules, disk_size=disk_size * 1024 * 1024, force=force)
    kernel = built.manifest["kernel"]
    click.echo(f"{directory}: {'up to date' if built.cached else 'built'} "
               f"(kernel {kernel['release']}, {kernel['name']} {kernel['version']})".rstrip())


@vm.command("create")
@click.argument("name")
@store_option
@click.option("--image", type=click.Path(dir_okay=False, exists=True),
              help="Raw disk image to start from (copied; reflinked when it can be).")
@click.option("--from", "snapshot_id", metavar="ID", help="Store snapshot to start from.")
@click.option("--kernel", type=click.Path(file_okay=False, exists=True),
              help="Directory with vmlinuz and initrd.img (default: the image's directory, "
                   "or the kernel the snapshot was taken with).")
@click.option("--memory", default=256, show_default=True, help="Memory in MiB.")
@click.option("--cpus", default=1, show_default=True)
@reports_errors
def vm_create(name, store_path, image, snapshot_id, kernel, memory, cpus):
    """Make sandbox VM NAME (stopped) from a raw image or a snapshot.

    \b
    Example:
      blockdiff vm create box --store S --image vm/rootfs.img
      blockdiff vm create box2 --store S --from 3f2a9c0d1e2b4a5c
    """
    from blockdiff.vm.sandbox import Sandbox

    Sandbox.create(_open_store(store_path), name, image=image, snapshot=snapshot_id,
                   kernel=kernel, memory_mb=memory, cpus=cpus)
    click.echo(f"created VM {name}")


@vm.command("start")
@click.argument("name")
@store_option
@click.option("--timeout", default=120.0, show_default=True, help="Seconds to wait for the boot.")
@reports_errors
def vm_start(name, store_path, timeout):
    """Boot VM NAME in the background; return when it runs commands.

    \b
    Example:
      blockdiff vm start box
    """
    box = _sandbox(store_path, name)
    box.start(timeout=timeout)
    click.echo(f"VM {name} running ({box.status().accel})")


@vm.command("exec", context_settings={"ignore_unknown_options": True})
@click.argument("name")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@store_option
@click.option("--timeout", type=float, help="Kill the command after this many seconds.")
@click.option("-i", "--stdin", "pass_stdin", is_flag=True, help="Pass this process's stdin.")
@click.option("--cwd", default="/", show_default=True, help="Directory to run in.")
@reports_errors
def vm_exec(name, command, store_path, timeout, pass_stdin, cwd):
    """Run COMMAND in VM NAME; exit with its status.

    \b
    Example:
      blockdiff vm exec box -- sh -c 'echo hello > /root/greeting'
    """
    data = sys.stdin.buffer.read() if pass_stdin else b""
    result = _sandbox(store_path, name).exec(list(command), timeout=timeout, input=data, cwd=cwd)
    sys.stdout.buffer.write(result.stdout)
    sys.stdout.flush()
    sys.stderr.buffer.write(result.stderr)
    if result.truncated:
        click.echo("blockdiff: output was cut at 16 MiB per stream", err=True)
    if result.timed_out:
        _fail(f"{command[0]} was killed after {timeout:g} s", 124)
    sys.exit(result.status)


@vm.command("snapshot")
@click.argument("name")
@store_option
@click.option("-m", "--message", default="", help="What this step did.")
@click.option("--meta", multiple=True, metavar="KEY=VALUE", help="Metadata; repeatable.")
@click.option("--ttl", help="Expire after this long (e.g. 30m, 2h, 7d).")
@json_option
@reports_errors
def vm_snapshot(name, store_path, message, meta, ttl, as_json):
    """Snapshot VM NAME's disk (pausing it briefly); print the id last.

    \b
    Example:
      blockdiff vm snapshot box -m "pip install" --meta step=3
    """
    box = _sandbox(store_path, name)
    snapshot_id = box.checkpoint(message, _pairs(meta), ttl=_duration(ttl))
    t = box.last_checkpoint
    if as_json:
        return _emit_json({"id": snapshot_id, "vm": name,
                           "timing": None if t is None else dataclasses.asdict(t)})
    if t:
        click.echo(f"paused {t.paused * 1000:.1f} ms (freeze {t.freeze * 1000:.1f} ms)")
    click.echo(snapshot_id)


@vm.command("restore")
@click.argument("name")
@click.argument("snapshot_id", metavar="ID")
@store_option
@json_option
@reports_errors
def vm_restore(name, snapshot_id, store_path, as_json):
    """Put VM NAME's disk back to snapshot ID (a running VM keeps running).

    A running VM's processes end and its disk is swapped under it, without a
    reboot; a stopped VM stays stopped.

    \b
    Example:
      blockdiff vm restore box 3f2a9c0d1e2b4a5c
    """
    box = _sandbox(store_path, name)
    snapshot_id = box.store.resolve(snapshot_id)
    result = box.restore(snapshot_id)
    if as_json:
        return _emit_json({"vm": name, "snapshot": snapshot_id, "running": box.running}
                          | dataclasses.asdict(result))
    how = "rebooted" if result.rebooted else "running" if box.running else "stopped"
    click.echo(f"VM {name} at {snapshot_id} ({how}, {result.seconds * 1000:.0f} ms)")


@vm.command("fork")
@click.argument("name")
@click.argument("snapshot_id", metavar="ID")
@click.argument("new_name", metavar="NEWNAME")
@store_option
@click.option("--no-start", is_flag=True, help="Leave the new VM stopped.")
@json_option
@reports_errors
def vm_fork(name, snapshot_id, new_name, store_path, no_start, as_json):
    """Make VM NEWNAME, like NAME, from snapshot ID, and start it.

    \b
    Example:
      blockdiff vm fork box 3f2a9c0d1e2b4a5c box-b
    """
    box = _sandbox(store_path, name)
    snapshot_id = box.store.resolve(snapshot_id)
    box.fork(snapshot_id, new_name, start=not no_start)
    if as_json:
        return _emit_json({"vm": new_name, "forked_from": snapshot_id, "running": not no_start})
    click.echo(f"VM {new_name} forked from {snapshot_id}" + ("" if no_start else ", running"))


@vm.command("stop")
@click.argument("name")
@store_option
@reports_errors
def vm_stop(name, store_path):
    """Shut VM NAME down (cleanly; killed if it does not power off).

    \b
    Example:
      blockdiff vm stop box
    """
    _sandbox(store_path, name).stop()
    click.echo(f"VM {name} stopped")


@vm.command("rm")
@click.argument("name")
@store_option
@reports_errors
def vm_rm(name, store_path):
    """Stop VM NAME and delete it; its snapshots stay in the store.

    \b
    Example:
      blockdiff vm rm box
    """
    _sandbox(store_path, name).destroy()
    click.echo(f"removed VM {name}")


@vm.command("ls")
@store_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@reports_errors
def vm_ls(store_path, as_json):
    """List the store's VMs: state, accelerator, the snapshot each descends from.

    \b
    Example:
      blockdiff vm ls --json
    """
    from blockdiff.vm.sandbox import Sandbox

    statuses = [box.status() for box in Sandbox.list(_open_store(store_path))]
    if as_json:
        return _echo_records(statuses)
    for s in statuses:
        state = f"running (pid {s.pid}, {s.accel})" if s.running else "stopped"
        click.echo(f"{_printable(s.name):20} {state:28} {_printable(s.snapshot)}")


# ------------------------------------------------------------ agent threads

@main.group()
def agent():
    """Agent checkpoints: threads, their history, approvals, rewind and fork.

    Encrypted state needs its key in BLOCKDIFF_AGENT_KEY (or a file named by
    BLOCKDIFF_AGENT_KEY_FILE).

    \b
    Example:
      blockdiff agent threads --store S
      blockdiff agent history --store S run-42
    """


def _agent_db(store_path, codec=None):
    from blockdiff.agent.agent import AgentDB

    return AgentDB(_open_store(store_path), codec)


def _checkpoint_id(store, checkpoint_id: str, thread: str) -> str:
    """The full id of the checkpoint an id or a unique prefix of one names
    (an error about it points to THREAD's history)."""
    from blockdiff.agent.agent import AgentDB

    with AgentDB(store) as db:
        return db.checkpoint(checkpoint_id, thread).id


def _when(t: float | None) -> str:
    import time as time_module

    return "-" if t is None else time_module.strftime("%Y-%m-%d %H:%M:%S",
                                                      time_module.localtime(t))


@agent.command("threads")
@store_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@reports_errors
def agent_threads(store_path, as_json):
    """List the store's threads: status, head checkpoint, who runs it.

    \b
    Example:
      blockdiff agent threads --store S --json
    """
    threads = _agent_db(store_path).threads()
    if as_json:
        return _echo_records(threads)
    for t in threads:
        extra = f"  forked from {_printable(t.forked_from)}" if t.forked_from else ""
        who = f"  by {_printable(t.owner)}" if t.owner else ""
        click.echo(f"{_printable(t.id):24} {_printable(t.status):17} {_printable(t.head):16}"
                   f"{who}{extra}")


@agent.command("history")
@click.argument("thread")
@store_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@reports_errors
def agent_history(thread, store_path, as_json):
    """THREAD's checkpoints from its head back to its start, newest first.

    \b
    Example:
      blockdiff agent history --store S run-42
    """
    from blockdiff.agent.sealing import Codec

    # Sealed meta shows with the key (and as null without it) in --json only.
    history = _agent_db(store_path, Codec() if as_json else None).history(thread)
    if as_json:
        return _echo_records(history)
    for c in history:
        disk = f"disk {_printable(c.disk_snapshot)}" if c.disk_snapshot else "no disk"
        click.echo(f"{_printable(c.id)}  step {c.step:<4} {_when(c.created)}  "
                   f"{_printable(c.reason):24} {disk}"
                   + (f"  ({_printable(c.thread)})" if c.thread != thread else ""))


@agent.command("tree")
@store_option
@reports_errors
def agent_tree(store_path):
    """Every thread's checkpoints as one tree; forks and rewinds branch.

    \b
    Example:
      blockdiff agent tree --store S
    """
    click.echo(_agent_db(store_path).tree(label=_printable))


@agent.command("show")
@click.argument("checkpoint_id", metavar="CHECKPOINT")
@store_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@reports_errors
def agent_show(checkpoint_id, store_path, as_json):
    """One checkpoint: its record, execution state and messages.

    \b
    Example:
      BLOCKDIFF_AGENT_KEY=... blockdiff agent show --store S 6050da99569807ab
    """
    from blockdiff.agent.sealing import Codec

    codec = Codec()
    db = _agent_db(store_path, codec)
    cp = db.checkpoint(checkpoint_id)
    checkpoint_id = cp.id   # a prefix resolved
    state_blob, messages_blob = db.contents(checkpoint_id)
    record = dataclasses.asdict(cp) | {
        "state": codec.decode(state_blob, f"checkpoint {checkpoint_id} state"),
        "messages": codec.decode(messages_blob, f"checkpoint {checkpoint_id} messages")}
    if as_json:
        return _emit_json(record)
    for key in ("id", "thread", "parent", "step", "reason", "disk_snapshot"):
        click.echo(f"{key + ':':15}" + _printable(record[key]))
    # JSON, not Python's repr; ASCII, so nothing in it reaches the terminal raw.
    click.echo(f"{'meta:':15}" + ("(sealed; give the key to read it)" if cp.meta is None
                                  else json.dumps(cp.meta, sort_keys=True)))
    click.echo(f"{'created:':15}{_when(cp.created)}   expires: {_when(cp.expires)}")
    click.echo("state:\n" + json.dumps(record["state"], indent=2))
    click.echo(f"messages: {len(record['messages'])}")
    for m in record["messages"][-10:]:
        click.echo(f"  {json.dumps(m)}")


@agent.command("journal")
@click.argument("thread")
@store_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@reports_errors
def agent_journal(thread, store_path, as_json):
    """THREAD's tool calls, oldest first: request id, tool, status.

    \b
    Example:
      blockdiff agent journal --store S run-42
    """
    entries = _agent_db(store_path).journal(thread)
    if as_json:
        return _echo_records(entries)
    for e in entries:
        click.echo(f"{_printable(e.request_id)}  {_printable(e.tool):16} "
                   f"{_printable(e.status):14} {_when(e.started)}")


@agent.command("pending")
@store_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@reports_errors
def agent_pending(store_path, as_json):
    """Approvals waiting for a decision, in every thread.

    \b
    Example:
      blockdiff agent pending --store S
    """
    from blockdiff.agent.sealing import Codec

    approvals = _agent_db(store_path).approvals(pending_only=True, codec=Codec())
    if as_json:
        return _echo_records(approvals)
    if not approvals:
        click.echo("no pending approvals")
    for a in approvals:
        click.echo(f"{_printable(a.thread):24} {json.dumps(a.action)}  (asked {_when(a.created)}, "
                   f"expires {_when(a.expires)})")


def _decide(thread, store_path, decision, comment):
    approval = _agent_db(store_path).decide(thread, decision, comment=comment)
    click.echo(f"{_printable(thread)}: {approval.decision}; the run continues when the agent "
               f"resumes it")


@agent.command("approve")
@click.argument("thread")
@store_option
@click.option("-m", "--comment", default="", help="Why.")
@reports_errors
def agent_approve(thread, store_path, comment):
    """Approve THREAD's pending action.

    \b
    Example:
      blockdiff agent approve --store S run-42 -m "ok to charge"
    """
    _decide(thread, store_path, "approved", comment)


@agent.command("reject")
@click.argument("thread")
@store_option
@click.option("-m", "--comment", default="", help="Why.")
@reports_errors
def agent_reject(thread, store_path, comment):
    """Reject THREAD's pending action.

    \b
    Example:
      blockdiff agent reject --store S run-42 -m "too expensive"
    """
    _decide(thread, store_path, "rejected", comment)


@agent.command("rewind")
@click.argument("thread")
@click.argument("checkpoint_id", metavar="CHECKPOINT")
@store_option
@json_option
@reports_errors
def agent_rewind(thread, checkpoint_id, store_path, as_json):
    """Put THREAD (state and disk) back to CHECKPOINT.

    Effects of tool calls made since are compensated newest first. Those
    whose compensation needs the agent's own tools are left pending and run
    when the agent next opens the thread; those that cannot be compensated
    are listed. CHECKPOINT may be a unique prefix of its id (4 hex digits or more).

    \b
    Example:
      blockdiff agent rewind --store S run-42 6050da99569807ab
    """
    from blockdiff.agent.agent import rewind_thread

    store = _open_store(store_path)
    checkpoint_id = _checkpoint_id(store, checkpoint_id, thread)
    report = rewind_thread(store, thread, checkpoint_id)
    if as_json:
        return _emit_json({"thread": thread, "checkpoint": checkpoint_id}
                          | dataclasses.asdict(report))
    click.echo(f"{_printable(thread)}: rewound to {_printable(checkpoint_id)}")
    for what, items in (("compensated", report.compensated),
                        ("compensation pending (runs when the agent resumes)", report.pending),
                        ("cannot be compensated", report.uncompensable)):
        for item in items:
            click.echo(f"  {what}: {_printable(item)}")


@agent.command("fork")
@click.argument("thread")
@click.argument("checkpoint_id", metavar="CHECKPOINT")
@click.argument("new_thread", metavar="NEW_THREAD")
@store_option
@json_option
@reports_errors
def agent_fork(thread, checkpoint_id, new_thread, store_path, as_json):
    """Start NEW_THREAD from THREAD's CHECKPOINT, with a disk of its own.

    \b
    Example:
      blockdiff agent fork --store S run-42 6050da99569807ab run-42b
    """
    from blockdiff.agent.agent import fork_thread

    store = _open_store(store_path)
    checkpoint_id = _checkpoint_id(store, checkpoint_id, thread)
    head = fork_thread(store, thread, checkpoint_id, new_thread)
    if as_json:
        return _emit_json({"thread": new_thread, "forked_from": checkpoint_id, "head": head})
    click.echo(f"{_printable(new_thread)}: forked from {_printable(checkpoint_id)}; head {head}")


@agent.command("gc")
@store_option
@click.option("--dry-run", is_flag=True, help="Say what would be removed; remove nothing.")
@json_option
@reports_errors
def agent_gc(store_path, dry_run, as_json):
    """Remove expired checkpoints and the disk snapshots only they used.

    A thread's head and a checkpoint an approval waits at are kept.

    \b
    Example:
      blockdiff agent gc --store S --dry-run
    """
    removed = _agent_db(store_path).gc(dry_run=dry_run)
    if as_json:
        return _emit_json({"removed": [dataclasses.asdict(c) for c in removed],
                           "dry_run": dry_run})
    verb = "would remove" if dry_run else "removed"
    for c in removed:
        click.echo(f"{verb} {_printable(c.id)}  [{_printable(c.thread)}] step {c.step}: "
                   f"{_printable(c.reason)}")
    click.echo(f"{verb} {len(removed)} expired checkpoint(s)")


@agent.command("keygen")
@reports_errors
def agent_keygen():
    """Print a new key for encrypting agent state (AES-256-GCM).

    \b
    Example:
      export BLOCKDIFF_AGENT_KEY=$(blockdiff agent keygen)
    """
    from blockdiff.agent.sealing import new_key

    click.echo(new_key())
