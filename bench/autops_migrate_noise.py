"""How often a migration with no pause at all would have met the pause goals in stored
``autops bench migrate`` runs, against how often the runs met them (dlrt_bench/migrate_noise.py),
with the pause taken against the job's communication time and against the workers' median
(the definition before). ``--around``: instead, the job's excess in each iteration around the
switch, pooled over the stored moves (``migrate_noise.around_switch``). ``--against-noise``:
instead, the moves' pauses pooled against the same statistic over the iterations without a
migration, per site, mode and neighbour job (``migrate_noise.against_noise``).

    python bench/autops_migrate_noise.py bench/results/autops_migrate*.json
    python bench/autops_migrate_noise.py bench/results/autops_migrate_connection_warm.json --order W --json -
    python bench/autops_migrate_noise.py bench/results/autops_migrate*.json --around
    python bench/autops_migrate_noise.py bench/results/autops_migrate*.json --against-noise
"""
import argparse
import json
import sys
from pathlib import Path

from dlrt_bench.migrate_noise import BASELINES, against_noise, around_switch, assess, read_rows, summarize

WHOSE = {"job": "the job's", "worker": "the workers'"}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--order", default=None, metavar="PREFIX", help="only rows whose 'order' label starts so")
    p.add_argument("--baseline", nargs="+", default=list(BASELINES), choices=BASELINES,
                   help="the pause against the job's communication time, the workers' median, or both (default)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the summary as JSON (-: stdout)")
    p.add_argument("--around", action="store_true",
                   help="the job's excess per iteration around the switch, pooled over the moves, instead")
    p.add_argument("--against-noise", action="store_true",
                   help="the moves' pauses pooled against the iterations without a migration, instead")
    args = p.parse_args(argv)
    rows = [r for r in read_rows(args.files)
            if args.order is None or str(r.get("order") or "").startswith(args.order)]
    if args.around:
        return print_around(around_switch(rows), args.json)
    if args.against_noise:
        return print_against_noise([g for b in args.baseline for g in against_noise(rows, baseline=b)], args.json)
    summary = summarize(a for b in args.baseline for a in (assess(r, b) for r in rows) if a is not None)
    for group in summary:
        print(f"{group['site'] or 'unlabelled'} {group['mode']}, pause against {WHOSE[group['baseline']]} baseline: "
              f"{group['runs']} runs, no-migration statistic median {group['quiet_median_ms']} ms")
        for name, g in group["goals"].items():
            print(f"  {name}: met in {g['met']}; a migration without a pause: {g['expected_without_pause']} expected "
                  f"(share per run median {g['share_median']}, {g['share_range'][0]}-{g['share_range'][1]})")
    write_json(summary, args.json)
    return 0


def print_around(groups: list[dict], json_out: str | None) -> int:
    """``--around``: a line per offset from the switch, per group."""
    for g in groups:
        print(f"{g['site'] or 'unlabelled'} {g['mode']}, {g['move']} moves ({g['moves']}): the job's communication "
              "time per iteration minus its median 6-9 iterations before and 5-8 after the switch, ms")
        for d, f in g["offsets"].items():
            share = next(v for k, v in f.items() if k.startswith("share_over"))
            where = {-1: "  the old owners' last", 0: "  the switch"}.get(d, "")
            print(f"  {d:+d}: median {f['median_ms']:7.1f}, mean {f['mean_ms']:7.1f}, p90 {f['p90_ms']:7.1f}, "
                  f"over 60 ms in {100 * share:4.1f}%{where}")
    write_json(groups, json_out)
    return 0


def print_against_noise(groups: list[dict], json_out: str | None) -> int:
    """``--against-noise``: a line per group."""
    for g in groups:
        over = next(k for k in g if k.startswith("share_over"))
        print(f"{g['site'] or 'unlabelled'} {g['mode']}, neighbour {g['other']}, pause against "
              f"{WHOSE[g['baseline']]} baseline: {g['moves']} moves of {g['runs']} runs against {g['quiet']} "
              f"stretches without a migration: median {g['median_ms']} vs {g['quiet_median_ms']} ms, "
              f"p90 {g['p90_ms']} vs {g['quiet_p90_ms']} ms, {over[len('share_'):]} {g[over]} vs "
              f"{g['quiet_' + over]}; shift {g['shift_ms']} ms (Mann-Whitney p {g['p_value']})")
    write_json(groups, json_out)
    return 0


def write_json(data: list[dict], where: str | None) -> None:
    if where:
        text = json.dumps(data, indent=1)
        if where == "-":
            print(text)
        else:
            Path(where).write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
