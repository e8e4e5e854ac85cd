"""A store shared by several hosts: what joins a host's store directory to
the shared catalog and the object store, and what brings the objects a host
lacks into its ``objects/``.

Each host keeps its own store directory on its own reflink filesystem: the
layers and maps it holds, its staging area, its images and VMs. All hosts
share the catalog (the snapshot tree, the layer records with their chunk
checksums, which host holds which layer, what is uploaded) and the object
store (:mod:`blockdiff.store.remote`), where every layer and map lands once
uploaded. A snapshot is *local* on a host that holds its map and every
layer it uses, and *durable* once all of those are in the object store: from
then on any host can restore it, fetching what it lacks.

The host's directory says where the shared parts are in ``STORE/shared.json``
(private to the owner): the catalog's URL without any secret in it (or a
SQLite file's path, for stores on one machine), this host's id in the
catalog and its name. A password given in the URL at ``init`` (in its user
information or as ``?password=``) goes to ``STORE/catalog.pgpass`` (0600,
libpq's passfile format, matching the host as libpq does) rather than into
the JSON, so it is never printed with the configuration; credentials may
equally come from libpq's environment (``PGPASSWORD``, ``~/.pgpass``). What
is stored and shown of a URL is what :func:`blockdiff.db.public_url` keeps.
``shared.json`` is read like every small file blockdiff reads: a regular
file (never a link followed or a device read), at most
:data:`CONFIG_LIMIT` bytes of UTF-8 JSON, every field checked; anything
else is ``Damaged``. The
object store's URL (``s3://BUCKET/PREFIX``) is a setting of the shared
catalog, the same for every host; its endpoint and credentials come from
the standard places boto3 reads (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``
and ``AWS_SECRET_ACCESS_KEY``, ``~/.aws``) and are never stored.

Fetching (:class:`Fetcher`): a layer or map this host lacks is downloaded
into ``staging/``, checked against the catalog (a layer chunk by chunk
against the CRC32C it keeps, a map by the digest it records: the object
store's contents are never trusted), and only then linked into ``objects/``
under the shared store lock, then recorded as this host's copy, vouched for
since every chunk was just checked. A layer not uploaded yet is refused with
the host that holds it. A local copy found damaged (a restore's check, or
``verify --repair``) is replaced the same way, if the object store has the
object: its row first (a new generation), then the file renamed over.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from blockdiff.db.conninfo import (
    ConninfoError,
    check_url,
    is_url,
    looks_like_keywords,
    passfile_lines,
    public_url,
    refusal,
    secrets_of,
    with_parameter,
)
from blockdiff.engine.files import UnreadableFile, read_json_file
from blockdiff.errors import ConstraintFailed, Damaged, StoreError, UsageError
from blockdiff.store.catalog import Catalog, Snapshot
from blockdiff.store.objects import ObjectFiles, StoreLock, fsync_dir

SHARED_FILE = "shared.json"
PASSFILE = "catalog.pgpass"
REMOTE_SETTING = "remote"
# Bytes a shared.json may have: a few hundred in practice.
CONFIG_LIMIT = 64 * 1024
_HOST_ID = re.compile(r"[0-9a-f]{16}")


@dataclass(frozen=True)
class SharedConfig:
    """Where a host's store finds the parts it shares (``STORE/shared.json``)."""

    catalog: str     # the catalog's URL without a password, or a SQLite file's absolute path
    host: str        # this host's id in the catalog
    name: str        # what messages call this host
    cache_size: int | None = None   # bytes of layer copies kept here (None: no limit)

    def write(self, root: Path) -> None:
        """Write the file (private, never over one)."""
        fd = os.open(root / SHARED_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                     0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"version": 1, **asdict(self)}, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())


def read_config(root: Path) -> SharedConfig | None:
    """The store's shared configuration, or None for a store of one host;
    Damaged if the file is not one this module wrote (see the module's notes)."""
    path = root / SHARED_FILE
    try:
        data = read_json_file(path, CONFIG_LIMIT)
    except FileNotFoundError:
        return None
    except UnreadableFile as e:
        raise _damaged(path, str(e)) from None
    try:
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        if data.pop("version", None) != 1:
            raise ValueError("an unknown version")
        if not {"catalog", "host", "name"} <= set(data) <= {"catalog", "host", "name",
                                                           "cache_size"}:
            # Not named: a name in the file could be anything.
            raise ValueError("fields missing, or others than catalog, host, name and "
                             "cache_size")
        config = SharedConfig(**data)
        if not all(isinstance(v, str) and v and "\0" not in v
                   for v in (config.catalog, config.host, config.name)):
            raise ValueError("fields that are empty or hold a NUL character")
        if not _HOST_ID.fullmatch(config.host):
            raise ValueError("a host id that is not 16 hex digits")
        if config.cache_size is not None and (type(config.cache_size) is not int
                                              or config.cache_size < 0):
            raise ValueError("a cache size that is not a number of bytes")
        if is_url(config.catalog):
            try:
                check_url(config.catalog)
            except ConninfoError as e:
                raise ValueError(f"a catalog URL that cannot be used: {e}") from None
        elif not config.catalog.startswith("/"):
            raise ValueError("a catalog that is neither a database URL nor an absolute path")
    except ValueError as e:
        raise _damaged(path, str(e)) from None
    return config


def _damaged(path: Path, reason: str) -> Damaged:
    return Damaged(f"{path} is damaged ({reason}); it says where the shared catalog is: "
                   f"write it again, or join the store anew with blockdiff init")


def catalog_target(target: str) -> tuple[str, str | None]:
    """``(what shared.json keeps, the password or None)`` of a catalog given
    at ``init``: a PostgreSQL URL without its secrets, the password being
    kept in the passfile (:func:`write_passfile`), or a SQLite file's
    absolute path. A URL that cannot be used is refused (UsageError) before
    anything is made, and so is one whose secret cannot be kept apart
    (``sslpassword``: a service file holds it), or a keyword/value string."""
    if not is_url(target):
        if looks_like_keywords(target):
            raise UsageError("give the catalog as a postgresql:// URL (a keyword/value "
                             "connection string is not taken: it would be taken for a "
                             "SQLite file's name)")
        return str(Path(target).absolute()), None
    try:
        check_url(target)
        secrets = secrets_of(target)
    except ConninfoError as e:
        raise UsageError(refusal(target, e)) from None
    public = public_url(target)
    if "sslpassword" in secrets:
        raise UsageError(f"{public}: blockdiff does not keep an sslpassword, which libpq "
                         f"reads only from the connection string; name a connection "
                         f"service that holds it (?service=NAME, pg_service.conf), or use "
                         f"a key without a passphrase")
    return public, secrets.get("password")


def write_passfile(root: Path, url: str, password: str) -> None:
    """Keep a password given in the catalog URL where libpq reads passwords
    from (its passfile format), private to the owner, for the hosts, port,
    database and user of ``url`` as libpq matches them."""
    try:
        lines = passfile_lines(url, password)
    except ConninfoError as e:
        raise UsageError(f"{public_url(url)}: {e}") from None
    fd = os.open(root / PASSFILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("".join(line + "\n" for line in lines))
        f.flush()
        os.fsync(f.fileno())


def open_catalog(target: str, root: Path, *, create: bool = False) -> Catalog:
    """The shared catalog at ``target``: a database URL, or a SQLite file
    (made when ``create`` and there is none). A new catalog gets its schema
    from the first host that opens it."""
    if is_url(target):
        return Catalog(_open_url(target, root, "catalog"), create=create)
    path = Path(target)
    return Catalog(str(path), create=create and not path.exists())


def _open_url(url: str, root: Path, user: str):
    """A connection to the shared PostgreSQL database, in the schema of one
    of its users (the catalog, the agent records, the LangGraph checkpoints:
    each has tables of its own names), with this host's passfile if any."""
    from blockdiff.db import open_database  # psycopg is needed only here
    passfile = root / PASSFILE
    if passfile.exists():
        url = with_parameter(url, "passfile", str(passfile))
    return open_database(url, schema=user)


def open_shared_database(config: SharedConfig, root: Path, user: str, **options):
    """The database a shared store keeps ``user``'s records in, beside its
    catalog ("agent": the agent records; "langgraph": the LangGraph
    checkpoints): a schema of its own in the catalog's PostgreSQL database,
    or a SQLite file of its own beside the catalog's (``CATALOG-USER.sqlite``,
    made private if missing). ``options`` are SQLite's (``connect``)."""
    if is_url(config.catalog):
        return _open_url(config.catalog, root, user)
    from blockdiff.db import connect
    catalog = Path(config.catalog)
    return connect(catalog.with_name(f"{catalog.stem}-{user}.sqlite"), **options)


def new_host_name(root: Path) -> str:
    """What a host joining with the store directory ``root`` is called."""
    return f"{socket.gethostname()}:{root.resolve()}"


def open_remote(url: str):
    """The object store at ``url`` (``s3://BUCKET/PREFIX``)."""
    from blockdiff.store.remote import S3Remote  # boto3 is needed only here
    return S3Remote(url)


class Fetcher:
    """Brings layers and maps a host lacks from the object store into its
    ``objects/`` (see the module's docstring); safe to share between threads."""

    def __init__(self, catalog: Catalog, files: ObjectFiles, lock: StoreLock, remote,
                 host: str):
        self.catalog = catalog
        self.files = files
        self.lock = lock
        self._remote = remote     # made when first needed
        self.host = host

    @property
    def remote(self):
        """The object store."""
        return self._remote()

    def holders(self, layer: int) -> str:
        """The hosts that hold a layer, as a phrase for messages."""
        names = [name for (name,) in self.catalog.db.execute(
            "SELECT h.name FROM layer_copies c JOIN hosts h ON h.id = c.host "
            "WHERE c.layer = ? ORDER BY c.generation", (int(layer),))]
        return ", ".join(names) if names else "no host"

    def layer(self, layer: int, pos, length, chunk: int, crcs, *,
              replace: bool = False) -> int:
        """Fetch a layer this host lacks, checked against its chunks' CRC32C
        (the runs ``pos``/``length`` cut into ``chunk``-byte chunks, ``crcs``)
        before it enters ``objects/``; the bytes downloaded (0 if another
        process of this host got it first). ``replace``: this host's copy is
        damaged, and is replaced by the object store's."""
        from blockdiff.store.layers import file_identity
        from blockdiff.store.remote import ChunkChecksums, layer_key
        final = self.files.layer_path(layer)
        if final.exists() and not replace:
            return 0
        size, uploaded = self.catalog.uploads([layer]).get(int(layer), (None, None))
        if uploaded is None:
            raise StoreError(f"layer {final.name} is not in the object store yet: it is "
                             f"only on {self.holders(layer)}; run blockdiff push there")
        checksums = ChunkChecksums(pos, length, chunk, crcs)

        def download(staged: Path) -> None:
            self.remote.get_file(layer_key(final.name), staged, size, checksums,
                                 mode=self.files.mode)

        def record(checked: float = 0.0, stat: str = "") -> None:
            with self.catalog.transaction() as db:
                self.catalog.add_copy(db, layer, checked, stat)

        with self.lock.shared():
            try:
                if replace:
                    # The row before the file: a copy placed again is another
                    # file, and the extent maps that relied on the old one stop
                    # holding (blockdiff.store.views) before it changes.
                    self._land(final, download, before=record)
                    self.catalog.mark_checked(layer, time.time(), file_identity(final))
                else:
                    self._land(final, download)
                    record(time.time(), file_identity(final))
            except ConstraintFailed:
                if not replace:
                    with contextlib.suppress(FileNotFoundError):
                        final.unlink()
                raise self._not_recorded(layer, final) from None
        return size

    def _not_recorded(self, layer: int, final: Path) -> StoreError:
        """Why this host's copy of a layer could not be recorded."""
        if self.catalog.layer(layer) is None:
            return StoreError(f"layer {final.name} was removed from the store while it was "
                              f"being fetched")
        if self.host not in self.catalog.host_names():
            return StoreError(f"this host (id {self.host}) is not among the shared catalog's "
                              f"hosts, so it cannot record the copies it fetches: the "
                              f"catalog was replaced or its row removed; join the store "
                              f"again with blockdiff init --catalog ...")
        return StoreError(f"layer {final.name}: this host's copy could not be recorded in "
                          f"the catalog; retry")

    def map(self, snap: Snapshot, *, replace: bool = False) -> None:
        """Fetch the map a snapshot names, checked against the digest the
        catalog records before it enters ``objects/``. ``replace``: this
        host's copy is damaged, and is replaced by the object store's."""
        from blockdiff.store.remote import map_key
        final = self.files.map_path(snap.id, snap.map_sha256)
        if final.exists() and not replace:
            return
        size, uploaded = self.catalog.map_upload(snap)
        if uploaded is None:
            names = self.catalog.host_names()
            where = names.get(snap.host, "the host that committed it") if snap.host else \
                "the host that wrote it"
            raise StoreError(f"snapshot {snap.id} is not in the object store yet: its map is "
                             f"only on {where}; run blockdiff push there")

        def download(staged: Path) -> None:
            key = map_key(final.name)
            self.remote.get_file(key, staged, size, mode=self.files.mode)
            if hashlib.sha256(staged.read_bytes()).hexdigest() != snap.map_sha256:
                raise Damaged(f"download {self.remote.object_url(key)}: the object is not "
                              f"the map the catalog records for snapshot {snap.id} (its "
                              f"digest differs): it is damaged in the object store; nothing "
                              f"was kept; upload it again from a host whose copy verifies")

        with self.lock.shared():
            self._land(final, download, before=(lambda: None) if replace else None)

    def uploaded_map(self, snap: Snapshot) -> bool:
        """Whether the map a snapshot names is in the object store."""
        return self.catalog.map_upload(snap)[1] is not None

    def uploaded_layer(self, layer: int) -> bool:
        """Whether a layer is in the object store."""
        return self.catalog.uploads([layer]).get(int(layer), (None, None))[1] is not None

    def _land(self, final: Path, download, before=None) -> None:
        """Download into a staging file (``download`` checks it), then link
        it into ``objects/``; with ``before``, rename it over the damaged
        file there once ``before()`` ran."""
        staged = self.files.staged(final.name, "fetch")
        try:
            download(staged)
            if before is not None:
                before()
                os.replace(staged, final)
            else:
                with contextlib.suppress(FileExistsError):   # another process was first
                    os.link(staged, final)
        finally:
            with contextlib.suppress(FileNotFoundError):
                staged.unlink()
        fsync_dir(self.files.objects)


def refuse_options(**given) -> None:
    """Options a shared store does not take (yet), refused by name."""
    for name, value in given.items():
        if value:
            raise UsageError(f"--{name.replace('_', '-')} is for stores of one host; a "
                             f"shared store (--catalog) does not take it")

