# The commands of the README: `make demo`, `make demo-multinode`, `make demo-recovery`, `make test`. All install first.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

.PHONY: demo demo-multinode demo-recovery test soak install system-deps lint clean

# Python environment: torch first, pinned (an unpinned torch pulls GBs of CUDA wheels), then opskit with all extras.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[all,test]'
	touch $@

# olah (a Hub mirror for the remote-tail tests) in its own venv: its pins clash with opskit's (psutil).
.venv-olah/.installed:
	$(PYTHON) -m venv .venv-olah
	.venv-olah/bin/python -m pip install -q olah
	touch $@

install: $(VENV)/.installed .venv-olah/.installed

# Debian packages (SLURM, munge, the KJV corpus, shellcheck); says so in one line where there is no root or apt.
system-deps:
	@scripts/system-deps.sh

demo: install system-deps
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" scripts/demo.sh

# A 3-node SLURM on this machine (root): a 2-node chain, a crash on node2, the next task excluding it.
demo-multinode: install system-deps
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" scripts/demo-multinode.sh

demo-recovery: install system-deps
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" scripts/demo-recovery.sh

# Two workers (pytest-xdist): the SLURM tests wait on the clock and on daemons while the other worker trains; each
# module, and each cluster's tests, stay on one worker (tests/conftest.py). The 20 slowest tests are printed.
test: install system-deps
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -q -n 2 --dist loadgroup --durations=20

# The long loops at full size (OPSKIT_SOAK=1): 30 SIGKILLs inside saves, synchronous and in the background, and every
# preset rehearsed end to end. Run it before resolving a change to opskit/train/, opskit/ckpt/ or the resume path;
# its figures go to docs/reliability.md.
soak: install system-deps
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" OPSKIT_SOAK=1 $(PY) -m pytest -q -s --timeout=3600 \
		tests/test_reliability.py tests/test_rehearse.py

lint: install
	$(PY) -m pip install -q ruff
	$(VENV)/bin/ruff check opskit tests
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) .venv-olah runs data .pytest_cache
