"""The diff commands: create, apply and view ``.bdiff`` files (no store)."""

from __future__ import annotations

import click

from blockdiff.cli.options import json_option, quiet_option
from blockdiff.cli.output import echo_notes, emit_json, human_size


def _result_record(result) -> dict:
    """A create or apply result for --json: its fields, the target id as hex
    (null if none), the notes left on stderr, where they were written."""
    import dataclasses

    record = dataclasses.asdict(result)
    del record["notes"]
    if "target_id" in record:   # 16 zero bytes: no id recorded
        record["target_id"] = record["target_id"].hex() if any(record["target_id"]) else None
    return record


@click.command()
@click.argument("out", type=click.Path(dir_okay=False))
@click.argument("target", type=click.Path(dir_okay=False))
@click.option("--base", type=click.Path(dir_okay=False),
              help="Image to diff against; without it the diff holds TARGET's data (compaction).")
@click.option("--format", "fmt", type=click.Choice(["v1", "v2"]), default="v2", show_default=True,
              help="v2: checksums, zero ranges, base identity. v1: CognitionAI's BDIFFv1.")
@click.option("--base-digest", is_flag=True,
              help="v2: also record a digest of the whole base (read in full), which "
                   "apply --verify-base checks.")
@quiet_option
@json_option
def create(out, target, base, fmt, base_digest, quiet, as_json):
    """Write a diff of TARGET against BASE to OUT.

    Changed blocks are found from the filesystem's extent maps and reflinked
    into OUT, so this takes milliseconds on XFS or btrfs.

    \b
    Example:
      blockdiff create step1.bdiff disk.img --base disk-step0.img
    """
    from blockdiff.engine.diff import create_diff

    result = create_diff(out, target, base, format=fmt, base_digest=base_digest)
    echo_notes(result.notes)
    if as_json:
        emit_json(_result_record(result))
    elif not quiet:
        click.echo(f"{out}: {fmt}, {result.ranges} ranges, {human_size(result.data_bytes)} data, "
                   f"{human_size(result.zero_bytes)} zeros, target "
                   f"{human_size(result.target_size)} ({result.method}, {result.reflinked} "
                   f"ranges reflinked)")


@click.command()
@click.argument("diff", metavar="IN", type=click.Path(dir_okay=False))
@click.argument("target", type=click.Path(dir_okay=False))
@click.option("--base", type=click.Path(dir_okay=False),
              help="The image the diff was made against (never modified).")
@click.option("--verify-base", is_flag=True,
              help="Also read the whole base and compare it with the digest the diff records "
                   "(a diff made with create --base-digest).")
@quiet_option
@json_option
def apply(diff, target, base, verify_base, quiet, as_json):
    """Rebuild TARGET from BASE and the diff IN.

    The diff (checksums) and the base (size, sampled fingerprint, snapshot id;
    all of it with --verify-base) are checked before anything is written;
    TARGET is replaced atomically.

    \b
    Example:
      blockdiff apply step1.bdiff restored.img --base disk-step0.img
    """
    from blockdiff.engine.diff import apply_diff

    result = apply_diff(diff, target, base, verify_base=verify_base)
    echo_notes(result.notes)
    if as_json:
        emit_json(_result_record(result))
    elif not quiet:
        click.echo(f"{target}: {human_size(result.target_size)} from v{result.version} diff, "
                   f"{result.ranges} ranges ({result.reflinked} reflinked)")


def _hex(value: str) -> int:
    try:
        return int(value, 16)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a hexadecimal offset (e.g. 0x1000)")


@click.command()
@click.argument("path", metavar="IN", type=click.Path(dir_okay=False))
@click.argument("offset", required=False)
@json_option
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
        emit_json(report)
    else:
        click.echo(view_module.render(report))


COMMANDS = (create, apply, view)
