"""Files the package writes: atomically, with the mode any new file gets, checked before work.

Readers (a training job polling a folder, a user's viewer) see the old file or the new one,
never a torn mix: the content goes to a temporary file beside the target, is flushed and
fsync'ed, then renamed over it. The temporary file is created with mode 0o666 so that the
kernel applies the umask as ``open(path, "w")`` would (0644 under umask 022), not
``tempfile.mkstemp``'s private 0600: traces and pictures are read by other users.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

__all__ = ["atomic_path", "check_output_file", "check_output_folder", "write_atomically"]

_TEMP_FLAGS = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
               | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))


def _create_temporary(path: Path) -> tuple[int, Path]:
    """A new, exclusive temporary file beside ``path`` (same suffix, so that tools that pick a
    format by suffix pick the target's)."""
    for _ in range(100):
        tmp = path.parent / f".{path.stem}.{secrets.token_hex(4)}.tmp{path.suffix}"
        try:
            return os.open(tmp, _TEMP_FLAGS, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {path}")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``path`` to write in full; it replaces ``path`` when the block
    ends without an error and is removed when it raises."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _create_temporary(path)
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomically(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` atomically; returns the path."""
    path = Path(path)
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
    return path


def check_output_file(path: str | os.PathLike, what: str, suffixes: Sequence[str] = ()) -> Path:
    """Refuse, before any work, an output file that cannot be written: a folder, a suffix not
    among ``suffixes``, or a place whose nearest existing folder is not writable. Raises
    ValueError with one line naming the fix."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{what} {path} is a folder: give a file name, e.g. {path / ('out' + (suffixes or ('',))[0])}")
    if suffixes and path.suffix.lower() not in suffixes:
        raise ValueError(f"{what} {path} has no known suffix: end the name with one of {', '.join(suffixes)}")
    _check_writable_place(path.parent, path, what)
    return path


def check_output_folder(path: str | os.PathLike, what: str) -> Path:
    """Refuse, before any work, an output folder that is a file or cannot be created or written."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{what} {path} is a file, not a folder: choose a folder (it is created if missing)")
    _check_writable_place(path, path, what)
    return path


def _check_writable_place(folder: Path, path: Path, what: str) -> None:
    """The nearest existing folder at or above ``folder`` must be a writable folder."""
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{what} {path} cannot be written ({folder} is not a writable folder): choose another place")
    try:  # permissions can say yes where writing does not (root on a read-only mount, /proc, a full disk)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".writable-"):
            pass
    except OSError as error:
        raise ValueError(f"{what} {path} cannot be written ({folder}: {error.strerror or error}): choose another "
                         "place") from None
