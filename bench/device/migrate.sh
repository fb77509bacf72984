#!/bin/bash
# On a lent device machine (16 cores, root, no package registry): the live-migration pause of a
# VGG19-shaped job, `sum` mode, across emulated hosts at 10 Gbit/s and on one host -- the goal
# this project's 2-core development machine measures only through its own CPU noise.
#
# Prepare here first (bench/device/prepare.sh), then one call of the device tool:
#   run(command="bash bench/device/migrate.sh", carry=[".device"], timeout_s=590)
# Writes to $OUT: machine.txt (what the machine is, the testbed probe's answer), hosts.json
# and onehost.json (one JSON line per run, as `autops bench migrate --json` writes them), and
# prints one line per run (median / longest pause, the goals). Every run is bounded so the whole
# call ends by DEADLINE_S (default 540 s) after it began.
#   RUNS_HOSTS (default 3) runs across hosts, --repeats REPEATS_HOSTS (4);
#   RUNS_ONE (default 1) runs on one host, --repeats REPEATS_ONE (12), no second job;
#   PYTHON (default python3).
set -u
start=$SECONDS
DEADLINE_S=${DEADLINE_S:-540}
OUT=${OUT:-/tmp/dlrt-device-out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# Python packages the image lacks (pyzmq), from .device/whl
if ! "$PY" -c 'import zmq' 2>/dev/null && [ -d .device/whl ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/dlrt-site \
        .device/whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/dlrt-site"
fi
# ip and tc, from .device/deb, when the image has none: unpacked aside, run through wrappers that
# alone see the unpacked libraries (so nothing else loads them)
if ! command -v tc >/dev/null 2>&1 && [ -d .device/deb ]; then
    root=/tmp/dlrt-iproute2
    mkdir -p "$root" /tmp/dlrt-bin
    for deb in .device/deb/*.deb; do dpkg -x "$deb" "$root"; done
    libs="$root/usr/lib/x86_64-linux-gnu:$root/lib/x86_64-linux-gnu"
    for tool in ip tc; do
        real=$(ls "$root"/sbin/$tool "$root"/bin/$tool "$root"/usr/sbin/$tool 2>/dev/null | head -n 1)
        [ -n "$real" ] && printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$libs" "$real" > /tmp/dlrt-bin/$tool
        chmod +x /tmp/dlrt-bin/$tool 2>/dev/null
    done
    export PATH="/tmp/dlrt-bin:$PATH"
fi
[ -f .device/tensor_shapes.json ] && export AUTOPS_TENSOR_SHAPES="${AUTOPS_TENSOR_SHAPES:-$PWD/.device/tensor_shapes.json}"

probe=$("$PY" -c 'from dlrt.testbed import available; print(available() or "ok")' 2>&1 | tail -n 1)
{
    echo "uname: $(uname -a)"
    echo "cpus: $(nproc)"
    free -g | sed -n 2p | awk '{print "memory_gib: " $2}'
    echo "python: $("$PY" -V 2>&1)"
    echo "zmq: $("$PY" -c 'import zmq; print(zmq.__version__)' 2>&1 | tail -n 1)"
    echo "tc: $(command -v tc || echo none)"
    echo "testbed: $probe"
} | tee "$OUT/machine.txt"

# one benchmark run, if the time left allows one of `need` seconds: migrate NEED FILE ARGS...
migrate() {
    local need=$1 file=$2; shift 2
    local left=$((DEADLINE_S - (SECONDS - start)))
    if [ "$left" -lt "$need" ]; then
        echo "skipped (${left} s left, a run needs ${need}): $*"
        return 0
    fi
    echo "== autops bench migrate $*"
    timeout -k 15 $((left - 10)) "$PY" -m autops.cli bench migrate --model vgg19 "$@" \
        --json "$file" --append 2>&1 | grep -v '^ *repeat ' | tail -n 12
}

if [ "$probe" = ok ]; then
    for _ in $(seq "${RUNS_HOSTS:-3}"); do
        migrate 150 "$OUT/hosts.json" --repeats "${REPEATS_HOSTS:-4}" --emulate-hosts --link 10gbit \
            --reserve 2G --reserve-shared 0.67
    done
    "$PY" -m dlrt.main testbed down --prefix apsm >/dev/null 2>&1
else
    echo "no emulated hosts here: $probe"
fi
for _ in $(seq "${RUNS_ONE:-1}"); do
    migrate 120 "$OUT/onehost.json" --repeats "${REPEATS_ONE:-12}" --other none
done

# one line per run: where, median / longest pause, the goals met, what a pause-free run meets here
for file in "$OUT/hosts.json" "$OUT/onehost.json"; do
    [ -s "$file" ] || continue
    "$PY" - "$file" <<'PYEOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"{r.get('site')}: median {r['median_pause_ms']:.1f} ms, longest {r['max_pause_ms']:.1f} ms, "
          f"per repeat {r.get('pause_ms_per_repeat')}, no-migration p90 {r.get('quiet_pause_ms_p90')}, "
          f"goals {r.get('targets_met')}, a pause-free run here {r.get('noise_only_targets_share')}")
PYEOF
done
echo "done in $((SECONDS - start)) s"
