"""The options several commands share, one decorator each, with the parsing
of their values (a command receives seconds, a dict, ranges), and the store
the ``--store`` option names."""

from __future__ import annotations

import functools
import math

import click


def store_option(command):
    """The --store option every store command takes (or BLOCKDIFF_STORE)."""
    return click.option("--store", "store_path", type=click.Path(file_okay=False),
                        envvar="BLOCKDIFF_STORE", show_envvar=True,
                        help="The snapshot store directory.")(command)


def open_store(path, *, freeing: bool = False):
    """The store at ``path`` (the --store option's value), opened."""
    from blockdiff.store.store import open_store as open_library_store

    return open_library_store(path, freeing=freeing)


def with_store(*, freeing: bool = False):
    """A command on a store: it takes --store (:func:`store_option`) and is
    called with ``store``, opened for it and closed when it returns or fails
    (as borg's ``with_repository``), in place of the option's path.
    ``freeing``: the command may free space (rm, gc), so a store opened to
    do it may be one whose filesystem is full."""
    def decorate(command):
        @functools.wraps(command)
        def with_it_open(*args, store_path, **kwargs):
            with open_store(store_path, freeing=freeing) as store:
                return command(*args, store=store, **kwargs)
        return store_option(with_it_open)
    return decorate


def json_option(command):
    """The --json option of a command whose output a program may read."""
    return click.option("--json", "as_json", is_flag=True,
                        help="Print one JSON document on stdout (see docs/cli.md).")(command)


def quiet_option(command):
    """-q/--quiet: print nothing on success."""
    return click.option("-q", "--quiet", is_flag=True, help="Print nothing on success.")(command)


def dry_run_option(command):
    """--dry-run: say what a removal would remove, remove nothing."""
    return click.option("--dry-run", is_flag=True,
                        help="Say what would be removed; remove nothing.")(command)


def message_option(command):
    """-m/--message: what the step a snapshot records did."""
    return click.option("-m", "--message", default="", help="What this step did.")(command)


def parse_duration(ctx, param, value: str | None) -> float | None:
    """An option's '90s', '15m', '2h', '7d' or plain seconds, in seconds:
    finite and not negative (a click callback)."""
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
        raise UsageError(f"{param.opts[0]} {value!r} is not a duration: give a length of time "
                         f"that is not negative (e.g. 90s, 15m, 2h, 7d)")
    return seconds


_SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MIB": 1 << 20,
               "G": 1 << 30, "GIB": 1 << 30, "T": 1 << 40, "TIB": 1 << 40}


def parse_size(ctx, param, value: str | None) -> int | None:
    """A size such as 512M, 20G or 1.5TiB (powers of 1024), in bytes."""
    if value is None:
        return None
    text = value.strip().upper()
    number = text.rstrip("BKMGTI")
    unit = text[len(number):]
    try:
        amount = float(number)
    except ValueError:
        amount = math.nan
    if unit not in _SIZE_UNITS or not math.isfinite(amount) or amount < 0:
        raise click.BadParameter(f"{value!r} is not a size (like 512M, 20G or 1.5TiB)")
    return int(amount * _SIZE_UNITS[unit])


def ttl_option(command):
    """--ttl: when a snapshot expires, as a duration (the command gets seconds)."""
    return click.option("--ttl", callback=parse_duration,
                        help="Expire after this long (e.g. 30m, 2h, 7d).")(command)


def _parse_pairs(ctx, param, items) -> dict[str, str]:
    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--meta")
        pairs[key] = value
    return pairs


def meta_option(command):
    """--meta KEY=VALUE, repeatable (the command gets a dict)."""
    return click.option("--meta", multiple=True, metavar="KEY=VALUE", callback=_parse_pairs,
                        help="Metadata; repeatable.")(command)


def _parse_written(ctx, param, source) -> tuple | None:
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


def written_option(command):
    """--written FILE: the ranges written since the image was last committed
    or restored (the command gets ``(offsets, lengths)`` or None)."""
    return click.option(
        "--written", type=click.File("r"), metavar="FILE", callback=_parse_written,
        help="Ranges written to IMAGE since it was last committed or restored, one "
             "'OFFSET LENGTH' per line ('-': stdin), as a dirty-block tracker reports "
             "them: only those are mapped. They must cover every write.")(command)
