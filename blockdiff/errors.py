"""Every error blockdiff shows a user, in one table: a family per exit status,
each status meaning one thing.

Library code raises these (or ``OSError`` with errno and path, which the CLI
reports with status 1); only the CLI turns them into one line on stderr and
an exit status. Anything else escaping the library is a bug and keeps its
traceback. A class's docstring says when it is raised; the message, built
where it is raised, says what happened and what to do. The README's table of
exit statuses lists exactly the statuses here (``tests/test_errors.py``).
"""

from __future__ import annotations


class BlockdiffError(Exception):
    """Something the user can fix; the message says what and how."""

    exit_code = 1


# 1: the operating system refused or failed; OSError is reported with it too.


class FilesystemError(BlockdiffError):
    """A filesystem that cannot serve: a scratch filesystem (the demo's, the
    tests') that could not be made, mounted or taken down (a tool missing or
    failing, no loop device), or one without the room an operation needs
    (:class:`NoSpace`)."""

    exit_code = 1


class NoSpace(FilesystemError):
    """A filesystem has not the room an operation needs (ENOSPC); the
    message says how much, and what was left as it was."""


# 2


class UsageError(BlockdiffError):
    """The arguments do not make sense together."""

    exit_code = 2


# 3, 4, 5: the diff engine


class InvalidDiff(BlockdiffError):
    """A diff file is not well formed: wrong magic, truncated, bad ranges."""

    exit_code = 3


class ChecksumMismatch(InvalidDiff):
    """A diff's header or data does not match its checksum: it is corrupt."""


class WrongBase(BlockdiffError):
    """The base given to apply is not the one the diff was made against."""

    exit_code = 4


class Unsupported(BlockdiffError):
    """The file or filesystem is in a state the engine refuses to guess about."""

    exit_code = 5


# 6, 7: the snapshot store


class StoreError(BlockdiffError):
    """A store operation that cannot be done as asked."""

    exit_code = 6


class UnknownSnapshot(StoreError):
    """No snapshot has the id (or id prefix) given."""


class AmbiguousId(StoreError):
    """An id prefix that more than one snapshot's id begins with."""


class ImageBusy(StoreError):
    """Another process holds the image being committed or restored."""


class Conflict(StoreError):
    """The catalog changed under an operation (another host or process
    committed, removed or rewrote a snapshot it works on): nothing was done,
    and it may be tried again."""


class ObjectInTheWay(StoreError):
    """A file an operation is placing in a store's ``objects/`` is there
    already (``path``): left by an operation killed before its catalog
    switch, which the sweep removes, or named by a row, which the store
    never replaces."""

    def __init__(self, message: str, path):
        super().__init__(message)
        self.path = path


class Damaged(BlockdiffError):
    """Data that fails its checks: a layer's checksum, a map, a damaged or
    empty database, a restore that differs from what was committed."""

    exit_code = 7


class DatabaseDamaged(Damaged):
    """A database file that is not the database it should be: empty, not
    SQLite, its tables or identity missing."""


class DemoCheckFailed(Damaged):
    """Something the demo restored or forked differs from what it committed,
    or a size it measured is not what it should be."""


# 8, 9: sandbox VMs


class ImageBuildError(BlockdiffError):
    """The VM image could not be built: a package, a tool or an input missing."""

    exit_code = 8


class VMError(BlockdiffError):
    """A sandbox VM problem: QEMU missing or exited, an unknown VM, a guest
    or a QEMU service that does not answer as it should."""

    exit_code = 9


class UnknownVM(VMError):
    """No sandbox VM of the name given."""


class GuestError(VMError):
    """The guest daemon failed a request or cannot be reached."""


class GuestTimeout(GuestError):
    """The guest daemon did not answer in time."""


class DiskUsedEarly(VMError):
    """A guest resuming from a checkpoint used its disk while the disk was
    still being restored beside the resume, or QEMU could not say whether
    it did (the resume then restores the disk first)."""


class NBDError(VMError):
    """An NBD server refused a request or broke the protocol."""


# 10, 11, 12: agent checkpoints


class AgentError(BlockdiffError):
    """An agent thread's request that cannot be done as asked."""

    exit_code = 10


class UnknownThread(AgentError):
    """No thread of the id given."""


class UnknownCheckpoint(AgentError):
    """No checkpoint of the id (or id prefix) given."""


class AmbiguousCheckpoint(AgentError):
    """A checkpoint id prefix that more than one checkpoint's id begins with."""


class ThreadBusy(AgentError):
    """The thread is being run by another process."""


class InDoubt(AgentError):
    """A call was in flight when its process died, and its tool cannot say
    whether it took effect: running it again could do it twice."""


class ThreadFailed(AgentError):
    """A step raised; the thread's last checkpoint is as it was before it."""


class ToolFailed(AgentError):
    """A tool call failed without taking effect."""


class EnvironmentChanged(AgentError):
    """A thread resumed under another model or system prompt than its head
    checkpoint was taken under."""


class SealingError(BlockdiffError):
    """A sealing key that is missing, malformed or not the one a sealed
    checkpoint was sealed with."""

    exit_code = 11


class SaverError(BlockdiffError):
    """The LangGraph checkpointer was asked for something it cannot do."""

    exit_code = 12


class MissingConfigKey(SaverError, ValueError):
    """A LangGraph config without a key the saver needs (``thread_id``)."""


class UnknownSaverCheckpoint(SaverError, LookupError):
    """No LangGraph checkpoint of the id given."""


class NoDiskSnapshot(SaverError):
    """A LangGraph checkpoint that has no disk snapshot to restore."""


class DiskWaitTimeout(SaverError, TimeoutError):
    """A disk snapshot did not finish within the time allowed."""


class ThreadNotEmpty(SaverError, ValueError):
    """A copy of a thread into one that already has checkpoints."""


class UnknownStrategy(SaverError, ValueError):
    """A prune strategy the saver does not know."""


class SnapshotsNotRemoved(SaverError):
    """LangGraph checkpoints were deleted but the store refused to remove
    disk snapshots only they used."""

    def __init__(self, message: str, snapshots: dict[str, BaseException]):
        super().__init__(message)
        self.snapshots = snapshots


# 13: the databases (catalog, agent records, LangGraph checkpoints)


class DatabaseError(BlockdiffError):
    """A database that cannot be used as it is: locked for too long, written
    by a newer blockdiff, refused by SQLite."""

    exit_code = 13


class SchemaTooNew(DatabaseError):
    """A database written by a newer blockdiff, with a schema this one does
    not know."""


class ConstraintFailed(DatabaseError):
    """A change the database refused because it breaks a rule of its schema:
    a row it refers to is gone, a key that must be unique is taken."""


# 14: the object store (S3) shared by several hosts


class RemoteError(BlockdiffError):
    """The object store refused or failed a request: it cannot be reached,
    it refused the credentials, the bucket is missing, a transfer broke off."""

    exit_code = 14


class NoSuchObject(RemoteError):
    """No object under the key asked for: it was never uploaded, or was deleted."""


class ObjectExists(RemoteError):
    """An upload to a key that already holds other content: objects never change."""
