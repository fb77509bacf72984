"""Runs the W=2 job of tests/integration/test_migration.py (``train``) where it is started --
inside an emulated host -- and pickles its results.

Usage: hosts_migration_job.py MASTER MODE SCHEDULE_JSON OUT.pickle
(SCHEDULE_JSON: {"iteration": [[[key indices], "agg-N"], ...]}, as the property test draws it)
"""
import json
import pathlib
import pickle
import sys

sys.path[:0] = [str(pathlib.Path(__file__).resolve().parents[1] / "integration")]
from test_migration import train  # noqa: E402


def main() -> None:
    master, mode, schedule, out = sys.argv[1:5]
    drawn = {int(it): [(list(pick), target) for pick, target in moves]
             for it, moves in json.loads(schedule).items()}
    with open(out, "wb") as fh:
        pickle.dump(train(master, mode, drawn), fh)


if __name__ == "__main__":
    main()
