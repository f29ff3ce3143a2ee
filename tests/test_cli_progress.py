"""The command line's progress bar: plain lines off a terminal, one redrawn line on one."""

from __future__ import annotations

import io

from moe_fp8.progress import Progress, format_seconds


def test_plain_lines_when_not_a_tty():
    stream = io.StringIO()
    with Progress(3, "warmup", stream=stream) as p:
        p.update(1, "a")
        p.write("a message")
        p.update(2, "b and c")
    assert stream.getvalue().splitlines() == ["[1/3] warmup: a", "a message", "[3/3] warmup: b and c"]


def test_redrawn_bar_on_a_tty():
    stream = io.StringIO()
    with Progress(4, "bench", stream=stream, tty=True) as p:
        p.update(2, "half")
        p.write("between")
        p.update(2, "done")
    text = stream.getvalue()
    assert text.endswith("\n") and "\r\x1b[2K" in text
    assert "between\n" in text
    last = text.rstrip("\n").split("\r\x1b[2K")[-1]
    assert last.startswith("bench [########################] 4/4 100% 0:00")
    assert p.line("x").startswith("bench [########################] 4/4")


def test_disabled_and_zero_total_are_silent_and_safe():
    stream = io.StringIO()
    with Progress(0, stream=stream, enabled=False) as p:
        p.update(5)
        p.write("hidden")
    assert stream.getvalue() == ""
    assert Progress(0, stream=io.StringIO(), tty=True).line().startswith("[#")


def test_format_seconds():
    assert format_seconds(0.4) == "0:00"
    assert format_seconds(75.3) == "1:15"
    assert format_seconds(3725) == "1:02:05"
