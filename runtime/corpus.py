"""A small real corpus that needs no download: the Python standard library's own sources, on
every machine that runs sbpc, as byte-level tokens.

The ``.py`` files under ``sysconfig``'s stdlib directory, in sorted path order, skipping test
suites, ``site-packages`` and ``idlelib``; file after file up to the size cap (4 MiB by default;
the last file is cut there).
Each file's UTF-8 bytes are its tokens (vocabulary 256), written as a uint16 ``.bin`` with a
sidecar ``.bin.json`` (dtype, token and file count, the Python version). Deterministic for one
Python version; another version has other sources, so the file name carries the version.
``--data stdlib`` builds it once into the cache directory (``$SBPC_CACHE_DIR``, else
``$XDG_CACHE_HOME/sbpc``, else ``~/.cache/sbpc``) and reuses it.
"""
from __future__ import annotations

import json
import os
import platform
import sysconfig

from sbpc.runtime.files import atomic_path, check_output_dir, write_atomic

STDLIB = "stdlib"  # the --data value that names this corpus
DEFAULT_MAX_BYTES = 4 << 20
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}


def corpus_name() -> str:
    return f"stdlib-{platform.python_version()}.bin"


def cache_dir() -> str:
    base = os.environ.get("SBPC_CACHE_DIR")
    if base:
        return base
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "sbpc")


def source_files(root: str | None = None) -> list[str]:
    """The stdlib's ``.py`` files, relative to ``root``, in sorted order."""
    root = root or sysconfig.get_paths()["stdlib"]
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("config-"))
        found += [os.path.relpath(os.path.join(folder, f), root) for f in files if f.endswith(".py")]
    return sorted(found)


def build_corpus(out_dir: str, max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    """Write the corpus into ``out_dir`` (created if missing); return the .bin path."""
    check_output_dir(out_dir, "corpus")
    os.makedirs(out_dir, exist_ok=True)
    root = sysconfig.get_paths()["stdlib"]
    chunks, size = [], 0
    for rel in source_files(root):
        with open(os.path.join(root, rel), "rb") as f:
            raw = f.read()
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            continue  # a few test fixtures are Latin-1 on purpose
        chunks.append(raw[:max_bytes - size])  # the last file is cut at the cap
        size += len(chunks[-1])
        if size == max_bytes:
            break
    import numpy as np  # here, not at import: `sbpc --help` stays quick

    tokens = np.frombuffer(b"".join(chunks), dtype=np.uint8).astype(np.uint16)
    path = os.path.join(out_dir, corpus_name())
    with atomic_path(path) as tmp:
        tokens.tofile(tmp)
    meta = {"dtype": "uint16", "tokens": int(tokens.size), "files": len(chunks), "vocab": 256,
            "source": f"Python {platform.python_version()} standard library ({root})", "tokenizer": "bytes"}
    write_atomic(path + ".json", json.dumps(meta, indent=1) + "\n")
    return path


def resolve_data(path: str | None) -> str | None:
    """``--data`` as a file path: ``stdlib`` is the cached corpus, built on first use."""
    if path != STDLIB:
        return path
    cached = os.path.join(cache_dir(), corpus_name())
    if os.path.isfile(cached) and os.path.isfile(cached + ".json"):
        return cached
    return build_corpus(cache_dir())
