"""The sandbox VMs of a store: their names, directories and configurations,
and the kernels they boot.

Layout of ``<store>/vms/``::

    .kernels/<key>/{vmlinuz,initrd.img}   kernels, shared by the VMs using them
    .<name>.creating/                     a VM being made (gone once it is there)
    <name>/vm.json                        configuration
    <name>/disk.img                       the disk (reflinked from the store)

Beside these, a VM's directory holds what its QEMU process uses while it
runs (see :mod:`blockdiff.vm.machine`) and what the checkpoint protocol keeps
(see :mod:`blockdiff.vm.sandbox`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from blockdiff.engine.files import copy_file
from blockdiff.engine.identity import sha256_file
from blockdiff.errors import UnknownVM, UsageError, VMError
from blockdiff.store.catalog import Snapshot
from blockdiff.store.store import Store
from blockdiff.vm import intents

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
KERNEL_FILES = ("vmlinuz", "initrd.img")
CONFIG = "vm.json"
DISK = "disk.img"


def check_name(name: str) -> str:
    """``name`` if it can name a VM (and its directory); UsageError otherwise."""
    if not NAME.fullmatch(name or ""):
        raise UsageError(f"bad VM name {name!r}: use letters, digits, '.', '_' and '-'")
    return name


@dataclass(frozen=True)
class VMEntry:
    """One VM of the registry: its directory and its configuration."""

    name: str
    directory: Path
    config: dict
    kernels: Path   # the store's kernel cache

    @property
    def disk(self) -> Path:
        return self.directory / DISK

    @property
    def kernel_dir(self) -> Path:
        """Where the VM's kernel and initramfs are."""
        return self.kernels / self.config["kernel"]

    @property
    def memory_mb(self) -> int:
        return self.config["memory_mb"]

    @property
    def cpus(self) -> int:
        return self.config["cpus"]


class Registry:
    """The VMs under ``<store>/vms/``."""

    def __init__(self, store: Store):
        # Absolute, whatever the store was opened as: QEMU starts in the VM's
        # directory and daemonizes, so it must be given no path relative to
        # this process's working directory (a relative --store).
        self.root = Path(os.path.abspath(store.root)) / "vms"
        self.kernels = self.root / ".kernels"
        self.store_root = store.root
        self._store = store

    def entry(self, name: str) -> VMEntry:
        """VM ``name``; UnknownVM if there is none."""
        directory = self.root / check_name(name)
        try:
            config = json.loads((directory / CONFIG).read_text())
        except FileNotFoundError:
            raise UnknownVM(f"no VM named {name} in {self.store_root}; list them with: "
                            f"blockdiff vm ls") from None
        return VMEntry(name, directory, config, self.kernels)

    def names(self) -> list[str]:
        """Every VM's name, sorted."""
        if not self.root.is_dir():
            return []
        return [d.name for d in sorted(self.root.iterdir())
                if not d.name.startswith(".") and (d / CONFIG).is_file()]

    def add(self, name: str, config: dict, write_disk: Callable[[Path], None], *,
            intent: tuple[str, dict] | None = None) -> VMEntry:
        """A new VM: ``write_disk(path)`` makes its disk, ``config`` (with its
        name and the time added) becomes its ``vm.json``. Everything is made in
        a staging directory and moved in whole, ``vm.json`` last; a name
        already taken is a VMError, and a failure leaves nothing behind.
        ``intent``: ``(op, args)`` of an intent record (blockdiff.vm.intents)
        the VM is registered with, for its maker to remove once it is done.

        The directory holds an intent record from the moment it is made, so
        that one left by a process killed before the VM was registered (no
        ``vm.json``) is known for what it is and made again."""
        check_name(name)
        self.root.mkdir(exist_ok=True)
        directory = self.root / name
        staging = self.root / f".{name}.creating"
        self._reclaim_unregistered(directory)
        try:
            directory.mkdir()
        except FileExistsError:
            raise VMError(f"a VM named {name} already exists; remove it with: "
                          f"blockdiff vm rm {name}") from None
        try:
            op, args = intent or (intents.CREATE, {})
            intents.write(directory, op, **args)
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir()
            write_disk(staging / DISK)
            intents.crash_point("registry.staged")
            config = {"name": name, **config, "created": time.time()}
            (staging / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
            for entry in sorted(staging.iterdir(), key=lambda e: e.name == CONFIG):
                os.replace(entry, directory / entry.name)
            if intent is None:
                intents.clear(directory)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return self.entry(name)

    @staticmethod
    def _reclaim_unregistered(directory: Path) -> None:
        """Remove ``directory`` if a VM's maker left it unregistered (no
        ``vm.json``) when it was killed: its intent record's writer is gone."""
        if not directory.is_dir() or (directory / CONFIG).exists():
            return
        intent = intents.read(directory)
        if intent is not None and not intent.writer_alive():
            shutil.rmtree(directory, ignore_errors=True)

    def remove(self, name: str) -> None:
        """Delete VM ``name``'s directory (its snapshots stay in the store)."""
        shutil.rmtree(self.root / check_name(name))

    # ------------------------------------------------------------ kernels

    def kernel_source(self, kernel: str | os.PathLike | None, image: str | os.PathLike | None,
                      snapshot: Snapshot | None) -> Path:
        """The directory holding the kernel a new VM is to boot: ``kernel`` if
        given, else the image's own directory, else the kernel ``snapshot``
        was taken with."""
        if kernel is not None:
            source = Path(kernel)
            missing = [f for f in KERNEL_FILES if not (source / f).is_file()]
            if missing:
                raise UsageError(f"{source} has no {' or '.join(missing)}; give a directory "
                                 f"made by: blockdiff vm build-image DIR")
            return source
        if image is not None and all((Path(image).parent / f).is_file() for f in KERNEL_FILES):
            return Path(image).parent
        if snapshot is not None and snapshot.meta.get("vm.kernel"):
            installed = self.kernels / snapshot.meta["vm.kernel"]
            if not all((installed / f).is_file() for f in KERNEL_FILES):
                self._fetch_kernel(snapshot.meta["vm.kernel"])
            if all((installed / f).is_file() for f in KERNEL_FILES):
                return installed
        raise UsageError("no kernel for the VM: pass --kernel DIR, a directory made by: "
                         "blockdiff vm build-image DIR")

    def install_kernel(self, source: Path) -> str:
        """Keep the kernel and initramfs under the store, named by their
        content, so a VM still boots after the build directory is gone;
        returns the name (the key of ``vm.json`` and ``vm.kernel``)."""
        if (source.resolve().parent == self.kernels.resolve()
                and re.fullmatch(r"[0-9a-f]{16}", source.name)):
            key = source.name   # installed already, named by its content then (a fork)
        else:
            key = hashlib.sha256("".join(sha256_file(source / f) for f in KERNEL_FILES)
                                 .encode()).hexdigest()[:16]
        target = self.kernels / key
        if not all((target / f).is_file() for f in KERNEL_FILES):
            target.mkdir(parents=True, exist_ok=True)
            for f in KERNEL_FILES:
                copy_file(source / f, target / f)
        # A shared store keeps its kernels too, so a VM's snapshot boots on any host.
        for f in KERNEL_FILES:
            self._store.share_file(f"kernels/{key}/{f}", target / f)
        return key

    def _fetch_kernel(self, key: str) -> None:
        """Bring a kernel another host of a shared store installed from its
        object store, kept only if its files hash to its name (the key is
        their content's); nothing for a store of one host."""
        if self._store.shared is None or not re.fullmatch(r"[0-9a-f]{16}", key):
            return
        staging = self.kernels / f".{key}.{os.getpid()}"
        try:
            staging.mkdir(parents=True)
            for f in KERNEL_FILES:
                if not self._store.fetch_shared_file(f"kernels/{key}/{f}", staging / f):
                    return
            got = hashlib.sha256("".join(sha256_file(staging / f) for f in KERNEL_FILES)
                                 .encode()).hexdigest()[:16]
            if got != key:
                raise VMError(f"kernel {key} in the object store does not match its name; "
                              f"install it again from a host that has it (blockdiff vm "
                              f"create --kernel DIR)")
            with contextlib.suppress(FileExistsError, OSError):
                os.rename(staging, self.kernels / key)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
