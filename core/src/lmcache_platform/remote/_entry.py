"""The remote entry format: one chunk as bytes in a shared store, and the refusal of bad ones.

A remote store is shared by every node, so what comes back from it is untrusted: another
deployment, a buggy writer, a truncated write, an evicted-and-reused key or a hostile
client may have put it there. An entry therefore says what it is, and a reader refuses
(and counts, by reason) anything that is not exactly what it asked for. Nothing is
unpickled or evaluated: the header is fixed binary fields, dtypes come from an
allow-list by name, tensors are rebuilt with ``torch.frombuffer`` over the fetched bytes
(no copy).

Layout (little-endian)::

    offset  size  field
    0       4     magic b"LMCR"
    4       1     version (2; 1 is still read)
    5       1     flags (bit 0: keyed checksum)
    6       2     header length H (a multiple of 64, checksum included)
    8       1     prefix length P (0..64)
    9       1     namespace length N (1..64)
    10      1     key length K (1..64)
    11      1     tensor count T (1..64)
    12      4     reserved (0)
    16      8     payload length L
    24      P+N+K the deployment prefix, the namespace, the key
    ...     per tensor: dtype name length (1), dtype name (ASCII), ndim (1), ndim x 8-byte dims
    ...     zeros up to H - 32
    H - 32  32    checksum of bytes [0, H - 32) and the payload (see below)
    H       L     payload: the tensors' bytes, each starting at a multiple of 64

The checksum is what the version says: version 2, keyed BLAKE3 (about five times the
speed of BLAKE2b on one core, and like it a MAC when keyed); version 1, which servers
before it wrote, BLAKE2b-256 (person ``b"lmcp-remote1"``). New entries are version 2; a
version-1 entry is still read, checked with its own MAC (the tier counts it,
``fetched_v1``), so a rolling upgrade loses no entry and none is served unchecked. The
BLAKE3 key is derived from the deployment's secret (or from nothing, unkeyed) with
BLAKE3's own key derivation, so the two versions never share a key.

The checksum is keyed with a secret shared by the deployment's servers when one is
configured (``--remote-key-file``; flag bit 0 says so). Unkeyed, it catches accidents:
truncation, bit flips, a key overwritten by something else, an entry of another
namespace, prefix or layout. Keyed, it also stops forgery: a writer without the secret
cannot make an entry a reader accepts (it can still delete entries or fill the store).
Neither mode hides the bytes: anyone who can read the store can read the KV.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

from .._ipc_wrapper import ALLOWED_DTYPES, MAX_EXTENT

if TYPE_CHECKING:
    import torch

    from ._store import Buffer

MAGIC = b"LMCR"
#: The version new entries are written in; :data:`VERSIONS` are read.
VERSION = 2
VERSIONS = (1, 2)
FLAG_KEYED = 1
ALIGN = 64
DIGEST_BYTES = 32
MAX_NAME = 64  # prefix, namespace and key each (the protocol's MAX_KEY_LEN)
MAX_TENSORS = 64
MAX_NDIM = 8
_PERSON = b"lmcp-remote1"
_CONTEXT_V2 = "lmcache-platform 2026-12 remote entry v2 checksum key"
_FIXED = struct.Struct("<4sBBHBBBBIQ")

#: Every reason an entry is refused for; the tier counts ``refused_<reason>``.
REASONS = (
    "truncated",
    "magic",
    "version",
    "header",
    "auth",
    "prefix",
    "namespace",
    "key",
    "layout",
    "checksum",
)


class Refused(Exception):
    """An entry that must not be loaded; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class TensorSpec(NamedTuple):
    """One tensor of a chunk as the header describes it: a dtype name and a shape."""

    dtype: str
    shape: tuple[int, ...]


class Decoded(NamedTuple):
    """A decoded entry: the chunk's tensors (read-only views of the fetched bytes), their bytes
    and the entry's format version."""

    tensors: list[torch.Tensor]
    nbytes: int
    version: int = VERSION
    #: The tensors are the caller's own, read in place (``RemoteTier.fetch(into=...)``).
    placed: bool = False


@dataclass(frozen=True)
class EntryIdentity:
    """What an entry must say it is: the deployment prefix, the namespace and the key."""

    prefix: bytes
    namespace: bytes
    key: bytes


def spec_of(t: torch.Tensor) -> TensorSpec:
    return TensorSpec(str(t.dtype).removeprefix("torch."), tuple(int(d) for d in t.shape))


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _Hasher(Protocol):
    def update(self, data: Buffer, /) -> object: ...
    def digest(self) -> bytes: ...


def _hasher(secret: bytes | None, version: int = VERSION) -> _Hasher:
    """The checksum of ``version``: keyed BLAKE3 (2) or BLAKE2b (1); keyed with ``secret`` if given."""
    if version == 1:
        return hashlib.blake2b(digest_size=DIGEST_BYTES, key=secret or b"", person=_PERSON)
    import blake3

    return blake3.blake3(key=_blake3_key(secret))


@functools.lru_cache(maxsize=8)
def _blake3_key(secret: bytes | None) -> bytes:
    import blake3

    return blake3.blake3(secret or b"", derive_key_context=_CONTEXT_V2).digest()


def _itemsize(dtype: str) -> int:
    from .._ipc_wrapper import dtype_from_name

    return int(dtype_from_name(dtype).itemsize)


def derive_secret(material: bytes) -> bytes:
    """The 32-byte checksum key made from a key file's contents (any length of at least 16 bytes)."""
    if len(material) < 16:
        raise ValueError(f"a remote key must hold at least 16 bytes, got {len(material)}")
    return hashlib.blake2b(material, digest_size=32, person=b"lmcp-remotekey1").digest()


def encode(
    tensors: Sequence[torch.Tensor],
    who: EntryIdentity,
    secret: bytes | None = None,
    *,
    version: int = VERSION,
) -> memoryview:
    """The entry for one chunk, as bytes over fresh host memory; the tensors must be on the CPU.

    Their bytes are copied once (into the entry) and read once more (by the checksum).
    ``version`` 1 writes what older servers wrote (for tests of a mixed deployment).
    No numpy: the entry's memory is a torch tensor seen through ``ctypes``. The copies are
    plain ``memcpy``s, never torch's: in an engine's process (vLLM's native offloading)
    torch's copies fan out over intra-op threads the engine keeps busy.
    """
    import torch

    header, offsets, payload_len = _header(tensors, who, secret, version)
    header_len = len(header)
    entry = torch.empty(header_len + payload_len, dtype=torch.uint8)  # no zero fill: every byte is written
    view = byte_view(entry)
    prev = 0
    for t, off in zip(tensors, offsets, strict=True):
        start = header_len + off
        view[header_len + prev : start] = bytes(off - prev)  # alignment padding
        if t.nbytes:
            view[start : start + t.nbytes] = byte_view(_flat_bytes(t))
        prev = off + t.nbytes
    h = _hasher(secret, version)
    h.update(header[: header_len - DIGEST_BYTES])
    h.update(view[header_len:])
    header[header_len - DIGEST_BYTES :] = h.digest()
    view[:header_len] = header
    return view


def encode_parts(
    tensors: Sequence[torch.Tensor],
    who: EntryIdentity,
    secret: bytes | None = None,
    *,
    version: int = VERSION,
) -> list[memoryview]:
    """:func:`encode`'s entry as the buffers it is made of, in order, without copying the tensors.

    The header, then each tensor's bytes (a view of its memory; a non-contiguous tensor is
    made contiguous first) after its alignment padding: for a store that writes a list of
    buffers in one call (``put_many_gather``, a ``writev``). The tensors must stay as they
    are until the parts are written.
    """
    header, offsets, _ = _header(tensors, who, secret, version)
    header_len = len(header)
    parts: list[memoryview] = []
    prev = 0
    for t, off in zip(tensors, offsets, strict=True):
        if off > prev:
            parts.append(memoryview(bytes(off - prev)))
        if t.nbytes:
            parts.append(byte_view(_flat_bytes(t)))
        prev = off + t.nbytes
    h = _hasher(secret, version)
    h.update(header[: header_len - DIGEST_BYTES])
    for part in parts:
        h.update(part)
    header[header_len - DIGEST_BYTES :] = h.digest()
    return [memoryview(header), *parts]


def _header(
    tensors: Sequence[torch.Tensor], who: EntryIdentity, secret: bytes | None, version: int
) -> tuple[bytearray, list[int], int]:
    """An entry's header (its checksum left zero), each tensor's payload offset, the payload length."""
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"remote entries are written from host memory, got a tensor on {t.device}")
    return _header_of([(spec_of(t), int(t.nbytes)) for t in tensors], who, secret, version)


def _header_of(
    tensors: Sequence[tuple[TensorSpec, int]], who: EntryIdentity, secret: bytes | None, version: int
) -> tuple[bytearray, list[int], int]:
    """:func:`_header` from each tensor's spec and byte count."""
    if version not in VERSIONS:
        raise ValueError(f"entry format version {version}: this server writes {VERSIONS}")
    _check_identity(who)
    if not 1 <= len(tensors) <= MAX_TENSORS:
        raise ValueError(f"a chunk has 1 to {MAX_TENSORS} tensors, got {len(tensors)}")
    descr = bytearray()
    for s, _ in tensors:
        if s.dtype not in ALLOWED_DTYPES or len(s.shape) > MAX_NDIM:
            raise ValueError(f"cannot store a tensor of {s.dtype} with {len(s.shape)} dims remotely")
        name = s.dtype.encode()
        descr += struct.pack(f"<B{len(name)}sB{len(s.shape)}Q", len(name), name, len(s.shape), *s.shape)
    variable = who.prefix + who.namespace + who.key + bytes(descr)
    header_len = _align(_FIXED.size + len(variable) + DIGEST_BYTES)
    offsets, end = [], 0
    for _, nbytes in tensors:
        start = _align(end)
        offsets.append(start)
        end = start + nbytes
    header = bytearray(header_len)
    flags = FLAG_KEYED if secret else 0
    _FIXED.pack_into(
        header, 0, MAGIC, version, flags, header_len, len(who.prefix), len(who.namespace), len(who.key),
        len(tensors), 0, end,
    )  # fmt: skip
    header[_FIXED.size : _FIXED.size + len(variable)] = variable
    return header, offsets, end


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable byte ``memoryview`` over a contiguous CPU tensor's memory, keeping it alive.

    Through ``ctypes`` rather than ``Tensor.numpy()``: numpy is nobody's dependency here.
    """
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"a byte view needs a contiguous CPU tensor, got one on {t.device}")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray())
    arr = (ctypes.c_ubyte * n).from_address(t.data_ptr())
    arr._lmcache_owner = t  # type: ignore[attr-defined]  # the memory lives as long as the view
    return memoryview(arr).cast("B")


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _check_identity(who: EntryIdentity) -> None:
    for name, value, lo in (("prefix", who.prefix, 0), ("namespace", who.namespace, 1), ("key", who.key, 1)):
        if not lo <= len(value) <= MAX_NAME:
            raise ValueError(f"an entry's {name} is {lo} to {MAX_NAME} bytes, got {len(value)}")


def decode(
    data: bytes | bytearray | memoryview,
    who: EntryIdentity,
    secret: bytes | None = None,
    expect: Sequence[TensorSpec] | None = None,
) -> Decoded:
    """The chunk ``data`` holds, if it is exactly ``who``'s (and of the ``expect``-ed layout).

    Raises :class:`Refused` with the first reason found: the cheap checks (length, magic,
    header fields, identity, layout) run before the checksum, which reads every byte.
    """
    view = memoryview(data).cast("B") if isinstance(data, memoryview) else memoryview(data)
    version, header_len, specs, sizes, offsets = _check_header(view, len(view), who, secret, expect)
    h = _hasher(secret, version)
    h.update(view[: header_len - DIGEST_BYTES])
    h.update(view[header_len:])
    if h.digest() != view[header_len - DIGEST_BYTES : header_len]:
        raise Refused("checksum", "checksum mismatch: the entry was corrupted or forged")
    return Decoded(_tensors(view, specs, sizes, [header_len + o for o in offsets]), sum(sizes), version)


def plan(
    who: EntryIdentity, expect: Sequence[TensorSpec], secret: bytes | None = None
) -> tuple[int, list[int], int]:
    """Where an entry of ``who`` with tensors ``expect`` puts things: its header length, each
    tensor's offset in the payload, the payload length (for reading one into place)."""
    header, offsets, payload_len = _header_of([(s, _nbytes(s)) for s in expect], who, secret, VERSION)
    return len(header), offsets, payload_len


def decode_placed(
    header: Buffer,
    payload: Sequence[Buffer],
    tensors: Sequence[torch.Tensor],
    who: EntryIdentity,
    secret: bytes | None = None,
    expect: Sequence[TensorSpec] | None = None,
) -> Decoded:
    """:func:`decode` of an entry read in place (see :func:`plan`): ``header`` its header,
    ``payload`` its payload's pieces in order (padding and the ``tensors``' own bytes).

    The same checks, the same refusals; the tensors returned are ``tensors`` themselves.
    """
    view = memoryview(header).cast("B")
    total = len(view) + sum(len(memoryview(p).cast("B")) for p in payload)
    version, header_len, specs, _sizes, _offsets = _check_header(view, total, who, secret, expect)
    if header_len != len(view) or [spec_of(t) for t in tensors] != specs:
        raise Refused(
            "layout", f"entry holds {_show(specs)}, read into {_show([spec_of(t) for t in tensors])}"
        )
    h = _hasher(secret, version)
    h.update(view[: header_len - DIGEST_BYTES])
    for piece in payload:
        h.update(piece)
    if h.digest() != view[header_len - DIGEST_BYTES : header_len]:
        raise Refused("checksum", "checksum mismatch: the entry was corrupted or forged")
    return Decoded(list(tensors), sum(int(t.nbytes) for t in tensors), version)


def _check_header(
    view: memoryview,
    total: int,
    who: EntryIdentity,
    secret: bytes | None,
    expect: Sequence[TensorSpec] | None,
) -> tuple[int, int, list[TensorSpec], list[int], list[int]]:
    """Every check but the checksum of an entry of ``total`` bytes whose header ``view`` starts:
    its version, header length, tensor specs, their sizes and payload offsets."""
    if total < _FIXED.size or len(view) < _FIXED.size:
        raise Refused("truncated", f"{total} bytes is shorter than an entry header")
    magic, version, flags, header_len, np_, nn, nk, nt, reserved, payload_len = _FIXED.unpack_from(view, 0)
    if magic != MAGIC:
        raise Refused("magic", f"not an lmcache-platform entry (starts with {bytes(magic)!r})")
    if version not in VERSIONS:
        raise Refused("version", f"entry format version {version}; this server reads versions 1 and 2")
    if header_len > len(view):
        raise Refused("truncated", f"{len(view)} bytes, but the header alone is {header_len}")
    if (
        header_len % ALIGN
        or reserved
        or flags & ~FLAG_KEYED
        or np_ > MAX_NAME
        or not 1 <= nn <= MAX_NAME
        or not 1 <= nk <= MAX_NAME
        or not 1 <= nt <= MAX_TENSORS
    ):
        raise Refused("header", "malformed entry header fields")
    if total != header_len + payload_len:
        raise Refused("truncated", f"{total} bytes where the header says {header_len + payload_len}")
    specs = _specs(view, _FIXED.size + np_ + nn + nk, nt, header_len - DIGEST_BYTES)
    if bool(flags & FLAG_KEYED) != bool(secret):
        raise Refused(
            "auth",
            "entry is keyed but this server has no remote key"
            if secret is None
            else "entry is not keyed but this server requires its remote key",
        )
    pos = _FIXED.size
    for name, want, n in (
        ("prefix", who.prefix, np_),
        ("namespace", who.namespace, nn),
        ("key", who.key, nk),
    ):
        if view[pos : pos + n] != want:
            raise Refused(name, f"entry is for another {name} ({bytes(view[pos : pos + n]).hex()[:16]})")
        pos += n
    sizes = [_nbytes(s) for s in specs]
    offsets, end = [], 0
    for size in sizes:
        start = _align(end)
        offsets.append(start)
        end = start + size
    if end != payload_len:
        raise Refused("header", f"tensors of {end} bytes in a payload of {payload_len}")
    if expect is not None and list(specs) != [TensorSpec(e.dtype, tuple(e.shape)) for e in expect]:
        raise Refused("layout", f"entry holds {_show(specs)}, expected {_show(expect)}")
    return version, header_len, specs, sizes, offsets


def _specs(view: memoryview, pos: int, count: int, limit: int) -> list[TensorSpec]:
    specs = []
    try:
        for _ in range(count):
            n = view[pos]
            name = bytes(view[pos + 1 : pos + 1 + n]).decode("ascii")
            pos += 1 + n
            ndim = view[pos]
            if name not in ALLOWED_DTYPES or ndim > MAX_NDIM:
                raise Refused("header", f"tensor of dtype {name!r} with {ndim} dims is not allowed")
            dims = struct.unpack_from(f"<{ndim}Q", view, pos + 1)
            pos += 1 + 8 * ndim
            if any(d > MAX_EXTENT for d in dims):
                raise Refused("header", f"tensor shape {dims} is out of range")
            specs.append(TensorSpec(name, tuple(dims)))
    except (IndexError, struct.error, UnicodeDecodeError):
        raise Refused("header", "tensor descriptors run past the header") from None
    if pos > limit or any(view[pos:limit]):
        raise Refused("header", "tensor descriptors run past the header or padding is not zero")
    return specs


def _nbytes(s: TensorSpec) -> int:
    n = _itemsize(s.dtype)
    for d in s.shape:
        n *= d
    if n > MAX_EXTENT:
        raise Refused("header", f"tensor of {s.shape} is out of range")
    return n


def _show(specs: Sequence[TensorSpec]) -> str:
    return ", ".join(f"{s.dtype}{list(s.shape)}" for s in specs)


def _tensors(
    view: memoryview,
    specs: Sequence[TensorSpec],
    sizes: Sequence[int],
    starts: Sequence[int],
) -> list[torch.Tensor]:
    """Views of ``data`` (no copy) where the bytes are aligned for the dtype, copies elsewhere."""
    import torch

    from .._ipc_wrapper import dtype_from_name

    _quiet_frombuffer()
    out = []
    for s, size, start in zip(specs, sizes, starts, strict=True):
        dtype = dtype_from_name(s.dtype)
        if size == 0:
            out.append(torch.empty(s.shape, dtype=dtype))
            continue
        flat = torch.frombuffer(view, dtype=torch.uint8, count=size, offset=start)
        if flat.data_ptr() % dtype.itemsize:
            flat = flat.clone()  # a store's buffer at an odd address: one copy, aligned
        out.append(flat.view(dtype).view(s.shape))
    return out


_primed = False


def _quiet_frombuffer() -> None:
    """Take torch's once-per-process "buffer is not writable" warning here, silently, once.

    Fetched entries are immutable ``bytes``; the tensors over them are only ever read
    (copied into an engine's blocks), so the warning says nothing useful, and torch emits
    it only for the first read-only buffer of the process.
    """
    global _primed
    if _primed:
        return
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.frombuffer(b"\0", dtype=torch.uint8)
    _primed = True
