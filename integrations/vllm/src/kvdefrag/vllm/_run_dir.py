"""The run directory: private to this user, and no file in it is reached through a link.

kvdefrag's workers and scheduler meet in one directory (``KVDEFRAG_VLLM_RUN_DIR``): the
rank sockets and ``ranks.json`` (every rank's address and identity secret) live there. A
directory another user may write would let that user plant a symlink where a file is
written (rank 0, often root, would write through it), swap ``ranks.json`` (the scheduler
would step someone else's service) or read the secrets. So::

    create      every missing directory mode 0700, the same whatever the umask
    accept      a directory of this user, not a symlink, mode & 0o077 == 0; else refuse
                (UnsafeRunDir, saying how to fix it)
    write       O_CREAT|O_EXCL|O_NOFOLLOW, 0600, under a random name, relative to the
                checked directory's descriptor; then rename to the final name there
    read        O_NOFOLLOW relative to the checked directory; a regular file of this
                user that group and others cannot reach, else refuse

NOTE: the directories above an existing run directory are not checked: choose one whose
parents only you and root can change (``$XDG_RUNTIME_DIR`` is made so by the system).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Iterator

from kvdefrag.vllm.errors import UnsafeRunDir

_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_NAME_ATTEMPTS = 16


def ensure_private_dir(path: str) -> None:
    """Creates ``path`` and every missing parent mode 0700; checks ``path`` is private.

    Parents that already exist are left as they are; every directory created here (by
    this process, or meanwhile by another rank of the engine) must be private too.

    Raises:
        UnsafeRunDir: ``path``, or a directory created on the way, is not private.
    """
    missing: list[str] = []
    current = os.path.normpath(path)
    while not os.path.lexists(current):
        missing.append(current)
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            pass  # another rank created it: checked below like any other
        else:
            # NOTE: mkdir's mode passes through the umask; set it exactly, on the
            # directory just made (not through a link that replaced it).
            with _opened_private_dir(directory, fix_mode=True):
                pass
            continue
        with _opened_private_dir(directory):
            pass
    with _opened_private_dir(path):
        pass


def write_private_file(directory: str, name: str, data: bytes) -> None:
    """Writes ``directory/name`` (0600) atomically, following no link, replacing nothing
    but the final name.

    Raises:
        UnsafeRunDir: ``directory`` is not private.
    """
    with _opened_private_dir(directory) as dir_fd:
        partial, fd = _create_exclusive(dir_fd, name)
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            # NOTE: rename replaces a link at the final name, never what it points to.
            try:
                os.rename(partial, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except IsADirectoryError:
                raise UnsafeRunDir(
                    f"kvdefrag: {os.path.join(directory, name)} is a directory, where "
                    "kvdefrag writes a file: remove it and restart vLLM"
                ) from None
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(partial, dir_fd=dir_fd)
            raise


def read_private_file(directory: str, name: str) -> bytes:
    """Reads ``directory/name``: a regular file of this user in a private directory,
    reached through no link.

    Raises:
        FileNotFoundError: There is no such file.
        UnsafeRunDir: The directory or the file is not private, or the file is a link.
    """
    path = os.path.join(directory, name)
    with _opened_private_dir(directory) as dir_fd:
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(name, flags, dir_fd=dir_fd)
        except OSError as err:
            if err.errno != errno.ELOOP:
                raise
            raise UnsafeRunDir(
                f"kvdefrag: {path} is a symlink; kvdefrag reads only the file rank 0 wrote: "
                f"remove it and restart vLLM"
            ) from None
        # NOTE: checked before fdopen, which refuses a directory naming only the fd.
        try:
            problem = _file_problem(os.fstat(fd))
        except BaseException:
            os.close(fd)
            raise
        if problem:
            os.close(fd)
            raise UnsafeRunDir(
                f"kvdefrag: {path} {problem}; kvdefrag reads only the file rank 0 "
                "wrote (0600): remove it and restart vLLM"
            )
        with os.fdopen(fd, "rb") as file:
            return file.read()


@contextlib.contextmanager
def _opened_private_dir(path: str, *, fix_mode: bool = False) -> Iterator[int]:
    """A descriptor of the directory ``path`` once it is checked private."""
    try:
        fd = os.open(path, _DIRECTORY_FLAGS)
    except FileNotFoundError:
        raise
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR):
            what = "a symlink" if os.path.islink(path) else "not a directory"
            raise UnsafeRunDir(
                f"kvdefrag: the run directory {path} is {what}: name a real directory "
                "private to this engine (e.g. under $XDG_RUNTIME_DIR; kvdefrag creates it "
                "0700)"
            ) from None
        raise
    try:
        if fix_mode and os.fstat(fd).st_uid == os.geteuid():
            os.fchmod(fd, 0o700)
        problem = _directory_problem(os.fstat(fd), path)
        if problem:
            raise UnsafeRunDir(f"kvdefrag: the run directory {path} {problem}")
        yield fd
    finally:
        os.close(fd)


def _directory_problem(info: os.stat_result, path: str) -> str:
    uid = os.geteuid()
    if info.st_uid != uid:
        return (
            f"belongs to uid {info.st_uid}, not to this process (uid {uid}): another user "
            f"could plant links or swap ranks.json there. Use a directory of your own, "
            "e.g. under $XDG_RUNTIME_DIR (kvdefrag creates it 0700)"
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        return (
            f"has mode {mode:04o}: group or others may reach it. Run `chmod 700 {path}`, "
            "or choose a new directory under $XDG_RUNTIME_DIR (kvdefrag creates it 0700)"
        )
    return ""


def _file_problem(info: os.stat_result) -> str:
    uid = os.geteuid()
    if not stat.S_ISREG(info.st_mode):
        return "is not a regular file"
    if info.st_uid != uid:
        return f"belongs to uid {info.st_uid}, not to this process (uid {uid})"
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        return f"has mode {mode:04o}: group or others may reach it"
    return ""


def _create_exclusive(dir_fd: int, name: str) -> tuple[str, int]:
    """Creates a new 0600 file under a random name next to ``name``; returns both."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(_MAX_NAME_ATTEMPTS):
        partial = f".{name}.{secrets.token_hex(8)}"
        try:
            return partial, os.open(partial, flags, 0o600, dir_fd=dir_fd)
        except FileExistsError:
            continue  # something is there already (planted or not): never reuse it
    raise FileExistsError(
        errno.EEXIST, f"kvdefrag: no free name for a new {name} after {_MAX_NAME_ATTEMPTS} tries"
    )
