"""Build a small bootable sandbox VM from Debian packages, reproducibly.

Output, in one directory:

- ``vmlinuz``: a Debian kernel (by default ``linux-image-cloud-amd64``),
  fetched with ``apt-get download`` and unpacked with ``dpkg-deb``;
- ``initrd.img``: a gzip'd cpio archive written here byte for byte (no root,
  no mounts): static busybox, the blockdiff guest daemon compiled statically
  from ``guest/guestd.c``, the virtio modules the kernel lacks in dependency
  order, and ``guest/init``, which mounts the sandbox disk and starts the
  guest daemon;
- ``rootfs.img``: a sparse raw ext4 disk made with ``mkfs.ext4 -d`` from a
  busybox tree: a sandbox disk to start from;
- ``manifest.json``: what went in, with a key over every input. A build whose
  key matches the manifest is skipped, so the directory is a cache.

The kernel and initramfs are the sandbox's "firmware": commands run chrooted
into whatever disk the VM has, so any raw image of a filesystem the kernel
has built in (ext4, for the cloud kernel) can be a sandbox disk with nothing
installed on it.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from blockdiff.engine.identity import sha256_file
from blockdiff.errors import ImageBuildError
from blockdiff.progress import NO_PROGRESS, Progress, Steps

BUILDER_VERSION = 1
GUEST_DIR = Path(__file__).with_name("guest")
DEFAULT_KERNEL_PACKAGE = "linux-image-cloud-amd64"
BUSYBOX_PACKAGE = "busybox-static"
DEFAULT_DISK_SIZE = 1 << 30
# What the guest needs beyond a cloud kernel's built-ins: the PCI transport,
# the disk and the guest daemon's virtio-serial port.
GUEST_MODULES = ("virtio_pci", "virtio_blk", "virtio_console")
FILES = ("vmlinuz", "initrd.img", "rootfs.img")
# Fixed so that two builds of the same inputs give the same disk.
ROOTFS_UUID = "6b1d4f0e-5a5e-4b1d-9d1f-b10cd1ff0001"
FAKE_TIME = "1700000000"


@dataclass(frozen=True)
class Package:
    name: str
    version: str
    sha256: str


def _run(cmd: list[str], what: str, **kwargs) -> str:
    try:
        done = subprocess.run(cmd, check=True, capture_output=True, text=True, **kwargs)
    except FileNotFoundError:
        raise ImageBuildError(f"{what}: {cmd[0]} is not installed; install it "
                              f"(Debian: apt-get install {_provider(cmd[0])})") from None
    except subprocess.CalledProcessError as e:
        detail = (e.stderr or e.stdout or "").strip().splitlines()
        raise ImageBuildError(f"{what} failed: {detail[-1] if detail else e}") from None
    return done.stdout


def _provider(tool: str) -> str:
    return {"apt-get": "apt", "apt-cache": "apt", "dpkg-deb": "dpkg", "gcc": "gcc libc6-dev",
            "mkfs.ext4": "e2fsprogs"}.get(tool, tool)


# ------------------------------------------------------------ packages


def candidate(name: str) -> Package:
    """The version apt would download for ``name``. A kernel metapackage
    resolves to the kernel it depends on (``linux-image-cloud-amd64`` → the
    versioned ``linux-image-6.1.0-…-cloud-amd64``)."""
    fields = _fields(_run(["apt-cache", "show", "--no-all-versions", name],
                          f"looking up {name} (run apt-get update if apt knows no packages)"))
    if "Version" not in fields:
        raise ImageBuildError(f"apt knows no package {name}; run apt-get update or check the name")
    for dep in fields.get("Depends", "").split(","):
        dep = dep.split("(")[0].split("|")[0].strip()
        if name.startswith("linux-image-") and dep.startswith("linux-image-"):
            return candidate(dep)
    return Package(name, fields["Version"], fields.get("SHA256", ""))


def _fields(control: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in control.splitlines():
        if line and not line[0].isspace() and ":" in line:
            key, _, value = line.partition(":")
            out.setdefault(key, value.strip())
    return out


def download(pkg: Package, cache: Path) -> Path:
    """The package's .deb in ``cache``, downloaded unless already there and intact."""
    cache.mkdir(parents=True, exist_ok=True)
    for deb in cache.glob(f"{pkg.name}_*.deb"):
        if sha256_file(deb) == pkg.sha256:
            return deb
        deb.unlink()
    _run(["apt-get", "download", "-q", f"{pkg.name}={pkg.version}"], f"downloading {pkg.name}",
         cwd=cache)
    debs = [d for d in cache.glob(f"{pkg.name}_*.deb") if sha256_file(d) == pkg.sha256]
    if not debs:
        raise ImageBuildError(f"downloaded {pkg.name} does not match apt's checksum; "
                              f"run apt-get update and build again")
    return debs[0]


# ------------------------------------------------------------- modules


def modinfo(ko: Path) -> dict[str, str]:
    """The ``.modinfo`` section of a kernel module (an ELF64 object)."""
    data = ko.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ImageBuildError(f"{ko} is not a 64-bit kernel module")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def section(i):
        name, _type, _flags, _addr, offset, size = struct.unpack_from(
            "<IIQQQQ", data, shoff + i * shentsize)
        return name, offset, size

    _, stroff, _ = section(shstrndx)
    for i in range(shnum):
        name, offset, size = section(i)
        if data[stroff + name:data.index(b"\0", stroff + name)] == b".modinfo":
            info: dict[str, str] = {}
            for item in data[offset:offset + size].split(b"\0"):
                key, eq, value = item.decode(errors="replace").partition("=")
                if eq:
                    info.setdefault(key, value)
            return info
    return {}


def module_load_order(modules_dir: Path, wanted=GUEST_MODULES) -> list[Path]:
    """The ``.ko`` files for ``wanted`` and everything they depend on, each
    after its dependencies. A wanted module with no file is taken to be built
    into the kernel."""
    index = {ko.name.split(".ko")[0].replace("-", "_"): ko for ko in modules_dir.rglob("*.ko")}
    order: list[Path] = []
    seen: set[str] = set()

    def visit(name: str, chain: tuple[str, ...]) -> None:
        if name in seen:
            return
        if name in chain:
            raise ImageBuildError(f"kernel modules depend on each other in a cycle: {chain}")
        ko = index.get(name)
        if ko is None:
            return
        for dep in filter(None, modinfo(ko).get("depends", "").split(",")):
            visit(dep.replace("-", "_"), chain + (name,))
        seen.add(name)
        order.append(ko)

    for name in wanted:
        visit(name, ())
    return order


# ----------------------------------------------------------- initramfs


class Cpio:
    """A newc cpio archive, written deterministically: fixed times and owners."""

    def __init__(self):
        self.out = io.BytesIO()
        self.ino = 1

    def _entry(self, name: str, mode: int, data: bytes = b"", rdev: tuple[int, int] = (0, 0)):
        encoded = name.encode() + b"\0"
        fields = (self.ino, mode, 0, 0, 1, 0, len(data), 0, 0, rdev[0], rdev[1], len(encoded), 0)
        self.ino += 1
        self.out.write(b"070701" + b"".join(b"%08X" % f for f in fields) + encoded)
        self.out.write(b"\0" * (-(110 + len(encoded)) % 4))
        self.out.write(data + b"\0" * (-len(data) % 4))

    def directory(self, name: str) -> None:
        self._entry(name, 0o040755)

    def file(self, name: str, data: bytes, mode: int = 0o755) -> None:
        self._entry(name, 0o100000 | mode, data)

    def char_device(self, name: str, major: int, minor: int) -> None:
        self._entry(name, 0o020600, rdev=(major, minor))

    def finish(self) -> bytes:
        self._entry("TRAILER!!!", 0)
        self.out.write(b"\0" * (-self.out.tell() % 512))
        return self.out.getvalue()


def make_initramfs(busybox: Path, guestd: Path, modules: list[Path]) -> bytes:
    """The gzip'd initramfs: busybox, ``init``, the guest daemon and the modules
    with their load order."""
    cpio = Cpio()
    for d in ("bin", "sbin", "dev", "proc", "sys", "mnt", "lib", "lib/modules"):
        cpio.directory(d)
    # The kernel opens /dev/console before init runs: without the node the
    # init script's messages would never reach the console log.
    cpio.char_device("dev/console", 5, 1)
    cpio.file("bin/busybox", busybox.read_bytes())
    cpio.file("init", (GUEST_DIR / "init").read_bytes())
    cpio.file("sbin/blockdiff-guestd", guestd.read_bytes())
    for ko in modules:
        cpio.file(f"lib/modules/{ko.name}", ko.read_bytes(), 0o644)
    cpio.file("lib/modules/load-order", "".join(f"{ko.name}\n" for ko in modules).encode(), 0o644)
    raw = cpio.finish()
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=6, mtime=0) as gz:
        gz.write(raw)
    return buf.getvalue()


def compile_guestd(out: Path) -> None:
    """The guest daemon, linked statically: the initramfs has no libc."""
    _run(["gcc", "-static", "-Os", "-Wall", "-o", str(out), str(GUEST_DIR / "guestd.c")],
         "compiling the guest daemon (needs gcc and libc6-dev for static linking)")


# -------------------------------------------------------------- rootfs


def make_rootfs(busybox: Path, out: Path, size: int, workdir: Path) -> None:
    tree = workdir / "rootfs"
    for d in ("bin", "sbin", "usr/bin", "usr/sbin", "etc", "root", "home", "proc", "sys",
              "dev", "var", "mnt"):
        (tree / d).mkdir(parents=True, exist_ok=True)
    (tree / "tmp").mkdir(mode=0o1777)
    os.chmod(tree / "tmp", 0o1777)
    shutil.copy(busybox, tree / "bin/busybox")
    os.chmod(tree / "bin/busybox", 0o755)
    for applet in _run([str(busybox), "--list-full"], "listing busybox applets").split():
        link = tree / applet
        if applet != "bin/busybox" and not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(tree / "bin/busybox", link.parent))
    (tree / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (tree / "etc/group").write_text("root:x:0:\n")
    (tree / "etc/hostname").write_text("sandbox\n")
    (tree / "etc/profile").write_text("export PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin\n")
    # mkfs.ext4 -d copies each file's times: fix them for a reproducible disk.
    for path in [tree, *tree.rglob("*")]:
        os.utime(path, (int(FAKE_TIME), int(FAKE_TIME)), follow_symlinks=False)
    env = dict(os.environ, E2FSPROGS_FAKE_TIME=FAKE_TIME)
    _run(["mkfs.ext4", "-q", "-F", "-L", "sandbox", "-U", ROOTFS_UUID,
          "-E", f"hash_seed={ROOTFS_UUID},root_owner=0:0", "-d", str(tree), str(out),
          f"{size // 1024}k"], "making the ext4 root disk", env=env)
    # Inode change times come from the tree and cannot be set there: set them
    # in the image.
    script = workdir / "ctimes.debugfs"
    script.write_text("".join(f"sif /{p.relative_to(tree)} ctime {FAKE_TIME}\n"
                              for p in sorted(tree.rglob("*"))) + f"sif / ctime {FAKE_TIME}\n")
    _run(["debugfs", "-w", "-f", str(script), str(out)], "fixing times in the root disk", env=env)


# --------------------------------------------------------------- build


@dataclass(frozen=True)
class BuiltImage:
    directory: Path
    manifest: dict
    cached: bool

    @property
    def kernel(self) -> Path:
        return self.directory / "vmlinuz"

    @property
    def initrd(self) -> Path:
        return self.directory / "initrd.img"

    @property
    def rootfs(self) -> Path:
        return self.directory / "rootfs.img"


def _inputs_key(kernel: Package, busybox: Package, disk_size: int,
                modules: list[Path] | None) -> str:
    h = hashlib.sha256(f"builder {BUILDER_VERSION}\n".encode())
    for part in (GUEST_DIR / "guestd.c", GUEST_DIR / "init"):
        h.update(part.read_bytes())
    h.update(json.dumps([kernel.__dict__, busybox.__dict__, disk_size, GUEST_MODULES]).encode())
    for ko in modules or ():  # a kernel of your own: its modules are inputs too
        h.update(ko.name.encode() + sha256_file(ko).encode())
    return h.hexdigest()


def read_manifest(directory: str | os.PathLike) -> dict | None:
    try:
        manifest = json.loads((Path(directory) / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    if not all((Path(directory) / f).is_file() for f in FILES):
        return None
    return manifest


def build_image(directory: str | os.PathLike, *, kernel_package: str = DEFAULT_KERNEL_PACKAGE,
                kernel_image: str | os.PathLike | None = None,
                modules: str | os.PathLike | None = None,
                disk_size: int = DEFAULT_DISK_SIZE, force: bool = False,
                progress: Progress = NO_PROGRESS) -> BuiltImage:
    """Build (or find already built) the VM image in ``directory``.

    The kernel is the Debian package ``kernel_package``, or a kernel of your
    own: ``kernel_image`` (a bzImage) with ``modules``, the directory holding
    its ``.ko`` files (``lib/modules/<release>``). Drivers it lacks as modules
    are taken to be built in. Each step of a build is a phase of ``progress``."""
    directory = Path(directory)
    if disk_size < 16 << 20:
        raise ImageBuildError("the root disk needs at least 16 MiB")
    local_modules = None
    if kernel_image is not None:
        kernel_image = Path(kernel_image)
        if not kernel_image.is_file():
            raise ImageBuildError(f"no kernel image at {kernel_image}")
        kernel = Package(f"file:{kernel_image.resolve()}", "", sha256_file(kernel_image))
        local_modules = module_load_order(Path(modules)) if modules is not None else []
    elif modules is not None:
        raise ImageBuildError("--modules goes with a kernel image of your own (--kernel-image)")
    else:
        kernel = candidate(kernel_package)
    busybox_pkg = candidate(BUSYBOX_PACKAGE)
    key = _inputs_key(kernel, busybox_pkg, disk_size, local_modules)
    manifest = read_manifest(directory)
    if manifest and manifest.get("key") == key and not force:
        return BuiltImage(directory, manifest, cached=True)

    directory.mkdir(parents=True, exist_ok=True)
    cache = directory / ".debs"
    steps = Steps(progress, 7 if kernel_image is None else 6)
    steps.begin(f"downloading {busybox_pkg.name}")
    busybox_deb = download(busybox_pkg, cache)
    with tempfile.TemporaryDirectory(prefix=".build-", dir=directory) as tmp:
        work = Path(tmp)
        if kernel_image is None:
            steps.begin(f"downloading and unpacking {kernel.name}")
            _run(["dpkg-deb", "-x", str(download(kernel, cache)), str(work / "kernel")],
                 "unpacking the kernel")
            vmlinuz = sorted((work / "kernel/boot").glob("vmlinuz-*"))
            module_dirs = sorted((work / "kernel/lib/modules").glob("*"))
            if not vmlinuz or not module_dirs:
                raise ImageBuildError(f"{kernel.name} has no /boot/vmlinuz-* and /lib/modules; "
                                      f"pick a Debian kernel image package")
            kernel_file, release = vmlinuz[0], module_dirs[0].name
            guest_modules = module_load_order(module_dirs[0])
        else:
            kernel_file, guest_modules = kernel_image, local_modules
            release = Path(modules).name if modules is not None else "custom"
        steps.begin("unpacking busybox")
        _run(["dpkg-deb", "-x", str(busybox_deb), str(work / "busybox")], "unpacking busybox")
        busybox = work / "busybox/bin/busybox"
        guestd = work / "blockdiff-guestd"
        steps.begin("compiling the guest daemon")
        compile_guestd(guestd)
        steps.begin("packing the initramfs")
        (work / "initrd.img").write_bytes(make_initramfs(busybox, guestd, guest_modules))
        shutil.copyfile(kernel_file, work / "vmlinuz")
        steps.begin("making the root disk (mkfs.ext4)")
        make_rootfs(busybox, work / "rootfs.img", disk_size, work)
        steps.begin("checksumming the image")
        manifest = {
            "key": key,
            "builder": BUILDER_VERSION,
            "kernel": kernel.__dict__ | {"release": release},
            "busybox": busybox_pkg.__dict__,
            "modules": [ko.name for ko in guest_modules],
            "disk_size": disk_size,
            "sha256": {f: sha256_file(work / f) for f in FILES},
        }
        (directory / "manifest.json").unlink(missing_ok=True)
        for f in FILES:
            os.replace(work / f, directory / f)
        tmp_manifest = work / "manifest.json"
        tmp_manifest.write_text(json.dumps(manifest, indent=2) + "\n")
        os.replace(tmp_manifest, directory / "manifest.json")
    steps.end()
    return BuiltImage(directory, manifest, cached=False)
