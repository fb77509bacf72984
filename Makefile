# The README's commands. `make demo` and `make test` do all set-up themselves (idempotent, quick when done).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup pyverbs bytecode demo demo-hosts test bench check-pinned clean

setup: $(STAMP) pyverbs bytecode

# The packages' bytecode, as a non-editable install would have it: every command starts without
# compiling the sources (PYTHONDONTWRITEBYTECODE=1 shells never cache it). Up-to-date files are skipped.
bytecode: | $(STAMP)
	@$(PY) -m compileall -q autops infiniswap tiresias dlrt dlrt_cluster dlrt_bench > /dev/null

$(PY):
	$(PYTHON) -m venv $(VENV)

# System packages: libfuse3 (+ pkg-config) to build the C core's FUSE front end, fuse3 (fusermount3),
# fio and stress-ng for the benchmarks and memory-pressure tests, chromium (headless) for the
# Tiresias dashboard test, libibverbs-dev and python3-pyverbs for the RDMA transport (docs/rdma.md),
# libssl-dev (libcrypto) for the data server's cluster-key handshake (csrc/infiniswap/isw_auth.c).
# Installed when missing and we are
# root with apt-get; otherwise skipped quietly (the C build then says that libfuse3-dev is missing).
SYSPKGS := fuse3 libfuse3-dev pkg-config fio stress-ng chromium libibverbs-dev python3-pyverbs libssl-dev

# torch first, pinned: the machine carries a CPU build of 2.13.0; an unpinned torch would pull CUDA wheels.
# The C core is built by `pip install -e`: a change to its sources re-runs this step.
$(STAMP): pyproject.toml infiniswap/_build_core.py $(wildcard csrc/infiniswap/*.c csrc/infiniswap/*.h) | $(PY)
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    missing=""; \
	    for p in $(SYSPKGS); do \
	        dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'install ok installed' || missing="$$missing $$p"; \
	    done; \
	    if [ -n "$$missing" ]; then \
	        echo "apt-get install$$missing"; \
	        (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing) \
	            || echo "warning: could not install$$missing"; \
	    fi; \
	fi
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $@

# AutoPS's rdma transport: Debian's pyverbs is built for Debian's python3.11; the venv's CPython 3.11
# shares its ABI, so that one package is linked into the venv (when the suffix matches and it imports).
PYVERBS := /usr/lib/python3/dist-packages/pyverbs
pyverbs: | $(STAMP)
	@site=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])'); \
	suffix=$$($(PY) -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))'); \
	if [ -e "$(PYVERBS)/device$$suffix" ]; then \
	    ln -sfn $(PYVERBS) "$$site/pyverbs"; \
	    $(PY) -c 'import pyverbs.device, pyverbs.qp, pyverbs.mr' \
	        || { rm -f "$$site/pyverbs"; echo "note: Debian's pyverbs does not load in $(PY): the rdma transport is unavailable"; }; \
	elif [ -d "$(PYVERBS)" ]; then \
	    echo "note: Debian's pyverbs is built for another Python than $(PY) ($$suffix): the rdma transport is unavailable"; \
	fi

demo: setup
	$(PY) examples/autops_demo.py
	$(PY) examples/tiresias_demo.py
	$(PY) examples/infiniswap_demo.py

# two AutoPS jobs whose workers and aggregators sit on different emulated hosts (root)
demo-hosts: setup
	$(PY) examples/autops_hosts_demo.py

test: setup
	$(PY) -m pytest -q -ra --durations=15

bench: setup
	$(PY) bench/autops_pushpull.py --transport shm ipc tcp --json bench/results/autops_pushpull.json
	$(PY) bench/autops_pushpull.py --model flat64m resnet50 --workers 2 --transport shm ipc --mode server --json bench/results/autops_pushpull_server_adam.json
	$(PY) bench/autops_pushpull.py --model flat64m resnet50 --workers 2 --transport cma ipc shm --json bench/results/autops_pushpull_cma.json
	$(PY) bench/autops_pushpull.py --emulate-hosts --workers 2 4 --aggregators same --model flat64m resnet50 vgg19 --link 1gbit 10gbit --iters 4 --rounds 2 --json bench/results/autops_pushpull_hosts.json
	$(PY) bench/autops_packing.py --jobs 4 --model vgg19 --rounds 3 --json bench/results/autops_packing.json
	$(PY) bench/autops_packing.py --jobs 4 --model bert-base resnet50 alexnet --json bench/results/autops_packing.json --append
	$(PY) bench/autops_packing.py --jobs 2 3 --model vgg19 --json bench/results/autops_packing.json --append
	$(PY) bench/autops_migrate.py --model vgg19 bert-base --repeats 3 --json bench/results/autops_migrate.json
	$(PY) bench/autops_migrate.py --model vgg19 --mode server --repeats 3 --json bench/results/autops_migrate.json --append
	$(PY) bench/autops_migrate.py --model vgg19 --mode sum server --repeats 3 --emulate-hosts --link 10gbit --json bench/results/autops_migrate_hosts.json
	$(PY) bench/autops_pushpull.py --workers 2 --model flat64m resnet50 --transport tcp shm --curve off on --json bench/results/autops_pushpull_curve.json
	$(PY) bench/autops_pushpull.py --emulate-hosts --workers 2 --aggregators same --model flat64m resnet50 --link 1gbit 10gbit --curve off on --json bench/results/autops_pushpull_curve_hosts.json
	$(PY) bench/autops_failover.py --repeats 4 --json bench/results/autops_failover.json
	$(PY) bench/autops_torch_step.py --model mlp many-small --json bench/results/autops_torch_step.json
	$(PY) bench/autops_tail_loss.py --trials 9 --json bench/results/autops_tail_loss.json
	$(PY) bench/infiniswap_tail_loss.py --trials 9 --json bench/results/infiniswap_tail_loss.json
	$(PY) -m autops.simulate --trace ../shared/data/traces/philly.csv --json bench/results/autops_simulate.json --plot bench/results/autops_simulate.png
	$(PY) bench/tiresias_scale.py --json bench/results/tiresias_scale.json
	$(PY) bench/tiresias_queues.py --json bench/results/tiresias_queues.json
	$(PY) bench/tiresias_live.py --json bench/results/tiresias_live.json
	$(PY) bench/optimus_models.py --json bench/results/optimus_models.json
	$(PY) bench/optimus_scale.py --json bench/results/optimus_scale.json
	$(PY) bench/optimus_workloads.py --json bench/results/optimus_workloads.json
	$(PY) bench/optimus_own.py --json bench/results/optimus_own.json
	$(PY) bench/optimus_sensitivity.py --json bench/results/optimus_sensitivity.json
	$(PY) bench/autops_paa.py --json bench/results/autops_paa.json
	$(PY) bench/infiniswap_bench.py --size 2G --num-daemons 3 --json bench/results/infiniswap_bench.json
	$(PY) bench/infiniswap_fio.py --json bench/results/infiniswap_fio.json
	$(PY) bench/infiniswap_bench.py --emulate-hosts --link 10gbit --json bench/results/infiniswap_bench_hosts.json
	$(PY) bench/infiniswap_fio.py --emulate-hosts --link 10gbit --json bench/results/infiniswap_fio_hosts.json
	$(PY) bench/infiniswap_apps.py --json bench/results/infiniswap_apps.json
	$(VENV)/bin/tiresias compare --trace ../shared/data/traces/philly.csv --cluster 48x8 --original --no-progress \
	    --json bench/results/tiresias_philly_original.json --plot bench/results/tiresias_philly_cdf.png
	$(VENV)/bin/tiresias compare --trace ../shared/data/traces/philly.csv --cluster 48x8 --models cycle --no-progress \
	    --json bench/results/tiresias_philly_modelled.json

# Every simulator figure bench/results pins, replayed by the command that wrote it (minutes;
# make test replays the quick ones): counts exact, floats within 1e-9.
check-pinned: setup
	$(PY) bench/tiresias_pinned.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis

# The C core under the sanitizers (csrc/README.md): csrc/tests/isw_stress.c drives the device core from
# several threads through its C API (I/O, map/evict, remotes over shm and TCP, close) and checks every
# page it reads back.  Built from the same C files as the cffi module, once with ASan+UBSan and once with
# TSan, and both are run: a sanitizer report or a data mismatch fails the target.  No Python involved.
.PHONY: sanitize
SAN_DIR    := build/sanitize
SAN_SRCS    = csrc/tests/isw_stress.c $(wildcard csrc/infiniswap/*.c)
SAN_DEPS    = $(SAN_SRCS) $(wildcard csrc/infiniswap/*.h)
SAN_CFLAGS  = -std=c11 -D_GNU_SOURCE -pthread -Wall -Wextra -O1 -g -fno-omit-frame-pointer \
              -Icsrc/infiniswap $(shell pkg-config --cflags fuse3)
SAN_LIBS    = -pthread $(shell pkg-config --libs fuse3) -lcrypto

sanitize: setup $(SAN_DIR)/isw_stress_asan $(SAN_DIR)/isw_stress_tsan
	$(SAN_DIR)/isw_stress_asan
	$(SAN_DIR)/isw_stress_tsan

$(SAN_DIR)/isw_stress_asan: $(SAN_DEPS)
	@mkdir -p $(SAN_DIR)
	$(CC) $(SAN_CFLAGS) -fsanitize=address,undefined -fno-sanitize-recover=all -o $@ $(SAN_SRCS) $(SAN_LIBS)

$(SAN_DIR)/isw_stress_tsan: $(SAN_DEPS)
	@mkdir -p $(SAN_DIR)
	$(CC) $(SAN_CFLAGS) -fsanitize=thread -o $@ $(SAN_SRCS) $(SAN_LIBS)
