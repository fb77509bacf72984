"""``dlrt cluster up|down|status``: the command group's actions (``dlrt.main`` adds them).

Without ``--ray`` each command works on the embedded single-machine setup (``local``); with
``--ray ADDR`` on the Ray cluster there (``onray``). ``--config FILE`` (TOML or YAML,
``config``) names the choices; the same file should be given to ``down`` and ``status`` when
it moves the state directory. ``status`` exits 0 when every service answers, 1 otherwise
(nothing up included), so scripts can wait on it.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

from dlrt import cli

from .config import load


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _cluster(args: argparse.Namespace) -> Any:
    config = load(args.config)
    if args.ray:
        from .onray import RayCluster
        return RayCluster(config, args.ray, log_level=args.log_level, say=_say)
    from .local import LocalCluster
    return LocalCluster(config, log_level=args.log_level, say=_say)


def _table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "nothing is up"
    head = ("SERVICE", "WHERE", "ENDPOINT", "ANSWERS")
    body = [(r["name"], r["where"], r["endpoint"], ("yes: " if r["answers"] else "NO: ") + r["detail"])
            for r in rows]
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(3)]
    return "\n".join("  ".join(cell.ljust(widths[i]) if i < 3 else cell for i, cell in enumerate(row))
                     for row in [head, *body])


def _run(args: argparse.Namespace, action: str) -> int:
    cluster = _cluster(args)
    try:
        if action == "up":
            rows = cluster.up()
            cli.emit(args.json, {"services": rows}, _table(rows))
            return 0 if rows and all(r["answers"] for r in rows) else 1
        if action == "down":
            stopped = cluster.down()
            cli.emit(args.json, {"stopped": stopped},
                     f"stopped {', '.join(stopped)}" if stopped else "nothing was up")
            return 0
        rows = cluster.status()
        cli.emit(args.json, {"services": rows}, _table(rows))
        return 0 if rows and all(r["answers"] for r in rows) else 1
    finally:
        close = getattr(cluster, "close", None)
        if close is not None:
            close()


def add_cluster_commands(group: argparse.ArgumentParser) -> None:
    """The actions of ``dlrt``'s ``cluster`` group."""
    sub = cli.add_commands(group, dest="action")
    helps = {"up": "start every service, each answering before the next; prints where they run",
             "down": "stop what `up` started (pMaster stops its aggregators)",
             "status": "every service, where it runs and whether it answers (exit 1 if one does not)"}
    for action, help in helps.items():
        p = cli.add_command(sub, action, help, json_help="write the result as JSON to FILE (- for stdout)")
        p.add_argument("--ray", default=None, metavar="HOST:PORT",
                       help="the Ray cluster's address (what `ray start --head` printed); without it: "
                            "the embedded single-machine setup")
        p.add_argument("--config", default=None, metavar="FILE",
                       help="TOML or YAML file of choices (docs/cluster.md; default: the built-in ones)")
        p.set_defaults(run=lambda args, action=action: _run(args, action))
