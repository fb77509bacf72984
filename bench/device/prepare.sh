#!/bin/sh
# Run here, in the repository, before lending runs bench/device/migrate.sh on a device machine:
# gathers into .device/ (ignored by git, carried by the device tool) what that machine's image
# lacks and cannot fetch, since it reaches no package registry:
#   .device/whl/    pyzmq for its Python 3.12 (its image has msgpack, numpy, psutil, scipy ...)
#   .device/deb/    iproute2 (ip, tc) and the libraries they load, used only if it has no `tc`
#   .device/tensor_shapes.json   the models' tensor shapes (../shared does not travel)
# Then: run(command="bash bench/device/migrate.sh", carry=[".device"], timeout_s=590).
set -eu
cd "$(git rev-parse --show-toplevel)"
mkdir -p .device/whl .device/deb          # .gitignore keeps .device/ out of the repository
PYZMQ=${PYZMQ:-pyzmq==27.3.0}
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .device/whl "$PYZMQ"
(cd .device/deb && apt-get download -q iproute2 libbpf1 libbsd0 libcap2 libelf1 libmd0 libmnl0 libxtables12)
cp ../shared/data/models/tensor_shapes.json .device/tensor_shapes.json
du -sh .device
