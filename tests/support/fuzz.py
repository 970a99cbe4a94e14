"""A byte-level mutator over valid encoded messages, deterministic for a given seed.

Structure-blind on purpose (hypothesis covers structure-aware generation): each
mutation is one of the edits real corruption and real attackers make, applied to
a valid message so that most results get past the magic and deep into the parser.

* bit flips and random byte overwrites;
* truncation, and insertion or deletion of a random run of bytes;
* splicing the head of one message onto the tail of another;
* length tampering: a msgpack str/bin/array/map header gets a length of 0, 1, off
  by one, or the largest value its width can hold (a 4-byte one says 4 GiB);
* integer tampering: a msgpack integer becomes the most negative int64, the largest
  uint64, -1 or 2**48 + 1;
* header tampering: the magic or version byte changes.

Several edits may stack on one message.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable, Sequence

# msgpack first bytes whose following bytes are a length: byte -> (width, kind).
_LENGTH_HEADERS: dict[int, int] = {
    0xC4: 1,
    0xC5: 2,
    0xC6: 4,  # bin 8/16/32
    0xD9: 1,
    0xDA: 2,
    0xDB: 4,  # str 8/16/32
    0xDC: 2,
    0xDD: 4,  # array 16/32
    0xDE: 2,
    0xDF: 4,  # map 16/32
}
_INT_HEADERS = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8}
_HOSTILE_INTS = [
    b"\xd3" + struct.pack(">q", -(1 << 63)),
    b"\xcf" + struct.pack(">Q", (1 << 64) - 1),
    b"\xff",  # -1 as a negative fixint
    b"\xcf" + struct.pack(">Q", (1 << 48) + 1),
    b"\xce" + struct.pack(">I", 0xFFFFFFFF),
    b"\xcb" + struct.pack(">d", float("nan")),  # a float where an int belongs
]


class Mutator:
    """Derives hostile variants of ``corpus`` messages from a seeded PRNG."""

    def __init__(self, corpus: Sequence[bytes], seed: int) -> None:
        if not corpus:
            raise ValueError("the mutator needs at least one valid message")
        self.corpus = list(corpus)
        self.rng = random.Random(seed)
        self._ops: list[Callable[[bytearray], bytearray]] = [
            self._flip_bits,
            self._overwrite,
            self._truncate,
            self._insert,
            self._delete,
            self._splice,
            self._tamper_length,
            self._tamper_length,
            self._tamper_int,
            self._tamper_header,
        ]

    def __call__(self) -> bytes:
        data = bytearray(self.rng.choice(self.corpus))
        for _ in range(1 + (self.rng.random() < 0.3) + (self.rng.random() < 0.1)):
            data = self.rng.choice(self._ops)(data)
        return bytes(data)

    # -- edits ---------------------------------------------------------------------------

    def _pos(self, data: bytearray) -> int:
        return self.rng.randrange(len(data)) if data else 0

    def _flip_bits(self, data: bytearray) -> bytearray:
        for _ in range(self.rng.randint(1, 4)):
            if data:
                data[self._pos(data)] ^= 1 << self.rng.randrange(8)
        return data

    def _overwrite(self, data: bytearray) -> bytearray:
        if data:
            data[self._pos(data)] = self.rng.randrange(256)
        return data

    def _truncate(self, data: bytearray) -> bytearray:
        return data[: self.rng.randrange(len(data) + 1)]

    def _insert(self, data: bytearray) -> bytearray:
        at = self._pos(data)
        run = bytes(self.rng.randrange(256) for _ in range(self.rng.randint(1, 16)))
        return data[:at] + run + data[at:]

    def _delete(self, data: bytearray) -> bytearray:
        at = self._pos(data)
        return data[:at] + data[at + self.rng.randint(1, 16) :]

    def _splice(self, data: bytearray) -> bytearray:
        other = self.rng.choice(self.corpus)
        return data[: self._pos(data)] + other[self.rng.randrange(len(other) + 1) :]

    def _tamper_length(self, data: bytearray) -> bytearray:
        spots = [i for i, b in enumerate(data) if b in _LENGTH_HEADERS or 0x80 <= b <= 0xBF]
        if not spots:
            return self._flip_bits(data)
        at = self.rng.choice(spots)
        head = data[at]
        if head not in _LENGTH_HEADERS:  # fixmap/fixarray/fixstr: the length is in the byte
            data[at] = (head & 0xE0 if head >= 0xA0 else head & 0xF0) | self.rng.randrange(16)
            return data
        width = _LENGTH_HEADERS[head]
        old = int.from_bytes(data[at + 1 : at + 1 + width].ljust(width, b"\0"), "big")
        top = (1 << (8 * width)) - 1
        new = self.rng.choice([0, 1, max(old - 1, 0), min(old + 1, top), top])
        data[at + 1 : at + 1 + width] = new.to_bytes(width, "big")
        return data

    def _tamper_int(self, data: bytearray) -> bytearray:
        spots = [i for i, b in enumerate(data) if b in _INT_HEADERS or b <= 0x7F]
        if not spots:
            return self._flip_bits(data)
        at = self.rng.choice(spots)
        width = _INT_HEADERS.get(data[at], 0)
        return data[:at] + self.rng.choice(_HOSTILE_INTS) + data[at + 1 + width :]

    def _tamper_header(self, data: bytearray) -> bytearray:
        if len(data) >= 5:
            data[self.rng.randrange(5)] = self.rng.randrange(256)
        return data
