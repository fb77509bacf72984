"""The ``dlrt testbed`` commands (emulated hosts, ``dlrt_bench.testbed``), added to the
``dlrt`` command's parser by ``dlrt.main`` only when that command runs.

``dlrt testbed up --hosts N --link 1gbit [--delay 50us] [--prefix P]`` builds a testbed and
leaves it up (prints its hosts and addresses), ``dlrt testbed status`` shows it with each
host's byte counters and processes, ``dlrt testbed exec HOST -- CMD...`` runs a command in a
host (exit status: the command's), ``dlrt testbed blackout HOST --ms 30`` drops every packet
to a host for a while and restores its link, ``dlrt testbed down`` removes it (and whatever a killed
run left behind).
"""
from __future__ import annotations

import argparse
from typing import Any

from dlrt import cli

from .testbed import (DEFAULT_CONGESTION, DEFAULT_PREFIX, Testbed, TestbedError, add_rps_option, available,
                      check_prefix, cleanup)

__all__ = ["add_testbed_commands", "describe"]


def _require_testbeds() -> None:
    reason = available()
    if reason:
        raise TestbedError(f"emulated hosts are unavailable: {reason}")


def _link(text: str) -> str | None:
    """argparse type: a link rate, or ``none`` for unshaped links."""
    return None if text.strip().lower() in ("none", "off") else text


def _prefix(text: str) -> str:
    """argparse type: a testbed prefix."""
    try:
        return check_prefix(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def describe(tb: Testbed, live: bool) -> dict[str, Any]:
    """The testbed as data; ``live`` adds each host's byte counters and processes."""
    hosts = []
    for host in tb.hosts:
        row: dict[str, Any] = {"name": host.name, "netns": host.netns, "addr": host.addr,
                               "host_id": host.host_id, "ifname": host.ifname}
        if live:
            sent, received = tb.counters(host)
            row.update(sent_bytes=sent, received_bytes=received, pids=tb.pids(host))
        hosts.append(row)
    return {"prefix": tb.prefix, "bridge": tb.bridge, "subnet": tb.subnet, "link": tb.link,
            "delay": tb.delay, "congestion": tb.congestion, "rps": tb.rps, "hosts": hosts}


def _table(data: dict[str, Any]) -> str:
    lines = [f"testbed {data['prefix']}: {len(data['hosts'])} hosts on bridge {data['bridge']} "
             f"({data['subnet']}), link {data['link'] or 'unshaped'}, delay {data['delay'] or 'none'}, "
             f"TCP {data['congestion']}, receive steering {'on' if data['rps'] else 'off'}"]
    for row in data["hosts"]:
        line = f"  {row['name']:<14} {row['addr']:<15} link {row['ifname']:<14} DLRT_HOST_ID={row['host_id']}"
        if "sent_bytes" in row:
            line += (f"  sent {row['sent_bytes']} B  received {row['received_bytes']} B  "
                     f"processes {len(row['pids'])}")
        lines.append(line)
    return "\n".join(lines)


def cmd_up(args: argparse.Namespace) -> int:
    tb = Testbed(args.hosts, link=args.link, delay=args.delay, prefix=args.prefix, congestion=args.congestion,
                 rps=args.rps)
    _require_testbeds()
    tb.up()
    data = describe(tb, live=False)
    cli.emit(args.json, data, _table(data))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    _require_testbeds()
    data = describe(Testbed.attach(args.prefix), live=True)
    cli.emit(args.json, data, _table(data))
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    _require_testbeds()
    removed = cleanup(args.prefix)
    text = f"removed {', '.join(removed)}" if removed else f"nothing named {args.prefix}-* to remove"
    cli.emit(args.json, {"prefix": args.prefix, "removed": removed}, text)
    return 0


def cmd_exec(args: argparse.Namespace) -> int:
    command = args.cmd
    if not command:
        raise cli.UsageError("no command given: dlrt testbed exec HOST -- CMD...")
    _require_testbeds()
    host = Testbed.attach(args.prefix).host(args.host)
    # in the terminal's process group, so Ctrl-C reaches the command as well
    proc = host.popen(command, mount_visible=args.mount_visible, start_new_session=False)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        return proc.wait()


def cmd_blackout(args: argparse.Namespace) -> int:
    _require_testbeds()
    tb = Testbed.attach(args.prefix)
    host = tb.host(args.host)
    timer = tb.blackout(host, args.ms / 1e3)
    try:
        timer.join()
    except KeyboardInterrupt:           # restore at once rather than leave the link dark
        timer.cancel()
        timer.function()
        raise
    cli.emit(args.json, {"prefix": tb.prefix, "host": host.name, "ms": args.ms},
             f"{host.name}: every packet to it dropped for {args.ms:g} ms; its link's shaping is back")
    return 0


def add_testbed_commands(testbed: argparse.ArgumentParser) -> None:
    """The actions of the ``dlrt testbed`` group parser ``testbed`` (``args.action``; each sets
    ``args.run``)."""
    sub = cli.add_commands(testbed, dest="action")

    def command(name: str, help: str, run: Any, json_help: str | None = None) -> argparse.ArgumentParser:
        p = cli.add_command(sub, name, help, log_level=None, json_help=json_help)
        p.add_argument("--prefix", type=_prefix, default=DEFAULT_PREFIX,
                       help="names: PREFIX-br, PREFIX-hN (namespaces), PREFIX-vN (links)")
        p.set_defaults(run=run)
        return p

    up = command("up", "build a testbed and leave it up", cmd_up, "write the hosts as JSON to FILE ('-': stdout)")
    up.add_argument("--hosts", type=cli.positive(int), required=True, help="number of emulated hosts")
    up.add_argument("--link", type=_link, default="1gbit",
                    help="each host link's rate in both directions (tc units: 100mbit, 1gbit, 10gbit; "
                         "'none': unshaped)")
    up.add_argument("--delay", default=None,
                    help="one-way delay between two hosts (50us, 1ms; needs the netem qdisc)")
    up.add_argument("--congestion", default=DEFAULT_CONGESTION, metavar="CC",
                    help="every host's TCP congestion control (cubic, bbr, reno: "
                         "/proc/sys/net/ipv4/tcp_available_congestion_control)")
    add_rps_option(up)
    command("status", "show a testbed, its hosts' byte counters and processes", cmd_status,
            "write the status as JSON to FILE ('-': stdout)")
    command("down", "remove a testbed (also what a killed run left behind)", cmd_down,
            "write what was removed as JSON to FILE ('-': stdout)")
    ex = command("exec", "run a command in a host: exec HOST -- CMD... (exit status: the command's)",
                 cmd_exec)
    ex.add_argument("--mount-visible", action="store_true",
                    help="enter only the network namespace (nsenter), so mounts stay visible outside")
    ex.add_argument("host", help="host index (0), short name (h0) or name (PREFIX-h0)")
    dark = command("blackout", "drop every packet to a host for a while, then restore its link "
                   "(a link that flapped: what a lost tail costs)", cmd_blackout,
                   "write what was done as JSON to FILE ('-': stdout)")
    dark.add_argument("--ms", type=cli.positive(float), default=30.0, help="how long, in ms (default 30)")
    dark.add_argument("host", help="host index (0), short name (h0) or name (PREFIX-h0)")
