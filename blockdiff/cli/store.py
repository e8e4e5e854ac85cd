"""The store commands: init, commit, restore, log, tree, diff, rm, gc, verify,
export, import, compact, and for a store shared by several hosts push and
pull.

Snapshot ids may be given by a unique prefix (4 hex digits or more); output
always shows full ids. The ``--json`` documents are described in docs/cli.md.
"""

from __future__ import annotations

import sys

import click

from blockdiff.cli.options import (
    dry_run_option,
    json_option,
    message_option,
    meta_option,
    open_store,
    parse_duration,
    parse_size,
    store_option,
    ttl_option,
    written_option,
)
from blockdiff.cli.output import emit_json, human_size, printable, when
from blockdiff.cli.progress import progress_bar


def _snapshot_dict(snap) -> dict:
    """A snapshot's record as commit and log print it with --json."""
    return {"id": snap.id, "parent": snap.parent, "created": snap.created,
            "message": snap.message, "meta": snap.meta, "size": snap.size,
            "changed_bytes": snap.changed_bytes, "ranges": snap.ranges, "expires": snap.expires}


def _removal_dict(result, *, dry_run: bool) -> dict:
    """What rm and gc print with --json (bytes_freed is null for a dry run)."""
    return {"removed": list(result.removed),
            "reasons": {sid: result.reasons[sid] for sid in result.removed},
            "bytes_freed": None if dry_run else result.bytes_freed, "dry_run": dry_run}


@click.command()
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--allow-copy", is_flag=True,
              help="On a filesystem without reflink, copy data instead (slow: every commit "
                   "reads the image and its parent in full).")
@click.option("--group", metavar="GROUP",
              help="Let this group read the store too (it is private to its owner otherwise).")
@click.option("--catalog", metavar="URL",
              help="Join a store shared by several hosts: its catalog (postgresql://...; or a "
                   "SQLite file, for stores on one machine). The first host makes it. A "
                   "password in the URL is kept in a private passfile, never shown.")
@click.option("--remote", metavar="s3://BUCKET/PREFIX",
              help="The shared store's object store (the first host names it; the endpoint "
                   "and credentials come from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...).")
@click.option("--cache-size", callback=parse_size, metavar="SIZE",
              help="In a shared store: keep at most SIZE (e.g. 50G) of layers on this host, "
                   "evicting the least recently used uploaded ones after a fetch.")
def init(directory, allow_copy, group, catalog, remote, cache_size):
    """Make a snapshot store in DIRECTORY (on XFS with reflink, or btrfs).

    The store is readable by its owner only, unless --group is given. With
    --catalog it is this host's part of a store shared by several hosts.

    \b
    Example:
      blockdiff init /var/lib/sandboxes/store
      blockdiff init /srv/store --catalog postgresql://blockdiff@db/blockdiff \\
          --remote s3://sandboxes/store
    """
    from blockdiff.db import public_url
    from blockdiff.store.store import Store

    with Store.init(directory, allow_copy=allow_copy, group=group, catalog=catalog,
                    remote=remote, cache_size=cache_size) as store:
        if store.shared is None:
            click.echo(f"initialised store {directory}")
        else:
            click.echo(f"initialised store {directory}, a host of the shared store at "
                       f"{printable(public_url(store.shared.catalog))} (objects in "
                       f"{printable(store.catalog.setting('remote'))})")


@click.command()
@store_option
@click.argument("image", type=click.Path(dir_okay=False))
@click.option("--parent", help="Snapshot the image descends from (default: what it was last "
                               "committed as or restored from).")
@message_option
@meta_option
@ttl_option
@click.option("--skip-unchanged", is_flag=True,
              help="If nothing changed since the parent, print the parent's id instead.")
@written_option
@click.option("--no-push", is_flag=True,
              help="In a shared store: leave the snapshot on this host (blockdiff push uploads "
                   "it later).")
@json_option
def commit(store_path, image, parent, message, meta, ttl, skip_unchanged, written, no_push,
           as_json):
    """Snapshot IMAGE; print the new snapshot's id as the last line.

    PARENT may be given by a unique prefix of its id (at least 4 hex digits).

    \b
    Example:
      blockdiff commit --store S disk.img -m "pip install" --meta step=3
    """
    with open_store(store_path) as store, progress_bar("commit", as_json=as_json) as progress:
        before = None
        if skip_unchanged:   # what the commit compares with: its id back means unchanged
            before = store.resolve(parent) if parent is not None else store.lineage(image)[0]
        snap = store.commit(image, parent=parent, message=message, meta=meta, ttl=ttl,
                            skip_unchanged=skip_unchanged, written=written, push=not no_push,
                            progress=progress)
    if as_json:
        return emit_json(_snapshot_dict(snap) | {"unchanged": snap.id == before})
    click.echo(snap.id)


@click.command()
@store_option
@click.argument("snapshot_id", metavar="ID")
@click.argument("image", type=click.Path(dir_okay=False))
@written_option
@json_option
def restore(store_path, snapshot_id, image, written, as_json):
    """Make IMAGE byte-identical to snapshot ID (a new path is a fork).

    ID may be a unique prefix of the snapshot's id (at least 4 hex digits).

    \b
    Example:
      blockdiff restore --store S 3f2a9c0d1e2b4a5c disk.img
      blockdiff restore --store S 3f2a branch-b.img
    """
    import dataclasses

    with open_store(store_path) as store, progress_bar("restore", as_json=as_json) as progress:
        result = store.restore(snapshot_id, image, written=written, progress=progress)
    if as_json:
        return emit_json(dataclasses.asdict(result))
    if result.forked:
        click.echo(f"{image}: forked from {result.snapshot} ({result.ranges} pieces cloned)")
    else:
        click.echo(f"{image}: restored in place to {result.snapshot} "
                   f"({result.ranges} ranges rewritten)")


@click.command()
@store_option
@click.argument("snapshot_id", metavar="[ID]", required=False)
@json_option
def log(store_path, snapshot_id, as_json):
    """The ancestry of ID (default: every snapshot), newest first.

    \b
    Example:
      blockdiff log --store S 3f2a9c0d1e2b4a5c
    """
    with open_store(store_path) as store:
        snaps = store.log(snapshot_id)
        where = {p.snapshot: p for p in store.placement()} if store.shared else None
    if as_json:
        return emit_json([_snapshot_dict(s) | ({} if where is None else _placement_dict(
            where[s.id])) for s in snaps])
    for s in snaps:
        extra = "".join(f" {printable(k)}={printable(v)}" for k, v in sorted(s.meta.items()))
        expiry = f" expires {when(s.expires, seconds=False)}" if s.expires else ""
        place = "" if where is None else f"{where[s.id].state:9}  "
        click.echo(f"{printable(s.id)}  parent {printable(s.parent):16}  {when(s.created)}  "
                   f"{place}{human_size(s.changed_bytes):>10} changed{expiry}  "
                   f"{printable(s.message)}{extra}")


def _placement_dict(place) -> dict:
    """Where a snapshot of a shared store is, as log --json prints it."""
    return {"where": place.state, "here": place.here, "host": place.host}



@click.command()
@store_option
def tree(store_path):
    """Draw the whole snapshot tree.

    \b
    Example:
      blockdiff tree --store S
    """
    from types import SimpleNamespace

    from blockdiff.engine.view import render_tree

    with open_store(store_path) as store:
        snapshots = store.log()
    click.echo(render_tree([
        SimpleNamespace(seq=s.seq, id=printable(s.id), message=printable(s.message),
                        parent=None if s.parent is None else printable(s.parent))
        for s in snapshots]))


@click.command(name="diff")
@store_option
@click.argument("a")
@click.argument("b")
@json_option
def diff_command(store_path, a, b, as_json):
    """The ranges where snapshot B differs from snapshot A.

    \b
    Example:
      blockdiff diff --store S 3f2a9c0d1e2b4a5c 77e0a1b2c3d4e5f6
    """
    from blockdiff.engine.extents import DATA

    with open_store(store_path) as store:
        a, b = store.resolve(a), store.resolve(b)
        ranges = store.diff(a, b)
    entries = [{"offset": int(o), "length": int(n), "kind": "data" if k == DATA else "zero"}
               for o, n, k in zip(ranges.offset, ranges.length, ranges.kind)]
    total = int(ranges.length.sum())
    if as_json:
        return emit_json({"a": a, "b": b, "bytes": total, "ranges": entries})
    for e in entries:
        click.echo(f"offset={e['offset']:#x} length={e['length']:#x} {e['kind']}")
    click.echo(f"{len(entries)} ranges, {human_size(total)} differ")


@click.command()
@store_option
@click.argument("snapshot_id", metavar="ID")
@json_option
def rm(store_path, snapshot_id, as_json):
    """Delete snapshot ID, with the snapshots that are parts of it (a VM
    checkpoint's memory); its descendants stay restorable.

    \b
    Example:
      blockdiff rm --store S 3f2a9c0d1e2b4a5c
    """
    with open_store(store_path, freeing=True) as store:
        result = store.rm(snapshot_id)
    if as_json:
        return emit_json(_removal_dict(result, dry_run=False))
    *parts, asked = result.removed   # the parts of the snapshot asked for go first
    what = f"{asked} with its part(s) {', '.join(parts)}; their" if parts else f"{asked}; its"
    click.echo(f"removed {what} files held {human_size(result.bytes_freed)} "
               f"(blocks an image still shares stay in use)")


@click.command()
@store_option
@click.option("--keep-last", type=click.IntRange(min=0), help="Keep the N newest snapshots.")
@click.option("--keep-within", callback=parse_duration,
              help="Keep snapshots younger than this (e.g. 2h, 7d).")
@click.option("--cache-size", callback=parse_size, metavar="SIZE",
              help="In a shared store: evict this host's least recently used layers that are "
                   "uploaded until its layers take at most SIZE (e.g. 50G).")
@dry_run_option
@json_option
def gc(store_path, keep_last, keep_within, cache_size, dry_run, as_json):
    """Remove expired snapshots and those the policy does not keep.

    Without --keep-last or --keep-within only expired snapshots (TTL) go.
    A snapshot that is a part of another (a VM checkpoint's memory) takes no
    place of its own and goes with it. Files left by interrupted operations
    are swept too; in a shared store, so are the objects no snapshot uses
    and the uploads never completed, an hour after they began (by the
    object store's clock).

    \b
    Example:
      blockdiff gc --store S --keep-last 50 --keep-within 1d
    """
    from blockdiff.store.retention import Policy

    policy = Policy(keep_last=keep_last, keep_within=keep_within)
    with open_store(store_path, freeing=not dry_run) as store:
        result = store.gc(policy, dry_run=dry_run)
        evicted, evicted_bytes = [], 0
        if cache_size is not None and not dry_run:
            evicted, evicted_bytes = store.evict(cache_size)
        if store.shared is not None and not dry_run:
            store.sweep_remote()
    result.bytes_freed += evicted_bytes
    if as_json:
        return emit_json(_removal_dict(result, dry_run=dry_run) | {"evicted": len(evicted)})
    if evicted:
        click.echo(f"evicted {len(evicted)} uploaded layer(s) from this host's cache "
                   f"({human_size(evicted_bytes)})")
    verb = "would remove" if dry_run else "removed"
    for snapshot_id in result.removed:
        click.echo(f"{verb} {snapshot_id} ({result.reasons[snapshot_id]})")
    if dry_run and not result.removed:
        click.echo("nothing to remove")
    if not dry_run:
        click.echo(f"removed files held {human_size(result.bytes_freed)} "
                   f"(blocks an image still shares stay in use)")


@click.command()
@store_option
@click.argument("snapshot_id", metavar="[ID]", required=False)
@click.option("--repair", is_flag=True,
              help="In a shared store: replace this host's damaged copies of maps and "
                   "layers by the object store's (checked first), then check again.")
@json_option
def verify(store_path, snapshot_id, repair, as_json):
    """Check the catalog and every checksum (of ID, or of every snapshot),
    and the VMs' standby images and spares (those of ID).

    Exits non-zero (7) and names each damaged snapshot (or VM) on stderr.

    \b
    Example:
      blockdiff verify --store S
      blockdiff verify --store S --repair
    """
    from blockdiff.vm.integrity import verify_vms

    fetched = []
    with open_store(store_path) as store, progress_bar("verify", as_json=as_json) as progress:
        if repair:
            done = store.repair(snapshot_id, progress=progress)
            problems, fetched = done.problems, done.fetched_again
        else:
            problems = store.verify(snapshot_id, progress=progress)
        problems |= verify_vms(store, store.resolve(snapshot_id) if snapshot_id else None)
    if as_json:
        emit_json({"consistent": not problems, "problems": problems}
                  | ({"fetched_again": fetched} if repair else {}))
    elif fetched:
        click.echo(f"fetched again from the object store (this host's copies were "
                   f"damaged): {', '.join(fetched)}")
    if not problems:
        if not as_json:
            click.echo("store is consistent; every checksum matches")
        return
    for name, found in problems.items():
        for problem in found:
            click.echo(f"blockdiff: damaged: {name}: {problem}", err=True)
    sys.exit(7)


@click.command()
@store_option
@click.argument("snapshot_id", metavar="ID")
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--since", metavar="ANCESTOR",
              help="Export only what changed since this ancestor (the other host has it).")
@json_option
def export(store_path, snapshot_id, out, since, as_json):
    """Write one portable file from which another store recreates ID.

    The file is a BDIFFv2 diff (of the whole image, or against ANCESTOR) with
    the snapshot's record at its end.

    \b
    Example:
      blockdiff export --store S 3f2a9c0d1e2b4a5c step7.bdx --since 77e0a1b2c3d4e5f6
    """
    with open_store(store_path) as store, progress_bar("export", as_json=as_json) as progress:
        snapshot_id = store.resolve(snapshot_id)
        since = None if since is None else store.resolve(since)
        result = store.export(snapshot_id, out, since, progress=progress)
    if as_json:
        return emit_json({"id": snapshot_id, "since": since, "out": out,
                          "ranges": result.ranges, "data_bytes": result.data_bytes,
                          "zero_bytes": result.zero_bytes, "size": result.target_size})
    click.echo(f"{out}: {snapshot_id}, {result.ranges} ranges, {human_size(result.data_bytes)}")


@click.command(name="import")
@store_option
@click.argument("path", metavar="FILE", type=click.Path(dir_okay=False))
@json_option
def import_command(store_path, path, as_json):
    """Recreate the snapshot an export FILE holds; print its id.

    The file is read and checked whole; a snapshot the store has already is
    skipped, and says so on stderr.

    \b
    Example:
      blockdiff import --store S step7.bdx
    """
    with open_store(store_path) as store, progress_bar("import", as_json=as_json) as progress:
        result = store.import_(path, progress=progress)
    if result.skipped:
        click.echo(f"skipped: {result.skipped} (the export checks out)", err=True)
    if as_json:
        return emit_json({"ids": list(result.ids), "skipped": result.skipped or None})
    for snapshot_id in result.ids:
        click.echo(snapshot_id)


@click.command()
@store_option
@click.argument("snapshot_id", metavar="ID")
@json_option
def compact(store_path, snapshot_id, as_json):
    """Rewrite snapshot ID's data into one contiguous layer.

    For a snapshot forked from often whose data is scattered over many
    layers: forks of it then take a few clones instead of one per fragment.
    Restore images from it again afterwards (see docs/store.md).

    \b
    Example:
      blockdiff compact --store S 3f2a9c0d1e2b4a5c
    """
    with open_store(store_path) as store, progress_bar("compact", as_json=as_json) as progress:
        before = len(store.load_map(store.get(snapshot_id)).pieces)
        snap = store.compact(snapshot_id, progress=progress)
        after = len(store.load_map(snap).pieces)
    if as_json:
        return emit_json({"id": snap.id, "pieces_before": before, "pieces_after": after})
    click.echo(f"{snap.id}: {before} pieces -> {after}")


@click.command()
@store_option
@click.argument("snapshot_id", metavar="[ID]", required=False)
@json_option
def push(store_path, snapshot_id, as_json):
    """Upload what this host of a shared store holds that the object store lacks.

    Everything pending, or only what snapshot ID needs.

    \b
    Example:
      blockdiff push --store S
    """
    with open_store(store_path) as store, progress_bar("push", as_json=as_json) as progress:
        result = store.push(snapshot_id, progress=progress)
    if as_json:
        return emit_json({"layers": result.layers, "maps": result.maps, "bytes": result.bytes,
                          "durable": result.snapshots})
    click.echo(f"uploaded {result.layers} layer(s) and {result.maps} map(s), "
               f"{human_size(result.bytes)}")


@click.command()
@store_option
@click.argument("snapshot_id", metavar="ID")
@json_option
def pull(store_path, snapshot_id, as_json):
    """Fetch what snapshot ID needs onto this host of a shared store, checked.

    A restore fetches it anyway; pull does it ahead of time.

    \b
    Example:
      blockdiff pull --store S 3f2a9c0d1e2b4a5c
    """
    with open_store(store_path) as store:
        snapshot_id = store.resolve(snapshot_id)
        fetched = store.pull(snapshot_id)
    if as_json:
        return emit_json({"id": snapshot_id, "fetched_bytes": fetched})
    click.echo(f"{snapshot_id}: fetched {human_size(fetched)}")


COMMANDS = (init, commit, restore, log, tree, diff_command, rm, gc, verify, export, push, pull,
            import_command, compact)
