#!/bin/bash
# On a lent machine with a GPU: AutoPS's CUDA checks -- the GPU tests, then the push+pull
# benchmark with CUDA tensors against gloo (docs/results.md, "CUDA tensors on a GPU").
#
# Prepare here first (bench/device/prepare.sh), then, with the migration runs after it:
#   run(command="DEADLINE_S=240 bash bench/device/gpu.sh; DEADLINE_S=330 bash bench/device/migrate.sh",
#       carry=[".device"], timeout_s=590)
# Writes to $OUT: gpu.txt (the device, torch), gpu_tests.log (pytest's output) and
# pushpull_gpu.json (one JSON line per configuration); each step runs only if the time left
# before DEADLINE_S (default 300 s) allows it.
#   MODELS (default "resnet50 vgg19 flat64m"), WORKERS (default "2 4").
set -u
cd "$(dirname "$0")/../.."
DEADLINE_S=${DEADLINE_S:-300}
. bench/device/env.sh

"$PY" - <<'PYEOF' 2>&1 | tee "$OUT/gpu.txt"
import torch
print("torch", torch.__version__, "cuda available:", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device:", torch.cuda.get_device_name(0))
PYEOF
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "no CUDA device: nothing to check here"
    exit 0
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$OUT/gpu.txt" 2>&1

echo "== the GPU tests"
set -o pipefail
bounded 30 "$PY" -m pytest -q -ra -p no:cacheprovider tests/gpu \
    tests/unit/test_torch_device.py tests/integration/test_torch_api.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 15

for model in ${MODELS:-resnet50 vgg19 flat64m}; do
    echo "== autops bench pushpull --device cuda --model $model"
    rm -f /tmp/dlrt-pushpull-$model.json
    bounded 60 "$PY" -m autops.cli bench pushpull --device cuda --model "$model" \
        --workers ${WORKERS:-2 4} --aggregators same --transport ipc --json /tmp/dlrt-pushpull-$model.json 2>&1 | tail -n 8
    cat /tmp/dlrt-pushpull-$model.json >> "$OUT/pushpull_gpu.json" 2>/dev/null
done
echo "done in ${SECONDS} s"
