# The two commands of the README: `make demo` (a real CSBP training run on 2 CPU ranks, then samples that show
# what it learned) and `make test`
# (the whole suite); `make test-quick` is the few-minute part for development (no `slow` tests).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: venv demo test test-quick data clean

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test,megatron-lm,hf,eval]"
	touch $@

venv: $(VENV)/.installed

data: venv
	$(PY) scripts/prepare_data.py

demo: venv
	$(PY) scripts/prepare_data.py --corpus sequences
	$(PY) -m megatron_csbp.torchrun --standalone --nproc-per-node 2 scripts/pretrain_bdlm.py --config configs/demo_sequences.yaml
	$(PY) scripts/generate_bdlm.py --load runs/demo_sequences --prompt "january february " --prompt "monday tuesday " \
		--prompt "mercury venus " --prompt "red orange " --max-new-tokens 40 --temperature 0

test: venv
	$(PY) -m pytest -q tests

test-quick: venv
	$(PY) -m pytest -q -m "not slow" tests

clean:
	rm -rf $(VENV) data runs
