"""The ``blockdiff`` command line: parse, call one library function, report.

One module per command group: ``diff`` (create, apply, view), ``demo``,
``store`` (init, commit, restore, log, ...), ``vm`` and ``agent``; under
them ``errors`` (library errors to one line and an exit status), ``output``
(escaping, ``--json``, sizes), ``options`` (the shared options) and
``progress`` (progress bars on a terminal). Only
click is imported at start-up: the library and numpy are imported inside the
commands, so that ``blockdiff --help`` stays quick.
"""

from __future__ import annotations

import click

from blockdiff.cli import agent, demo, diff, store, vm
from blockdiff.cli.errors import ReportingGroup


@click.group(cls=ReportingGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="blockdiff")
def main():
    """Block-level copy-on-write diffs of disk images on reflink filesystems.

    \b
    Example:
      blockdiff create step1.bdiff disk.img --base disk-step0.img
      blockdiff apply step1.bdiff restored.img --base disk-step0.img
    """


for _group in (diff, demo, store, vm, agent):
    for _command in _group.COMMANDS:
        main.add_command(_command)
