"""A value sent as the buffers it is made of: a chunk's entry reaches the socket without a copy.

The tier hands a store that gathers (``put_many_gather``) each entry as its header and
views of the chunk's own tensors. The client's default command packer (libvalkey's)
joins a command's arguments into one ``bytes``, a copy of every value; the client's own
Python packer sends large arguments as they are, but one argument is one buffer. So a
``SET``'s value is given as :class:`Gathered`, and :func:`gather_packer`'s packer frames
it (``$<length>``) and sends its parts one after another: the server reads one value.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from lmcache_platform.remote import Buffer

#: The client's own cutoff: arguments longer than this are sent unjoined.
_CUTOFF = 6000


class Gathered:
    """One command argument made of several buffers, sent in order without joining them."""

    __slots__ = ("nbytes", "parts")

    def __init__(self, parts: Sequence[Buffer]) -> None:
        self.parts = [v for v in (memoryview(p).cast("B") for p in parts) if len(v)]
        self.nbytes = sum(len(p) for p in self.parts)


def gather_packer() -> Any:
    """A command packer for the client's connections (``command_packer=``): the client's Python
    packer, plus :class:`Gathered` arguments, their parts sent as they are."""
    from valkey._parsers.encoders import Encoder  # the client's own (bytes pass as they are)

    return _packer_class()(_CUTOFF, Encoder("utf-8", "strict", False).encode)  # type: ignore[no-untyped-call]


@functools.cache
def _packer_class() -> type:
    from valkey.connection import PythonRespSerializer  # imported with the client, on first use

    class GatherPacker(PythonRespSerializer):
        def pack(self, *args: Any) -> list[Any]:
            if not any(isinstance(a, Gathered) for a in args):
                return super().pack(*args)
            out: list[Any] = []
            buff = b"*%d\r\n" % len(args)
            for arg in args:
                if isinstance(arg, Gathered):
                    out.append(buff + b"$%d\r\n" % arg.nbytes)
                    out.extend(arg.parts)
                    buff = b"\r\n"
                else:
                    data = bytes(self.encode(arg))
                    buff += b"$%d\r\n" % len(data) + data + b"\r\n"
            out.append(buff)
            return out

    return GatherPacker
