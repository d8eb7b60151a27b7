# The two commands of the README:  make demo   and   make test
# Both create .venv and install what they need on first use (torch is pinned to the CPU build
# that pip finds on these machines; an unpinned torch would pull a CUDA build of several GB).
PY      ?= python3
VENV    := .venv
PYBIN   := $(VENV)/bin/python
STAMP   := $(VENV)/.fxrec-installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PYBIN) || $(PY) -m venv $(VENV)
	$(PYBIN) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PYBIN) -m pip install -q --disable-pip-version-check -e '.[cpu,test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PYBIN) examples/dlrm_demo.py

test: $(STAMP)
	$(PYBIN) -m pytest -q tests

bench: $(STAMP)
	$(PYBIN) benchmarks/bench_lookups.py

clean:
	rm -rf $(VENV) *.egg-info
