"""The command-line convention the ``autops``, ``infiniswap`` and ``tiresias`` CLIs share.

DESIGN §6: ``--json FILE`` writes JSON to FILE (``-`` for stdout); ``--log-level`` is
accepted after the subcommand (DEBUG, INFO, WARNING or ERROR, any case); addresses accept
``HOST:PORT`` and ``tcp://HOST:PORT``; services bind 127.0.0.1 unless ``--bind`` says
otherwise; exit status 2 for usage errors (a bad argument, a bad input file), 1 for runtime
errors, never a traceback for user input, and the error is one line on stderr (``PROG:
error: ...``, argparse's too: ``--help`` shows the usage); ``--help`` shows defaults; a
command group with no subcommand prints its list and exits 2.

This module owns the pieces: ``parser`` / ``add_commands`` / ``add_command`` (help with
defaults, ``--log-level`` and ``--json FILE`` on every subcommand), argparse types for
addresses, log levels, ports and numbers with bounds (``positive``, ``non_negative``),
``setup_logging``, ``write_json`` / ``emit`` (honouring ``-``), ``no_subcommand`` and
``run_main``, which maps the errors a command raises to its exit status and one line on
stderr.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import pathlib
import sys
from typing import Any, Callable, NoReturn, TextIO

from .endpoints import endpoint
from .messages import ProtocolError
from .sizes import parse_size
from .trace import NoValidJob

__all__ = ["LOG_LEVELS", "UsageError", "HelpFormatter", "Parser", "parser", "add_commands", "add_command",
           "add_log_level", "add_json", "log_level", "address", "bind_address", "address_list", "port",
           "positive", "non_negative", "one_line", "setup_logging", "write_json", "text_out", "emit",
           "no_subcommand", "run_main"]

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
JSON_HELP = "write the result as JSON to FILE ('-' for stdout)"
LOG_FORMAT = "%(asctime)s %(process)d %(name)s %(levelname)s %(message)s"


class UsageError(ValueError):
    """A bad argument found after parsing (exit status 2)."""


def one_line(text: Any) -> str:
    """``text`` as one line: its lines joined by spaces (an error message on stderr)."""
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def _says_something(default: Any) -> bool:
    """Whether a default is worth showing (not None, a flag's False or an empty list)."""
    empty = isinstance(default, (list, tuple, dict, str)) and not default
    return not (default is None or default is False or default is argparse.SUPPRESS or empty)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default, except the ones that say nothing."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.nargs == 0 or not _says_something(action.default):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose options without a help text still show their default and
    whose usage errors are one line (its subcommands' parsers are ``Parser`` too)."""

    def error(self, message: str) -> NoReturn:
        """A usage error: ``PROG: error: MESSAGE`` on one line of stderr, exit status 2 (the
        usage is what ``--help`` shows)."""
        self.exit(2, f"{self.prog}: error: {one_line(message)}\n")

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        if action.help is None and action.option_strings and action.nargs != 0 \
                and _says_something(action.default):
            action.help = "(default: %(default)s)"
        return action


def parser(prog: str, description: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A top-level parser whose ``--help`` shows defaults."""
    return Parser(prog=prog, description=description, formatter_class=HelpFormatter, **kwargs)


def add_commands(p: argparse.ArgumentParser, dest: str = "command") -> argparse._SubParsersAction:
    """The subcommands of ``p``; not required by argparse: ``no_subcommand`` answers a
    missing one (its list, exit 2)."""
    return p.add_subparsers(dest=dest, metavar=dest.upper())


def add_command(sub: argparse._SubParsersAction, name: str, help: str, *, log_level: str | None = "INFO",
                json_help: str | None = None, **kwargs: Any) -> argparse.ArgumentParser:
    """A subcommand with ``--log-level`` (default ``log_level``; None: the one given before the
    subcommand) and, when ``json_help`` is given, ``--json FILE``."""
    p = sub.add_parser(name, help=help, description=kwargs.pop("description", help),
                       formatter_class=HelpFormatter, **kwargs)
    add_log_level(p, log_level)
    if json_help is not None:
        add_json(p, json_help)
    return p


def add_log_level(p: argparse.ArgumentParser, default: str | None = "INFO") -> None:
    """``--log-level``; with ``default=None`` an absent option leaves the value parsed before
    the subcommand in place (the parent parser's)."""
    if default is None:
        p.add_argument("--log-level", type=log_level, choices=LOG_LEVELS, metavar="LEVEL",
                       default=argparse.SUPPRESS,
                       help="DEBUG, INFO, WARNING or ERROR (default: the level given before the "
                            "command, else INFO)")
    else:
        p.add_argument("--log-level", type=log_level, choices=LOG_LEVELS, metavar="LEVEL",
                       default=default, help="DEBUG, INFO, WARNING or ERROR")


def add_json(p: argparse.ArgumentParser, help: str = JSON_HELP) -> None:
    p.add_argument("--json", metavar="FILE", default=None, help=help)


def log_level(text: str) -> str:
    """argparse type: a log level name in any case -> upper case (choices check the rest)."""
    return str(text).strip().upper()


def _endpoint(text: str, bind: bool) -> str:
    try:
        return endpoint(text, bind=bind)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def address(text: str) -> str:
    """argparse type: ``HOST:PORT``, ``tcp://HOST:PORT`` or ``ipc://PATH`` -> a ZeroMQ endpoint."""
    return _endpoint(text, bind=False)


def bind_address(text: str) -> str:
    """argparse type: an address to listen on (port 0 or ``*``: any free port)."""
    return _endpoint(text, bind=True)


def address_list(text: str) -> list[str]:
    """argparse type: comma-separated addresses -> ZeroMQ endpoints."""
    items = [a.strip() for a in text.split(",") if a.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list of addresses")
    return [address(a) for a in items]


def port(text: str) -> int:
    """argparse type: a TCP port, 0..65535 (0: any free port, or off where the option says so)."""
    value = _number(int, text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port {text!r} is out of range (0..65535)")
    return value


def _number(kind: Callable[[str], Any], text: str) -> Any:
    try:
        value = kind(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                         f"got {text!r}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive(kind: Callable[[str], Any] = float) -> Callable[[str], Any]:
    """argparse type: a finite number of ``kind`` (``int`` or ``float``) above 0."""
    def parse(text: str) -> Any:
        value = _number(kind, text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected a number above 0, got {text!r}")
        return value
    parse.__name__ = f"positive {kind.__name__}"
    return parse


def non_negative(kind: Callable[[str], Any] = float) -> Callable[[str], Any]:
    """argparse type: a finite number of ``kind`` (``int`` or ``float``), 0 or more."""
    def parse(text: str) -> Any:
        value = _number(kind, text)
        if value < 0:
            raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
        return value
    parse.__name__ = f"non-negative {kind.__name__}"
    return parse


def share(text: str) -> float:
    """argparse type: a share of something, a number above 0 and at most 1."""
    value = _number(float, text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number above 0 and at most 1, got {text!r}")
    return value


def size(text: str) -> int:
    """argparse type: a byte size as users write it (``4G``, ``512M``, ``4096``; ``dlrt.sizes``)."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def setup_logging(level: str, fmt: str = LOG_FORMAT) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), stream=sys.stderr, format=fmt)


def write_json(path: str, data: Any, *, indent: int | None = 2, lines: bool = False,
               append: bool = False) -> None:
    """``data`` as JSON to ``path`` (``-``: stdout); parent directories are created. With
    ``lines`` ``data`` is an iterable written one compact object per line (appended to the
    file with ``append``)."""
    if lines:
        text = "".join(json.dumps(row) + "\n" for row in data)
    else:
        text = json.dumps(data, indent=indent) + "\n"
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a" if append else "w", encoding="utf-8") as fh:
        fh.write(text)


def text_out(json_path: str | None) -> TextIO:
    """Where a command prints its text: stdout, or stderr when ``--json -`` owns stdout."""
    return sys.stderr if json_path == "-" else sys.stdout


def emit(json_path: str | None, data: Any, text: str, indent: int | None = 2) -> None:
    """A command's result: ``text`` on stdout, or the JSON instead with ``--json -``; with
    ``--json FILE`` the JSON goes to FILE and ``text`` to stdout."""
    if json_path:
        write_json(json_path, data, indent=indent)
    if json_path != "-":
        print(text, flush=True)


def no_subcommand(p: argparse.ArgumentParser) -> int:
    """A command group called without a subcommand: its help (the list) on stdout, and exit
    status 2 (a usage error: nothing was started)."""
    p.print_help()
    return 2


# runtime errors of libraries, by module: looked up only once the module is loaded (a
# library that was never imported cannot have raised), so this module imports none of them
_LIBRARY_RUNTIME_ERRORS = (("zmq", "ZMQError"), ("sqlite3", "Error"))


def _runtime_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a runtime error (exit status 1) rather than a usage error or a bug."""
    if isinstance(exc, (NoValidJob, ProtocolError, OSError, RuntimeError)):
        return True
    for module, name in _LIBRARY_RUNTIME_ERRORS:
        kind = getattr(sys.modules.get(module), name, None)
        if kind is not None and isinstance(exc, kind):
            return True
    return False


def run_main(name: str, func: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """``func(args)``, its failures turned into one line on stderr (``NAME: error: ...``) and
    the exit status: 1 for a runtime error (``OSError`` -- timeouts and an address in use
    included --, ``RuntimeError``, ZeroMQ's and SQLite's errors, a peer's malformed message,
    a trace with no valid job), 2 for a usage error (``UsageError``, any other ``ValueError``
    such as a bad trace), 130 for Ctrl-C. Other exceptions are bugs and keep their
    traceback."""
    try:
        return func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if _runtime_error(exc):
            status = 1
        elif isinstance(exc, ValueError):
            status = 2
        else:
            raise
        print(f"{name}: error: {one_line(exc) or type(exc).__name__}", file=sys.stderr)
        return status
