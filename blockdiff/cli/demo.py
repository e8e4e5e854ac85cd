"""The demo command: the whole story on a scratch disk image, every step verified."""

from __future__ import annotations

import click


@click.command()
@click.option("--dir", "workdir", type=click.Path(file_okay=False, exists=True),
              help="Run in this directory on a reflink filesystem instead of a scratch XFS "
                   "(which needs root and loop devices).")
@click.option("--size", default=512, show_default=True, help="Disk image size in MiB.")
@click.option("--steps", default=6, show_default=True, help="Agent steps to snapshot.")
@click.option("--no-vm", is_flag=True, help="Leave out the sandbox VM part.")
@click.option("--vm-image", type=click.Path(file_okay=False),
              help="Where the sandbox VM image is built and cached "
                   "(default: ~/.cache/blockdiff/vm-image).")
def demo(workdir, size, steps, no_vm, vm_image):
    """Snapshot a disk image through agent steps, then restore, fork and move it.

    Every snapshot and restore is verified byte for byte.

    \b
    Example:
      sudo blockdiff demo --size 1024 --steps 8
    """
    from blockdiff.demo import session

    def show(event):
        timing = f"{event.seconds * 1000:8.1f} ms" if event.seconds else " " * 11
        click.echo(f"{timing}  {event.what}" + (f"\n{'':13}{event.detail}" if event.detail else ""))

    session.run(workdir, size=size * 1024 * 1024, steps=steps, vm=not no_vm,
                vm_image=vm_image, report=show)


COMMANDS = (demo,)
