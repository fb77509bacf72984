"""The costs the simulator charges: preemption (pause + resume) and unconsolidated placement.

The original Tiresias simulator charged neither; both models can be switched off.

Pause and resume (thesis §3.2.2, Fig. 3.4 / 3.5). On a pause the chief worker checkpoints the
model to the shared file system; on a resume every worker loads it and the framework starts
again. The thesis' testbed file system reads and writes 1.2 GB/s (§3.5.1) and the figures put
pausing at about a second and resuming at several seconds to tens of seconds, growing with
the model and the number of workers. Modelled as::

    pause  = 1.0 s + model_MB / 1200 MB/s
    resume = 5.0 s + model_MB / 1200 MB/s + 0.5 s x workers (GPUs)

with the model sizes of Table 3.3 (230 MB, a mid-size model, when the trace names none).
The simulator charges both when a preempted job resumes: it holds its GPUs for
``pause + resume`` seconds before making progress again.

Unconsolidated placement (Fig. 3.3: four 8-GPU jobs on eight 4-GPU servers). Random placement
ran the VGG family at roughly 0.6 of its consolidated speed and AlexNet at roughly 0.65, while
ResNet, Inception and GoogLeNet stayed within a few percent — the more a model's largest tensor
dominates (its skew, Table 3.3), the more it suffers. Modelled as a speed factor linear in skew
for a multi-GPU job spread over more nodes than it needs::

    speed = 1 - 0.55 x skew        (VGG19 0.61, AlexNet 0.66, ResNet-50 0.95, GoogLeNet 0.92)
"""
from __future__ import annotations

from .cluster import model_key

CHECKPOINT_MB_PER_S = 1200.0
PAUSE_FIXED_S = 1.0
RESUME_FIXED_S = 5.0
RESUME_PER_WORKER_S = 0.5
DEFAULT_MODEL_MB = 230.0
SPREAD_PENALTY = 0.55

# Table 3.3 model sizes in MB; BERT from ../shared/data/models/tensor_shapes.json (fp32)
MODEL_MB: dict[str, float] = {
    "vgg19": 548.1, "vgg16": 527.8, "vgg11": 506.8, "alexnet": 235.9, "resnet152": 230.2,
    "resnet101": 170.4, "resnet50": 97.7, "inception4": 162.9, "inception3": 91.0, "googlenet": 26.7,
    "bert-base": 438.0, "bert-large": 1340.0,
}
_MB = {model_key(k): v for k, v in MODEL_MB.items()}


def model_mb(model: str | None) -> float:
    return _MB.get(model_key(model), DEFAULT_MODEL_MB) if model else DEFAULT_MODEL_MB


def pause_seconds(model: str | None, gpus: int) -> float:
    return PAUSE_FIXED_S + model_mb(model) / CHECKPOINT_MB_PER_S


def resume_seconds(model: str | None, gpus: int) -> float:
    return RESUME_FIXED_S + model_mb(model) / CHECKPOINT_MB_PER_S + RESUME_PER_WORKER_S * gpus


def preemption_cost(model: str | None, gpus: int) -> float:
    """Seconds a preempted job loses: its pause plus its later resume."""
    return pause_seconds(model, gpus) + resume_seconds(model, gpus)


def placement_speed(skew: float, consolidated: bool) -> float:
    """Progress per second of a job placed as given (1.0 when consolidated)."""
    if consolidated:
        return 1.0
    return max(0.1, 1.0 - SPREAD_PENALTY * skew)
