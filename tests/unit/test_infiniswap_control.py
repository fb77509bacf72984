"""Small pieces of the Infiniswap control plane that need no process or socket peer:
size parsing, timing summaries, the wake-up pipe, command-line parsing."""
from __future__ import annotations


import pytest

from infiniswap import cli
from dlrt.sizes import format_size, parse_size
from infiniswap.timings import Timings, summarize


@pytest.mark.parametrize("text, want", [
    ("4096", 4096), ("4K", 4096), ("1M", 1 << 20), ("8G", 8 << 30), ("1.5G", 3 << 29),
    ("2GiB", 2 << 30), ("512mb", 512 << 20), (" 1 T ", 1 << 40), (7, 7),
])
def test_parse_size(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("text", ["", "lots", "-1G", "1.1K", "4X", "G"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="bad size"):
        parse_size(text)


def test_format_size():
    assert format_size(None) == "-"
    assert format_size(512) == "512 B"
    assert format_size(3 << 29) == "1.5 GiB"
    assert format_size(-(2 << 20)) == "-2.0 MiB"


def test_summarize_and_timings():
    assert summarize([]) == {"count": 0, "mean": None, "p50": None, "p99": None, "max": None}
    s = summarize(range(1, 101))
    assert s["count"] == 100 and s["p50"] == 50 and s["p99"] == 99 and s["max"] == 100
    assert s["mean"] == 50.5
    t = Timings(keep=3)
    for v in (5.0, 1.0, 2.0, 3.0):
        t.add(v)
    assert t.values() == [1.0, 2.0, 3.0]              # the last `keep`
    assert t.summary()["count"] == 4 and t.summary()["max"] == 3.0


def test_cli_parses_sizes_and_lists():
    args = cli._parser().parse_args(["device", "--size", "4G", "--backup", "f", "--daemons",
                                     "a:1, b:2,,", "--slab-size", "256M"])
    assert args.size == 4 << 30 and args.slab_size == 256 << 20
    assert args.daemons == ["tcp://a:1", "tcp://b:2"]        # HOST:PORT normalised to an endpoint
    d = cli._parser().parse_args(["daemon"])
    assert d.headroom == 8 << 30 and d.slab_size == 1 << 30 and d.capacity is None


def test_cli_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["daemon", "--period", "0"])
    assert exc.value.code == 2
    assert "'0' must be positive" in capsys.readouterr().err


def test_unreachable_daemon_is_pinged_with_a_growing_interval():
    from infiniswap.devicectl import next_retry
    intervals, t = [], 0.0
    for _ in range(8):
        t = next_retry(t, period=0.5, cap=4.0)
        intervals.append(t)
    assert intervals == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0, 4.0]
    assert next_retry(0.0, period=1.0, cap=0.5) == 1.0      # never below the period
    assert next_retry(3.0, period=1.0, cap=0.5) == 1.0
