"""The unix socket file a server listens on: private while it binds, removed only by its owner.

gRPC creates the socket file when it binds, with the process umask, and unlinks whatever
socket sits at the path it bound when it stops. So the server binds in a directory only
its user may enter and publishes the finished file under the public name::

    PATH                        the address: unix:PATH
    DIR/.kvdefrag-XXXXXXXX/s    where gRPC binds (mode 0700 directory), then chmod 0600
    link s -> PATH              fails if PATH appeared meanwhile (never replaces a file)
    unlink s, rmdir             gRPC's own unlink at stop then finds nothing of anyone's

Who owns PATH is decided by a lock, not by the file's inode: before it looks at PATH, a
server takes an exclusive ``flock`` on the sibling ``PATH.lock`` and holds it for its
lifetime::

    PATH.lock                   O_NOFOLLOW, 0600, ours; flock(LOCK_EX) until remove()
    PATH                        touched (stale file removed, socket linked, socket
                                removed at stop) only while the lock is held

A server that stops removes PATH and ``PATH.lock`` while it still holds the lock, then
releases it; a replacement that finds the lock held waits for it while nobody listens on
PATH (the holder is stopping) and refuses the address at once while somebody does. A
child forked from the holder without exec closes its copy of the lock at once
(``os.register_at_fork``): the lock dies with the server, not with its last child.
NOTE: the inode alone cannot tell: a replacement that unlinks the stale file and binds
gets the same ``(st_dev, st_ino)`` back from the file system more often than not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import functools
import logging
import os
import socket
import stat
import tempfile
import time
import weakref
from collections.abc import Iterator

from kvdefrag.common import InvalidArgument

_LOGGER = logging.getLogger(__name__)

# sockaddr_un.sun_path holds 108 bytes, the terminating NUL included.
MAX_SOCKET_PATH_BYTES = 107
_PRIVATE_PREFIX = ".kvdefrag-"
_PRIVATE_NAME = "s"
LOCK_SUFFIX = ".lock"
# How long a new server waits for the lock of a server that no longer listens (it is
# stopping: its grace, then gRPC's shutdown) before it gives up on the address.
LOCK_WAIT_S = 10.0
_LOCK_POLL_S = 0.005
# flock's answers on a file system that has no such locks (NFS without lockd, some FUSE).
_NO_FLOCK_ERRNOS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS})


class PathLock:
    """An exclusive ``flock`` on ``<socket path>.lock``: who holds it owns the path.

    Invariant: while ``is_held``, ``fd`` is open, locked, and is the file at ``path``
    (the holder checked it after locking; only a holder unlinks it).
    """

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self.fd = fd
        self.is_held = True

    @classmethod
    def acquire(cls, socket_path: str, wait_s: float = LOCK_WAIT_S) -> PathLock:
        """Takes the lock of ``socket_path``, waiting while its holder no longer listens.

        Raises:
            InvalidArgument: The lock file is not a regular file of this user, or cannot
                be opened (a symlink, another user's file), or its file system has no
                ``flock`` (``ENOLCK`` and kin: the message names the directory; the lock
                file is removed).
            OSError: A live server listens on ``socket_path``, or the holder of the lock
                has not released it within ``wait_s`` (``errno.EADDRINUSE``).
        """
        lock_path = socket_path + LOCK_SUFFIX
        deadline = time.monotonic() + wait_s
        while True:
            fd = _open_lock_file(lock_path, socket_path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                if _is_listening(socket_path):
                    raise _taken(socket_path) from None
                if time.monotonic() >= deadline:
                    raise OSError(
                        errno.EADDRINUSE,
                        f"address unix:{socket_path} is taken: the server holding "
                        f"{lock_path} did not release it within {wait_s:.0f} s (it is "
                        "stopping, or hangs); stop it or choose another address",
                    ) from None
                time.sleep(_LOCK_POLL_S)
                continue
            except OSError as err:
                if err.errno not in _NO_FLOCK_ERRNOS:
                    os.close(fd)
                    raise
                # NOTE: on this file system nobody can hold the lock, so the file is
                # nobody's: it goes, and nothing is left behind.
                if _same_file(fd, lock_path):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(lock_path)
                os.close(fd)
                raise InvalidArgument(
                    f"address unix:{socket_path}: the file system of "
                    f"{os.path.dirname(socket_path)} does not support flock on its lock "
                    f"file {lock_path} ({err.strerror}), which keeps two servers off one "
                    "address; serve the socket (KVDEFRAG_ADDRESS, or KVDEFRAG_VLLM_RUN_DIR "
                    "for vLLM workers) in a directory on a local file system, e.g. under "
                    "$XDG_RUNTIME_DIR"
                ) from None
            except BaseException:
                os.close(fd)
                raise
            # NOTE: the holder we waited for unlinks the file before releasing it; ours
            # is the lock only if the file we locked is still the one at the path (an
            # open file keeps its inode, so no other file can have its number).
            if _same_file(fd, lock_path):
                lock = cls(lock_path, fd)
                os.register_at_fork(
                    after_in_child=functools.partial(_drop_in_child, weakref.ref(lock))
                )
                return lock
            os.close(fd)

    def release(self) -> None:
        """Removes the lock file, then unlocks it (idempotent)."""
        if not self.is_held:
            return
        self.is_held = False
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        finally:
            os.close(self.fd)


def _drop_in_child(lock_ref: weakref.ref[PathLock]) -> None:
    """In a child forked from the holder: closes its copy of the lock's descriptor.

    A ``flock`` belongs to the open file, which a fork shares: a child forked without
    exec (a worker's helper process) would hold the lock for as long as it lives, and a
    replacement of a killed server would be refused the address. ``O_CLOEXEC`` covers
    an exec, not a fork. The child never owned the path, so it never removes anything.
    """
    lock = lock_ref()
    if lock is not None and lock.is_held:
        lock.is_held = False
        with contextlib.suppress(OSError):
            os.close(lock.fd)


@dataclasses.dataclass(frozen=True)
class SocketFile:
    """A socket file this process created: its path, its inode there, and the path's lock."""

    path: str
    device_id: int
    inode: int
    lock: PathLock

    def is_in_place(self) -> bool:
        """True while ``path`` is still this very file."""
        try:
            info = os.lstat(self.path)
        except FileNotFoundError:
            return False
        return (info.st_dev, info.st_ino) == (self.device_id, self.inode)

    def remove(self) -> bool:
        """Unlinks ``path`` if this server still owns it, then gives the path up.

        Returns whether it unlinked the file. Idempotent: once the lock is released the
        path may be another server's, and is never touched again.
        """
        if not self.lock.is_held:
            return False
        try:
            if not self.is_in_place():
                _LOGGER.info("not removing %s: it is not this server's socket", self.path)
                return False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            return True
        finally:
            self.lock.release()


def _open_lock_file(lock_path: str, socket_path: str) -> int:
    """Opens (creating, 0600) the lock file without following a symlink; checks its owner.

    Raises:
        InvalidArgument: It is not a regular file of this user, or cannot be opened.
    """
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(lock_path, flags, 0o600)
    except FileNotFoundError:
        raise InvalidArgument(
            f"address unix:{socket_path}: directory {os.path.dirname(socket_path)} does not exist"
        ) from None
    except OSError as err:
        raise InvalidArgument(
            f"address unix:{socket_path}: cannot open its lock file {lock_path} ({err}); "
            "remove it if it is a symlink or another user's file, or serve in a directory "
            "only you can write (e.g. under $XDG_RUNTIME_DIR)"
        ) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        os.close(fd)
        raise InvalidArgument(
            f"address unix:{socket_path}: its lock file {lock_path} is not a regular file "
            f"of uid {os.geteuid()} (owner uid {info.st_uid}); remove it, or serve in a "
            "directory only you can write (e.g. under $XDG_RUNTIME_DIR)"
        )
    return fd


def _same_file(fd: int, path: str) -> bool:
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (info.st_dev, info.st_ino) == (held.st_dev, held.st_ino)


def _is_listening(path: str) -> bool:
    """Whether a server accepts connections on the socket file at ``path``."""
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return False
    except FileNotFoundError:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


def check_path(path: str) -> None:
    """Removes a stale socket file; refuses a live one or a file that is not a socket.

    Call it holding the path's ``PathLock``: a socket nobody listens on is then stale,
    not the socket of a server that is starting or stopping.

    Raises:
        InvalidArgument: The directory does not exist, or the file is not a socket.
        OSError: A live server listens on the path (``errno.EADDRINUSE``).
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        if not os.path.isdir(os.path.dirname(path)):
            raise InvalidArgument(
                f"address unix:{path}: directory {os.path.dirname(path)} does not exist"
            ) from None
        return
    if not stat.S_ISSOCK(mode):
        raise InvalidArgument(f"address unix:{path}: {path} exists and is not a socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            _LOGGER.info("removing stale socket file %s (nobody listens on it)", path)
            os.unlink(path)
            return
    raise _taken(path)


@contextlib.contextmanager
def private_bind_path(path: str) -> Iterator[str]:
    """A path in a fresh 0700 directory next to ``path``; the directory goes on exit.

    Raises:
        InvalidArgument: The private path would be too long for a unix socket.
    """
    directory = tempfile.mkdtemp(prefix=_PRIVATE_PREFIX, dir=os.path.dirname(path))
    try:
        private_path = os.path.join(directory, _PRIVATE_NAME)
        if len(os.fsencode(private_path)) > MAX_SOCKET_PATH_BYTES:
            raise InvalidArgument(
                f"address unix:{path}: the server binds in {directory} first, and "
                f"{private_path} is over {MAX_SOCKET_PATH_BYTES} bytes; use a shorter "
                "directory"
            )
        yield private_path
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, _PRIVATE_NAME))
        os.rmdir(directory)


def publish(private_path: str, path: str, lock: PathLock) -> SocketFile:
    """Makes the bound socket at ``private_path`` owner-only and links it to ``path``.

    ``lock`` is ``path``'s lock, held by the caller; the result owns it from then on.

    Raises:
        OSError: Something appeared at ``path`` since it was checked
            (``errno.EADDRINUSE``); it is left alone.
    """
    os.chmod(private_path, 0o600)
    info = os.lstat(private_path)
    try:
        os.link(private_path, path)
    except FileExistsError:
        raise _taken(path) from None
    os.unlink(private_path)
    return SocketFile(path, info.st_dev, info.st_ino, lock)


def _taken(path: str) -> OSError:
    return OSError(errno.EADDRINUSE, f"address unix:{path} is taken: a live server listens on it")
