# The two commands of the README: `make demo` (a real CSBP training run on 2 CPU ranks) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: venv demo test data clean

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

venv: $(VENV)/.installed

data: venv
	$(PY) scripts/prepare_data.py

demo: data
	$(PY) -m megatron_csbp.torchrun --standalone --nproc-per-node 2 scripts/pretrain_bdlm.py --config configs/tiny_cpu.yaml

test: venv
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) data runs
