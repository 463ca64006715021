"""A streaming safetensors writer: header, then each tensor's bytes straight from host memory.

safetensors' own ``save_file`` first builds every tensor's bytes in Python; writing the
format directly lets the exporter hash as it writes, check for cancellation between chunks,
and avoid one full copy of the model. The layout follows the published format: an 8-byte
little-endian header length, a JSON header (padded with spaces to 8 bytes) of dtype, shape and
``data_offsets``, then the packed data.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import struct
import threading
from collections.abc import Callable, Sequence
from typing import BinaryIO

import torch

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}

# Bytes handed to write() and hash.update() at once: large enough that both release the GIL
# for long stretches, small enough to keep cancellation and memory use fine-grained.
CHUNK = 64 << 20


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (it must be contiguous and on the CPU)."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def header_bytes(tensors: Sequence[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> bytes:
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors:
        if t.dtype not in DTYPE_NAMES:
            raise TypeError(f"tensor {name!r} has dtype {t.dtype}, which safetensors cannot hold")
        size = nbytes(t)
        header[name] = {
            "dtype": DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_file(
    path: str | os.PathLike[str],
    tensors: Sequence[tuple[str, torch.Tensor]],
    *,
    metadata: dict[str, str] | None = None,
    check: Callable[[], None] = lambda: None,
    opener: Callable[[str | os.PathLike[str]], BinaryIO] | None = None,
    fsync: bool = True,
) -> tuple[int, str]:
    """Write one safetensors file; returns (size, sha256 of the file).

    ``check`` runs before the file is opened and before every chunk, and may raise to stop
    the write (cancellation).
    """
    check()  # a shard queued behind a failed one never starts
    head = header_bytes(tensors, metadata or {"format": "pt"})
    hasher = _SequentialHasher()
    writeback = _Writeback() if fsync else None
    open_ = opener or (lambda p: open(p, "xb"))  # noqa: SIM115 - closed below
    try:
        with open_(path) as f:
            f.write(head)
            hasher.feed(memoryview(head))
            size = len(head)
            for _name, t in tensors:
                data = raw_bytes(t)
                for start in range(0, len(data), CHUNK):
                    check()  # per chunk: a tensor of several GB must not delay a cancel
                    chunk = data[start : start + CHUNK]
                    hasher.feed(chunk)
                    f.write(chunk)
                    if writeback is not None:
                        writeback.advance(f, size + start + len(chunk))
                size += len(data)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
    finally:
        digest = hasher.finish()
    return size, digest


class _Writeback:
    """Start the disk write of what has been written so far, in large page-aligned windows.

    Left alone, the kernel holds the dirty pages until the final fsync (a file smaller than
    the dirty threshold is not written back earlier), so the whole disk write would wait
    for hashing and copying to finish. On Linux, POSIX_FADV_DONTNEED starts writeback of a
    range without waiting for it (PostgreSQL flushes data the same way). Windows are large
    and end on a page boundary so that no page still being filled is sent to the disk and
    the next write never waits for it. The fsync at the end still decides durability and
    reports any write error.
    """

    WINDOW = 32 << 20
    PAGE = 4096

    def __init__(self) -> None:
        self._advise = getattr(os, "posix_fadvise", None)
        self._done = 0

    def advance(self, f: BinaryIO, written: int) -> None:
        if self._advise is None or written - self._done < self.WINDOW:
            return
        end = written - written % self.PAGE
        try:
            f.flush()
            self._advise(f.fileno(), self._done, end - self._done, os.POSIX_FADV_DONTNEED)
        except (OSError, ValueError, AttributeError):
            # Not a real file (a test double) or a filesystem without the hint: fsync alone.
            self._advise = None
        self._done = end


class _SequentialHasher:
    """sha256 of a byte stream, computed on its own thread while the caller writes the same
    chunks: both release the GIL, so the file hash costs little extra wall time."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()
        self._queue: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="sha256", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (chunk := self._queue.get()) is not None:
            self._hash.update(chunk)

    def feed(self, chunk: memoryview) -> None:
        self._queue.put(chunk)

    def finish(self) -> str:
        self._queue.put(None)
        self._thread.join()
        return self._hash.hexdigest()


def tensor_sha256(t: torch.Tensor, check: Callable[[], None] = lambda: None) -> str:
    """sha256 of a CPU tensor's bytes (hashlib releases the GIL on large chunks); ``check``
    runs before each chunk, as in ``write_file``."""
    h = hashlib.sha256()
    data = raw_bytes(t)
    for start in range(0, len(data), CHUNK):
        check()
        h.update(data[start : start + CHUNK])
    return h.hexdigest()


def weights_digest(entries: Sequence[tuple[str, str, Sequence[int], str]]) -> str:
    """One digest for a set of weights: (name, dtype, shape, sha256 of bytes) sorted by name.

    Independent of sharding and file layout, so a restarted engine that recomputes it from
    the tensors it holds proves it holds exactly that version."""
    h = hashlib.sha256()
    for name, dtype, shape, digest in sorted(entries):
        h.update(json.dumps([name, dtype, list(shape), digest]).encode())
    return h.hexdigest()
