# make demo: run the pipeline on a tiny local target.  make test: the test suite.
# Both create .venv on first use, with CPU torch pinned through constraints.txt.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test,bench]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m draftfeed demo

test: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) *.egg-info
