"""How often a migration with no pause at all would have met the pause goals in stored
``autops bench migrate`` runs, against how often the runs met them (dlrt_bench/migrate_noise.py),
with the pause taken against the job's communication time and against the workers' median
(the definition before).

    python bench/autops_migrate_noise.py bench/results/autops_migrate*.json
    python bench/autops_migrate_noise.py bench/results/autops_migrate_connection_warm.json --order W --json -
"""
import argparse
import json
import sys
from pathlib import Path

from dlrt_bench.migrate_noise import BASELINES, assess, read_rows, summarize

WHOSE = {"job": "the job's", "worker": "the workers'"}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--order", default=None, metavar="PREFIX", help="only rows whose 'order' label starts so")
    p.add_argument("--baseline", nargs="+", default=list(BASELINES), choices=BASELINES,
                   help="the pause against the job's communication time, the workers' median, or both (default)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the summary as JSON (-: stdout)")
    args = p.parse_args(argv)
    rows = [r for r in read_rows(args.files)
            if args.order is None or str(r.get("order") or "").startswith(args.order)]
    summary = summarize(a for b in args.baseline for a in (assess(r, b) for r in rows) if a is not None)
    for group in summary:
        print(f"{group['site'] or 'unlabelled'} {group['mode']}, pause against {WHOSE[group['baseline']]} baseline: "
              f"{group['runs']} runs, no-migration statistic median {group['quiet_median_ms']} ms")
        for name, g in group["goals"].items():
            print(f"  {name}: met in {g['met']}; a migration without a pause: {g['expected_without_pause']} expected "
                  f"(share per run median {g['share_median']}, {g['share_range'][0]}-{g['share_range'][1]})")
    if args.json:
        text = json.dumps(summary, indent=1)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
