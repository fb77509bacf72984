"""The ``dlrt`` command: the runtime's shared tools: ``dlrt cluster`` (the three systems up as
one, ``dlrt_cluster.cli``), ``dlrt testbed`` (emulated hosts) and ``dlrt keys`` (the
cluster's keys, ``dlrt.keys_cli``).

The cluster's commands live in ``dlrt_cluster``, above the three systems, and the testbed's
with the benchmarks (``dlrt_bench.testbed_cli``): this module imports each only when the
command line names its group (``dlrt --help`` lists the groups without them), so the shared
core loads none of the systems' code and none of the benchmarks'. DESIGN §6's conventions: ``--json FILE``, one-line errors,
exit 2 for usage errors and 1 for runtime errors.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from . import cli
from .keys_cli import add_keys_commands

PROG = "dlrt"


def _parser(testbed: bool, cluster: bool = False) -> argparse.ArgumentParser:
    """The ``dlrt`` parser; the ``testbed`` and ``cluster`` groups get their actions (and
    import their packages) only when asked for; else they are only listed (``dlrt --help``)."""
    ap = cli.parser(PROG, "The runtime's shared tools: the cluster up as one, emulated multi-host testbeds, "
                          "the cluster's keys.")
    cli.add_log_level(ap)
    groups = cli.add_commands(ap)
    group = groups.add_parser("cluster", help="bring AutoPS, Infiniswap and Tiresias up as one, here or on Ray",
                              description="pMaster, Infiniswap daemons and the Tiresias master, wired "
                                          "together: on this machine, or with --ray on an existing Ray "
                                          "cluster (docs/cluster.md).", formatter_class=cli.HelpFormatter)
    group.set_defaults(group=group)
    if cluster:
        from dlrt_cluster.cli import add_cluster_commands
        add_cluster_commands(group)
    group = groups.add_parser("testbed", help="emulated hosts: namespaces on a bridge, shaped links",
                              description="Emulated hosts (network namespaces on one bridge, links "
                                          "shaped with tc); needs root.",
                              formatter_class=cli.HelpFormatter)
    group.set_defaults(group=group)
    if testbed:
        from dlrt_bench.testbed_cli import add_testbed_commands
        add_testbed_commands(group)
    add_keys_commands(groups)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # exec's command is everything after the first "--" (options may come before or after HOST)
    head, command = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, None)
    ap = _parser(testbed="testbed" in head, cluster="cluster" in head)
    args, rest = ap.parse_known_args(head)
    is_exec = getattr(args, "action", None) == "exec"
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}"
                 + (" (the command goes after '--': dlrt testbed exec HOST -- CMD...)" if is_exec else ""))
    if command is not None and not is_exec:
        ap.error(f"unrecognized arguments: -- {' '.join(command)}")
    if is_exec:
        args.cmd = command or []
    if args.command is None:
        return cli.no_subcommand(ap)
    if getattr(args, "action", None) is None:
        return cli.no_subcommand(args.group)
    cli.setup_logging(args.log_level)
    return cli.run_main(f"{PROG} {args.command} {args.action}", args.run, args)


if __name__ == "__main__":
    raise SystemExit(main())
