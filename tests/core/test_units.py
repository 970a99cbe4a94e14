"""``format_bytes`` and ``parse_bytes``: the one way sizes are printed and the one grammar they are read in."""

from __future__ import annotations

import re

import pytest

from lmcache_platform import format_bytes, parse_bytes


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (3096, "3.0 KiB"),
        (40 << 20, "40.0 MiB"),
        ((1 << 20) - 1, "1.0 MiB"),  # rounds up into the next unit instead of "1024.0 KiB"
        (int(1.5 * (1 << 30)), "1.5 GiB"),
        (3 << 40, "3.0 TiB"),
        (5000 << 40, "5000.0 TiB"),  # TiB is the largest unit
    ],
)
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text


@pytest.mark.parametrize(
    ("bad", "error"), [(-1, ValueError), (1.5, TypeError), ("1K", TypeError), (True, TypeError)]
)
def test_format_bytes_refuses_what_is_not_a_byte_count(bad: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=repr(bad) if error is TypeError else "0 or more"):
        format_bytes(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("0", 0),
        ("123", 123),
        ("3B", 3),
        ("3 b", 3),
        ("64K", 64 << 10),
        ("64kb", 64 << 10),
        ("64KiB", 64 << 10),
        ("512M", 512 << 20),
        ("512MB", 512 << 20),
        (" 8g ", 8 << 30),
        ("1 GiB", 1 << 30),
        ("2T", 2 << 40),
    ],
)
def test_parse_bytes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize(
    "text",
    [
        "",
        " ",
        "G",
        "1.5G",
        "-1",
        "+1",
        "16X",
        "16 GB extra",
        "1e6",
        "0x10",
        "1_000",
        "\u0661\u0662",
        "64KiBB",
    ],
)
def test_parse_bytes_refuses_anything_outside_the_grammar(text: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"not a byte size: {text!r}")):
        parse_bytes(text)


def test_parse_bytes_refuses_a_non_string() -> None:
    with pytest.raises(TypeError, match="takes a str, got int"):
        parse_bytes(64)  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [0, 1, 1023, 1 << 10, 5 << 20, 7 << 30, 2 << 40])
def test_what_format_bytes_prints_for_a_whole_unit_parse_bytes_reads_back(n: int) -> None:
    text = format_bytes(n).replace(".0 ", "")
    assert parse_bytes(text) == n
