"""The Pollux applications (OSDI '21 artifact) as simulated jobs, for Optimus and Tiresias.

``profiles``: measured step times and validation curves per application; ``workload``: the
Pollux workload files; ``pushpull``: the aggregator dimension (push/pull cost model, model
sizes). Pure data and functions: nothing here imports the simulator, the driver or the service.
"""
from .profiles import Application, load_application, load_applications
from .pushpull import PushPullCosts, costs_from_pushpull_results, load_costs, model_bytes, pushpull_time
from .workload import WorkloadJob, load_workload

__all__ = ["Application", "load_application", "load_applications", "PushPullCosts",
           "costs_from_pushpull_results", "load_costs", "model_bytes", "pushpull_time",
           "WorkloadJob", "load_workload"]
