"""Writing a file whole or not at all: every file autopar writes goes through here.

A plan written in place when the disk fills is left truncated (invalid JSON where a good
plan was), and Ctrl-C half-way through a report leaves half a page. So the data goes to a
temporary file in the same folder (the same file system, so the rename is atomic), is
flushed to the disk, and is renamed over the target: a reader sees the old file or the new
one, never a mix. On any failure the temporary file is removed and the target left as it
was; an ``OSError`` becomes one ``UsageError`` naming the path and the reason. SIGINT and
SIGTERM are held back while the file is written and renamed, so Ctrl-C, even one that
ends the process at once (``autopar_entry``), lands before the write or after it.

>>> write_atomic("plan.json", text)                     # doctest: +SKIP
PosixPath('plan.json')
>>> write_atomic("/nonexistent/dir/plan.json", text)    # doctest: +SKIP
Traceback (most recent call last):
UsageError: cannot write /nonexistent/dir/plan.json: the folder /nonexistent/dir does not exist
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import signal
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

from autopar_plans.errors import UsageError

TEMP_SUFFIX = ".tmp"


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` atomically; returns the path written.

    A symbolic link is followed (its target is replaced, the link kept); an existing file
    keeps its permissions, a new one gets the usual ``0o666`` less the umask.
    """
    path = Path(path)
    target = path.resolve() if path.is_symlink() else path
    payload = data.encode("utf-8") if isinstance(data, str) else data
    temp = target.with_name(f".{target.name}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
    with _signals_held():
        try:
            _write_temp(temp, payload, _mode_of(target))
            os.replace(temp, target)
        except BaseException as error:  # an interrupt too: never leave the temporary file
            with contextlib.suppress(OSError):
                temp.unlink()
            if isinstance(error, OSError):
                raise UsageError(cannot_write(path, error)) from None
            raise
    _sync_folder(target.parent)
    return path


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM that arrive in the block wait for its end, then go to the
    handlers that were there before (Python's, ``autopar_entry``'s, the default).

    Python runs signal handlers in the main thread only, so a write from another thread
    is never cut by one; and a handler is swapped, not the signal mask, since the kernel
    hands a signal to any thread that does not block it.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    before = {
        number: signal.signal(number, lambda got, frame: arrived.append(got))
        for number in (signal.SIGINT, signal.SIGTERM)
        if signal.getsignal(number) is not None  # None: a handler not set from Python
    }
    try:
        yield
    finally:
        for number, handler in before.items():
            signal.signal(number, handler)
        for number in dict.fromkeys(arrived):
            signal.raise_signal(number)


def _write_temp(temp: Path, payload: bytes, mode: int | None) -> None:
    """Create ``temp`` (never an existing file), write ``payload`` and flush it to disk."""
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    with os.fdopen(fd, "wb") as file:
        file.write(payload)
        file.flush()
        os.fsync(file.fileno())
    if mode is not None:
        os.chmod(temp, mode)


def _mode_of(target: Path) -> int | None:
    """The permissions of the file being replaced, or None where there is none."""
    try:
        info = target.stat()
    except FileNotFoundError:
        return None
    if stat.S_ISDIR(info.st_mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(target))
    return stat.S_IMODE(info.st_mode)


def _sync_folder(folder: Path) -> None:
    """Make the rename itself durable; where a folder cannot be opened (some file
    systems, Windows), the rename is still atomic, only not yet on disk."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def check_writable(path: str | Path) -> None:
    """Refuse, before any work, a path ``write_atomic`` could not write: a folder that does
    not exist or cannot be written to, a folder given for a file (``UsageError``)."""
    path = Path(path)
    folder = path.parent
    if path.is_dir():
        raise UsageError(cannot_write(path, IsADirectoryError(str(path))))
    if not folder.is_dir():
        error: OSError = (
            NotADirectoryError(str(folder)) if folder.exists() else FileNotFoundError(str(folder))
        )
        raise UsageError(cannot_write(path, error))
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(cannot_write(path, PermissionError(str(folder))))


def cannot_write(path: Path, error: OSError) -> str:
    """The one line a failed write becomes: the path, and the reason in words."""
    folder = path.parent
    if isinstance(error, FileNotFoundError) and not folder.is_dir():
        return f"cannot write {path}: the folder {folder} does not exist"
    if isinstance(error, NotADirectoryError):
        return f"cannot write {path}: a part of {folder} is a file, not a folder"
    if isinstance(error, IsADirectoryError):
        return f"cannot write {path}: it is a folder; give a file name"
    if isinstance(error, PermissionError):
        return f"cannot write {path}: permission denied; choose a folder you can write to"
    if error.errno == errno.ENOSPC:
        return f"cannot write {path}: no space left on the device; the old file is unchanged"
    reason = error.strerror or str(error)
    return f"cannot write {path}: {reason}"
