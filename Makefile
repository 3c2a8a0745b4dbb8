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

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test,bench]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/meshplan models
	$(VENV)/bin/meshplan estimate --model megatron-145.6b --cluster dgx-a100-80gb --nodes 192 \
		--tp 8 --pp 8 --sp --zero 1 --recompute selective --micro-batch 1 --global-batch 2304 \
		--framework megatron

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
