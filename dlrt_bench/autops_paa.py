"""``bench/autops_paa.py``: Optimus's PAA vs. MXNet's default split vs. AutoPS's key planning.

Optimus's parameter assignment (EuroSys'18 §5.3, Table 3) on the models of ``tensor_shapes.json``.

For each model and number of servers p, three ways to spread one job's parameters:

* **mxnet**: ``assign_mxnet`` (a tensor under 10^6 parameters to a random server, a larger
  one sliced evenly over all p);
* **paa**: ``assign_paa`` over the tensors (sizes in parameters);
* **autops**: what pMaster does for a job that asked for p aggregators and set no partition
  size (``Master._declare``): ``auto_partition_bytes`` of the model's fp32 bytes for p,
  ``plan_keys`` with the default small-key bound, ``spread_by_bytes`` of the keys over p fresh
  aggregators. Its "requests" are keys per aggregator per step; ``messages`` also counts
  the batching of small keys (all of an aggregator's small keys travel as one message).

Each gets Table 3's measures (sizes in parameters). The winner of a (model, p) is the
smallest ``(size_imbalance, total_requests, request_imbalance)``, compared in that order.

    python bench/autops_paa.py --json bench/results/autops_paa.json
"""
from __future__ import annotations

import math
import platform
import sys
from typing import Sequence

from autops.master.assignment import spread_by_bytes
from autops.models import SYNTHETIC, Tensor, known_models, model_tensors, shapes_path
from autops.master.paa import SMALL_FRACTION, Placement, assign_mxnet, assign_paa, measures
from autops.wire.partition import DEFAULT_SMALL_BYTES, auto_partition_bytes, plan_keys, tensor_bytes
from dlrt import cli

SERVERS = (2, 4, 8, 16)
ALGORITHMS = ("mxnet", "paa", "autops")
SIZE_TIE = 0.02     # the second verdict: size imbalances within 2% of avg count as equal
# Table 3 (ResNet-50, 157 blocks; 247 - 157 = 90 extra MXNet requests = 10 big blocks x 9: p = 10)
PAPER_MODEL, PAPER_SERVERS = "resnet50", 10
PAPER_ROWS = {"mxnet": {"size_imbalance": 3_600_000, "request_imbalance": 43, "total_requests": 247},
              "paa": {"size_imbalance": 100_000, "request_imbalance": 1, "total_requests": 157}}


def blocks_of(tensors: Sequence[Tensor]) -> list[tuple[str, int]]:
    """``(name, parameters)`` of each tensor."""
    return [(name, int(math.prod(shape))) for name, shape, _ in tensors]


def autops_plan(tensors: Sequence[Tensor], servers: int) -> tuple[list[Placement], int, list[int]]:
    """pMaster's keys for a job of ``tensors`` that asked for ``servers`` aggregators, as
    ``(placements in parameters, partition bytes, messages per step on each aggregator)``."""
    aggregators = [f"agg{i}" for i in range(servers)]
    partition = auto_partition_bytes(sum(tensor_bytes(shape, dtype) for _, shape, dtype in tensors), servers)
    keys = plan_keys(list(tensors), partition, DEFAULT_SMALL_BYTES)
    table = spread_by_bytes([(k.key, k.nbytes) for k in keys], aggregators)
    index = {agg: i for i, agg in enumerate(aggregators)}
    rows = [(k.tensor, int(k.key.rpartition("#p")[2]) if "#p" in k.key else 0, k.numel, index[table[k.key]])
            for k in keys]
    messages = [0] * servers
    for agg in {table[k.key] for k in keys if k.small}:
        messages[index[agg]] += 1                       # one batch of its small keys
    for k in keys:
        if not k.small:
            messages[index[table[k.key]]] += 1
    return rows, partition, messages


def winner(rows: dict[str, dict], size_slack: float = 0.0) -> str:
    """The algorithm with the smallest (size imbalance, total requests, request imbalance),
    compared in that order; size imbalances within ``size_slack`` of the smallest count as
    equal (0: only equal ones)."""
    best = min(r["size_imbalance"] for r in rows.values())
    tied = [a for a in rows if rows[a]["size_imbalance"] <= best + size_slack]
    return min(tied, key=lambda a: (0 if size_slack else rows[a]["size_imbalance"], rows[a]["total_requests"],
                                    rows[a]["request_imbalance"], rows[a]["size_imbalance"], ALGORITHMS.index(a)))


def compare(tensors: Sequence[Tensor], servers: int, small_fraction: float = SMALL_FRACTION,
            seed: int = 0, size_tie: float = SIZE_TIE) -> dict:
    """The three algorithms' measures for one model on ``servers``, the winner, and the winner
    when size imbalances within ``size_tie`` x the average server size count as equal."""
    blocks = blocks_of(tensors)
    plan, partition, messages = autops_plan(tensors, servers)
    rows = {"mxnet": measures(assign_mxnet(blocks, servers, seed=seed), servers),
            "paa": measures(assign_paa(blocks, servers, small_fraction), servers),
            "autops": measures(plan, servers)}
    rows["autops"].update(partition_bytes=partition, messages=sum(messages),
                          message_imbalance=max(messages) - min(messages))
    avg = sum(size for _, size in blocks) / servers
    for row in rows.values():
        row["size_imbalance_of_avg"] = row["size_imbalance"] / avg
    return {"servers": servers, "blocks": len(blocks), "params": sum(s for _, s in blocks),
            "algorithms": rows, "winner": winner(rows), "winner_size_tie": winner(rows, size_tie * avg)}


def _m(params: int) -> str:
    return f"{params / 1e6:.2f}M" if params >= 10_000 else str(params)


def table(results: dict[str, list[dict]]) -> str:
    """Table 3's columns per model, p and algorithm; ``msgs``: AutoPS's messages per step
    (total / max - min over aggregators); ``win``: the strict verdict, ``~``: the verdict with
    size imbalances within ``SIZE_TIE`` of avg tied."""
    lines = [f"{'model':<11}{'p':>3}  {'algorithm':<8}{'size diff':>11}{'(of avg)':>9}{'req diff':>9}"
             f"{'requests':>9}{'msgs':>10}  win"]
    for model, runs in results.items():
        for run in runs:
            for algo in ALGORITHMS:
                r = run["algorithms"][algo]
                msgs = f"{r['messages']}/{r['message_imbalance']}" if "messages" in r else ""
                mark = ("<" if run["winner"] == algo else " ") + ("~" if run["winner_size_tie"] == algo else "")
                lines.append(f"{model:<11}{run['servers']:>3}  {algo:<8}{_m(r['size_imbalance']):>11}"
                             f"{r['size_imbalance_of_avg']:>9.1%}{r['request_imbalance']:>9}"
                             f"{r['total_requests']:>9}{msgs:>10}  {mark}")
    return "\n".join(lines)


def tally(results: dict[str, list[dict]], verdict: str) -> dict[str, int]:
    """How many (model, p) each algorithm wins under ``verdict`` ("winner" or "winner_size_tie")."""
    return {a: sum(run[verdict] == a for runs in results.values() for run in runs) for a in ALGORITHMS}


def paper_check(tensors: Sequence[Tensor], small_fraction: float, seed: int) -> dict:
    """Table 3's setting (ResNet-50, p = 10) next to the paper's numbers."""
    run = compare(tensors, PAPER_SERVERS, small_fraction, seed)
    return {"model": PAPER_MODEL, "servers": PAPER_SERVERS, "ours": run["algorithms"], "paper": PAPER_ROWS,
            "blocks": run["blocks"], "paper_blocks": 157}


def main(argv: list[str] | None = None) -> int:
    p = cli.parser("autops_paa", description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=None, help="models of the shapes file (default: all)")
    p.add_argument("--servers", nargs="+", type=int, default=list(SERVERS))
    p.add_argument("--shapes", default=None,
                   help="tensor shapes JSON (default: $AUTOPS_TENSOR_SHAPES, else shared/data/models/...)")
    p.add_argument("--small-fraction", type=float, default=SMALL_FRACTION, help="PAA's 'very small' bound, of avg")
    p.add_argument("--seed", type=int, default=0, help="MXNet's random server choice")
    p.add_argument("--size-tie", type=float, default=SIZE_TIE,
                   help="second verdict: size imbalances within this fraction of avg count as equal")
    cli.add_json(p)
    args = p.parse_args(argv)
    log = cli.text_out(args.json)
    models = args.models or [m for m in known_models(args.shapes) if m not in SYNTHETIC]
    results = {m: [compare(model_tensors(m, args.shapes), s, args.small_fraction, args.seed, args.size_tie)
                   for s in args.servers]
               for m in models}
    print(table(results), file=log)
    wins, wins_tie = tally(results, "winner"), tally(results, "winner_size_tie")
    print("wins (<: smallest size imbalance, then fewest total requests, then smallest request imbalance): "
          + ", ".join(f"{a} {n}" for a, n in wins.items()), file=log)
    print(f"wins (~: the same with size imbalances within {args.size_tie:.0%} of avg tied): "
          + ", ".join(f"{a} {n}" for a, n in wins_tie.items()), file=log)
    check = None
    if PAPER_MODEL in known_models(args.shapes):
        check = paper_check(model_tensors(PAPER_MODEL, args.shapes), args.small_fraction, args.seed)
        for algo in ("mxnet", "paa"):
            ours, paper = check["ours"][algo], check["paper"][algo]
            print(f"Table 3 check, {PAPER_MODEL} p={PAPER_SERVERS} ({check['blocks']} blocks; paper 157) {algo}: "
                  f"ours {_m(ours['size_imbalance'])} / {ours['request_imbalance']} / {ours['total_requests']}, "
                  f"paper {_m(paper['size_imbalance'])} / {paper['request_imbalance']} / {paper['total_requests']}",
                  file=log)
    if args.json:
        cli.write_json(args.json, {"bench": "autops_paa", "python": platform.python_version(),
                                   "argv": sys.argv[1:] if argv is None else argv,
                                   "shapes": str(shapes_path(args.shapes)),
                                   "rule": ["size_imbalance", "total_requests", "request_imbalance"],
                                   "size_tie": args.size_tie, "results": results, "wins": wins,
                                   "wins_size_tie": wins_tie, "paper_check": check})
    return 0


if __name__ == "__main__":
    sys.exit(main())
