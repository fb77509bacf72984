# The README's commands. `make demo` and `make test` do all set-up themselves (idempotent, quick when done).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup demo test bench clean

setup: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first, pinned: the machine carries a CPU build of 2.13.0; an unpinned torch would pull CUDA wheels.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $@

demo: setup
	$(PY) -m autops.demo

test: setup
	$(PY) -m pytest -q -ra

bench: setup
	$(PY) bench/autops_pushpull.py --transport shm ipc tcp --json bench/results/autops_pushpull.json
	$(PY) bench/autops_pushpull.py --model flat64m resnet50 --workers 2 --transport shm ipc --mode server --json bench/results/autops_pushpull_server_adam.json
	$(PY) bench/tiresias_scale.py --json bench/results/tiresias_scale.json
	$(PY) bench/infiniswap_bench.py --size 2G --daemons 3 --json bench/results/infiniswap_bench.json
	$(VENV)/bin/tiresias compare --trace ../shared/data/traces/philly.csv --cluster 48x8 --original --no-progress \
	    --json bench/results/tiresias_philly_original.json --plot bench/results/tiresias_philly_cdf.png
	$(VENV)/bin/tiresias compare --trace ../shared/data/traces/philly.csv --cluster 48x8 --models cycle --no-progress \
	    --json bench/results/tiresias_philly_modelled.json

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
