# The two commands of the README:  make demo   and   make test
# Both create .venv and install what they need on first use (torch is pinned to the CPU build
# that pip finds on these machines; an unpinned torch would pull a CUDA build of several GB).
# TORCH_INDEX=URL takes torch alone from that index (https://download.pytorch.org/whl/cpu: its CPU build).
PY      ?= python3
VENV    := .venv
PYBIN   := $(VENV)/bin/python
STAMP   := $(VENV)/.fxrec-installed

.PHONY: demo test test-gpu bench bench-gpu bench-gpu-compile bench-gpu-host bench-transform clean

# Graphviz's `dot` (fxrec.viz, `fxrec draw`, transform(dump_dir=...)) is a system package: installed
# here when missing if we are root with apt-get (CI: a fresh Debian machine), else we say how.
$(STAMP): pyproject.toml Makefile
	@command -v dot >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Graphviz (Debian package graphviz) for fxrec.viz"; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q graphviz >/dev/null || \
	    { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q graphviz >/dev/null; } || \
	    echo "WARNING: apt-get install graphviz failed; the picture tests will be skipped"; \
	  else \
	    echo "NOTE: Graphviz's 'dot' is missing: install it with 'sudo apt-get install graphviz' (Debian/Ubuntu) or 'brew install graphviz' (macOS); until then fxrec cannot render pictures and their tests are skipped"; \
	  fi; }
	test -x $(PYBIN) || $(PY) -m venv $(VENV)
	$(PYBIN) -m pip install -q --disable-pip-version-check torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PYBIN) -m pip install -q --disable-pip-version-check -e '.[cpu,test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PYBIN) examples/dlrm_demo.py

test: $(STAMP)
	$(PYBIN) -m pytest -q tests

# The GPU suite (tests marked requires_cuda), on a machine with torch 2.11 + CUDA and fbgemm-gpu
# 1.6.0 already importable (pip install -e '.[cuda,test]'; on the GPU machines lent to the developers,
# their own notes, outside this repository, say how): no venv is made here. Fails, rather than skips, without a GPU.
# Only the files that hold such tests are collected (the others import packages, hypothesis among
# them, that a GPU machine may lack), on 4 workers where pytest-xdist is installed.
GPU_PY ?= python3
GPU_TESTS = $(shell grep -l "mark.requires_cuda" tests/*.py tests/*/*.py)
GPU_XDIST = $(shell $(GPU_PY) -c "import xdist" 2>/dev/null && echo "-n 4")
test-gpu:
	FXREC_REQUIRE_CUDA=1 $(GPU_PY) -m pytest -q $(GPU_XDIST) -m requires_cuda $(GPU_TESTS)

# The GPU benchmark (benchmarks/bench_gpu.py -> benchmarks/results/gpu.json) as the anchor figures
# were measured (10 alternating rounds, queued steps too; no torch.compile of the plain model, whose
# compile of 512 tables takes minutes: bench-gpu-compile adds it); bench-gpu-host: the host's time a
# call with each of fxrec's host-side changes off and on (benchmarks/bench_host.py ->
# benchmarks/results/gpu_host.json). Same interpreter as test-gpu; each fits one 10-minute command.
bench-gpu:
	$(GPU_PY) benchmarks/bench_gpu.py --no-compile --rounds 10 --queue 10

bench-gpu-compile:
	$(GPU_PY) benchmarks/bench_gpu.py --rounds 10 --queue 10 --out benchmarks/results/gpu_compile.json

bench-gpu-host:
	$(GPU_PY) benchmarks/bench_host.py --device cuda --out benchmarks/results/gpu_host.json

bench: $(STAMP)
	$(PYBIN) benchmarks/bench_lookups.py

# Transform time vs TorchRec, and peak memory of transform: benchmarks/results/cpu_transform.json.
# torchrec goes in with --no-deps (its requirement "fbgemm-gpu" would pull the CUDA build over
# fbgemm-gpu-cpu); the extra `bench` has the pure-Python packages it imports.
bench-transform: $(STAMP)
	$(PYBIN) -c "import tensordict, pyre_extensions, torchrec; assert torchrec.__version__ == '1.8.0'" 2>/dev/null || { \
	  $(PYBIN) -m pip install -q --disable-pip-version-check -e '.[cpu,bench]' && \
	  $(PYBIN) -m pip install -q --disable-pip-version-check --no-deps torchrec==1.8.0; }
	$(PYBIN) benchmarks/bench_transform.py

clean:
	rm -rf $(VENV) *.egg-info
