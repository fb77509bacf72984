"""Job traces for the Tiresias simulator: ``dlrt.trace``'s reader plus the model assignment
of ``--models cycle``.

The CSV formats, validation and normalisation live in ``dlrt.trace`` (AutoPS's pool
simulation reads the same traces); this module re-exports them under Tiresias's names and
adds what only Tiresias needs: ``with_models`` gives jobs without a model Table 3.3's
models in turn (``CYCLE_MODELS``), as the thesis' testbed workload did, so skew and sizes
can be modelled.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from dlrt.trace import FORMATS, LoadReport, TraceError, TraceJob, detect_format, load_trace

__all__ = ["TraceJob", "TraceError", "LoadReport", "FORMATS", "detect_format", "load_trace",
           "CYCLE_MODELS", "with_models"]

# Table 3.3's models, assigned in turn by ``--models cycle``
CYCLE_MODELS = ("vgg19", "vgg16", "vgg11", "alexnet", "resnet152", "resnet101", "resnet50",
                "inception4", "inception3", "googlenet")


def with_models(jobs: Sequence[TraceJob], models: Sequence[str] = CYCLE_MODELS) -> list[TraceJob]:
    """``jobs`` with every job that names no model given ``models[job_id % len(models)]``."""
    return [j if j.model else dataclasses.replace(j, model=models[j.job_id % len(models)])
            for j in jobs]
