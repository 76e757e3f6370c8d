"""Files sbpc writes (plans, weights, traces, reports, IR dumps, launch results): paths checked
before the work that fills them, and written atomically, so a bad path is a one-line error
(exit 2) and a crash or a full disk never leaves half a file behind."""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

from sbpc.errors import OutputError


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """A temporary path next to ``path`` for the block to write; renamed over ``path`` when the
    block ends, removed when it raises. A crash never leaves half a file behind, and a reader
    never sees one. An OSError (no such directory, no permission, no space) is an OutputError."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as err:
        raise OutputError(f"cannot write {path!r}: {err.strerror or err}",
                          hint="check the path, the permissions and the free space") from err
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


def write_atomic(path: str, text: str) -> None:
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        f.write(text)


def check_output_path(path: str, what: str) -> None:
    """Refuse, before any work, a file path that cannot be written: a directory, a missing or
    read-only parent directory."""
    if not path:
        raise OutputError(f"the {what} path is empty", hint="pass a file name, e.g. plan.json")
    if os.path.isdir(path):
        raise OutputError(f"cannot write the {what} to {path!r}: it is a directory",
                          hint="pass a file path inside it, e.g. " + os.path.join(path, "out.json"))
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        raise OutputError(f"cannot write the {what} to {path!r}: directory {parent!r} does not exist",
                          hint="create the directory first, or pass another path")
    if not os.access(parent, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise OutputError(f"cannot write the {what} to {path!r}: permission denied",
                          hint="pass a path in a directory you can write")


def check_output_dir(path: str, what: str) -> None:
    """A directory sbpc creates if missing, then fills: refuse one it cannot make or write."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise OutputError(f"cannot write the {what} into {path!r}: it is a file, not a directory",
                          hint="pass a directory path (it is created if missing)")
    probe = os.path.abspath(path)
    while not os.path.exists(probe):  # the nearest ancestor that exists must let us create the rest
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write the {what} into {path!r}: {probe!r} is not a writable directory",
                          hint="pass a directory you can write")
