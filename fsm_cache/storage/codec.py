"""One page as bytes: a header naming its key, dtype, shape and length, then the raw bytes.

Both backends store a page this way, the header and the bytes together in one
file or one Redis value, so a page is either whole or absent: LMCache's Redis
connector kept them under two keys, and a server that evicted the bytes left a
header that promised a page it could not give. The header is verified on every
read, so a torn file, a foreign file or a page under the wrong key is a
:class:`~fsm_cache.errors.CorruptPage`, never wrong KV.

Layout: ``FSMPAGE1``, a 4-byte little-endian header length, the header as
compact JSON (``key``, ``dtype``, ``shape``, ``nbytes``), then ``nbytes`` bytes.
The bytes are the tensor's memory as is, so every dtype (float8 included)
round-trips bit for bit; torch alone moves them (no numpy).
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import struct
from collections.abc import Sequence
from typing import Any

import torch

from fsm_cache.errors import BadArgument, CorruptPage
from fsm_cache.storage.keys import check_keys


MAGIC = b"FSMPAGE1"
_PREFIX = struct.Struct("<8sI")
_MAX_HEADER = 1 << 16


def check_pages(keys: Sequence[str], pages: Sequence[torch.Tensor]) -> None:
    """Refuse a put's arguments before anything is written.

    Raises:
        BadArgument: A key is not a page key, the counts differ, or a page is
            not a non-empty CPU tensor.
    """
    check_keys(keys)
    if len(keys) != len(pages):
        raise BadArgument(f"{len(keys)} keys for {len(pages)} pages")
    for index, page in enumerate(pages):
        if not isinstance(page, torch.Tensor):
            raise BadArgument(f"page {index} is a {type(page).__name__}, not a torch.Tensor")
        if page.device.type != "cpu" or page.numel() == 0:
            raise BadArgument(f"page {index} must be a non-empty CPU tensor, not {page.device}")


def header(key: str, page: torch.Tensor) -> bytes:
    """Return the bytes that precede ``page``'s bytes under ``key``."""
    dtype = str(page.dtype).removeprefix("torch.")
    nbytes = page.numel() * page.element_size()
    fields = {"key": key, "dtype": dtype, "shape": list(page.shape), "nbytes": nbytes}
    encoded = json.dumps(fields, separators=(",", ":")).encode()
    return _PREFIX.pack(MAGIC, len(encoded)) + encoded


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
    flat = page.detach().contiguous()
    return b"".join((header(key, flat), raw_bytes(flat)))


def write(fd: int, key: str, page: torch.Tensor) -> int:
    """Write ``page`` under ``key`` to the open file ``fd``; return the bytes written.

    Header and bytes go down in one ``writev``: a small buffered write before a
    large one makes Python's buffered writer copy the page at about half speed.

    Raises:
        OSError: The write failed (the disk is full, or made no progress).
    """
    flat = page.detach().contiguous()
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
    """Return the page stored as ``value`` under ``key``, after checking its header.

    Raises:
        CorruptPage: ``value`` is not a page, is torn, or names another key.
    """
    fields, start = _parse(where, key, value[: _PREFIX.size + _MAX_HEADER])
    dtype, shape, nbytes = fields
    if len(value) != start + nbytes:
        raise CorruptPage(where, key, f"{len(value) - start} bytes after a header of {nbytes}")
    page = torch.empty(nbytes, dtype=torch.uint8)
    raw_bytes(page)[:] = memoryview(value)[start:]
    return page.view(dtype).reshape(shape)


def read(path: str, key: str) -> torch.Tensor:
    """Return the page in the file at ``path``, after checking its header and length.

    Reads the header, then the bytes straight into the new tensor (no buffer
    between, no read past the header).

    Raises:
        FileNotFoundError: There is no such file (the page was evicted or dropped).
        CorruptPage: The file is not a page, is torn, or names another key.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        head = os.read(fd, _PREFIX.size)
        if len(head) == _PREFIX.size and head.startswith(MAGIC):
            head += os.read(fd, min(_PREFIX.unpack(head)[1], _MAX_HEADER))
        (dtype, shape, nbytes), start = _parse(path, key, head)
        if size != start + nbytes:
            raise CorruptPage(path, key, f"{size - start} bytes after a header of {nbytes}")
        page = torch.empty(nbytes, dtype=torch.uint8)
        into, got = raw_bytes(page), 0
        while got < nbytes:
            chunk = os.readv(fd, [into[got:]])
            if chunk == 0:  # pragma: no cover - the file shrank while we read it
                raise CorruptPage(path, key, f"read {got} of {nbytes} bytes")
            got += chunk
    finally:
        os.close(fd)
    return page.view(dtype).reshape(shape)


def _parse(where: str, key: str, head: bytes) -> tuple[tuple[torch.dtype, list[int], int], int]:
    """Return the dtype, shape and length a header declares, and where the bytes start."""
    if len(head) < _PREFIX.size or head[: len(MAGIC)] != MAGIC:
        raise CorruptPage(where, key, "no page header")
    _, length = _PREFIX.unpack_from(head)
    start = _PREFIX.size + length
    if len(head) < start:
        raise CorruptPage(
            where, key, f"header cut short: {len(head) - _PREFIX.size} of {length} bytes"
        )
    try:
        fields: Any = json.loads(head[_PREFIX.size : start])
        found, name, shape, nbytes = (fields[k] for k in ("key", "dtype", "shape", "nbytes"))
    except (ValueError, KeyError, TypeError):
        raise CorruptPage(where, key, "unreadable page header") from None
    if found != key:
        raise CorruptPage(where, key, f"header names page {str(found)[:12]}")
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype) or not _sized(shape, nbytes, dtype):
        raise CorruptPage(where, key, f"header's {name} {shape} does not make {nbytes} bytes")
    return (dtype, shape, nbytes), start


def _sized(shape: object, nbytes: object, dtype: torch.dtype) -> bool:
    """Whether ``shape`` of ``dtype`` takes exactly ``nbytes`` bytes."""
    if not isinstance(shape, list) or not all(_count(n) for n in shape):
        return False
    itemsize = torch.empty((), dtype=dtype).element_size()
    return _count(nbytes) and math.prod(shape) * itemsize == nbytes


def _count(value: object) -> bool:
    """Whether ``value`` is an int >= 0 (JSON's ``true`` is not one)."""
    return type(value) is int and value >= 0
