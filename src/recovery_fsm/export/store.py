"""The checkpoint root on disk: naming, manifests, start-up scan, verification, safe delete.

Only a directory named ``step-<version>`` holding a valid manifest is a checkpoint. It gets
there by an atomic rename of a fully written and fsynced ``.tmp-step-<version>-<hex>``
sibling, so a crash can leave temporary directories behind but never a torn checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import attrs

from ..errors import CorruptCheckpoint, UnsafePath

MANIFEST = "recovery_manifest.json"
FORMAT = "recovery_fsm/1"
_FINAL = re.compile(r"^step-(\d+)$")
_TEMP = re.compile(r"^\.tmp-step-(\d+)-[0-9a-f]+$")


@attrs.frozen
class ScanReport:
    committed: dict[int, Path]
    removed_temp: list[Path]
    invalid: list[tuple[Path, str]]
    ignored: list[Path]


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


class CheckpointStore:
    """All file operations on the recovery root go through here."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).absolute()
        self.root.mkdir(parents=True, exist_ok=True)
        self.root = self.root.resolve()

    def path_for(self, version: int) -> Path:
        return self.root / f"step-{version}"

    def temp_path(self, version: int) -> Path:
        return self.root / f".tmp-step-{version}-{os.urandom(6).hex()}"

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
            raise CorruptCheckpoint(f"{p}/{MANIFEST} is not a {FORMAT} manifest")
        return data

    def verify(self, path: str | os.PathLike[str], *, full: bool = False) -> dict[str, Any]:
        """Check every file against the manifest: sizes always, sha256 when ``full``."""
        p = Path(path)
        manifest = self.read_manifest(p)
        for name, meta in manifest["files"].items():
            f = p / name
            if not f.is_file():
                raise CorruptCheckpoint(f"{p}: {name} listed in the manifest is missing")
            size = f.stat().st_size
            if size != meta["size"]:
                raise CorruptCheckpoint(
                    f"{p}: {name} has {size} bytes, manifest says {meta['size']}"
                )
            if full and file_sha256(f) != meta["sha256"]:
                raise CorruptCheckpoint(f"{p}: {name} does not match its sha256")
        return manifest

    def scan(self) -> ScanReport:
        """Start-up: adopt committed checkpoints, remove orphaned temporaries, report the rest."""
        committed: dict[int, Path] = {}
        removed: list[Path] = []
        invalid: list[tuple[Path, str]] = []
        ignored: list[Path] = []
        for child in sorted(self.root.iterdir()):
            if child.is_symlink():
                ignored.append(child)
            elif _TEMP.match(child.name) and child.is_dir():
                shutil.rmtree(child)
                removed.append(child)
            elif (m := _FINAL.match(child.name)) and child.is_dir():
                try:
                    manifest = self.verify(child)
                except CorruptCheckpoint as err:
                    invalid.append((child, str(err)))
                    continue
                if manifest.get("version") != int(m.group(1)):
                    invalid.append((child, f"manifest names version {manifest.get('version')}"))
                    continue
                committed[int(m.group(1))] = child
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
        if p.parent != self.root:
            raise UnsafePath(f"refusing {path}: only direct children of {self.root} are deleted")
        if not (_FINAL.match(p.name) or _TEMP.match(p.name)):
            raise UnsafePath(
                f"refusing {path}: the name must be step-<version> or a .tmp-step- directory"
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
        if _TEMP.match(p.name):
            shutil.rmtree(p)
            return
        # Rename first, so a crash mid-delete leaves a temporary that the next scan removes,
        # never a half-deleted step-<v> that looks like a checkpoint.
        doomed = self.temp_path(int(p.name[len("step-") :]))
        os.rename(p, doomed)
        fsync_dir(self.root)
        shutil.rmtree(doomed)
