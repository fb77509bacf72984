"""tiresias.apps.profiles: loading the Pollux traces, step-time interpolation, progress, losses."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from tiresias.apps.profiles import DEFAULT_TRACES, StepTimes, load_application, load_applications

pytestmark = pytest.mark.skipif(not DEFAULT_TRACES.is_dir(), reason="Pollux traces not present")

POLLUX_CAPS = {"bert": 2, "cifar10": 100, "ncf": 10, "imagenet": 90, "deepspeech2": 80, "yolov3": 50}


@pytest.fixture(scope="module")
def apps():
    return load_applications()


def test_every_app_loads_with_pollux_epoch_caps(apps):
    assert {name: app.epoch_cap for name, app in apps.items()} == POLLUX_CAPS
    for app in apps.values():
        for b in app.batch_sizes:
            assert len(app.loss_curve(b)) == app.epoch_cap
            assert len(app.steps_per_epoch(b)) == app.epoch_cap
    assert apps["cifar10"].batch_sizes == [128, 256, 512, 1024, 2048, 4096]


def test_measured_points_come_back_exactly(apps):
    app = apps["cifar10"]
    # placement "4" (one node, 4 GPUs), local batch 64: read it from the file itself
    rows = [line.split(",") for line in (DEFAULT_TRACES / "cifar10" / "placements.csv").read_text().split()[1:]]
    step, sync = next((float(r[2]), float(r[3])) for r in rows if r[0] == "4" and r[1] == "64")
    assert app.step_time(4, 256) == pytest.approx(step, rel=1e-12)
    assert app.sync_time(4, 256) == pytest.approx(sync, rel=1e-12)
    # scalability row: 8 nodes, 32 GPUs, local 64
    srows = [line.split(",") for line in (DEFAULT_TRACES / "cifar10" / "scalability.csv").read_text().split()[1:]]
    sstep = next(float(r[3]) for r in srows if r[:3] == ["8", "32", "64"])
    assert app.step_time(32, 2048, nodes=8) == pytest.approx(sstep, rel=1e-12)


def test_local_batch_interpolates_in_log_space_between_neighbours():
    table = StepTimes([(1, 1, 10.0, 1.0, 0.1), (1, 1, 40.0, 3.0, 0.1)])
    assert table.at(1, 1, 20.0)[0] == pytest.approx(2.0)       # log-midpoint of 10 and 40
    assert table.at(1, 1, 5.0)[0] == 1.0                         # never below the smallest measured
    assert table.at(1, 1, 80.0) == pytest.approx((0.1 + 2.9 * 2, 0.1))   # compute in proportion


def test_unmeasured_configurations_lie_between_neighbours(apps):
    app = apps["imagenet"]
    # 7 GPUs / 2 nodes is measured ("34"); 22 GPUs on 6 nodes lies between measured 20 and 24
    lo, hi = app.step_time(20, 2200, nodes=6), app.step_time(24, 2200, nodes=6)
    mid = app.step_time(22, 2200, nodes=6)
    assert min(lo, hi) <= mid <= max(lo, hi)
    # 7 nodes: between 6 and 8 nodes at the same GPU count
    a, b, c = (app.step_time(24, 2400, nodes=n) for n in (6, 7, 8))
    assert min(a, c) <= b <= max(a, c)
    # every count up to max_gpus has a finite time
    for g in range(1, app.max_gpus(6400) + 1):
        assert math.isfinite(app.step_time(g, 6400)) and app.compute_time(g, 6400) >= 0


def test_yolov3_local_batch_cap_accumulates_gradients(apps):
    app = apps["yolov3"]
    assert app.max_local_bsz == 8
    one = app.step_time(1, 8)
    sync = app.sync_time(1, 8)
    # local 16 on one GPU = two micro-batches of 8: twice the compute, one sync
    assert app.step_time(1, 16) == pytest.approx(2 * (one - sync) + sync)


def test_max_gpus_and_bad_configurations(apps):
    app = apps["cifar10"]
    assert app.max_gpus(128) == 4             # smallest measured local batch is 32
    assert app.max_gpus(4096) == 64           # no more than measured
    with pytest.raises(ValueError, match="max_gpus"):
        app.step_time(5, 128)
    with pytest.raises(ValueError, match="spread"):
        app.step_time(8, 1024, nodes=1)
    with pytest.raises(ValueError, match="no validation file"):
        app.total_steps(100)


def test_steps_and_progress_match_the_columns(apps):
    app = apps["cifar10"]
    steps = app.steps_per_epoch(1024)
    assert sum(steps) == app.total_steps(1024) == 5722
    assert steps[0] > steps[-1]                # early epochs take more steps at a large batch
    progress = sum(app.progress_per_step(1024, e) * s for e, s in enumerate(steps))
    assert progress == pytest.approx(app.total_progress(1024))


@pytest.mark.parametrize("name,batch,first_metric", [
    ("cifar10", 128, 0.4455), ("ncf", 256, 0.6241721854304636), ("bert", 12, 86.70941580662803),
    ("deepspeech2", 20, 99.47931732716228), ("yolov3", 8, 25.413258189723642)])
def test_metric_becomes_a_decreasing_quantity(apps, name, batch, first_metric):
    expected = {"cifar10": 1 - first_metric, "ncf": 1 - first_metric, "bert": 1 - first_metric / 100,
                "deepspeech2": first_metric, "yolov3": first_metric}[name]
    curve = apps[name].loss_curve(batch)
    assert curve[0] == (apps[name].steps_per_epoch(batch)[0], pytest.approx(expected))
    assert curve[-1][1] < curve[0][1]


def test_bad_trace_files_raise(tmp_path: Path):
    app_dir = tmp_path / "toy"
    app_dir.mkdir()
    (app_dir / "placements.csv").write_text("placement,local_bsz,step_time,sync_time\n1,4,x,0.1\n")
    with pytest.raises(ValueError, match=r"placements.csv:2"):
        load_application(app_dir)
    (app_dir / "placements.csv").write_text("placement,local_bsz,step_time,sync_time\n1,4,0.5,0.1\n")
    with pytest.raises(ValueError, match="no validation"):
        load_application(app_dir)
    (app_dir / "validation-4.csv").write_text("progress,iteration,metric\n1,1,0.5\n2,2,0.4\n")
    toy = load_application(app_dir, model_bytes=1000)
    assert toy.epoch_cap == 2 and toy.step_time(1, 4) == 0.5
    with pytest.raises(ValueError, match="no metric rule"):
        toy.loss_curve(4)
