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
cd "$(dirname "$0")/../.."
. bench/device/env.sh

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
    echo "== autops bench migrate $*"
    bounded "$need" "$PY" -m autops.cli bench migrate --model vgg19 "$@" \
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
echo "done in ${SECONDS} s"
