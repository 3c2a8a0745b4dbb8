"""Checkpoint integrity: a manifest of every file's size and SHA-256, written before the commit.

``checksums.json`` in a checkpoint folder::

    {"algorithm": "sha256",
     "files": {"__0_0.distcp": {"bytes": 1234, "sha256": "9f2c..."}, ".metadata": {...},
               "train_state.json": {...}}}

It lists every file of the folder but itself. ``check_sizes`` compares sizes only (cheap: the
launcher runs it before any worker starts, catching truncated or missing files);
``verify_files`` re-hashes a share of the files (each rank hashes every world-th one, so a
large checkpoint is checked in parallel) and names the first file whose bytes changed (random
bytes, zeroed blocks). A checkpoint that fails either is refused; training never starts from it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable

CHECKSUMS = "checksums.json"
ALGORITHM = "sha256"
_CHUNK_BYTES = 8 * 2 ** 20


class CorruptCheckpoint(ValueError):
    """A checkpoint's files do not match its manifest (or it has none)."""


def file_digest(path: str) -> str:
    """Hex SHA-256 of the file ``path``, read in 8 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_files(folder: str) -> list[str]:
    """The names of the files of ``folder`` a manifest covers (sorted; not the manifest)."""
    return sorted(name for name in os.listdir(folder)
                  if name != CHECKSUMS and os.path.isfile(os.path.join(folder, name)))


def entries(folder: str, names: Iterable[str]) -> dict[str, dict]:
    """Manifest entries (size and digest) of the files ``names`` of ``folder``."""
    return {name: {"bytes": os.path.getsize(os.path.join(folder, name)),
                   ALGORITHM: file_digest(os.path.join(folder, name))} for name in names}


def write_manifest(folder: str, files: dict[str, dict]) -> None:
    """Write ``checksums.json`` (fsynced) from ``files`` (``entries`` of every file)."""
    missing = set(checkpoint_files(folder)) - files.keys()
    if missing:
        raise RuntimeError(f"{folder}: no checksum for {sorted(missing)}")
    path = os.path.join(folder, CHECKSUMS)
    with open(path, "w") as handle:
        json.dump({"algorithm": ALGORITHM, "files": files}, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())


def read_manifest(folder: str) -> dict[str, dict]:
    """The manifest's files; ``CorruptCheckpoint`` when it is missing or unreadable."""
    path = os.path.join(folder, CHECKSUMS)
    try:
        with open(path) as handle:
            data = json.load(handle)
        files = data["files"]
        if data.get("algorithm") != ALGORITHM or not isinstance(files, dict):
            raise ValueError("unknown layout")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CorruptCheckpoint(f"checkpoint {folder} has no readable {CHECKSUMS} ({err}); "
                                "refusing to resume from it") from None
    return files


def check_sizes(folder: str) -> dict[str, dict]:
    """The manifest, after checking that every file it lists exists with its size."""
    files = read_manifest(folder)
    for name, entry in files.items():
        path = os.path.join(folder, name)
        size = os.path.getsize(path) if os.path.isfile(path) else None
        if size != entry["bytes"]:
            found = "missing" if size is None else f"{size} bytes"
            raise CorruptCheckpoint(f"checkpoint {folder} is damaged: {name} is {found}, the "
                                    f"manifest says {entry['bytes']} bytes; refusing to resume")
    return files


def verify_files(folder: str, *, rank: int = 0, world_size: int = 1) -> str | None:
    """Re-hash this rank's share of the manifest's files; the first problem, or None."""
    try:
        files = check_sizes(folder)
    except CorruptCheckpoint as err:
        return str(err)
    for index, name in enumerate(sorted(files)):
        if index % world_size != rank:
            continue
        digest = file_digest(os.path.join(folder, name))
        if digest != files[name][ALGORITHM]:
            return (f"checkpoint {folder} is damaged: {name} does not match its {ALGORITHM} "
                    f"(stored {files[name][ALGORITHM][:12]}..., read {digest[:12]}...); "
                    "refusing to resume")
    return None
