"""Places only the current user can have written: where fedagg builds and loads native code.

Loading a shared library runs its constructors in the loading process, so a library that
another local user could have written or replaced is code execution as this user. fedagg
loads two kinds of native code (the accumulator's fold kernel, the collectives' plan runner)
and each is loaded only from a file that passes these checks (the rules of OpenSSH's
``StrictModes``):

* the directory that holds it is owned by the current uid and writable by nobody else
  (no group / other write bit), and is not a symbolic link; fedagg creates its own
  directories with mode 0700;
* the file is a regular file (not a symbolic link, a FIFO, a device), owned by the current
  uid, and writable by nobody else;
* for a path checked by name (:func:`check_path`), every directory above it is owned by the
  current uid or by root and writable by nobody else, or is sticky (``/tmp``: others may add
  entries there but not rename or remove this user's).

:func:`private_dir` and :func:`open_file` check an open file descriptor (``fstat``), so what is
checked is what is loaded (load ``/proc/self/fd/N``); :func:`check_path` checks by name, for a
loader that takes a path. A failed check raises :class:`NotOwned`, whose message names the
path, what is wrong and how to fix it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

from fedagg.errors import FedaggError

__all__ = ["NotOwned", "check_path", "fd_path", "fix", "open_file", "private_dir"]


class NotOwned(FedaggError):
    """A path another local user could have written: not to be loaded."""

    def __init__(self, path: str | Path, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path} {problem}")


def fix(exc: NotOwned, env: str = "FEDAGG_CACHE_DIR") -> str:
    """What to do about a failed check: make the path private, or use another directory."""
    return (f"remove {exc.path} (or, if you made it, make it yours and private: "
            f"chown $(id -un) {exc.path}; chmod go-w {exc.path}), or set {env} to a directory "
            "only you can write")


def _mode(st: os.stat_result) -> str:
    return f"mode {stat.S_IMODE(st.st_mode):04o}"


def _check_owner(path: str | Path, st: os.stat_result, what: str) -> None:
    uid = os.getuid()
    if st.st_uid != uid:
        raise NotOwned(path, f"is a {what} owned by uid {st.st_uid}, not by this user "
                             f"(uid {uid})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise NotOwned(path, f"is a {what} other users can write ({_mode(st)})")


def private_dir(path: str | Path) -> int:
    """Open ``path`` as a directory only this user can write, creating it with mode 0700.

    Parameters
    ----------
    path : str or Path
        The directory. Missing parents are created with the process's umask.

    Returns
    -------
    int
        A file descriptor of the directory (``O_DIRECTORY``); close it with ``os.close``.

    Raises
    ------
    NotOwned
        The path exists but is a symbolic link, not a directory, owned by another uid, or
        writable by group / others.
    OSError
        The directory cannot be created or opened (read-only file system, no permission on a
        parent, a parent that is a file).
    """
    p = Path(path)
    if not os.path.lexists(p):
        p.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):  # a concurrent creator
            os.mkdir(p, 0o700)
    st = os.lstat(p)
    if stat.S_ISLNK(st.st_mode):
        raise NotOwned(p, "is a symbolic link, not a directory of this user")
    if not stat.S_ISDIR(st.st_mode):
        raise NotOwned(p, "is not a directory")
    try:
        fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NotOwned(p, "was replaced while it was checked") from None
        raise
    try:
        _check_owner(p, os.fstat(fd), "directory")
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file(dir_fd: int, name: str, where: str | Path) -> int | None:
    """Open ``name`` inside an already checked directory, or ``None`` if it does not exist.

    Parameters
    ----------
    dir_fd : int
        A descriptor from :func:`private_dir`.
    name : str
        A plain file name (no ``/``).
    where : str or Path
        The directory's path, for messages.

    Returns
    -------
    int or None
        A read-only descriptor of the file, checked with ``fstat``.

    Raises
    ------
    NotOwned
        ``name`` is a symbolic link, not a regular file, owned by another uid, or writable by
        group / others.
    """
    shown = Path(where) / name
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotOwned(shown, "is a symbolic link, not a file of this user") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotOwned(shown, "is not a regular file")
        _check_owner(shown, st, "file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def fd_path(fd: int) -> str:
    """A path that names exactly the open file ``fd`` (``/proc/self/fd/N`` on Linux)."""
    return f"/proc/self/fd/{fd}"


def check_path(path: str | Path, *, directory: bool = False) -> Path:
    """Check a file (or directory) and every directory above it, by name.

    Parameters
    ----------
    path : str or Path
        The file to be loaded (or, with ``directory=True``, a directory to build in).
    directory : bool
        Whether ``path`` itself is a directory.

    Returns
    -------
    Path
        The real path (symbolic links resolved): load this one, not ``path``.

    Raises
    ------
    NotOwned
        ``path`` is not owned by this user or writable by others, or a directory above it is
        owned by another uid than this user's or root's, or writable by others without the
        sticky bit.
    OSError
        ``path`` does not exist.
    """
    real = Path(os.path.realpath(path))
    st = os.lstat(real)
    if directory:
        if not stat.S_ISDIR(st.st_mode):
            raise NotOwned(real, "is not a directory")
        _check_owner(real, st, "directory")
    else:
        if not stat.S_ISREG(st.st_mode):
            raise NotOwned(real, "is not a regular file")
        _check_owner(real, st, "file")
    uid = os.getuid()
    for parent in real.parents:
        pst = os.lstat(parent)
        if pst.st_uid not in (uid, 0):
            raise NotOwned(parent, f"(above {real}) is owned by uid {pst.st_uid}, neither "
                                   "this user nor root")
        if pst.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not pst.st_mode & stat.S_ISVTX:
            raise NotOwned(parent, f"(above {real}) is writable by other users without the "
                                   f"sticky bit ({_mode(pst)})")
    return real
