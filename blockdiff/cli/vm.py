"""The ``vm`` commands: sandbox VMs (QEMU) whose disks live in a store."""

from __future__ import annotations

import sys

import click

from blockdiff.cli.errors import fail
from blockdiff.cli.options import (
    json_option,
    message_option,
    meta_option,
    ttl_option,
    with_store,
)
from blockdiff.cli.output import emit_json, emit_records, printable
from blockdiff.cli.progress import progress_bar


@click.group()
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


def _sandbox(store, name):
    from blockdiff.vm.sandbox import Sandbox

    return Sandbox(store, name)


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
def vm_build_image(directory, kernel_package, kernel_image, modules, disk_size, force):
    """Build a bootable sandbox image in DIRECTORY from Debian packages.

    Writes vmlinuz, initrd.img, rootfs.img (raw ext4) and manifest.json. Cached:
    nothing is rebuilt while the inputs stay the same.

    \b
    Example:
      blockdiff vm build-image ~/.cache/blockdiff/vm
    """
    from blockdiff.vm.image import build_image

    with progress_bar("vm build-image") as progress:
        built = build_image(directory, kernel_package=kernel_package, kernel_image=kernel_image,
                            modules=modules, disk_size=disk_size * 1024 * 1024, force=force,
                            progress=progress)
    kernel = built.manifest["kernel"]
    click.echo(f"{directory}: {'up to date' if built.cached else 'built'} "
               f"(kernel {kernel['release']}, {kernel['name']} {kernel['version']})".rstrip())


@vm.command("create")
@click.argument("name")
@with_store()
@click.option("--image", type=click.Path(dir_okay=False, exists=True),
              help="Raw disk image to start from (copied; reflinked when it can be).")
@click.option("--from", "snapshot_id", metavar="ID", help="Store snapshot to start from.")
@click.option("--kernel", type=click.Path(file_okay=False, exists=True),
              help="Directory with vmlinuz and initrd.img (default: the image's directory, "
                   "or the kernel the snapshot was taken with).")
@click.option("--memory", default=256, show_default=True, help="Memory in MiB.")
@click.option("--cpus", default=1, show_default=True)
@click.option("--disk-only", is_flag=True,
              help="Checkpoints hold the disk only (by default they hold RAM and device "
                   "state too, so a restore or fork brings the processes back).")
def vm_create(name, store, image, snapshot_id, kernel, memory, cpus, disk_only):
    """Make sandbox VM NAME (stopped) from a raw image or a snapshot.

    On a store on a reflink filesystem, its checkpoints hold the whole VM:
    disk, RAM and device state.

    \b
    Example:
      blockdiff vm create box --store S --image vm/rootfs.img
      blockdiff vm create box2 --store S --from 3f2a9c0d1e2b4a5c
      blockdiff vm create files --store S --image vm/rootfs.img --disk-only
    """
    from blockdiff.vm.sandbox import Sandbox

    with progress_bar("vm create") as progress:
        if snapshot_id is not None and image is None:
            # From a checkpoint with memory, the VM resumes its processes
            # when started (also on another host of a shared store).
            box = Sandbox.from_checkpoint(store, snapshot_id, name,
                                          start=False, disk_only=disk_only, kernel=kernel,
                                          memory_mb=memory, cpus=cpus,
                                          memory=False if disk_only else None,
                                          progress=progress)
        else:
            box = Sandbox.create(store, name, image=image,
                                 snapshot=snapshot_id, kernel=kernel, memory_mb=memory,
                                 cpus=cpus, memory=False if disk_only else None,
                                 progress=progress)
    kind = "whole-VM" if box.memory_checkpoints else "disk-only"
    click.echo(f"created VM {name} ({kind} checkpoints)")


@vm.command("start")
@click.argument("name")
@with_store()
@click.option("--timeout", default=120.0, show_default=True, help="Seconds to wait for the boot.")
def vm_start(name, store, timeout):
    """Boot VM NAME in the background; return when it runs commands.

    \b
    Example:
      blockdiff vm start box
    """
    box = _sandbox(store, name)
    with progress_bar("vm start") as progress:
        box.start(timeout=timeout, progress=progress)
    click.echo(f"VM {name} running ({box.status().accel})")


@vm.command("exec", context_settings={"ignore_unknown_options": True})
@click.argument("name")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@with_store()
@click.option("--timeout", type=float, help="Kill the command after this many seconds.")
@click.option("-i", "--stdin", "pass_stdin", is_flag=True, help="Pass this process's stdin.")
@click.option("--cwd", default="/", show_default=True, help="Directory to run in.")
def vm_exec(name, command, store, timeout, pass_stdin, cwd):
    """Run COMMAND in VM NAME; exit with its status.

    \b
    Example:
      blockdiff vm exec box -- sh -c 'echo hello > /root/greeting'
    """
    data = sys.stdin.buffer.read() if pass_stdin else b""
    result = _sandbox(store, name).exec(list(command), timeout=timeout, input=data, cwd=cwd)
    sys.stdout.buffer.write(result.stdout)
    sys.stdout.flush()
    sys.stderr.buffer.write(result.stderr)
    if result.truncated:
        click.echo("blockdiff: output was cut at 16 MiB per stream", err=True)
    if result.timed_out:
        fail(f"{command[0]} was killed after {timeout:g} s", 124)
    sys.exit(result.status)


@vm.command("snapshot")
@click.argument("name")
@with_store()
@message_option
@meta_option
@ttl_option
@click.option("--disk-only", is_flag=True,
              help="Snapshot the disk alone, not the VM's memory.")
@json_option
def vm_snapshot(name, store, message, meta, ttl, disk_only, as_json):
    """Checkpoint VM NAME (pausing it briefly); print the id last.

    A running VM created with memory checkpoints (the default) is
    checkpointed whole: its disk, and its RAM and device state as a memory
    snapshot that the disk snapshot's vm.memory names.

    \b
    Example:
      blockdiff vm snapshot box -m "pip install" --meta step=3
    """
    import dataclasses

    from blockdiff.vm.checkpoint import memory_of

    box = _sandbox(store, name)
    snapshot_id = box.checkpoint(message, meta, ttl=ttl, memory=False if disk_only else None)
    t = box.last_checkpoint
    if as_json:
        return emit_json({"id": snapshot_id, "vm": name,
                          "memory": memory_of(box.store.get(snapshot_id).meta),
                          "timing": None if t is None else dataclasses.asdict(t)})
    if t:
        what = (f", memory {t.memory_bytes / (1 << 20):.1f} MiB stored" if t.memory
                else ", disk only")
        click.echo(f"paused {t.paused * 1000:.1f} ms (freeze {t.freeze * 1000:.1f} ms{what})")
    click.echo(snapshot_id)


@vm.command("restore")
@click.argument("name")
@click.argument("snapshot_id", metavar="ID")
@with_store()
@click.option("--disk-only", is_flag=True,
              help="Restore the files only: the VM's processes end and the disk is swapped "
                   "under the running guest, even for a checkpoint with memory.")
@json_option
def vm_restore(name, snapshot_id, store, disk_only, as_json):
    """Put VM NAME back to checkpoint ID.

    A checkpoint with memory brings the VM back running, with the processes
    it had, whether it was running or stopped. Otherwise (or with
    --disk-only) a running VM's processes end and its disk is swapped under
    it, without a reboot; a stopped VM stays stopped.

    \b
    Example:
      blockdiff vm restore box 3f2a9c0d1e2b4a5c
      blockdiff vm restore box 3f2a9c0d1e2b4a5c --disk-only
    """
    import dataclasses

    box = _sandbox(store, name)
    snapshot_id = box.store.resolve(snapshot_id)
    result = box.restore(snapshot_id, disk_only=disk_only)
    if as_json:
        return emit_json({"vm": name, "snapshot": snapshot_id, "running": box.running}
                         | dataclasses.asdict(result))
    how = ("running, resumed with its processes" if result.memory else "rebooted" if result.rebooted
           else "running" if box.running else "stopped")
    click.echo(f"VM {name} at {snapshot_id} ({how}, {result.seconds * 1000:.0f} ms)")


@vm.command("fork")
@click.argument("name")
@click.argument("snapshot_id", metavar="ID")
@click.argument("new_name", metavar="NEWNAME")
@with_store()
@click.option("--no-start", is_flag=True, help="Leave the new VM stopped.")
@click.option("--disk-only", is_flag=True,
              help="Fork the files only and boot, even from a checkpoint with memory.")
@json_option
def vm_fork(name, snapshot_id, new_name, store, no_start, disk_only, as_json):
    """Make VM NEWNAME, like NAME, from checkpoint ID, and start it.

    From a checkpoint with memory, the new VM resumes running where the
    checkpoint was taken (its processes included) instead of booting.

    \b
    Example:
      blockdiff vm fork box 3f2a9c0d1e2b4a5c box-b
    """
    box = _sandbox(store, name)
    snapshot_id = box.store.resolve(snapshot_id)
    with progress_bar("vm fork", as_json=as_json) as progress:
        other = box.fork(snapshot_id, new_name, start=not no_start, disk_only=disk_only,
                         progress=progress)
    result = other.last_fork
    if as_json:
        sources = {"spare": "spare", "standby copy": "standby", "": "layers"}
        return emit_json({"vm": new_name, "forked_from": snapshot_id, "running": not no_start,
                          "memory": result.memory,
                          "memory_from": sources[result.memory_source] if result.memory else None,
                          "disk_from": sources[result.disk_source],
                          "prestarted": result.prestarted})
    state = "" if no_start else (", resumed with its processes" if result.memory
                                 else ", booted")
    click.echo(f"VM {new_name} forked from {snapshot_id}{state}")


@vm.command("stop")
@click.argument("name")
@with_store()
def vm_stop(name, store):
    """Shut VM NAME down (cleanly; killed if it does not power off).

    \b
    Example:
      blockdiff vm stop box
    """
    _sandbox(store, name).stop()
    click.echo(f"VM {name} stopped")


@vm.command("rm")
@click.argument("name")
@with_store()
def vm_rm(name, store):
    """Stop VM NAME and delete it; its snapshots stay in the store.

    \b
    Example:
      blockdiff vm rm box
    """
    _sandbox(store, name).destroy()
    click.echo(f"removed VM {name}")


@vm.command("ls")
@with_store()
@json_option
def vm_ls(store, as_json):
    """List the store's VMs: state, accelerator, whether their checkpoints hold
    memory, and the snapshot each descends from (and whether it has memory).

    The state is what QEMU says (running, paused, waiting) or an operation
    under way or interrupted (restoring, restore interrupted, fork
    incomplete...), which the next command on the VM finishes or undoes.

    \b
    Example:
      blockdiff vm ls --json
    """
    from blockdiff.vm.sandbox import Sandbox

    statuses = [box.status() for box in Sandbox.list(store)]
    if as_json:
        return emit_records(statuses)
    for s in statuses:
        state = f"{s.state} (pid {s.pid}, {s.accel})" if s.pid is not None else s.state
        kind = "whole-VM" if s.memory else "disk-only"
        held = "" if s.snapshot is None else (" (with memory)" if s.snapshot_memory
                                              else " (disk only)")
        click.echo(f"{printable(s.name):20} {state:28} {kind:10} {printable(s.snapshot)}{held}")


COMMANDS = (vm,)
