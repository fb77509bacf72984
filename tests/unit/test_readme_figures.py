"""Every figure of the README's headline results table is one that docs/results.md gives.

The first cell of each row links the sections of docs/results.md its figures come from. Every
number the row's result gives in a unit of measure (``0.67x``, ``8.8%``, ``16.5 ms``, ``135k
IOPS``, ``4.1 GB/s``, ...) must be a number of those sections in the same unit (or in a table
cell, whose unit is in the header), rounded as the README rounds it: ``75 ms`` for 75.14 ms,
never more digits than the section gives. A range (``0.34–0.68x``) must be one there too,
written as a range or as a list (``0.68, 0.47, 0.75x`` gives 0.47–0.75x). Reads the two files
only.
"""
from __future__ import annotations

import pathlib
import re
from decimal import ROUND_HALF_UP, Decimal
from typing import NamedTuple

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RESULTS = ROOT / "docs" / "results.md"
RESULTS_LINK = "docs/results.md"

NUMBER = r"\d+(?:\.\d+)?(?:k(?![A-Za-z]))?"
# what a result is measured in; sizes and link rates (KiB, MB, Gbit/s) describe the setup
UNIT = r"(?:x|%|ms|s|µs|us|ns|GB/s|MB/s|GiB/s|MiB/s|IOPS)"
FIGURE = re.compile(rf"(?<![\w.])({NUMBER})(?:\s*[–-]\s*({NUMBER}))?\s*({UNIT})(?![\w/])")
# numbers written together, sharing the unit after the last: "16.5 / 41 ms", "0.68, 0.47, 0.75x"
CHAIN = re.compile(rf"(?<![\w.]){NUMBER}(?:\s*(?:/|,|–|-|and|to)\s*{NUMBER})*(?:\s*({UNIT})(?![\w/]))?")


class Figure(NamedTuple):
    low: str
    high: str | None          # the range's upper end; None for one number
    unit: str


def _plain(text: str) -> str:
    """``text`` without link targets, code spans, emphasis and thousands separators."""
    text = re.sub(r"\]\([^)]*\)", "]", text)
    text = re.sub(r"`[^`]*`", "", text)
    text = text.replace("**", "").replace("—", "–")
    return re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", text)


def _unit(unit: str | None) -> str | None:
    return "µs" if unit == "us" else unit


def _value(number: str) -> Decimal:
    """``"17.2k"`` -> 17.2E3: the value, with the precision as written."""
    if number.endswith("k"):
        return Decimal(number[:-1]).scaleb(3)
    return Decimal(number)


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def results_sections(text: str) -> dict[str, str]:
    """docs/results.md's sections by anchor: each heading's text down to the next heading of
    its level or above (headings inside fenced code are not headings)."""
    lines = text.splitlines()
    headings = []
    fenced = False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"(#{1,6}) (.*)", line)):
            headings.append((i, len(m.group(1)), m.group(2)))
    sections: dict[str, str] = {}
    for k, (start, level, title) in enumerate(headings):
        end = next((i for i, lv, _ in headings[k + 1:] if lv <= level), len(lines))
        anchor = _slug(title)
        n = sum(1 for a in sections if a == anchor or re.fullmatch(re.escape(anchor) + r"-\d+", a))
        sections[f"{anchor}-{n}" if n else anchor] = "\n".join(lines[start:end])
    return sections


def headline_rows(text: str) -> list[tuple[str, str]]:
    """(first cell, result cell) of each row of the README's headline results table."""
    section = text.split("\n## Headline results\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    assert rows and rows[1].startswith("|---"), "no table under ## Headline results"
    cells = [[c.strip() for c in re.split(r"(?<!\\)\|", row.strip().strip("|"))] for row in rows[2:]]
    return [(c[0], c[1]) for c in cells]


def figures(result: str) -> list[Figure]:
    """The numbers with a unit of measure in a result cell."""
    return [Figure(low, high or None, _unit(unit)) for low, high, unit in FIGURE.findall(_plain(result))]


def given(text: str) -> tuple[list[tuple[Decimal, str | None]], list[tuple[Decimal, Decimal, str | None]]]:
    """The numbers ``text`` gives, with their unit, and the ranges (from a range or a list of
    numbers: its lowest and highest). A number in a table cell with no unit next to it has
    the column's (None: any); in prose it is a count (unit "")."""
    text = _plain(text)
    numbers, ranges = [], []
    for chain in CHAIN.finditer(text):
        in_table = text[text.rfind("\n", 0, chain.start()) + 1:].lstrip().startswith("|")
        unit = _unit(chain.group(1)) or (None if in_table else "")
        values = [_value(n) for n in re.findall(NUMBER, chain.group(0))]
        numbers += [(v, unit) for v in values]
        if len(values) > 1:
            ranges.append((min(values), max(values), unit))
    return numbers, ranges


def rounds_to(have: Decimal, number: str) -> bool:
    """Whether ``have`` is ``number`` as written, or rounds to it."""
    want = _value(number)
    return have.as_tuple().exponent <= want.as_tuple().exponent and \
        have.quantize(Decimal(1).scaleb(want.as_tuple().exponent), rounding=ROUND_HALF_UP) == want


def found(figure: Figure, text: str) -> bool:
    numbers, ranges = given(text)
    if figure.high is None:
        return any(unit in (figure.unit, None) and rounds_to(v, figure.low) for v, unit in numbers)
    return any(unit in (figure.unit, None) and rounds_to(lo, figure.low) and rounds_to(hi, figure.high)
               for lo, hi, unit in ranges)


def missing(readme: str, results: str) -> list[str]:
    """What the README's table gives that the sections it links do not: one line each."""
    sections = results_sections(results)
    out = []
    for first, result in headline_rows(readme):
        anchors = re.findall(rf"\]\({re.escape(RESULTS_LINK)}#([^)]+)\)", first)
        if not anchors:
            out.append(f"{first!r}: links no section of {RESULTS_LINK}")
            continue
        unknown = [a for a in anchors if a not in sections]
        if unknown:
            out.append(f"{first!r}: no section {unknown} in {RESULTS_LINK}")
            continue
        text = "\n".join(sections[a] for a in anchors)
        out += [f"{first!r}: {figure} is not in {', '.join(anchors)}" for figure in figures(result)
                if not found(figure, text)]
    return out


def test_every_headline_figure_is_in_the_results_section_the_row_links():
    readme, results = README.read_text(), RESULTS.read_text()
    assert len(headline_rows(readme)) >= 20
    assert sum(len(figures(r)) for _, r in headline_rows(readme)) >= 60
    assert missing(readme, results) == []


def test_a_changed_figure_is_caught():
    """The check itself: each row's first bold figure, its leading digit changed in a copy of
    the README (0.67x -> 0.77x, 13–19 s -> 23–19 s), is reported."""
    readme, results = README.read_text(), RESULTS.read_text()
    checked = 0
    for _, result in headline_rows(readme):
        bold = next((f for b in re.finditer(r"\*\*(.*?)\*\*", result)
                     for f in FIGURE.finditer(result, b.start(1), b.end(1))), None)
        if bold is None:
            continue
        figure = bold.group(0)
        digit = re.search(r"[1-9]", figure) or re.search(r"\d", figure)
        changed = figure[:digit.start()] + str(int(digit.group()) % 9 + 1) + figure[digit.end():]
        edited = result[:bold.start()] + changed + result[bold.end():]
        assert missing(readme.replace(result, edited, 1), results), f"{figure} -> {changed} went unnoticed"
        checked += 1
    assert checked >= 15


def test_rounding_units_and_ranges():
    assert rounds_to(Decimal("75.14"), "75") and rounds_to(Decimal("17200"), "17.2k")
    assert rounds_to(Decimal("70.2"), "70") and not rounds_to(Decimal("75"), "75.1")
    assert not rounds_to(Decimal("75.14"), "76") and not rounds_to(Decimal("0.34"), "0.35")
    assert figures("**0.34–0.68x** the time, 8.8% slower, 16x4, 135k IOPS, 70 us, 4 KiB, 1 Gbit/s, `--size 2G`") == \
        [Figure("0.34", "0.68", "x"), Figure("8.8", None, "%"), Figure("135k", None, "IOPS"),
         Figure("70", None, "µs")]
    text = "ratios 0.68, 0.47, 0.75x; pause 16.5 / 41 ms; 12 s in 3 runs\n| 85,100 (3.7 / 422) |\n  | 9 |"
    assert found(Figure("0.47", "0.75", "x"), text) and found(Figure("41", None, "ms"), text)
    assert found(Figure("85.1k", None, "IOPS"), text) and found(Figure("12", None, "s"), text)
    assert found(Figure("9", None, "ms"), text)                     # a table cell: the column's unit
    assert not found(Figure("12", None, "ms"), text) and not found(Figure("0.34", "0.75", "x"), text)
    assert not found(Figure("3", None, "ms"), text)                 # a count in prose
    assert _slug("Unix sockets with one copy: `ipc` over spliced streams") == \
        "unix-sockets-with-one-copy-ipc-over-spliced-streams"
    assert _slug("Push+pull against gloo all-reduce") == "pushpull-against-gloo-all-reduce"
