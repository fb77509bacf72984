"""Job traces as plain records: CSV formats, validation, normalisation.

The trace reader AutoPS's pool simulation and Tiresias's scheduler simulation share; it
knows no scheduler. Owns ``TraceJob`` (one job: submit time, GPUs, duration, optional model,
skew and batch size), ``detect_format`` and ``load_trace``. Three formats are read (columns
matched by name, in any order):

* ``philly``   -- ``timestamp,duration,num_gpus,gpu_time,cluster`` (Microsoft Philly, as
  shipped by the Pollux artifact; timestamps are wall-clock, read as UTC; file unsorted).
* ``tiresias`` -- ``job_id,num_gpu,submit_time,iterations,model_name,duration,interval``
  (the Tiresias simulator's own job CSV; seconds).
* ``generic``  -- ``job_id,submit_time,num_gpus,duration`` plus optional ``model``,
  ``skew`` (seconds; skew in [0, 1]) and ``batch_size`` (a label such as ``64`` or ``256/16``,
  kept as text: ``tiresias workload`` writes it with the model for co-location profiles).

A header with columns no format knows is read as the format whose columns it holds (the one
with the fewest unknown columns; a tie is an error); the unknown columns are ignored and
listed in ``LoadReport.ignored_columns``, which ``ignored_message`` turns into the one line
a command prints about them.

Jobs come back sorted by submit time (stable: ties keep file order), shifted so the
earliest submit is 0.0, and renumbered 0..N-1. Bad rows are either skipped and reported
(``on_bad="skip"``) or raise ``TraceError`` naming ``FILE:LINE`` (``on_bad="reject"``).
A trace without a single valid job (a header and no rows, or every row bad) raises
``NoValidJob`` with the count of bad rows and the first few reasons; ``skipped_message``
is the line a command prints about the rows it skipped (count and first few reasons).
A ``TraceError`` is a ``ValueError``: a bad trace is bad user input.
"""
from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Sequence

__all__ = ["TraceJob", "TraceError", "NoValidJob", "LoadReport", "FORMATS", "detect_format", "load_trace",
           "problems_summary", "skipped_message", "ignored_message"]

FIRST_PROBLEMS = 3       # bad rows named in messages (the count says how many there were)


@dataclass(frozen=True, slots=True)
class TraceJob:
    job_id: int                 # 0..N-1 in submit order (stable: ties keep file order)
    submit_time: float          # seconds from the earliest submit in the trace (first job at 0.0)
    num_gpus: int
    duration: float             # seconds of execution when run alone, consolidated
    model: str | None = None
    skew: float | None = None   # largest tensor's share of the model, 0..1
    source_line: int = 0        # 1-based line number in the file (for messages)
    batch_size: str | None = None   # generic format only: the batch size label ("64", "256/16")


class TraceError(ValueError):
    """A trace cannot be read; the message names the file (and the line where there is one)."""


class NoValidJob(TraceError):
    """The trace was read but holds no valid job: nothing to run (a runtime error for a CLI:
    exit status 1, where other bad traces are usage errors)."""


def problems_summary(problems: Sequence[str], of: str = "", shown: int = FIRST_PROBLEMS) -> str:
    """``"N bad rows[ of FILE]: A; B"`` -- ``"...; first: A; B; C"`` when there are more than
    ``shown`` -- the count and the first reasons, on one line."""
    n = len(problems)
    count = f"{n} bad row{'s' if n != 1 else ''}{f' of {of}' if of else ''}"
    listed = "; ".join(problems[:shown])
    return f"{count}; first: {listed}" if n > shown else f"{count}: {listed}"


def skipped_message(report: LoadReport, path: str | os.PathLike) -> str:
    """The line a command prints about the rows of ``path`` it skipped ("" when none was):
    ``"skipped N bad rows of FILE: ..."`` with the first few reasons."""
    if not report.problems:
        return ""
    return "skipped " + problems_summary(report.problems, of=os.fspath(path))


def ignored_message(report: LoadReport, path: str | os.PathLike) -> str:
    """The line a command prints about the columns of ``path`` it ignored ("" when none was)."""
    if not report.ignored_columns:
        return ""
    cols = ", ".join(repr(c) for c in report.ignored_columns)
    return (f"ignored column{'s' if len(report.ignored_columns) != 1 else ''} {cols} of {os.fspath(path)} "
            f"(not part of the {report.format} format)")


@dataclass
class LoadReport:
    jobs: list[TraceJob]
    skipped: int
    problems: list[str] = field(default_factory=list)   # "FILE:LINE: reason", one per bad row
    format: str = ""
    ignored_columns: list[str] = field(default_factory=list)   # header columns no format reads


# format -> (required columns, optional columns)
FORMATS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "philly": (("timestamp", "duration", "num_gpus", "gpu_time", "cluster"), ()),
    "tiresias": (("job_id", "num_gpu", "submit_time", "iterations", "model_name", "duration",
                  "interval"), ()),
    "generic": (("job_id", "submit_time", "num_gpus", "duration"), ("model", "skew", "batch_size")),
}

_ON_BAD = ("skip", "reject")
_EPOCH = datetime(1970, 1, 1)


def _accepted_headers() -> str:
    parts = []
    for name, (req, opt) in FORMATS.items():
        cols = ",".join(req) + "".join(f"[,{c}]" for c in opt)
        parts.append(f"{name}: {cols}")
    return "; ".join(parts)


def _norm_header(header: list[str]) -> list[str]:
    return [h.strip().lower() for h in header]


def _extra(cols: list[str], fmt: str) -> list[str] | None:
    """The columns of ``cols`` that ``fmt`` does not read, or None when ``fmt`` does not fit
    (a required column missing, or a column named twice)."""
    req, opt = FORMATS[fmt]
    if len(set(cols)) != len(cols) or not set(req) <= set(cols):
        return None
    return [c for c in cols if c not in req and c not in opt]


def _matches(cols: list[str], fmt: str) -> bool:
    return _extra(cols, fmt) is not None


def detect_format(header: list[str]) -> str:
    """Return ``"philly"``, ``"tiresias"`` or ``"generic"`` for a CSV header row.

    Column names are compared case-insensitively after stripping blanks, in any order.
    Extra columns are allowed (the reader ignores them): of the formats whose columns the
    header holds, the one with the fewest extra columns wins. An unknown header (the message
    lists the accepted ones), or one that fits two formats equally, raises ``TraceError``.
    """
    cols = _norm_header(header)
    fits = sorted((len(extra), fmt) for fmt in FORMATS if (extra := _extra(cols, fmt)) is not None)
    if len(fits) > 1 and fits[0][0] == fits[1][0]:
        raise TraceError(f"trace header {','.join(cols)!r} fits both the {fits[0][1]} and the {fits[1][1]} "
                         f"format; name the format or drop columns")
    if fits:
        return fits[0][1]
    if len(set(cols)) != len(cols):
        twice = sorted({c for c in cols if cols.count(c) > 1})
        raise TraceError(f"trace header {','.join(cols)!r} names column(s) {', '.join(twice)} twice")
    raise TraceError(f"unrecognised trace header {','.join(cols)!r}; accepted headers are "
                     f"{_accepted_headers()}")


class _Bad(Exception):
    """One row is bad; carries the reason."""


def _field(row: list[str], idx: int, name: str) -> str:
    v = row[idx].strip()
    if not v:
        raise _Bad(f"missing field {name!r}")
    return v


def _float(row: list[str], idx: int, name: str) -> float:
    s = _field(row, idx, name)
    try:
        v = float(s)
    except ValueError:
        raise _Bad(f"{name} is not a number: {s!r}") from None
    if not math.isfinite(v):
        raise _Bad(f"{name} is not finite: {s!r}")
    return v


def _int(row: list[str], idx: int, name: str) -> int:
    s = _field(row, idx, name)
    try:
        return int(s)
    except ValueError:
        pass
    try:
        v = float(s)
    except ValueError:
        raise _Bad(f"{name} is not an integer: {s!r}") from None
    if not math.isfinite(v) or not v.is_integer():
        raise _Bad(f"{name} is not an integer: {s!r}")
    return int(v)


def _timestamp(row: list[str], idx: int, name: str) -> float:
    s = _field(row, idx, name)
    try:
        dt = datetime.fromisoformat(s)
    except ValueError:
        raise _Bad(f"{name} is not a timestamp (YYYY-MM-DD HH:MM:SS): {s!r}") from None
    if dt.tzinfo is not None:                    # explicit offset: convert to naive UTC
        dt = dt.astimezone(timezone.utc).replace(tzinfo=None)
    return (dt - _EPOCH).total_seconds()         # naive timestamps are read as UTC


def _check_common(submit: float, gpus: int, duration: float, max_gpus: int | None) -> None:
    if submit < 0:
        raise _Bad(f"negative submit time {submit:g}")
    if duration <= 0:
        raise _Bad(f"duration must be > 0, got {duration:g}")
    if gpus < 1:
        raise _Bad(f"num_gpus must be >= 1, got {gpus}")
    if max_gpus is not None and gpus > max_gpus:
        raise _Bad(f"num_gpus {gpus} exceeds max_gpus {max_gpus}")


def load_trace(path: str | os.PathLike, fmt: str | None = None, max_gpus: int | None = None,
               on_bad: str = "skip", limit: int | None = None) -> LoadReport:
    """Load a job trace CSV into ``TraceJob``s sorted by submit time.

    ``fmt`` forces a format (the header must still fit it); by default it is detected from
    the header. ``max_gpus`` marks jobs asking for more GPUs as bad. ``on_bad`` is ``"skip"``
    (count and report bad rows) or ``"reject"`` (raise ``TraceError`` at the first one).
    ``limit`` keeps only the first ``limit`` jobs after sorting. Blank lines are ignored.
    A file without a valid job (a header and no rows, or every row bad) raises
    ``NoValidJob``; an empty, missing or unreadable file raises ``TraceError``.
    """
    if on_bad not in _ON_BAD:
        raise ValueError(f"on_bad must be one of {_ON_BAD}, got {on_bad!r}")
    if fmt is not None and fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {tuple(FORMATS)} or None, got {fmt!r}")
    if max_gpus is not None and (isinstance(max_gpus, bool) or max_gpus < 1):
        raise ValueError(f"max_gpus must be >= 1 or None, got {max_gpus!r}")
    if limit is not None and (isinstance(limit, bool) or limit < 0):
        raise ValueError(f"limit must be >= 0 or None, got {limit!r}")

    fname = os.fspath(path)
    try:
        fh = open(fname, "r", encoding="utf-8-sig", newline="")
    except FileNotFoundError:
        raise TraceError(f"{fname}: no such trace file") from None
    except IsADirectoryError:
        raise TraceError(f"{fname}: is a directory, not a trace file") from None
    except OSError as e:
        raise TraceError(f"{fname}: cannot open trace file: {e.strerror or e}") from None

    # rows: (submit, file_order, gpus, duration, model, skew, line, batch_size)
    rows: list[tuple[float, int, int, float, str | None, float | None, int, str | None]] = []
    problems: list[str] = []
    line = 0
    with fh:
        reader = csv.reader(fh)
        try:
            header = None
            for header in reader:
                line = reader.line_num
                if any(c.strip() for c in header):
                    break
            else:
                header = None
            if header is None:
                raise TraceError(f"{fname}: empty trace file (no header line)")
            cols = _norm_header(header)
            try:
                found = fmt if fmt is not None and _matches(cols, fmt) else detect_format(cols)
            except TraceError as e:
                raise TraceError(f"{fname}:{line}: {e}") from None
            if fmt is not None and fmt != found:
                raise TraceError(f"{fname}:{line}: header {','.join(cols)!r} is not a {fmt} "
                                 f"header (looks like {found})")
            use = fmt or found
            ix = {c: i for i, c in enumerate(cols)}
            ncols = len(cols)
            parse = _row_parser(use, ix)

            for row in reader:
                line = reader.line_num
                if len(row) != ncols:
                    if not any(c.strip() for c in row):
                        continue                     # blank line
                    if len(row) < ncols:
                        reason = f"missing field(s): expected {ncols} fields, got {len(row)}"
                    else:
                        reason = f"too many fields: expected {ncols}, got {len(row)}"
                else:
                    try:
                        submit, gpus, duration, model, skew, batch = parse(row)
                        _check_common(submit, gpus, duration, max_gpus)
                        rows.append((submit, len(rows), gpus, duration, model, skew, line, batch))
                        continue
                    except _Bad as e:
                        reason = str(e)
                msg = f"{fname}:{line}: {reason}"
                if on_bad == "reject":
                    raise TraceError(msg)
                problems.append(msg)
        except csv.Error as e:
            raise TraceError(f"{fname}:{reader.line_num or line}: malformed CSV: {e}") from None
        except UnicodeDecodeError as e:
            raise TraceError(f"{fname}: not a UTF-8 text file ({e.reason} at byte {e.start})") \
                from None
        except OSError as e:
            raise TraceError(f"{fname}: cannot read trace file: {e.strerror or e}") from None

    if not rows:
        why = problems_summary(problems) if problems else "no rows after the header"
        raise NoValidJob(f"no valid job in {fname}: {why}")
    rows.sort(key=lambda r: (r[0], r[1]))            # stable by construction
    if limit is not None:
        rows = rows[:limit]
    t0 = rows[0][0] if rows else 0.0
    jobs = [TraceJob(i, r[0] - t0, r[2], r[3], r[4], r[5], r[6], r[7]) for i, r in enumerate(rows)]
    return LoadReport(jobs=jobs, skipped=len(problems), problems=problems, format=use,
                      ignored_columns=_extra(cols, use) or [])


def _row_parser(fmt: str, ix: dict[str, int]):
    """A function row -> (submit, gpus, duration, model, skew, batch_size) for ``fmt``;
    raises _Bad."""
    if fmt == "philly":
        i_t, i_d, i_g = ix["timestamp"], ix["duration"], ix["num_gpus"]

        fromiso, epoch, isfinite = datetime.fromisoformat, _EPOCH, math.isfinite

        def parse(row: list[str]):
            try:                                 # fast path for well-formed rows
                d = float(row[i_d])
                if isfinite(d):
                    return ((fromiso(row[i_t]) - epoch).total_seconds(), int(row[i_g]), d,
                            None, None, None)
            except (ValueError, TypeError):
                pass                             # the careful path says what is wrong
            return (_timestamp(row, i_t, "timestamp"), _int(row, i_g, "num_gpus"),
                    _float(row, i_d, "duration"), None, None, None)
        return parse

    if fmt == "tiresias":
        i_s, i_g, i_d, i_m = ix["submit_time"], ix["num_gpu"], ix["duration"], ix["model_name"]

        def parse(row: list[str]):
            model = row[i_m].strip() or None
            return (_float(row, i_s, "submit_time"), _int(row, i_g, "num_gpu"),
                    _float(row, i_d, "duration"), model, None, None)
        return parse

    i_s, i_g, i_d = ix["submit_time"], ix["num_gpus"], ix["duration"]
    i_m, i_k, i_b = ix.get("model"), ix.get("skew"), ix.get("batch_size")

    def parse(row: list[str]):
        model = (row[i_m].strip() or None) if i_m is not None else None
        batch = (row[i_b].strip() or None) if i_b is not None else None
        skew = None
        if i_k is not None and row[i_k].strip():
            skew = _float(row, i_k, "skew")
            if not 0.0 <= skew <= 1.0:
                raise _Bad(f"skew must be in [0, 1], got {skew:g}")
        return (_float(row, i_s, "submit_time"), _int(row, i_g, "num_gpus"),
                _float(row, i_d, "duration"), model, skew, batch)
    return parse
