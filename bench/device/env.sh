# Sourced by the bench/device scripts on a lent machine, from the repository's root: what the
# machine's image lacks, from .device/ (bench/device/prepare.sh), and where results go.
#   PY        the Python (PYTHON, default python3: the image's, with torch)
#   OUT       the folder whose files come back (the device tool sets it)
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/dlrt-device-out}
mkdir -p "$OUT"

# Python packages the image lacks (pyzmq), from .device/whl
if ! "$PY" -c 'import zmq' 2>/dev/null && [ -d .device/whl ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/dlrt-site \
        .device/whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/dlrt-site"
fi
# ip and tc, from .device/deb, when the image has none: unpacked aside, run through wrappers that
# alone see the unpacked libraries (so nothing else loads them)
if ! command -v tc >/dev/null 2>&1 && [ -d .device/deb ]; then
    _root=/tmp/dlrt-iproute2
    mkdir -p "$_root" /tmp/dlrt-bin
    for _deb in .device/deb/*.deb; do dpkg -x "$_deb" "$_root"; done
    for _tool in ip tc; do
        _real=$(ls "$_root"/sbin/$_tool "$_root"/bin/$_tool "$_root"/usr/sbin/$_tool 2>/dev/null | head -n 1)
        [ -n "$_real" ] || continue
        printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' \
            "$_root/usr/lib/x86_64-linux-gnu:$_root/lib/x86_64-linux-gnu" "$_real" > /tmp/dlrt-bin/$_tool
        chmod +x /tmp/dlrt-bin/$_tool
    done
    export PATH="/tmp/dlrt-bin:$PATH"
fi
if [ -f .device/tensor_shapes.json ]; then
    export AUTOPS_TENSOR_SHAPES="${AUTOPS_TENSOR_SHAPES:-$PWD/.device/tensor_shapes.json}"
fi

# seconds left before DEADLINE_S (counted from the sourcing script's start)
left() { echo $(( ${DEADLINE_S:-540} - SECONDS )); }

# bounded NEED CMD...: run CMD under a timeout that ends it 10 s before DEADLINE_S, or skip it
# (saying so) when fewer than NEED seconds are left
bounded() {
    local need=$1 remaining; shift
    remaining=$(left)
    if [ "$remaining" -lt "$need" ]; then
        echo "skipped (${remaining} s left, it needs ${need}): $*"
        return 0
    fi
    timeout -k 10 $((remaining - 10)) "$@"
}
