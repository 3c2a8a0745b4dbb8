# Two entry points: `make demo` and `make test`. Both create .venv if needed.
# On a CPU-only machine torch==2.13.0 (the CPU build on local disk) is installed first, so the
# project's `torch>=2.4` requirement is met without downloading a CUDA build. A torch that is
# already importable in the venv (e.g. a user's CUDA build) is kept.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.meshplan-installed

.PHONY: demo test venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test,bench,export,notebooks,hf]"
	touch $(STAMP)

# The main job on a built-in example: plan MT-NLG 530B on 2,240 A100s, explain the best plan,
# export it for Megatron-LM, and show the estimator's per-stage report for the published plan.
demo: $(STAMP)
	mkdir -p build
	$(VENV)/bin/meshplan plan --model mt-nlg-530b --cluster dgx-a100-80gb --nodes 280 \
		--global-batch 1920 --framework megatron --top 5 -o build/demo-plan.json --force
	$(VENV)/bin/meshplan explain build/demo-plan.json --time-limit 20
	$(VENV)/bin/meshplan export build/demo-plan.json --to megatron
	$(VENV)/bin/meshplan estimate --model mt-nlg-530b --cluster dgx-a100-80gb --nodes 280 \
		--tp 8 --pp 35 --zero 1 --recompute full --micro-batch 1 --global-batch 1920 \
		--framework megatron

# Two workers (the CI machine has 2 cores; most planner tests use one), each test file on one
# worker (its module fixtures, e.g. a reference run, are made once).
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=40

clean:
	rm -rf $(VENV) build *.egg-info
