"""One writer at a time: an exclusive lock on a file, holding the holder's pid for the error message.

The store's data directory and the archive each have one, so that a second writer is refused
with the first one's pid instead of corrupting its work. ``flock`` locks end with the process, so
a killed writer leaves nothing to clean up.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

__all__ = ["Held", "take"]


class Held(Exception):
    """Another process holds the lock on `path`; `holder` is the pid it wrote there (or "unknown")."""

    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(f"{path} is locked by pid {holder}")
        self.path = path
        self.holder = holder


def take(path: Path) -> int:
    """Lock `path` (created if needed) for this process and write its pid there; return the
    descriptor, which holds the lock until it is closed.

    Raises :class:`Held` when another process holds it, OSError when the file cannot be created or
    locked (``ENOLCK``, ``EOPNOTSUPP``: a file system without locks).
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise Held(path, holder) from None
    except OSError:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
