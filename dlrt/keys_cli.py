"""``dlrt keys``: make and manage the cluster's key directory (``dlrt.keys``).

``dlrt keys init [--dir DIR] [--force]`` makes a cluster's keys (cluster key, operator
token, CURVE server and member key pairs); ``dlrt keys tenant NAME --out DIR`` makes a
tenant's directory (its own CURVE client key pair and the server's public key) and
authorizes it; ``dlrt keys revoke NAME`` stops accepting a tenant's key (services re-read the
authorized keys at every handshake); ``dlrt keys show`` lists what the directory holds.
Secret values are never printed.
"""
from __future__ import annotations

import argparse
from typing import Any

from . import cli
from .keys import CLUSTER_SECRET, OPERATOR_TOKEN, Keys, add_tenant, authorized_names, init_keys, key_dir, revoke

__all__ = ["add_keys_commands"]


def describe(directory: Any) -> dict[str, Any]:
    """What the key directory holds (names and public keys only)."""
    directory = key_dir(directory)
    keys = Keys.load(directory)
    return {"dir": str(directory), "curve": keys.curve,
            "cluster_secret": (directory / CLUSTER_SECRET).exists(),
            "operator_token": (directory / OPERATOR_TOKEN).exists(),
            "server_public": keys.server_public.decode() if keys.server_public else None,
            "serves": keys.server_secret is not None,
            "client_public": keys.client_public.decode() if keys.client_public else None,
            "authorized": authorized_names(directory)}


def _text(data: dict[str, Any]) -> str:
    lines = [f"key directory {data['dir']}: CURVE {'on' if data['curve'] else 'off'}",
             f"  cluster key: {'yes' if data['cluster_secret'] else 'no'}   operator token: "
             f"{'yes' if data['operator_token'] else 'no'}   serves (server secret key): "
             f"{'yes' if data['serves'] else 'no'}"]
    if data["server_public"]:
        lines.append(f"  server public key: {data['server_public']}")
    if data["client_public"]:
        lines.append(f"  client public key: {data['client_public']}")
    if data["authorized"]:
        lines.append(f"  authorized: {', '.join(data['authorized'])}")
    return "\n".join(lines)


def cmd_init(args: argparse.Namespace) -> int:
    directory = init_keys(args.dir, force=args.force)
    data = describe(directory)
    cli.emit(args.json, data, _text(data) + "\ncopy this directory to every host of the cluster "
             "(DLRT_KEYS=DIR); hand tenants only what `dlrt keys tenant` makes")
    return 0


def cmd_tenant(args: argparse.Namespace) -> int:
    out = add_tenant(args.name, args.out, args.dir)
    data = {**describe(out), "tenant": args.name}
    cli.emit(args.json, data, f"tenant {args.name}: keys in {out} (give that directory to the tenant; its "
             f"jobs run with DLRT_KEYS={out})")
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    if not revoke(args.name, args.dir):
        raise RuntimeError(f"no authorized key named {args.name!r} in {key_dir(args.dir)}")
    cli.emit(args.json, {"revoked": args.name}, f"revoked {args.name}: its connections are refused from now on")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    data = describe(args.dir)
    cli.emit(args.json, data, _text(data))
    return 0


def _name(text: str) -> str:
    from .keys import check_name
    try:
        return check_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_keys_commands(groups: argparse._SubParsersAction) -> None:
    """The ``keys`` command group of ``dlrt``."""
    keys = groups.add_parser("keys", help="the cluster's keys (CURVE, cluster key, operator token)",
                             description="The cluster's key directory ($DLRT_KEYS, else ~/.dlrt/keys); "
                                         "docs/security.md.", formatter_class=cli.HelpFormatter)
    keys.set_defaults(group=keys)
    sub = cli.add_commands(keys, dest="action")

    def command(name: str, help: str, run: Any) -> argparse.ArgumentParser:
        p = cli.add_command(sub, name, help, log_level=None, json_help="write the result as JSON to FILE")
        p.add_argument("--dir", default=None, help="the cluster's key directory (default: $DLRT_KEYS, "
                                                     "else ~/.dlrt/keys)")
        p.set_defaults(run=run)
        return p

    command("init", "make the cluster's keys (keeps existing ones)", cmd_init).add_argument(
        "--force", action="store_true", help="replace existing keys (every host and tenant needs the new ones)")
    tenant = command("tenant", "make a tenant's CURVE keys and authorize them", cmd_tenant)
    tenant.add_argument("name", type=_name, help="the tenant's name")
    tenant.add_argument("--out", required=True, help="directory to write the tenant's keys to")
    command("revoke", "stop accepting a tenant's key", cmd_revoke).add_argument("name", type=_name)
    command("show", "what the key directory holds (no secrets printed)", cmd_show)
