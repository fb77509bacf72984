"""``tiresias master users add|list|revoke``: the master's API users, managed in its state dir.

They work on ``STATE/state.db`` directly (SQLite lets them run while the master does; the
master reads the users table on every request, so a new or revoked token counts at once).
``add NAME [--role user|viewer]`` prints the new token once (``--json -``: as JSON); only a
salted hash is kept. Rotating a token is ``revoke`` then ``add``: the name, and so the jobs it
owns, stay.
"""
from __future__ import annotations

import argparse
import os
import time

from dlrt import cli

from .store import Store
from .users import USER, USER_ROLES, UserDirectory


def add_user_commands(master_parser: argparse.ArgumentParser) -> None:
    """``users add|list|revoke`` under ``tiresias master``."""
    sub = master_parser.add_subparsers(dest="master_command", metavar="COMMAND",
                                       title="commands on the master's state (instead of running it)")
    group = cli.add_command(sub, "users", "manage the master's API users (per-user tokens)")
    group.set_defaults(func=lambda args: cli.no_subcommand(group))
    users = cli.add_commands(group, dest="users_command")
    p = _command(users, "add", "add a user and print its token (shown once)")
    p.add_argument("name", help="the user's name (its jobs' owner; with --run-as-owner, its OS user)")
    p.add_argument("--role", choices=USER_ROLES, default=USER,
                   help="user: submits and sees its own jobs; viewer: reads every job, changes nothing")
    p.set_defaults(func=cmd_add)
    p = _command(users, "list", "list users (never their tokens)")
    p.set_defaults(func=cmd_list)
    p = _command(users, "revoke", "revoke a user's token at once")
    p.add_argument("name", help="the user's name")
    p.set_defaults(func=cmd_revoke)
    # the master itself takes no command argument: its usage says so (argparse would show
    # the optional ``users`` group as a required MASTER_COMMAND)
    master_parser.usage = (f"%(prog)s [options]\n       %(prog)s users {{{','.join(users.choices)}}} ...")


def _command(sub: argparse._SubParsersAction, name: str, help_text: str) -> argparse.ArgumentParser:
    p = cli.add_command(sub, name, help_text, log_level="WARNING", json_help="write the result as JSON to FILE "
                                                                             "('-' for stdout instead of the text)")
    p.add_argument("--state", default=argparse.SUPPRESS,
                   help="the master's state dir (default: the one given to 'master', else $TIRESIAS_STATE "
                        "or ~/.tiresias)")
    return p


def _directory(state: str) -> UserDirectory:
    path = os.path.join(state, "state.db")
    if not os.path.exists(path):
        raise RuntimeError(f"no master state in {state} (start 'tiresias master --state {state}' once first)")
    return UserDirectory(Store(path))


def cmd_add(args) -> int:
    directory = _directory(args.state)
    try:
        token = directory.add(args.name, args.role)
    finally:
        directory.store.close()
    cli.emit(args.json, {"name": args.name, "role": args.role, "token": token},
             f"user {args.name} ({args.role}) added; its token, shown only now:\n{token}")
    return 0


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def cmd_list(args) -> int:
    directory = _directory(args.state)
    try:
        users = directory.list()
    finally:
        directory.store.close()
    lines = [f"{'name':<20} {'role':<7} {'created':<19}  revoked"]
    lines += [f"{u['name']:<20} {u['role']:<7} {_when(u['created']):<19}  {_when(u['revoked'])}" for u in users]
    cli.emit(args.json, users, "\n".join(lines))
    return 0


def cmd_revoke(args) -> int:
    directory = _directory(args.state)
    try:
        directory.revoke(args.name)
    finally:
        directory.store.close()
    cli.emit(args.json, {"name": args.name, "revoked": True}, f"user {args.name}: token revoked")
    return 0
