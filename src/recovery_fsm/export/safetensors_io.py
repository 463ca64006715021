"""Streaming safetensors files: written and read one chunk at a time, each byte hashed once.

safetensors' own ``save_file`` first builds every tensor's bytes in Python; writing the
format directly lets the exporter hash as it writes, check for cancellation between chunks,
and avoid one full copy of the model. Reading it directly lets a recovery load check every
tensor against the manifest while the bytes arrive, instead of in a second pass. The layout
follows the published format: an 8-byte little-endian header length, a JSON header (padded
with spaces to 8 bytes) of dtype, shape and ``data_offsets``, then the packed data.

What is hashed: the header, and each tensor's bytes on their own. Together with the file's
size that covers every byte of the file (the data is packed, without gaps), and the
per-tensor digests are what an engine recomputes from the weights it holds.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import mmap
import os
import struct
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO, Literal, Protocol

import attrs
import torch
import xxhash

from ..errors import CorruptCheckpoint

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
DTYPES: dict[str, torch.dtype] = {name: dtype for dtype, name in DTYPE_NAMES.items()}

# Bytes handed to write() and hash.update() at once: large enough that both release the GIL
# for long stretches, small enough to keep cancellation and memory use fine-grained.
CHUNK = 64 << 20
# Reads are smaller: a slice is hashed while it is still in the core's cache.
READ_CHUNK = 1 << 20
# Threads that hash the tensors of one shard at once on a verified load.
HASH_THREADS = min(4, os.cpu_count() or 1)


class Hasher(Protocol):
    def update(self, data: Any, /) -> object: ...
    def hexdigest(self) -> str: ...


# The content hash of the manifest. The threat is corruption and staleness, not an
# adversary, so a fast non-cryptographic 128-bit hash will do: xxh3-128 runs at memory
# speed (about 10x sha256 here, see benchmarks/bench_export.py). sha256 stays readable.
HASHES: dict[str, Callable[[], Hasher]] = {
    "xxh3-128": xxhash.xxh3_128,
    "sha256": hashlib.sha256,
}
try:  # optional: only the benchmark asks for it
    import blake3  # type: ignore[import-not-found, unused-ignore]

    HASHES["blake3"] = blake3.blake3
except ImportError:
    pass
DEFAULT_HASH = "xxh3-128"


def new_hasher(name: str) -> Hasher:
    try:
        return HASHES[name]()
    except KeyError:
        raise CorruptCheckpoint(
            f"hash {name!r} is not one this install computes ({', '.join(HASHES)})"
        ) from None


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


@attrs.frozen
class WrittenFile:
    size: int
    header_digest: str
    tensor_digests: dict[str, str]


Writeback = Literal["sync_file_range", "dontneed", "off"]


def write_file(
    path: str | os.PathLike[str],
    tensors: Sequence[tuple[str, torch.Tensor]],
    *,
    hash_name: str = DEFAULT_HASH,
    metadata: dict[str, str] | None = None,
    check: Callable[[], None] = lambda: None,
    opener: Callable[[str | os.PathLike[str]], BinaryIO] | None = None,
    fsync: bool = True,
    writeback: Writeback = "off",
) -> WrittenFile:
    """Write one safetensors file, hashing the header and each tensor as it goes.

    ``check`` runs before the file is opened and before every chunk, and may raise to stop
    the write (cancellation).
    """
    check()  # a shard queued behind a failed one never starts
    head = header_bytes(tensors, metadata or {"format": "pt"})
    head_hash = new_hasher(hash_name)
    head_hash.update(head)
    digests: dict[str, str] = {}
    early = _EarlyWriteback(writeback) if fsync else None
    open_ = opener or (lambda p: open(p, "xb"))  # noqa: SIM115 - closed below
    with open_(path) as f:
        f.write(head)
        size = len(head)
        for name, t in tensors:
            data = raw_bytes(t)
            h = new_hasher(hash_name)
            for start in range(0, len(data), CHUNK):
                check()  # per chunk: a tensor of several GB must not delay a cancel
                chunk = data[start : start + CHUNK]
                h.update(chunk)
                f.write(chunk)
                if early is not None:
                    early.advance(f, size + start + len(chunk))
            digests[name] = h.hexdigest()
            size += len(data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    return WrittenFile(size, head_hash.hexdigest(), digests)


SYNC_FILE_RANGE_WRITE = 2


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    if sys.platform != "linux":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


def best_writeback() -> Writeback:
    """What the exporter uses unless told: start writeback early and keep the pages cached
    where the OS allows it (Linux), otherwise leave it all to the final fsync."""
    return "sync_file_range" if _sync_file_range is not None else "off"


class _EarlyWriteback:
    """Start the disk write of what has been written so far, in large page-aligned windows.

    Left alone, the kernel holds the dirty pages until the final fsync (a file smaller than
    the dirty threshold is not written back earlier), so the whole disk write would wait for
    hashing and copying to finish. Two ways to start it early on Linux:
    ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` starts writeback and leaves the pages cached,
    so a restart on this host reads the checkpoint from memory; ``POSIX_FADV_DONTNEED`` starts
    it too but also drops the pages that are already clean. Windows end on a page boundary so
    that no page still being filled is sent to the disk. The fsync at the end still decides
    durability and reports any write error.
    """

    WINDOW = 32 << 20
    PAGE = 4096

    def __init__(self, mode: Writeback) -> None:
        self._mode: Writeback = mode
        if mode == "sync_file_range" and _sync_file_range is None:
            self._mode = "off"
        if mode == "dontneed" and not hasattr(os, "posix_fadvise"):
            self._mode = "off"
        self._done = 0

    def advance(self, f: BinaryIO, written: int) -> None:
        if self._mode == "off" or written - self._done < self.WINDOW:
            return
        end = written - written % self.PAGE
        try:
            f.flush()
            fd = f.fileno()
            if self._mode == "sync_file_range":
                assert _sync_file_range is not None
                if _sync_file_range(fd, self._done, end - self._done, SYNC_FILE_RANGE_WRITE):
                    raise OSError(ctypes.get_errno(), "sync_file_range")
            else:
                os.posix_fadvise(fd, self._done, end - self._done, os.POSIX_FADV_DONTNEED)
        except (OSError, ValueError, AttributeError):
            # Not a real file (a test double) or a filesystem without the call: fsync alone.
            self._mode = "off"
        self._done = end


def tensor_digest(
    t: torch.Tensor, hash_name: str = DEFAULT_HASH, check: Callable[[], None] = lambda: None
) -> str:
    """The digest of a CPU tensor's bytes; ``check`` runs before each chunk."""
    h = new_hasher(hash_name)
    data = raw_bytes(t)
    for start in range(0, len(data), CHUNK):
        check()
        h.update(data[start : start + CHUNK])
    return h.hexdigest()


def weights_digest(entries: Sequence[tuple[str, str, Sequence[int], str]]) -> str:
    """One digest for a set of weights: (name, dtype, shape, tensor digest) sorted by name.

    Independent of sharding and file layout, so a restarted engine that recomputes it from
    the tensors it holds proves it holds exactly that version."""
    h = hashlib.sha256()
    for name, dtype, shape, digest in sorted(entries):
        h.update(json.dumps([name, dtype, list(shape), digest]).encode())
    return h.hexdigest()


# -- reading --------------------------------------------------------------------------------


@attrs.frozen
class _Slot:
    name: str
    dtype: str
    shape: list[int]
    begin: int
    end: int


def read_verified(
    path: str | os.PathLike[str],
    *,
    size: int,
    header_digest: str,
    tensors: Mapping[str, Mapping[str, Any]],
    hash_name: str,
    keep: bool,
) -> dict[str, torch.Tensor]:
    """Check every byte of one shard against the manifest; with ``keep``, return its tensors.

    ``tensors`` is the manifest's entry (dtype, shape, digest) for each tensor this file must
    hold. With ``keep`` each tensor is read a slice at a time into memory the process owns and
    hashed while the slice is still in cache, on a few threads at once (both release the
    GIL): one pass over the bytes, and the tensors returned map no file, so an engine booted
    from a checkpoint never keeps the files alive. Without, the file is mapped for the call
    and hashed in place. Any difference, or a layout that is not exactly the manifest's,
    raises CorruptCheckpoint.
    """
    with open(path, "rb") as f:
        fd = f.fileno()
        actual = os.fstat(fd).st_size
        if actual != size:
            raise CorruptCheckpoint(f"{path} has {actual} bytes, the manifest says {size}")
        if size < 8:
            raise CorruptCheckpoint(f"{path} is too short for a safetensors file")
        if hasattr(os, "posix_fadvise"):  # from disk: read ahead while the hash runs
            with contextlib.suppress(OSError):  # only advice: some filesystems refuse it
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        head = _read_at(path, fd, 0, 8)
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise CorruptCheckpoint(f"{path}: header length {n} exceeds the file")
        header = _read_at(path, fd, 8, n)
        h = new_hasher(hash_name)
        h.update(head + header)
        if h.hexdigest() != header_digest:
            raise CorruptCheckpoint(f"{path}: the safetensors header does not match its digest")
        slots = _layout(path, header, tensors, size - 8 - n)
        base = 8 + n
        # Kept tensors need memory of their own; a check alone reads the file's pages where
        # they are, mapped (no copy, nothing of the mapping outlives this call).
        mapped = None
        if keep:
            data = torch.empty(size - base, dtype=torch.uint8)
            whole = source = raw_bytes(data)
        else:
            mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ)
            whole = memoryview(mapped)
            source = whole[base:]

        def digest(slot: _Slot) -> str:
            h = new_hasher(hash_name)
            for start in range(slot.begin, slot.end, READ_CHUNK):
                with source[start : min(start + READ_CHUNK, slot.end)] as chunk:
                    if keep:
                        _read_into(path, fd, base + start, chunk)
                    h.update(chunk)
            return h.hexdigest()

        try:
            with ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="verify") as pool:
                for slot, found in zip(slots, pool.map(digest, slots), strict=True):
                    if found != tensors[slot.name]["digest"]:
                        raise CorruptCheckpoint(
                            f"{path}: tensor {slot.name!r} does not match its digest"
                        )
        finally:
            source.release()
            whole.release()
            if mapped is not None:
                mapped.close()
    if not keep:
        return {}
    return {slot.name: _tensor_at(data, slot) for slot in slots}


def _read_at(path: str | os.PathLike[str], fd: int, offset: int, length: int) -> bytes:
    buf = bytearray(length)
    _read_into(path, fd, offset, memoryview(buf))
    return bytes(buf)


def _read_into(path: str | os.PathLike[str], fd: int, offset: int, into: memoryview) -> None:
    """Fill ``into`` from ``offset`` of the file; a file that ends early was changed under us.
    ``preadv`` leaves the file position alone, so threads read one descriptor at once."""
    done = 0
    while done < len(into):
        if _PREADV:
            got = os.preadv(fd, [into[done:]], offset + done)
        else:
            chunk = os.pread(fd, len(into) - done, offset + done)
            into[done : done + len(chunk)] = chunk
            got = len(chunk)
        if got == 0:
            raise CorruptCheckpoint(f"{path} ended early: it changed while it was read")
        done += got


_PREADV = hasattr(os, "preadv")


def _layout(
    path: str | os.PathLike[str],
    head: bytes,
    expected: Mapping[str, Mapping[str, Any]],
    data_size: int,
) -> list[_Slot]:
    """The tensors of a (digest-checked) header, in file order, checked against the manifest:
    the same names, dtypes and shapes, packed from the first data byte to the last."""
    try:
        header = json.loads(head)
        slots = sorted(
            (
                _Slot(k, v["dtype"], list(v["shape"]), *v["data_offsets"])
                for k, v in header.items()
                if k != "__metadata__"
            ),
            key=lambda s: s.begin,
        )
    except (ValueError, KeyError, TypeError) as err:
        raise CorruptCheckpoint(f"{path}: unreadable safetensors header ({err})") from err
    if {s.name for s in slots} != set(expected):
        raise CorruptCheckpoint(f"{path}: holds other tensors than the manifest lists")
    pos = 0
    for s in slots:
        meta = expected[s.name]
        if (s.dtype, s.shape) != (meta["dtype"], list(meta["shape"])) or s.dtype not in DTYPES:
            raise CorruptCheckpoint(f"{path}: {s.name!r} differs from the manifest in type")
        if s.begin != pos or s.end - s.begin != _numel(s.shape) * DTYPES[s.dtype].itemsize:
            raise CorruptCheckpoint(f"{path}: {s.name!r} is not where the format puts it")
        pos = s.end
    if pos != data_size:
        raise CorruptCheckpoint(f"{path}: {data_size - pos} bytes follow the last tensor")
    return slots


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _tensor_at(data: torch.Tensor, slot: _Slot) -> torch.Tensor:
    """The tensor at ``slot`` of ``data``, the shard's data in a buffer of its own (aligned
    by the allocator: only the slot's offset can misalign it)."""
    dtype = DTYPES[slot.dtype]
    raw = data[slot.begin : slot.end]
    if raw.numel() == 0:
        return torch.empty(slot.shape, dtype=dtype)
    if slot.begin % dtype.itemsize:  # a view needs aligned storage: copy this one
        raw = raw.clone()
    return raw.view(dtype).view(slot.shape)
