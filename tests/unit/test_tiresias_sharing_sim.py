"""GPU sharing in the simulator and the command line: invariants over a generated workload,
the finish-time fairness metric, and what ``tiresias compare`` reports."""
import json
from types import SimpleNamespace

import pytest

from tiresias import cli
from tiresias.cluster import ClusterSpec
from tiresias.generate import generate
from tiresias.metrics import finish_time_fairness
from tiresias.packing.profiles import load_profiles
from tiresias.packing.slots import ProfileSharing
from tiresias.policies.las import DiscretizedLAS
from tiresias.sim import SimConfig, simulate

pytestmark = pytest.mark.skipif(not cli.DEFAULT_COLOCATION.exists(), reason="no co-location table in ../shared/data")


@pytest.fixture(scope="module")
def store():
    return load_profiles(cli.DEFAULT_COLOCATION)


def _types(store):
    return [(t.model, t.batch_size, t.gpus) for t in store.job_types()]


@pytest.mark.parametrize("packing", ["tesserae", "gavel"])
def test_shared_gpus_hold_at_most_two_jobs_at_their_table_speeds(store, packing):
    trace = generate("shockwave", 120, 80.0, 3, _types(store))
    sharing = ProfileSharing(store)
    seen = {"rounds": 0, "packed": 0}

    def check(drv):
        slots = drv.slots
        assert all(len(gpu) <= 2 for node in slots.plan for gpu in node)
        assert drv.used <= drv.capacity
        for a, b in slots.partner.items():
            if a in drv.running and b in drv.running:
                ja, jb = drv.running[a], drv.running[b]
                assert slots.gpus[a] == slots.gpus[b] and ja.num_gpus == jb.num_gpus
                want = sharing.pair(sharing.kind(ja), sharing.kind(jb))
                assert sum(want) > 1.0
                sa = ja.speed / drv.nodes.speed_on(ja, slots.allocation(a))    # without the spread
                sb = jb.speed / drv.nodes.speed_on(jb, slots.allocation(b))    # placement's slowdown
                assert sorted((sa, sb)) == pytest.approx(sorted(want))   # a pair of one type: either way
                if sharing.kind(ja) != sharing.kind(jb):
                    assert (sa, sb) == pytest.approx(want)
                seen["packed"] += 1
        seen["rounds"] += 1

    config = SimConfig("tiresias", packing=packing, decide_every=360.0, overheads=True, slowdown=True)
    result = simulate(trace, ClusterSpec(4, 4), DiscretizedLAS(), config=config, sharing=sharing, observe=check)
    assert all(j.end_time is not None for j in result.jobs)
    assert seen["packed"] > 0 and seen["rounds"] > 10
    assert result.migrations <= result.migrations_naive


def test_finish_time_fairness_of_hand_made_runs():
    job = lambda s, e, d, g: SimpleNamespace(submit_time=s, end_time=e, duration=d, num_gpus=g)
    # two 1-GPU jobs on 1 GPU, both active over [0, 10) then the second alone over [10, 20):
    # job A: N = 2 over its life, share 1/2 GPU, ideal 2 x 5 = 10, rho 1; job B: N = 1.5, ideal 15
    result = SimpleNamespace(jobs=[job(0, 10, 5, 1), job(0, 20, 10, 1)], capacity=1)
    ftf = finish_time_fairness(result)
    assert ftf["ftf_max"] == pytest.approx(20 / 15) and ftf["ftf_mean"] == pytest.approx((1 + 20 / 15) / 2)
    # a job alone on a cluster larger than it asks: its share covers it, rho = JCT / duration
    assert finish_time_fairness(SimpleNamespace(jobs=[job(0, 30, 20, 2)], capacity=8))["ftf_max"] == 1.5


def test_compare_reports_migrations_and_fairness(tmp_path, capsys):
    trace, out = tmp_path / "w.csv", tmp_path / "c.json"
    assert cli.main(["workload", "--jobs", "60", "--seed", "1", "--out", str(trace)]) == 0
    assert cli.main(["compare", "--trace", str(trace), "--cluster", "2x4", "--round", "360", "--no-progress",
                     "--policies", "las,tesserae-las,gavel-las", "--json", str(out)]) == 0
    rows = {r["policy"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"las", "tesserae-las", "gavel-las"}
    for r in rows.values():
        assert r["jobs"] == 60 and r["ftf_max"] >= r["ftf_mean"] > 0
        assert {"avg_jct", "makespan", "migrations"} <= set(r)
    assert rows["las"]["migrations"] == 0
    assert rows["tesserae-las"]["migrations"] <= rows["tesserae-las"]["migrations_without_matching"]
    assert rows["gavel-las"]["migrations"] == rows["gavel-las"]["migrations_without_matching"]


def test_sharing_options_are_checked(tmp_path, capsys):
    trace = tmp_path / "w.csv"
    assert cli.main(["workload", "--jobs", "10", "--out", str(trace)]) == 0
    base = ["simulate", "--trace", str(trace), "--cluster", "2x4", "--policy", "tesserae-las"]
    assert cli.main([*base, "--original"]) == 2
    assert "cannot run with --original" in capsys.readouterr().err
    assert cli.main([*base, "--profile-noise", "1.5"]) == 2
    assert cli.main([*base, "--colocation", str(tmp_path / "missing.csv")]) == 2
    assert "missing.csv" in capsys.readouterr().err
    out = tmp_path / "s.json"
    assert cli.main([*base, "--profile-noise", "0.5", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["policy"] == "tesserae-las" and summary["jobs"] == 10 and "ftf_max" in summary


def test_the_readme_sharing_lines_run_as_written(tmp_path, monkeypatch, capsys):
    """The quick start's `tiresias workload` and `tiresias compare ... tesserae-las` lines."""
    import pathlib
    import shlex
    readme = (pathlib.Path(cli.PROJECT_ROOT) / "README.md").read_text().splitlines()
    lines = [ln.split("#")[0] for ln in readme
             if ln.startswith("tiresias workload") or (ln.startswith("tiresias compare") and "tesserae-las" in ln)]
    assert len(lines) == 2
    monkeypatch.chdir(tmp_path)
    for line in lines:
        assert cli.main([*shlex.split(line)[1:], "--no-progress"] if "compare" in line else shlex.split(line)[1:]) == 0
    out = capsys.readouterr().out
    assert "tesserae-las" in out and "gavel-las" in out and "FTF max" in out


def test_a_noisy_profile_learns_the_speeds_packed_jobs_run_at(store):
    import random
    trace = generate("shockwave", 120, 80.0, 5, _types(store))
    config = SimConfig("tiresias", packing="tesserae", decide_every=360.0, learn_profiles=True)
    noisy = store.with_noise(1.0, random.Random(7))
    fresh = store.with_noise(1.0, random.Random(7))         # the same draw, never updated
    used = set()

    class Recording(ProfileSharing):
        def observe(self, a, b, sa, sb):
            used.add((a, b))
            super().observe(a, b, sa, sb)

    simulate(trace, ClusterSpec(4, 4), DiscretizedLAS(), config=config, sharing=Recording(noisy),
             true_sharing=ProfileSharing(store))
    assert used
    err = lambda s: sum(abs(x - y) for a, b in used for x, y in zip(s.pair(a, b), store.pair(a, b)))
    assert err(noisy) < 0.2 * err(fresh)        # each round's measurement halves a pair's error


def test_sharing_under_optimus_is_optimus_when_no_pair_is_known(tmp_path):
    """Pollux's applications are not in the co-location table: nothing can share, and
    ``tesserae-optimus`` decides exactly as ``optimus`` in the same rounds."""
    workload = cli.PROJECT_ROOT.parent / "shared" / "data" / "pollux" / "workloads" / "workload-1.csv"
    if not workload.exists():
        pytest.skip("no Pollux workloads in ../shared/data")
    got = {}
    for policy, extra in (("tesserae-optimus", []), ("optimus", ["--round", "600"])):
        out = tmp_path / f"{policy}.json"
        assert cli.main(["simulate", "--workload", str(workload), "--cluster", "16x4", "--limit", "40",
                         "--policy", policy, "--json", str(out), "--no-progress", *extra]) == 0
        got[policy] = json.loads(out.read_text())
    assert got["tesserae-optimus"]["policy"] == "tesserae-optimus"
    for key in ("avg_jct", "makespan", "preemptions", "jobs"):
        assert got["tesserae-optimus"][key] == got["optimus"][key]


def test_guests_under_optimus_ride_on_running_hosts_at_table_speeds(store):
    """``tesserae-optimus``: after every round and every end, each guest runs on the GPUs of a
    running host of its GPU count (one guest per host), holds none of its own, and both run
    at their speed alone times the table's packed speeds; a pair the matching keeps is not
    restarted, so guests are preempted less than once per round."""
    from tiresias.policies import make_policy
    trace = generate("shockwave", 120, 80.0, 3, _types(store))
    sharing = ProfileSharing(store)
    seen = {"rounds": 0, "pairs": 0, "kept": 0}
    last: dict[int, int] = {}

    def check(drv):
        guests = dict(drv._guest_of)
        assert len(set(guests.values())) == len(guests)
        own = 0
        for jid, job in drv.running.items():
            if jid in guests:
                host = drv.running[guests[jid]]
                assert host.num_gpus == job.num_gpus and jid not in drv.nodes.alloc
                want = sharing.pair(sharing.kind(host), sharing.kind(job))
                alloc = drv.nodes.alloc[host.job_id]
                assert host.speed / drv.nodes.speed_on(host, alloc) == pytest.approx(want[0])
                assert job.speed / drv.nodes.speed_on(job, alloc) == pytest.approx(want[1])
                seen["pairs"] += 1
                seen["kept"] += last.get(jid) == host.job_id
            else:
                own += job.num_gpus
                assert sum(g for _, g in drv.nodes.alloc[jid]) == job.num_gpus
        assert drv.used == own <= drv.capacity
        assert sum(drv.nodes.free) == drv.capacity - own
        last.clear()
        last.update(guests)
        seen["rounds"] += 1

    config = SimConfig("tiresias", packing="tesserae", decide_every=600.0, overheads=True, slowdown=True)
    policy = make_policy("optimus", cluster=ClusterSpec(4, 4))
    result = simulate(trace, ClusterSpec(4, 4), policy, config=config, sharing=sharing, observe=check)
    assert all(j.end_time is not None for j in result.jobs)
    assert seen["pairs"] > 20 and seen["kept"] > 0
