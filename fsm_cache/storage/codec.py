"""One page as bytes: a header naming its key, dtype, shape, length and checksum, then the bytes.

Both backends store a page this way, the header and the bytes together in one
file or one Redis value, so a page is either whole or absent: LMCache's Redis
connector kept them under two keys, and a server that evicted the bytes left a
header that promised a page it could not give. The header and a checksum of
the header's fields and the bytes are verified on every read, so a torn file
(even one of intact length whose last blocks were lost), a foreign file, a page
under the wrong key or a header whose dtype or shape changed is a
:class:`~fsm_cache.errors.CorruptPage`, never wrong KV.

Layout: ``FSMPAGE3``, a 4-byte little-endian header length, the header as
compact JSON (``key``, ``dtype``, ``shape``, ``nbytes``, and ``crc32``: the
CRC-32 of the other four fields, as the JSON list ``[key, dtype, shape,
nbytes]``, followed by the bytes, as 8 lowercase hex digits, fixed width so a
page's size is known before its bytes are hashed), then ``nbytes`` bytes. The
bytes are the tensor's memory as is, so every dtype (float8 included)
round-trips bit for bit; torch alone moves them (no numpy). Quantized dtypes
are the exception: their bytes mean nothing without a scale, so a page of one
is refused and a header naming one is corrupt.

Pages of the second format (``FSMPAGE2``, whose checksum covers the bytes
alone) are still read, so a store written before keeps its pages: a header of
theirs whose dtype or shape changed to another of the same length goes
unnoticed, which the cache's check of a page's shape and dtype covers. Pages
of the first format (``FSMPAGE1``, no checksum) are refused as corrupt: their
bytes cannot be verified. Pages of a later format (``FSMPAGE4`` on) cannot be
read here either, but are not torn: they are
:class:`~fsm_cache.errors.LaterFormatPage`, which a cache leaves stored.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import stat
import struct
import zlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from fsm_cache.errors import BadArgument, CorruptPage, LaterFormatPage
from fsm_cache.memory.kv import QUANTIZED
from fsm_cache.numeric import whole
from fsm_cache.storage.base import check_sequence
from fsm_cache.storage.keys import check_keys


MAGIC = b"FSMPAGE3"
"""The format written: the checksum covers the header's fields and the bytes."""
BYTES_ONLY_MAGIC = b"FSMPAGE2"
"""The second format's magic: the checksum covers the bytes alone; read, never written."""
OLD_MAGIC = b"FSMPAGE1"
"""The first format's magic: pages without a checksum, read as corrupt."""
LATER_MAGICS = frozenset(MAGIC[:-1] + bytes([v]) for v in range(MAGIC[-1] + 1, ord("9") + 1))
"""The magics a later version may write (``FSMPAGE4`` to ``FSMPAGE9``): such a page is
:class:`~fsm_cache.errors.LaterFormatPage`, unread but not taken for a torn one."""
_PREFIX = struct.Struct("<8sI")
_MAX_HEADER = 1 << 16
_CHECKED = frozenset({MAGIC, BYTES_ONLY_MAGIC})
"""The magics of the formats read: both have a checksum."""


class Header(NamedTuple):
    """What a page's header declares.

    Attributes:
        dtype: The page's dtype.
        shape: The page's shape.
        nbytes: The length of the bytes after the header.
        crc32: The CRC-32 of ``covered`` and those bytes, as 8 lowercase hex
            digits (as read: compared, never trusted to be well formed).
        start: Where the bytes start in the stored value.
        covered: The header's fields the checksum covers before the bytes
            (:func:`_covered`); empty in the second format.
    """

    dtype: torch.dtype
    shape: list[int]
    nbytes: int
    crc32: object
    start: int
    covered: bytes


def check_pages(keys: Sequence[str], pages: Sequence[torch.Tensor]) -> None:
    """Refuse a put's arguments before anything is written.

    Raises:
        BadArgument: ``keys`` or ``pages`` is not a sequence, a key is not a
            page key, the counts differ, or a page is not a non-empty, dense,
            CPU tensor of a plain dtype.
    """
    check_keys(keys)
    check_sequence("pages", pages, "tensors")
    if len(keys) != len(pages):
        raise BadArgument(f"{len(keys)} keys for {len(pages)} pages")
    for index, page in enumerate(pages):
        problem = _refusal(page)
        if problem:
            raise BadArgument(f"page {index} {problem}")


def _refusal(page: object) -> str:
    """Return why ``page`` cannot be stored as its memory's bytes, or ``""`` when it can.

    Sparse, nested and quantized tensors have no single block of memory that
    is their content (or their dtype's bytes mean nothing without a scale), so
    they are refused here rather than failing part-way through a batch.
    """
    if not isinstance(page, torch.Tensor):
        return f"is a {type(page).__name__}, not a torch.Tensor"
    if page.is_nested:
        return "is a nested tensor, not a dense one"
    if page.layout != torch.strided:
        return f"is a {str(page.layout).removeprefix('torch.')} tensor, not a dense (strided) one"
    unstored = _unstored(page.dtype)
    if unstored:
        return f"is {unstored}"
    return _misplaced(page)


def _unstored(dtype: torch.dtype) -> str:
    """Return why pages of ``dtype`` are not stored, or ``""`` when they are.

    The one rule for both directions: put refuses such a page, and a header
    that names such a dtype is corrupt, since put never wrote it. A quantized
    dtype is refused whether or not the tensor is quantized: plain bytes viewed
    as ``qint8`` report ``is_quantized`` False, yet mean nothing without a scale.
    """
    if dtype in QUANTIZED:
        return f"quantized ({_dtype_name(dtype)}), not of a plain dtype"
    return ""


def _dtype_name(dtype: torch.dtype) -> str:
    """Return the name a header gives ``dtype`` (``bfloat16``)."""
    return str(dtype).removeprefix("torch.")


def _misplaced(page: torch.Tensor) -> str:
    """Return why a dense ``page`` is not one to store: elsewhere than the CPU, or empty; else ``""``."""
    if page.device.type != "cpu":
        return f"is on {page.device}, not the CPU"
    if page.numel() == 0:
        return f"is empty (shape {list(page.shape)})"
    return ""


def dense(page: torch.Tensor) -> torch.Tensor:
    """Return ``page``'s logical content as a contiguous tensor (``page`` itself when it is one).

    Conjugate and negative views are resolved first: their memory holds the
    values before the view, so storing it as is would store other KV.
    """
    return page.detach().resolve_conj().resolve_neg().contiguous()


def header(key: str, page: torch.Tensor) -> bytes:
    """Return the bytes that precede a contiguous ``page``'s bytes under ``key``."""
    return _header(key, page, raw_bytes(page))


def stored_bytes(key: str, page: torch.Tensor) -> int:
    """Return what ``page`` takes stored under ``key``, header included, without hashing it."""
    return len(_header(key, page, None)) + page.numel() * page.element_size()


def _header(key: str, page: torch.Tensor, data: memoryview | None) -> bytes:
    """Return the header of ``page`` under ``key``, its checksum over ``data`` (0 when None).

    The header's length does not depend on the checksum (fixed width), so
    :func:`stored_bytes` need not hash the page.
    """
    name, shape = _dtype_name(page.dtype), list(page.shape)
    nbytes = page.numel() * page.element_size()
    crc = 0 if data is None else zlib.crc32(data, zlib.crc32(_covered(key, name, shape, nbytes)))
    fields = {"key": key, "dtype": name, "shape": shape, "nbytes": nbytes, "crc32": f"{crc:08x}"}
    encoded = json.dumps(fields, separators=(",", ":")).encode()
    return _PREFIX.pack(MAGIC, len(encoded)) + encoded


def _covered(key: object, dtype: object, shape: object, nbytes: object) -> bytes:
    """Return the header's fields as the checksum covers them: a compact JSON list.

    Encoded from the values, not copied from the stored header, so writer and
    reader agree on them byte for byte; a header that names another dtype or
    shape (a bit flipped, a writer's bug) fails the checksum.
    """
    return json.dumps([key, dtype, shape, nbytes], separators=(",", ":")).encode()


def raw_bytes(page: torch.Tensor) -> memoryview:
    """Return a byte view of a contiguous ``page``'s memory, without copying it.

    The view reads the tensor's memory in place: the caller keeps the tensor
    alive while the view is in use.
    """
    if not page.is_contiguous():
        raise BadArgument("a page's bytes are viewed only when the page is contiguous")
    nbytes = page.numel() * page.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(page.data_ptr())).cast("B")


def encode(key: str, page: torch.Tensor) -> bytes:
    """Return ``page`` as one value: its header, then its bytes (one copy)."""
    flat = dense(page)
    return b"".join((header(key, flat), raw_bytes(flat)))


def write(fd: int, key: str, page: torch.Tensor) -> int:
    """Write ``page`` under ``key`` to the open file ``fd``; return the bytes written.

    Header and bytes go down in one ``writev``: a small buffered write before a
    large one makes Python's buffered writer copy the page at about half speed.

    Raises:
        OSError: The write failed (the disk is full, or made no progress).
    """
    flat = dense(page)
    views = [memoryview(header(key, flat)), raw_bytes(flat)]
    total = sum(view.nbytes for view in views)
    while views:
        done = os.writev(fd, views)
        if done == 0:
            raise OSError(f"writev wrote nothing with {sum(v.nbytes for v in views)} bytes left")
        while views and done >= views[0].nbytes:
            done -= views[0].nbytes
            views.pop(0)
        if views and done:
            views[0] = views[0][done:]
    return total


def decode(where: str, key: str, value: bytes) -> torch.Tensor:
    """Return the page stored as ``value`` under ``key``, after checking its header and checksum.

    Raises:
        CorruptPage: ``value`` is not a page, is torn, or names another key.
    """
    head = _parse(where, key, value[: _PREFIX.size + _MAX_HEADER])
    if len(value) != head.start + head.nbytes:
        raise CorruptPage(
            where, key, f"{len(value) - head.start} bytes after a header of {head.nbytes}"
        )
    page = torch.empty(head.nbytes, dtype=torch.uint8)
    raw_bytes(page)[:] = memoryview(value)[head.start :]
    return _verified(where, key, head, page)


def read(path: str, key: str, *, folder: int | None = None) -> torch.Tensor:
    """Return the page in the file at ``path``, after checking its header, length and checksum.

    Reads the header, then the bytes straight into the new tensor (no buffer
    between, no read past the header). Opened non-blocking, so a FIFO planted
    at ``path`` is refused instead of waited on.

    Args:
        path: The file, as errors name it.
        key: The page key its header must name.
        folder: An open directory to find the file in by its name (the last
            part of ``path``), so a link swapped in above it is not followed.

    Raises:
        FileNotFoundError: There is no such file (the page was evicted or dropped).
        CorruptPage: The file is not a regular file or not a page, is torn, or
            names another key.
        OSError: The file could not be read (a disk error, no permission).
    """
    name = path if folder is None else os.path.basename(path)
    fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK, dir_fd=folder)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CorruptPage(path, key, "not a regular file")
        head = os.read(fd, _PREFIX.size)
        if len(head) == _PREFIX.size and head[: len(MAGIC)] in _CHECKED:
            head += os.read(fd, min(_PREFIX.unpack(head)[1], _MAX_HEADER))
        parsed = _parse(path, key, head)
        if info.st_size != parsed.start + parsed.nbytes:
            got = info.st_size - parsed.start
            raise CorruptPage(path, key, f"{got} bytes after a header of {parsed.nbytes}")
        page = _read_into(fd, path, key, parsed.nbytes)
    finally:
        os.close(fd)
    return _verified(path, key, parsed, page)


def _read_into(fd: int, path: str, key: str, nbytes: int) -> torch.Tensor:
    """Read ``nbytes`` from ``fd`` into a new uint8 tensor."""
    page = torch.empty(nbytes, dtype=torch.uint8)
    into, got = raw_bytes(page), 0
    while got < nbytes:
        chunk = os.readv(fd, [into[got:]])
        if chunk == 0:  # pragma: no cover - the file shrank while we read it
            raise CorruptPage(path, key, f"read {got} of {nbytes} bytes")
        got += chunk
    return page


def _verified(where: str, key: str, head: Header, page: torch.Tensor) -> torch.Tensor:
    """Return the bytes ``page`` as the header's dtype and shape, once their checksum matches."""
    crc = f"{zlib.crc32(raw_bytes(page), zlib.crc32(head.covered)):08x}"
    if crc != head.crc32:
        covers = "header and bytes" if head.covered else "bytes"
        problem = f"crc32 of the {covers} is {crc}, the header says {str(head.crc32)[:8]}"
        raise CorruptPage(where, key, problem)
    return page.view(head.dtype).reshape(head.shape)


def _parse(where: str, key: str, head: bytes) -> Header:
    """Return what a header declares, and where the bytes start."""
    if head[: len(OLD_MAGIC)] == OLD_MAGIC:
        raise CorruptPage(where, key, "a page of the first format (FSMPAGE1), with no checksum")
    if head[: len(MAGIC)] in LATER_MAGICS:
        later = head[: len(MAGIC)].decode()
        raise LaterFormatPage(
            where, key, f"a page of a later format ({later}), written by a newer version"
        )
    if len(head) < _PREFIX.size or head[: len(MAGIC)] not in _CHECKED:
        raise CorruptPage(where, key, "no page header")
    magic, length = _PREFIX.unpack_from(head)
    start = _PREFIX.size + length
    if len(head) < start:
        raise CorruptPage(
            where, key, f"header cut short: {len(head) - _PREFIX.size} of {length} bytes"
        )
    try:
        fields: Any = json.loads(head[_PREFIX.size : start])
        found, name, shape, nbytes, crc = (
            fields[k] for k in ("key", "dtype", "shape", "nbytes", "crc32")
        )
    except (ValueError, KeyError, TypeError, RecursionError):  # RecursionError: nested too deep
        raise CorruptPage(where, key, "unreadable page header") from None
    if found != key:
        raise CorruptPage(where, key, f"header names page {str(found)[:12]}")
    dtype = getattr(torch, str(name), None)
    unstored = _unstored(dtype) if isinstance(dtype, torch.dtype) else ""
    if unstored:
        raise CorruptPage(where, key, f"header's dtype is {unstored}")
    if not isinstance(dtype, torch.dtype) or not _sized(shape, nbytes, dtype):
        raise CorruptPage(where, key, f"header's {name} {shape} does not make {nbytes} bytes")
    covered = _covered(found, name, shape, nbytes) if magic == MAGIC else b""
    return Header(dtype, shape, nbytes, crc, start, covered)


def _sized(shape: object, nbytes: object, dtype: torch.dtype) -> bool:
    """Whether ``shape`` of ``dtype`` takes exactly ``nbytes`` bytes.

    The item size is the dtype's own: building a tensor of a dtype a header
    names makes torch warn for some (``complex32``).
    """
    if not isinstance(shape, list) or not all(whole(n) for n in shape):
        return False
    return whole(nbytes) and math.prod(shape) * dtype.itemsize == nbytes
