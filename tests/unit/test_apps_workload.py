"""tiresias.apps.workload: the Pollux workload CSVs."""
from __future__ import annotations

from pathlib import Path

import pytest

from tiresias.apps.workload import WorkloadJob, load_workload

WORKLOADS = Path(__file__).resolve().parents[3] / "shared" / "data" / "pollux" / "workloads"


@pytest.mark.skipif(not WORKLOADS.is_dir(), reason="Pollux workloads not present")
def test_pollux_workload_loads_in_file_order():
    jobs = load_workload(WORKLOADS / "workload-1.csv")
    assert len(jobs) == 160
    assert jobs[0] == WorkloadJob(0, "cifar10-0", 107.0, "cifar10", 6, 2048)
    assert [j.job_id for j in jobs] == list(range(160))


@pytest.mark.parametrize("row,match", [("a,10,cifar10,x,128", "num_replicas"), ("a,-1,ncf,1,256", "time"),
                                       ("a,10,cifar10,0,128", "num_replicas")])
def test_bad_row_names_file_and_line(tmp_path, row, match):
    path = tmp_path / "w.csv"
    path.write_text("name,time,application,num_replicas,batch_size\nok,1,ncf,1,256\n" + row + "\n")
    with pytest.raises(ValueError, match=rf"w\.csv:3: .*{match}"):
        load_workload(path)


def test_missing_column(tmp_path):
    path = tmp_path / "w.csv"
    path.write_text("name,time,application,batch_size\n")
    with pytest.raises(ValueError, match="missing columns num_replicas"):
        load_workload(path)
