"""The object tier: the layers and maps of a store shared by several hosts,
kept as immutable objects in an object store over the S3 API.

Interface (in the spirit of restic's backends): an :class:`ObjectBackend`
puts a local file under a key (:meth:`~ObjectBackend.put_file`), gets one
into a new file (:meth:`~ObjectBackend.get_file`) or into an open file at an
offset (:meth:`~ObjectBackend.get_into`), and stats, lists and deletes keys.
:class:`S3Remote` is the implementation over boto3; a remote is named by a
URL ``s3://BUCKET/PREFIX``. The endpoint and credentials come from where
boto3 reads them (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID`` and
``AWS_SECRET_ACCESS_KEY``, ``~/.aws/config`` and ``~/.aws/credentials``, a
profile), or from a ``boto3.Session`` given to it; no secret passes through
this module, so none can reach a message, a repr or a log line.

Keys: ``PREFIX/layers/NAME`` for a layer's data file and ``PREFIX/maps/NAME``
for a map file, NAME being the file's name in the store's ``objects/``
(:func:`layer_key`, :func:`map_key`). Those names never change meaning, so
an object never needs to change either.

Immutability: a key is written once. An upload first asks for the key
(HEAD): an object of the same size and digest is already the file (a retried
upload: nothing is sent), any other is refused (:class:`ObjectExists`). The
write itself is conditional (``If-None-Match: *`` on PutObject and on
CompleteMultipartUpload), so that of two hosts racing for one key, one wins
and the other is refused instead of overwriting it. SeaweedFS (4.48) honours
the condition on both; a server that answers it with 501 Not Implemented is
then guarded by the HEAD check alone, which leaves that race open.

Verification: every object carries a digest in its metadata
(``x-amz-meta-blockdiff-digest``: ``crc32c/1MiB:`` and the CRC32C of the
CRC32C of each MiB of the file), computed from the file before any byte is
sent; each part sent is checked against it, so a file that changes while it
is uploaded is refused, not stored half old, half new. A download checks
the object's size (against the size the caller expects, before writing
anything), pins the version it read (``If-Match`` with the ETag on every
ranged GET), and checks the CRC32C of every chunk where the caller gives
them (:class:`ChunkChecksums`: the 16 KiB chunks the store keeps per layer,
covering every byte a restore reads), else the object's digest when it has
one (one pass over the file either way). A mismatch is ``Damaged``;
:meth:`~ObjectBackend.get_file` then leaves nothing under the final name
(the object lands in a temporary file beside it and is renamed only once it
verifies). The digest is a check against damage, not against forgery: who
can write to the bucket can write a matching digest; the store's own chunk
checksums, from its catalog, are the check that matters for layers.

Parallelism and memory: a file larger than one part is uploaded in parts
(multipart upload), ``concurrency`` at a time, each read whole from the file
with ``pread`` (botocore signs and checksums a part, and may resend it); an
object larger than one part is downloaded by ranged GETs, ``concurrency`` at
a time, each response streamed a ``PIECE`` at a time straight into the file
with ``pwrite`` at its offset. Nothing holds an object whole: uploads hold at
most ``concurrency`` x ``part_size`` bytes of data (64 MiB by default),
downloads at most ``concurrency`` x ``PIECE`` (8 MiB). boto3's own
``upload_file`` cannot send the ``If-None-Match`` condition, hence the part
scheduling here (``bench/remote_bench.py`` measures it against boto3's).
A downloaded piece that is all zeros is not written into a new file, so a
sparse file comes back sparse (at ``PIECE`` granularity); object stores have
no holes, so the zeros of holes are uploaded as data.

Errors from boto3 and botocore become a :class:`RemoteError` (exit status
14) of one line: which operation, which object, what to do.
"""

from __future__ import annotations

import abc
import contextlib
import email.utils
import os
import threading
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from blockdiff import native
from blockdiff.engine.files import atomic_output, open_fd
from blockdiff.errors import Damaged, NoSuchObject, ObjectExists, RemoteError

try:
    import boto3
    from botocore import exceptions as boto_errors
    from botocore.config import Config
except ImportError:   # the "remote" extra is not installed
    boto3 = None

MiB = 1 << 20
DIGEST_CHUNK = native.CHUNK_CRC_MAX              # the digest's CRC32C granularity
DIGEST_SCHEME = "crc32c/1MiB"
DIGEST_METADATA = "blockdiff-digest"             # sent as x-amz-meta-blockdiff-digest
PART_SIZE = 8 * MiB
MIN_PART_SIZE = 5 * MiB                          # S3's least part (but the last)
MAX_PARTS = 10_000                               # S3's most parts in one upload
CONCURRENCY = 8
PIECE = MiB                                      # read from a response and written at a time
DELETE_BATCH = 1000                              # S3's most keys in one DeleteObjects
_ZERO_PIECE = bytes(PIECE)

# Error codes meaning "these credentials may not do this".
_CREDENTIALS_REFUSED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                        "InvalidToken", "ExpiredToken", "TokenRefreshRequired", "403"}
_NO_OBJECT = {"NoSuchKey", "NotFound", "404"}


def layer_key(name: str) -> str:
    """The key of a layer's data file, by its name in ``objects/``."""
    return f"layers/{name}"


def map_key(name: str) -> str:
    """The key of a map file, by its name in ``objects/``."""
    return f"maps/{name}"


@dataclass(frozen=True)
class ObjectInfo:
    """An object: its key (below the remote's prefix), size, ETag, the
    digest it was stored with (None when unknown: listings do not carry it,
    and objects not written by blockdiff have none) and, in listings, when
    it was written."""

    key: str
    size: int
    etag: str
    digest: str | None = None
    modified: float | None = None   # when it was written (seconds since the epoch), if known
    # In listings: seconds since it was written, both ends read from the
    # object store's own clock (its Last-Modified against the Date of the
    # listing's answer), so no host's clock enters it. None if unknown.
    age: float | None = None


@dataclass(frozen=True)
class UploadInfo:
    """A multipart upload begun and neither completed nor aborted: its key
    (below the remote's prefix), its id, and its age by the object store's
    own clock (its Initiated against the Date of the listing's answer;
    None if unknown)."""

    key: str
    upload_id: str
    age: float | None


@dataclass(frozen=True)
class ChunkChecksums:
    """The CRC32C of every chunk of some runs of a file, as the store keeps
    them per layer: runs at ``pos`` of ``length`` bytes, cut into ``chunk``-byte
    chunks (a run's last may be shorter), one CRC per chunk in run order."""

    pos: np.ndarray
    length: np.ndarray
    chunk: int
    crcs: np.ndarray

    def __post_init__(self):
        if not 0 < self.chunk <= native.CHUNK_CRC_MAX or native.CHUNK_CRC_MAX % self.chunk:
            raise ValueError(f"a chunk of {self.chunk} bytes does not divide "
                             f"{native.CHUNK_CRC_MAX}")
        object.__setattr__(self, "pos", np.asarray(self.pos, np.uint64))
        object.__setattr__(self, "length", np.asarray(self.length, np.uint64))
        object.__setattr__(self, "crcs", np.asarray(self.crcs, np.uint32))

    def bad_chunks(self, fd: int, offset: int, path) -> tuple[int, int, int]:
        """Check the runs, read from ``fd`` at ``offset`` on: ``(bad chunks,
        chunks, position of the first bad one or -1)``."""
        crcs = native.chunk_crcs(fd, self.pos + np.uint64(offset), self.length, self.chunk,
                                 path)
        if len(crcs) != len(self.crcs):
            raise ValueError("chunk checksums that do not fit their runs")
        bad = np.flatnonzero(crcs != self.crcs)
        if not len(bad):
            return 0, len(crcs), -1
        # The run holding the first bad chunk, by the index of each run's first chunk.
        counts = -(-self.length.astype(np.int64) // self.chunk)
        starts = np.cumsum(counts) - counts
        run = int(np.searchsorted(starts, bad[0], side="right") - 1)
        first = int(self.pos[run]) + (int(bad[0]) - int(starts[run])) * self.chunk
        return len(bad), len(crcs), first

    def end(self) -> int:
        """Where the last run ends: the least size of a file they fit."""
        return int((self.pos + self.length).max()) if len(self.pos) else 0


def mib_crcs(fd: int, offset: int, size: int, path) -> np.ndarray:
    """The CRC32C of each MiB of ``size`` bytes of a file from ``offset``."""
    if size == 0:
        return np.zeros(0, np.uint32)
    return native.chunk_crcs(fd, np.array([offset], np.uint64), np.array([size], np.uint64),
                             DIGEST_CHUNK, path)


def digest_of(crcs: np.ndarray) -> str:
    """The digest of a file whose MiB have the CRC32Cs ``crcs``."""
    return f"{DIGEST_SCHEME}:{native.crc32c(crcs.astype('<u4').tobytes()):08x}"


def _pread(fd: int, length: int, offset: int, path) -> bytes:
    try:
        return os.pread(fd, length, offset)
    except OSError as e:
        raise OSError(e.errno, e.strerror, os.fspath(path)) from None


def _pwrite_all(fd: int, data: bytes, offset: int, path) -> None:
    view = memoryview(data)
    try:
        while view:
            written = os.pwrite(fd, view, offset)
            view, offset = view[written:], offset + written
    except OSError as e:
        raise OSError(e.errno, e.strerror, os.fspath(path)) from None


def _all_zeros(piece: bytes) -> bool:
    if len(piece) == PIECE:
        return piece == _ZERO_PIECE
    return memoryview(_ZERO_PIECE)[:len(piece)] == piece


class _AlreadyThere(Exception):
    """A conditional write found the key taken."""


class _Stopped(Exception):
    """Another part of the same transfer failed: this one gives up."""


class ObjectBackend(abc.ABC):
    """Where a shared store's objects live: files put under keys and got back,
    each key written once. Subclasses name themselves by ``url``."""

    url: str

    @abc.abstractmethod
    def put_file(self, key: str, path: str | os.PathLike,
                 checksums: ChunkChecksums | None = None) -> bool:
        """Store a file under ``key``; True if it was stored, False if the key
        already held this very file. ``checksums``, if given, are checked
        first: a file that fails them is ``Damaged`` and not sent.
        ``ObjectExists`` if the key holds other content."""

    @abc.abstractmethod
    def get_into(self, key: str, fd: int, path: str | os.PathLike, offset: int, size: int,
                 checksums: ChunkChecksums | None = None, *, sparse: bool = False) -> None:
        """Write the object at ``key`` into ``fd`` at ``offset`` (``path``
        names the file in errors) and check it: ``Damaged`` if it is not
        ``size`` bytes (then nothing was written) or fails its digest or
        ``checksums`` (whose positions are the object's). With ``sparse``
        the range already reads as zeros (a new file): pieces of zeros are
        left as holes. ``NoSuchObject`` if there is none."""

    def get_file(self, key: str, path: str | os.PathLike, size: int,
                 checksums: ChunkChecksums | None = None, mode: int = 0o600) -> None:
        """Download the object at ``key`` into a new file at ``path`` (mode
        ``mode`` less the umask), as :meth:`get_into` checks it; the file
        appears under ``path`` only once it verifies, and replaces what was
        there; on any failure nothing is left under ``path`` or beside it."""
        path = os.fspath(path)
        with atomic_output(path, mode) as (fd, _temp):
            native.truncate(fd, size, path)
            self.get_into(key, fd, path, 0, size, checksums, sparse=True)

    @abc.abstractmethod
    def stat(self, key: str) -> ObjectInfo | None:
        """The object at ``key``, or None if there is none."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """The objects whose keys begin with ``prefix``, in key order."""

    @abc.abstractmethod
    def delete(self, keys: Sequence[str]) -> None:
        """Delete the objects at ``keys``; a key with no object is no error."""

    def uploads(self, prefix: str = "") -> Iterator[UploadInfo]:
        """The multipart uploads under way (or left by a writer that died)
        whose keys begin with ``prefix``. A backend without them has none."""
        return iter(())

    def abort(self, upload: UploadInfo) -> None:
        """Abort a multipart upload (its parts are dropped; one completed or
        aborted meanwhile is no error). Its writer, if still at it, fails."""


def _server_now(response: dict) -> float | None:
    """The object store's clock when it answered (its Date header)."""
    date = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    try:
        return email.utils.parsedate_to_datetime(date).timestamp() if date else None
    except (TypeError, ValueError):
        return None


def _age(now: float | None, then) -> float | None:
    return None if now is None or then is None else now - then.timestamp()


def parse_url(url: str) -> tuple[str, str]:
    """``(bucket, prefix)`` of ``s3://BUCKET/PREFIX`` (the prefix may be
    empty; it has no leading or trailing slash)."""
    refused = RemoteError(f"{url!r} is not an object store URL: give s3://BUCKET/PREFIX")
    try:
        parts = urllib.parse.urlsplit(url)
        # A bucket is a name: no port (a malformed one raises here), no
        # user information, no IPv6 address (a malformed one raised above).
        if (parts.scheme != "s3" or not parts.hostname or parts.query or parts.fragment
                or "@" in parts.netloc or parts.port is not None or "[" in parts.netloc):
            raise refused
    except ValueError:
        raise refused from None
    return parts.netloc, parts.path.strip("/")


def normal_url(url: str) -> str:
    """The URL of a remote as it is recorded: ``s3://BUCKET/PREFIX`` (or
    ``s3://BUCKET``), whatever slashes it was given with."""
    bucket, prefix = parse_url(url)
    return f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"


def _public(endpoint: str) -> str:
    """An endpoint URL without any user name or password in it."""
    parts = urllib.parse.urlsplit(endpoint)
    if "@" not in parts.netloc:
        return endpoint
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


def _code(error) -> tuple[str, int]:
    response = getattr(error, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code, status


class S3Remote(ObjectBackend):
    """Objects in an S3 bucket below a prefix, named ``s3://BUCKET/PREFIX``.

    ``part_size`` (a multiple of 1 MiB, at least 5 MiB) is the size of the
    parts of uploads and of the ranged GETs of downloads, ``concurrency`` how
    many run at once. ``session`` is the boto3 session to take the endpoint
    and credentials from (by default a new one, which reads them from the
    environment and ``~/.aws``). Safe to share between threads."""

    def __init__(self, url: str, *, part_size: int = PART_SIZE,
                 concurrency: int = CONCURRENCY, session=None):
        if boto3 is None:
            raise RemoteError("the object store needs boto3: pip install 'blockdiff[remote]'")
        if part_size % MiB or part_size < MIN_PART_SIZE:
            raise ValueError("part_size must be a multiple of 1 MiB, at least 5 MiB")
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.bucket, self.prefix = parse_url(url)
        self.url = normal_url(url)
        self.part_size = part_size
        self.concurrency = concurrency
        config = Config(max_pool_connections=max(10, concurrency))
        try:
            self._client = (session or boto3.session.Session()).client("s3", config=config)
        except boto_errors.BotoCoreError as e:
            raise RemoteError(f"{self.url}: the object store's configuration does not work "
                              f"({type(e).__name__}: {e}); check AWS_* and ~/.aws/config") from e
        except ValueError:
            # botocore's own check of an endpoint URL (AWS_ENDPOINT_URL) that is
            # not one; its text quotes the URL, which may hold a user's password.
            raise RemoteError(f"{self.url}: the object store's endpoint is not a URL; fix "
                              f"AWS_ENDPOINT_URL (or endpoint_url in ~/.aws/config)") from None
        self.endpoint = _public(self._client.meta.endpoint_url)
        # Until the server says it does not know If-None-Match.
        self._conditional = True
        self._bucket_known = False

    def __repr__(self) -> str:
        return f"S3Remote({self.url!r}, endpoint={self.endpoint!r})"

    def object_url(self, key: str) -> str:
        """The URL of the object at ``key``."""
        return f"s3://{self.bucket}/{self._full_key(key)}"

    def _full_key(self, key: str) -> str:
        if not key or key.startswith("/"):
            raise ValueError(f"not an object key: {key!r}")
        return f"{self.prefix}/{key}" if self.prefix else key

    # -- uploads

    def put_file(self, key: str, path: str | os.PathLike,
                 checksums: ChunkChecksums | None = None) -> bool:
        """See :meth:`ObjectBackend.put_file`."""
        path = os.fspath(path)
        with open_fd(path) as fd, self._request("upload", self.object_url(key)):
            size = os.fstat(fd).st_size
            if checksums is not None:
                self._check_chunks(fd, path, 0, size, checksums, key, "upload")
            crcs = mib_crcs(fd, 0, size, path)
            digest = digest_of(crcs)
            existing = self._head(key, missing_ok=True)
            if existing is not None:
                return self._same_or_refuse(key, existing, size, digest)
            try:
                if size <= self.part_size:
                    self._put_whole(key, fd, path, size, crcs, digest)
                else:
                    self._put_parts(key, fd, path, size, crcs, digest)
            except _AlreadyThere:
                # Another writer got there between the HEAD and the write.
                return self._same_or_refuse(key, self._head(key), size, digest)
            return True

    def _same_or_refuse(self, key: str, existing: ObjectInfo, size: int, digest: str) -> bool:
        if existing.size == size and existing.digest == digest:
            return False
        what = ("an object blockdiff did not write" if existing.digest is None
                else "other content")
        raise ObjectExists(f"upload {self.object_url(key)}: the key already holds {what} "
                           f"({existing.size} bytes; objects never change): upload under a "
                           f"new key, or delete the old object if nothing refers to it")

    def _read_part(self, fd: int, path: str, start: int, length: int,
                   crcs: np.ndarray, key: str) -> bytes:
        """A part of the file, checked against the MiB CRCs its digest was made of."""
        data = _pread(fd, length, start, path)
        view = memoryview(data)
        first = start // DIGEST_CHUNK
        changed = len(data) != length or any(
            native.crc32c(view[at:at + DIGEST_CHUNK]) != int(crcs[first + i])
            for i, at in enumerate(range(0, length, DIGEST_CHUNK)))
        if changed:
            raise Damaged(f"upload {self.object_url(key)}: {path} changed while it was being "
                          f"uploaded; nothing was stored: upload it when nothing writes to it")
        return data

    def _put_whole(self, key, fd, path, size, crcs, digest) -> None:
        data = self._read_part(fd, path, 0, size, crcs, key)
        self._conditional_call(self._client.put_object, Bucket=self.bucket,
                               Key=self._full_key(key), Body=data,
                               Metadata={DIGEST_METADATA: digest})

    def _put_parts(self, key, fd, path, size, crcs, digest) -> None:
        full_key = self._full_key(key)
        # Parts grow for a file of more than MAX_PARTS of them, in whole MiB.
        part = max(self.part_size, -(-size // MAX_PARTS // MiB) * MiB)
        upload = self._client.create_multipart_upload(
            Bucket=self.bucket, Key=full_key, Metadata={DIGEST_METADATA: digest},
            ChecksumAlgorithm="CRC32")
        upload_id = upload["UploadId"]

        def send(number_start: tuple[int, int], stop: threading.Event) -> dict:
            number, start = number_start
            data = self._read_part(fd, path, start, min(part, size - start), crcs, key)
            if stop.is_set():
                raise _Stopped
            sent = self._client.upload_part(Bucket=self.bucket, Key=full_key,
                                            UploadId=upload_id, PartNumber=number, Body=data,
                                            ChecksumAlgorithm="CRC32")
            done = {"PartNumber": number, "ETag": sent["ETag"]}
            if sent.get("ChecksumCRC32"):
                done["ChecksumCRC32"] = sent["ChecksumCRC32"]
            return done

        try:
            parts = self._parallel(send, list(enumerate(range(0, size, part), start=1)))
            self._conditional_call(self._client.complete_multipart_upload, Bucket=self.bucket,
                                   Key=full_key, UploadId=upload_id,
                                   MultipartUpload={"Parts": parts})
        except BaseException:
            # The parts sent would otherwise be kept (and billed) until aborted.
            with contextlib.suppress(Exception):
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=full_key,
                                                    UploadId=upload_id)
            raise

    def _conditional_call(self, call: Callable, **kwargs):
        """``call(**kwargs)``, a write that must create its key: with
        ``If-None-Match: *`` while the server honours it; ``_AlreadyThere``
        when the key is taken."""
        if self._conditional:
            try:
                return call(IfNoneMatch="*", **kwargs)
            except boto_errors.ClientError as e:
                code, status = _code(e)
                if code == "PreconditionFailed" or status == 412:
                    raise _AlreadyThere from None
                if code != "NotImplemented" and status != 501:
                    raise
                self._conditional = False   # from now on the HEAD check alone guards keys
        return call(**kwargs)

    # -- downloads

    def get_into(self, key: str, fd: int, path: str | os.PathLike, offset: int, size: int,
                 checksums: ChunkChecksums | None = None, *, sparse: bool = False) -> None:
        """See :meth:`ObjectBackend.get_into`."""
        path = os.fspath(path)
        with self._request("download", self.object_url(key)):
            info = self._head(key)
            if info.size != size:
                raise Damaged(f"download {self.object_url(key)}: the object is {info.size} "
                              f"bytes where {size} were expected: it is not the object the "
                              f"store refers to; nothing was written to {path}")
            full_key = self._full_key(key)

            def fetch(start: int, stop: threading.Event) -> None:
                self._fetch(full_key, info.etag, fd, path, offset, start,
                            min(self.part_size, size - start), sparse, stop)

            self._parallel(fetch, range(0, size, self.part_size))
        # The caller's chunk checksums, where given, are the check that matters
        # (the store's own, from its catalog, over every byte a restore
        # reads): the object's digest is then not read a second pass for.
        if checksums is None and info.digest is not None and \
                info.digest.startswith(DIGEST_SCHEME + ":"):
            if digest_of(mib_crcs(fd, offset, size, path)) != info.digest:
                raise Damaged(f"download {self.object_url(key)}: the object does not match "
                              f"the digest it was stored with: it is damaged in the object "
                              f"store; upload it again from a host whose copy verifies")
        if checksums is not None:
            self._check_chunks(fd, path, offset, size, checksums, key, "download")

    def _fetch(self, full_key: str, etag: str, fd: int, path: str, offset: int, start: int,
               length: int, sparse: bool, stop: threading.Event) -> None:
        """One ranged GET of the version ``etag``, written piece by piece at
        ``offset + start`` on."""
        response = self._client.get_object(Bucket=self.bucket, Key=full_key, IfMatch=etag,
                                           Range=f"bytes={start}-{start + length - 1}")
        done = 0
        with contextlib.closing(response["Body"]) as body:
            while done < length:
                if stop.is_set():
                    raise _Stopped
                piece = body.read(min(PIECE, length - done))
                if not piece:
                    break
                if not (sparse and _all_zeros(piece)):
                    _pwrite_all(fd, piece, offset + start + done, path)
                done += len(piece)
        if done != length:
            raise RemoteError(f"download s3://{self.bucket}/{full_key}: the object store sent "
                              f"{done} of the {length} bytes asked for at {start}; retry")

    def _check_chunks(self, fd: int, path: str, offset: int, size: int,
                      checksums: ChunkChecksums, key: str, operation: str) -> None:
        where = f"{operation} {self.object_url(key)}"
        if checksums.end() > size:
            raise Damaged(f"{where}: the chunk checksums cover {checksums.end()} bytes, the "
                          f"file has {size}: it is not the file they were made of")
        bad, total, first = checksums.bad_chunks(fd, offset, path)
        if not bad:
            return
        if operation == "upload":
            raise Damaged(f"{where}: {bad} of the {total} chunks of {path} fail their CRC32C "
                          f"(the first at byte {first}): the local copy is damaged and was "
                          f"not uploaded; run: blockdiff verify")
        raise Damaged(f"{where}: {bad} of the {total} chunks fail their CRC32C (the first at "
                      f"byte {first}): the object is damaged in the object store; upload it "
                      f"again from a host whose copy verifies")

    # -- keys

    def stat(self, key: str) -> ObjectInfo | None:
        """See :meth:`ObjectBackend.stat`."""
        with self._request("stat", self.object_url(key)):
            return self._head(key, missing_ok=True)

    def _head(self, key: str, missing_ok: bool = False) -> ObjectInfo | None:
        try:
            head = self._client.head_object(Bucket=self.bucket, Key=self._full_key(key))
        except boto_errors.ClientError as e:
            if _code(e)[0] not in _NO_OBJECT:
                raise
            # A HEAD answers 404 for a missing bucket too: tell the two apart.
            self._require_bucket()
            if missing_ok:
                return None
            raise
        self._bucket_known = True
        return ObjectInfo(key, int(head["ContentLength"]), head.get("ETag", ""),
                          head.get("Metadata", {}).get(DIGEST_METADATA))

    def _require_bucket(self) -> None:
        if self._bucket_known:
            return
        try:
            self._client.head_bucket(Bucket=self.bucket)
        except boto_errors.ClientError as e:
            if _code(e)[0] not in _NO_OBJECT:
                raise
            raise boto_errors.ClientError({"Error": {"Code": "NoSuchBucket"}},
                                          "HeadBucket") from None
        self._bucket_known = True

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """See :meth:`ObjectBackend.list`."""
        below = f"{self.prefix}/" if self.prefix else ""
        with self._request("list", f"{self.url}/{prefix}*"):
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=below + prefix)
            for page in pages:
                now = _server_now(page)
                for item in page.get("Contents", ()):
                    written = item.get("LastModified")
                    yield ObjectInfo(item["Key"][len(below):], int(item["Size"]),
                                     item.get("ETag", ""), None,
                                     None if written is None else written.timestamp(),
                                     _age(now, written))

    def uploads(self, prefix: str = "") -> Iterator[UploadInfo]:
        """See :meth:`ObjectBackend.uploads`."""
        below = f"{self.prefix}/" if self.prefix else ""
        with self._request("list uploads", f"{self.url}/{prefix}*"):
            pages = self._client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=below + prefix)
            for page in pages:
                now = _server_now(page)
                for item in page.get("Uploads", ()):
                    if item["Key"].startswith(below):
                        yield UploadInfo(item["Key"][len(below):], item["UploadId"],
                                         _age(now, item.get("Initiated")))

    def abort(self, upload: UploadInfo) -> None:
        """See :meth:`ObjectBackend.abort`."""
        try:
            with self._request("abort upload", self.object_url(upload.key)):
                self._client.abort_multipart_upload(Bucket=self.bucket,
                                                    Key=self._full_key(upload.key),
                                                    UploadId=upload.upload_id)
        except NoSuchObject:
            pass     # completed or aborted meanwhile

    def delete(self, keys: Sequence[str]) -> None:
        """See :meth:`ObjectBackend.delete`."""
        keys = list(keys)
        for first in range(0, len(keys), DELETE_BATCH):
            batch = keys[first:first + DELETE_BATCH]
            with self._request("delete", self.object_url(batch[0])):
                answer = self._client.delete_objects(Bucket=self.bucket, Delete={
                    "Objects": [{"Key": self._full_key(k)} for k in batch], "Quiet": True})
            errors = answer.get("Errors") or []
            if errors:
                e = errors[0]
                raise RemoteError(f"delete s3://{self.bucket}/{e.get('Key')}: the object store "
                                  f"refused to delete {len(errors)} of {len(batch)} objects "
                                  f"({e.get('Code')}: {e.get('Message')}); retry")

    # -- the machinery

    def _parallel(self, work: Callable, items: Sequence) -> list:
        """``[work(item, stop) for item in items]``, ``concurrency`` at a
        time; the first failure sets ``stop``, cancels what has not started
        and is raised once the rest have stopped."""
        stop = threading.Event()
        if len(items) <= 1:
            return [work(item, stop) for item in items]

        def run(item):
            try:
                return work(item, stop)
            except BaseException:
                stop.set()
                raise

        with ThreadPoolExecutor(min(self.concurrency, len(items)),
                                thread_name_prefix="s3-transfer") as pool:
            futures = [pool.submit(run, item) for item in items]
            try:
                return [f.result() for f in futures]
            except BaseException as caught:
                stop.set()
                for f in futures:
                    f.cancel()
                if isinstance(caught, _Stopped):
                    # Raise the failure that stopped the rest, once they have.
                    for f in futures:
                        failure = None if f.cancelled() else f.exception()
                        if failure is not None and not isinstance(failure, _Stopped):
                            raise failure from None
                raise

    @contextlib.contextmanager
    def _request(self, operation: str, url: str):
        """Turn what boto3 raises in the block into a one-line RemoteError
        naming the operation and the URL it was on."""
        try:
            yield
        except (boto_errors.ClientError, boto_errors.BotoCoreError) as e:
            raise self._translate(e, f"{operation} {url}") from e

    def _translate(self, error: Exception, where: str) -> RemoteError:
        if isinstance(error, boto_errors.ClientError):
            code, status = _code(error)
            message = " ".join(str(error.response.get("Error", {}).get("Message", "")).split())
            if code == "NoSuchBucket":
                return RemoteError(f"{where}: there is no bucket {self.bucket} at "
                                   f"{self.endpoint}: create it, or fix the remote's URL")
            if code in _NO_OBJECT or status == 404:
                return NoSuchObject(f"{where}: no such object: it was never uploaded, or "
                                    f"it was deleted")
            if code in _CREDENTIALS_REFUSED or status == 403:
                return RemoteError(f"{where}: the object store at {self.endpoint} refused the "
                                   f"credentials ({code or status}): check AWS_ACCESS_KEY_ID "
                                   f"and AWS_SECRET_ACCESS_KEY (or the profile in "
                                   f"~/.aws/credentials) and that they may use bucket "
                                   f"{self.bucket}")
            if code == "PreconditionFailed" or status == 412:
                return RemoteError(f"{where}: the object changed while it was being read, "
                                   f"though objects never change: find out what else writes "
                                   f"to the bucket, then retry")
            if status >= 500 or code in ("SlowDown", "ServiceUnavailable", "InternalError"):
                return RemoteError(f"{where}: the object store at {self.endpoint} failed "
                                   f"({code}: {message}); retry later")
            return RemoteError(f"{where}: the object store at {self.endpoint} refused it "
                               f"({code}: {message})")
        if isinstance(error, (boto_errors.NoCredentialsError, boto_errors.PartialCredentialsError,
                              boto_errors.CredentialRetrievalError)):
            return RemoteError(f"{where}: no usable credentials for the object store: set "
                               f"AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or a profile in "
                               f"~/.aws/credentials")
        if isinstance(error, (boto_errors.EndpointConnectionError,
                              boto_errors.ConnectTimeoutError)):
            return RemoteError(f"{where}: cannot reach the object store at {self.endpoint}: "
                               f"start it, or fix AWS_ENDPOINT_URL (or endpoint_url in "
                               f"~/.aws/config)")
        if isinstance(error, (boto_errors.HTTPClientError, boto_errors.ConnectionError,
                              boto_errors.IncompleteReadError)):
            return RemoteError(f"{where}: the connection to the object store at "
                               f"{self.endpoint} broke off ({type(error).__name__}); retry "
                               f"when it is back")
        # botocore's text may quote the endpoint URL as configured, user
        # information and all: only its public form is shown.
        text = str(error).replace(self._client.meta.endpoint_url, self.endpoint)
        return RemoteError(f"{where}: {type(error).__name__}: {text}")
