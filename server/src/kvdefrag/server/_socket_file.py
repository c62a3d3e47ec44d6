"""The unix socket file a server listens on: private while it binds, removed only by its owner.

gRPC creates the socket file when it binds, with the process umask, and unlinks whatever
socket sits at the path it bound when it stops. So the server binds in a directory only
its user may enter and publishes the finished file under the public name::

    PATH                        the address: unix:PATH
    DIR/.kvdefrag-XXXXXXXX/s    where gRPC binds (mode 0700 directory), then chmod 0600
    link s -> PATH              fails if PATH appeared meanwhile (never replaces a file)
    unlink s, rmdir             gRPC's own unlink at stop then finds nothing of anyone's

and remembers PATH's ``(st_dev, st_ino)``: ``remove()`` unlinks PATH only while it is
still that file, never the socket of a server that replaced this one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import socket
import stat
import tempfile
from collections.abc import Iterator

from kvdefrag.common import InvalidArgument

_LOGGER = logging.getLogger(__name__)

# sockaddr_un.sun_path holds 108 bytes, the terminating NUL included.
MAX_SOCKET_PATH_BYTES = 107
_PRIVATE_PREFIX = ".kvdefrag-"
_PRIVATE_NAME = "s"


@dataclasses.dataclass(frozen=True)
class SocketFile:
    """A socket file this process created: its path and the inode it has there."""

    path: str
    device_id: int
    inode: int

    def is_in_place(self) -> bool:
        """True while ``path`` is still this very file."""
        try:
            info = os.lstat(self.path)
        except FileNotFoundError:
            return False
        return (info.st_dev, info.st_ino) == (self.device_id, self.inode)

    def remove(self) -> bool:
        """Unlinks ``path`` if it is still this file; returns whether it did.

        NOTE: another server replaces a stale file only once nobody listens on it, so
        between the check and the unlink a replacement is not expected; the check
        keeps a server that stopped from removing one that bound since.
        """
        if not self.is_in_place():
            _LOGGER.info("not removing %s: it is another server's socket now", self.path)
            return False
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        return True


def check_path(path: str) -> None:
    """Removes a stale socket file; refuses a live one or a file that is not a socket.

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


def publish(private_path: str, path: str) -> SocketFile:
    """Makes the bound socket at ``private_path`` owner-only and links it to ``path``.

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
    return SocketFile(path, info.st_dev, info.st_ino)


def _taken(path: str) -> OSError:
    return OSError(errno.EADDRINUSE, f"address unix:{path} is taken: a live server listens on it")
