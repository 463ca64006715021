"""The checkpoint root on disk: naming, manifests, start-up scan, verification, safe delete.

Only a directory named ``step-<version>`` (the version in plain decimal, exactly as
``path_for`` writes it) holding a valid manifest is a checkpoint. It gets
there by an atomic rename of a fully written and fsynced ``.tmp-step-<version>-<hex>``
sibling, so a crash can leave temporary directories behind but never a torn checkpoint.

The manifest (``recovery_fsm/2``) names its content hash and lists ``shards`` (safetensors
files: size and the digest of their header), ``tensors`` (dtype, shape, file and the digest
of their bytes), the other ``files`` (size and digest) and the ``weights_digest`` over all
tensors. Every byte of a checkpoint is covered by exactly one digest, and the directory holds
nothing the manifest does not list (an engine that reads the directory itself would load an
unlisted ``*.safetensors`` unchecked). The exporter has listed every file it writes since
this format began, so every ``recovery_fsm/2`` manifest passes that check as written.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import attrs

from ..errors import CorruptCheckpoint, UnsafePath
from .safetensors_io import READ_CHUNK, new_hasher, read_verified

MANIFEST = "recovery_manifest.json"
FORMAT = "recovery_fsm/2"
# Exactly the names path_for and temp_path write, matched with fullmatch (a name with a
# trailing newline is not ours). The version is plain ASCII decimal without leading zeros:
# int() also reads "007", "+7", " 7" or other scripts' digits as 7, and a directory under such
# a name was not written here, so it must neither be adopted (beside step-7 it would stand in
# for it or hide it) nor deleted.
_VERSION = r"(0|[1-9][0-9]*)"
_FINAL = re.compile(rf"step-{_VERSION}")
_TEMP = re.compile(rf"\.tmp-step-{_VERSION}-[0-9a-f]{{12}}")
# The shared-root check's marker file (ray/placement.py), named here with the rest of the
# root: the store neither adopts nor removes one (a check that was killed leaves its marker
# for the next check to remove).
_MARKER = re.compile(r"\.recovery-fsm-shared-[0-9a-f]{32}")


@attrs.frozen
class ScanReport:
    committed: dict[int, Path]
    removed_temp: list[Path]
    invalid: list[tuple[Path, str]]
    ignored: list[Path]


def checkpoint_version(name: str) -> int | None:
    """The version a directory named ``name`` holds if the store could have written that
    name (``step-<v>``, ``v`` in plain decimal), else None."""
    m = _FINAL.fullmatch(name)
    return int(m.group(1)) if m else None


def shared_marker_name(token: str) -> str:
    """The name of the shared-root check's marker for ``token`` (32 hex digits)."""
    name = f".recovery-fsm-shared-{token}"
    if not _MARKER.fullmatch(name):
        raise UnsafePath(f"a shared-root marker's token is 32 hex digits, got {token!r}")
    return name


def is_shared_marker(name: str) -> bool:
    """``name`` is one the shared-root check writes (``shared_marker_name``), nothing else."""
    return _MARKER.fullmatch(name) is not None


def _check_version(version: object) -> int:
    if type(version) is not int or version < 0:
        raise UnsafePath(f"a checkpoint version must be an int >= 0, got {version!r}")
    return version


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_digest(path: Path, hash_name: str) -> str:
    h = new_hasher(hash_name)
    with path.open("rb") as f:
        while chunk := f.read(READ_CHUNK):
            h.update(chunk)
    return h.hexdigest()


class CheckpointStore:
    """All file operations on the recovery root go through here."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).absolute()
        self.root.mkdir(parents=True, exist_ok=True)
        self.root = self.root.resolve()

    def path_for(self, version: int) -> Path:
        return self.root / f"step-{_check_version(version)}"

    def temp_path(self, version: int) -> Path:
        return self.root / f".tmp-step-{_check_version(version)}-{os.urandom(6).hex()}"

    # -- reading ---------------------------------------------------------------------------

    def read_manifest(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        p = Path(path)
        try:
            data = json.loads((p / MANIFEST).read_text(encoding="utf-8"))
        except FileNotFoundError as err:
            raise CorruptCheckpoint(f"{p} has no {MANIFEST}: not a committed checkpoint") from err
        except (OSError, ValueError) as err:
            raise CorruptCheckpoint(f"{p}/{MANIFEST} is unreadable: {err}") from err
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else None
            raise CorruptCheckpoint(f"{p}/{MANIFEST} is not a {FORMAT} manifest (found {found})")
        for key in ("version", "hash", "weights_digest", "files", "shards", "tensors", "aliases"):
            if key not in data:
                raise CorruptCheckpoint(f"{p}/{MANIFEST} has no {key!r}")
        if type(data["version"]) is not int or data["version"] < 0:
            # As for the directory's name: 7.0, "7" or "007" is not a version the exporter wrote.
            raise CorruptCheckpoint(f"{p}/{MANIFEST} has version {data['version']!r}, not an int")
        return data

    def verify(self, path: str | os.PathLike[str], *, full: bool = False) -> dict[str, Any]:
        """Check the checkpoint against its manifest: the directory holds exactly the files
        it lists (and itself), each of its size, and with ``full`` every byte against its
        digest (one read of the whole checkpoint). Without ``full`` a changed byte that keeps
        the size is not found; every recovery load (``load_checkpoint``, ``load_model``)
        checks all bytes as it reads them.

        An entry the manifest does not list is refused, whatever it is: an engine that
        reads the directory itself (vLLM takes every ``*.safetensors``) would load it
        unchecked. A listed name that is no entry of the directory (``../x``, ``a/b``) is
        refused too, as is a symlink, so nothing outside the checkpoint is read as part of
        it."""
        p = Path(path)
        manifest = self.read_manifest(p)
        try:
            present = set(os.listdir(p))
        except OSError as err:
            raise CorruptCheckpoint(f"{p} cannot be listed: {err}") from err
        try:
            listed = {**manifest["files"], **manifest["shards"]}
            unlisted = sorted(present - set(listed) - {MANIFEST})
            if unlisted:
                raise CorruptCheckpoint(
                    f"{p}: {unlisted[0]} is not listed in the manifest"
                    + (f" (nor are {unlisted[1:]})" if len(unlisted) > 1 else "")
                    + "; an engine reading the directory would load it unchecked"
                )
            for name, meta in listed.items():
                f = p / name
                if name not in present or f.is_symlink() or not f.is_file():
                    raise CorruptCheckpoint(
                        f"{p}: {name} listed in the manifest is missing (not a file in {p.name})"
                    )
                size = f.stat().st_size
                if size != meta["size"]:
                    raise CorruptCheckpoint(
                        f"{p}: {name} has {size} bytes, manifest says {meta['size']}"
                    )
            if full:
                verify_contents(p, manifest, keep=False)
        except (KeyError, TypeError, AttributeError, ValueError) as err:
            raise CorruptCheckpoint(f"{p}/{MANIFEST} is malformed ({err!r})") from err
        return manifest

    def scan(self, *, full: bool = False) -> ScanReport:
        """Start-up: adopt committed checkpoints, remove orphaned temporaries, report the rest.

        A checkpoint is adopted on ``verify(full=full)``: by default its manifest, file set
        and sizes, not its bytes (that would read every checkpoint at start-up). The load
        that boots a group from it checks every byte, and refuses a corrupted one. A
        shared-root marker is ignored, whatever it is: the check that wrote it removes it."""
        committed: dict[int, Path] = {}
        removed: list[Path] = []
        invalid: list[tuple[Path, str]] = []
        ignored: list[Path] = []
        for child in sorted(self.root.iterdir()):
            if child.is_symlink() or is_shared_marker(child.name):
                ignored.append(child)
            elif _TEMP.fullmatch(child.name) and child.is_dir():
                shutil.rmtree(child)
                removed.append(child)
            elif (version := checkpoint_version(child.name)) is not None and child.is_dir():
                try:
                    manifest = self.verify(child, full=full)
                except CorruptCheckpoint as err:
                    invalid.append((child, str(err)))
                    continue
                if manifest.get("version") != version:
                    invalid.append((child, f"manifest names version {manifest.get('version')}"))
                    continue
                committed[version] = child
            else:
                ignored.append(child)
        if removed:
            fsync_dir(self.root)
        return ScanReport(committed, removed, invalid, ignored)

    # -- deleting --------------------------------------------------------------------------

    def check_deletable(self, path: str | os.PathLike[str]) -> Path:
        """The path, if it is a direct, real child of the root named by the scheme."""
        raw = Path(path)
        p = raw if raw.is_absolute() else self.root / raw
        if ".." in p.parts:
            raise UnsafePath(f"refusing {path}: '..' is not allowed")
        # The root was resolved: so is the parent given (a symlink to the root is the root),
        # but never the entry itself, which must not be a symlink.
        if p.parent.resolve() != self.root:
            raise UnsafePath(f"refusing {path}: only direct children of {self.root} are deleted")
        p = self.root / p.name
        if not (_FINAL.fullmatch(p.name) or _TEMP.fullmatch(p.name)):
            raise UnsafePath(
                f"refusing {path}: the name must be one the store writes: step-<version> "
                f"(plain decimal, no leading zero) or .tmp-step-<version>-<12 hex digits>"
            )
        if p.is_symlink():
            raise UnsafePath(f"refusing {path}: it is a symlink")
        if not p.exists():
            raise FileNotFoundError(f"{path} does not exist")
        if p.resolve().parent != self.root or not p.is_dir():
            raise UnsafePath(f"refusing {path}: it does not resolve to a directory in the root")
        return p

    def delete(self, path: str | os.PathLike[str]) -> None:
        p = self.check_deletable(path)
        if _TEMP.fullmatch(p.name):
            shutil.rmtree(p)
            return
        # Rename first, so a crash mid-delete leaves a temporary that the next scan removes,
        # never a half-deleted step-<v> that looks like a checkpoint.
        version = checkpoint_version(p.name)
        assert version is not None  # check_deletable let only step-<v> and temporaries by
        doomed = self.temp_path(version)
        os.rename(p, doomed)
        fsync_dir(self.root)
        shutil.rmtree(doomed)


def verify_contents(path: Path, manifest: dict[str, Any], *, keep: bool) -> dict[str, Any]:
    """Read every file of a checkpoint once, checking each byte against the manifest; with
    ``keep`` return the tensors (views of one buffer per shard)."""
    hash_name = manifest["hash"]
    for name, meta in manifest["files"].items():
        if file_digest(path / name, hash_name) != meta["digest"]:
            raise CorruptCheckpoint(f"{path}: {name} does not match its digest")
    by_file: dict[str, dict[str, Any]] = {name: {} for name in manifest["shards"]}
    for tname, meta in manifest["tensors"].items():
        if meta.get("file") not in by_file:
            raise CorruptCheckpoint(f"{path}: tensor {tname!r} is in no listed shard")
        by_file[meta["file"]][tname] = meta
    tensors: dict[str, Any] = {}
    for name, meta in manifest["shards"].items():
        tensors.update(
            read_verified(
                path / name,
                size=meta["size"],
                header_digest=meta["header_digest"],
                tensors=by_file[name],
                hash_name=hash_name,
                keep=keep,
            )
        )
    return tensors
