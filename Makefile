# One-command set-up: every target that needs Python depends on `setup`, which
# creates .venv and installs the pinned stack (see ../shared/DESIGN.md).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
STAMP := $(VENV)/.dist_gluon-setup
# Horovod is built with Gloo always and with MPI when `mpicc` is found (Debian's OpenMPI,
# installed by system-packages as root); HOROVOD_WITH/WITHOUT_MPI is added at build time.
HOROVOD_BUILD_ENV := HOROVOD_WITH_MXNET=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
	HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITH_GLOO=1 MAKEFLAGS=-j2
# Built wheels, one directory per flavour: pip's own wheel cache ignores the build
# variables, so it would hand a Gloo-only wheel to an MPI build (and back).
HOROVOD_WHEELS ?= $(HOME)/.cache/dist_gluon/horovod-0.28.1
PYTEST_ARGS ?=
# make test and make test-fast run this many pytest processes side by side (pytest-xdist;
# each test file runs whole in one of them: tests/conftest.py). 1 runs them in order.
# Three on 2 cores: the jobs wait (silence limits, stall reports, rate-limited links), and
# two processes kept the cores 171% busy, three 188% (make test 12:45 -> 11:22 here).
TEST_PROCESSES ?= 3
PYTEST_PARALLEL = $(if $(filter-out 1,$(TEST_PROCESSES)),-n $(TEST_PROCESSES) --dist loadgroup)

.PHONY: setup kernels gpu-check system-packages horovod test test-matrix test-stalls test-fast coverage demo lm-demo lint bench bench-cluster clean

# Debian packages behind the emulated-cluster tests (tools/emulated_cluster.py): sshd and
# the ssh client for the ssh launch path, ip and tc for namespaces and rate limits.
SYSTEM_PACKAGES := openssh-server openssh-client iproute2
# OpenMPI for horovod over MPI (--transport mpi, jobs started by mpirun), unless an MPI
# is already installed (a cluster's own, found through `mpicc`).
ifeq ($(shell command -v mpicc),)
SYSTEM_PACKAGES += openmpi-bin libopenmpi-dev
endif

setup: system-packages $(STAMP) horovod

# Installs the SYSTEM_PACKAGES that dpkg does not list as installed, with apt-get, when
# running as root; otherwise says so and goes on (those tests then skip with the reason).
# Does nothing, quickly, once they are all installed.
system-packages:
	@missing=$$(for p in $(SYSTEM_PACKAGES); do \
		dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q 'ok installed' || echo $$p; \
	done); \
	if [ -z "$$missing" ]; then exit 0; fi; \
	missing=$$(echo $$missing); \
	if [ "$$(id -u)" != 0 ]; then \
		echo "==> not root: skipping apt-get install of $$missing (multi-host tests will skip;"; \
		echo "    without OpenMPI horovod is built with Gloo only: see the horovod target)"; \
	elif ! command -v apt-get >/dev/null; then \
		echo "==> no apt-get: install $$missing by hand (multi-host tests will skip;"; \
		echo "    without OpenMPI horovod is built with Gloo only: see the horovod target)"; \
	else \
		echo "==> installing system packages with apt-get: $$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

$(STAMP): setup.py constraints.txt | system-packages
	@test -x $(PY) || { echo "==> creating $(VENV)"; $(PYTHON) -m venv $(VENV); }
	@echo "==> installing mxnet, numpy, gluoncv and tools (pinned by constraints.txt)"
	$(PIP) install -q --upgrade pip wheel setuptools
	$(PIP) install -q -c constraints.txt numpy==1.23.5 mxnet==1.9.1
	$(PIP) install -q -c constraints.txt -e '.[examples,test]'
	$(PY) -c 'import mxnet, numpy, gluoncv, dist_gluon; assert numpy.__version__ == "1.23.5", numpy.__version__'
	@touch $(STAMP)

# The fused kernels (dist_gluon/_kernels.cc: 2-bit, onebit, PowerSGD, fp16, ps-lite's
# exact float64 sum), compiled once per machine with the system g++ into ~/.cache/dist_gluon;
# without a compiler those run on MXNet's stock operators (same results, slower) and
# this says so.
setup: kernels
kernels: $(STAMP)
	@$(PY) -c 'from dist_gluon import _kernels as k; print("==> fused kernels:", k.build())' || \
		echo "==> the fused kernels could not be built: the codecs and ps-lite's float64 sum use MXNet's operators"

# horovod 0.28.1 with MXNet, Gloo and, when `mpicc` is found, MPI, built from its PyPI
# source by dist_gluon/build_horovod.py, which fixes Gloo's float16 sum (wrong for some pairs
# and scalar in the release: benchmarks/FINDINGS.md 9m) and labels the wheel
# 0.28.1+$(HOROVOD_LABEL). Quick when the installed build already is that build with what
# it can have (hvd.mpi_built()); an environment built with Gloo only is rebuilt once after
# OpenMPI appears. A build takes about 2 minutes; the wheel is kept in
# $(HOROVOD_WHEELS)-<flavour>-$(HOROVOD_LABEL) for the next fresh environment.
# Without root, add MPI with `sudo apt-get install openmpi-bin libopenmpi-dev` (or put
# your cluster's mpicc on PATH) and run `make setup` again.
HOROVOD_LABEL := $(shell sed -n 's/^LABEL = "\(.*\)"$$/\1/p' dist_gluon/build_horovod.py)
horovod: $(STAMP)
	@if command -v mpicc >/dev/null; then want=1; flavour=mpi-gloo; mpi=HOROVOD_WITH_MPI=1; \
	else want=0; flavour=gloo; mpi=HOROVOD_WITHOUT_MPI=1; fi; \
	have=$$($(PY) -c 'import importlib.metadata as m, horovod.mxnet as h; assert m.version("horovod").endswith("+$(HOROVOD_LABEL)"); print(int(h.mpi_built()))' 2>/dev/null); \
	if [ -n "$$have" ] && [ "$$have" -ge "$$want" ]; then \
		[ "$$have" = 1 ] && exit 0; \
		echo "==> horovod built with Gloo only (no mpicc). To add MPI: apt-get install"; \
		echo "    openmpi-bin libopenmpi-dev (make setup does it as root), then make setup"; \
		exit 0; \
	fi; \
	wheels=$(HOROVOD_WHEELS)-$$flavour-$(HOROVOD_LABEL); \
	if ! ls $$wheels/horovod-0.28.1+$(HOROVOD_LABEL)-*.whl >/dev/null 2>&1; then \
		echo "==> building horovod 0.28.1 with MXNet, $$flavour and Gloo's float16 sum fixed (about 2 minutes)"; \
		env $(HOROVOD_BUILD_ENV) $$mpi $(PY) -m dist_gluon.build_horovod $$wheels || exit 1; \
	fi; \
	echo "==> installing horovod ($$flavour) from $$wheels"; \
	$(PIP) uninstall -q -y horovod 2>/dev/null; \
	$(PIP) install -q -c constraints.txt $$wheels/horovod-0.28.1+$(HOROVOD_LABEL)-*.whl || exit 1; \
	$(PY) -c "import horovod.mxnet as h; assert h.gloo_built() and h.mpi_built() >= $$want" \
		|| { echo "==> the horovod build lacks Gloo or MPI"; exit 1; }; \
	echo "==> environment ready in $(VENV) (horovod: $$flavour, $(HOROVOD_LABEL))"

# As root the machine makes emulated hosts (network namespaces: tools/emulated_cluster.py),
# so the suites that need them must run, not skip (tests/conftest.py turns such a skip
# into a failure); DG_REQUIRE_EMULATED_HOSTS=0 where namespaces are not allowed.
REQUIRE_HOSTS = $(or $(DG_REQUIRE_EMULATED_HOSTS),$(if $(filter 0,$(shell id -u)),1,0))

test: setup
	DG_REQUIRE_EMULATED_HOSTS=$(REQUIRE_HOSTS) \
		$(PY) -m pytest -q $(PYTEST_PARALLEL) --durations=20 tests $(PYTEST_ARGS)

# The combination matrix with every triple of features (tests/matrix_plan.py); make test
# runs every pair.
test-matrix: setup
	DG_MATRIX_STRENGTH=3 $(PY) -m pytest -q tests/test_matrix.py $(PYTEST_ARGS)

# Every mismatch of tests/test_stall_rounds.py on every backend (make test runs a subset).
test-stalls: setup
	DG_STALL_KINDS=all $(PY) -m pytest -q tests/test_stall_rounds.py $(PYTEST_ARGS)

# The edit-run loop: the tests that start no MXNet process of their own and those that
# read their module's shared horovod job (no other backends, no test that launches a job
# or a training process of its own, no emulated hosts, examples or packaging;
# tests/conftest.py says which).
test-fast: setup
	$(PY) -m pytest -q $(PYTEST_PARALLEL) -m "not slow" tests $(PYTEST_ARGS)

# Line coverage of dist_gluon over the whole suite (PYTEST_ARGS narrows it), counting the
# code run in every process the tests start: a .pth file in the environment starts
# coverage in each new Python process while COVERAGE_PROCESS_START is set (and is removed
# afterwards; the launcher passes it to other hosts and to mpirun's ranks); the processes'
# data files, the pytest processes' included, are combined into one report. Target: 90%.
COVERAGE_PTH = $(shell $(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
	2>/dev/null)/dist_gluon_coverage.pth
coverage: setup
	rm -f .coverage .coverage.*
	echo 'import os; os.environ.get("COVERAGE_PROCESS_START") and __import__("coverage").process_startup()' \
		> $(COVERAGE_PTH)
	COVERAGE_PROCESS_START=$(CURDIR)/pyproject.toml COVERAGE_FILE=$(CURDIR)/.coverage \
		$(PY) -m pytest -q $(PYTEST_PARALLEL) tests $(PYTEST_ARGS); status=$$?; \
	rm -f $(COVERAGE_PTH); \
	$(PY) -m coverage combine -q --rcfile=pyproject.toml && \
	$(PY) -m coverage report --rcfile=pyproject.toml; \
	echo "==> target: 90% of dist_gluon's lines (pytest exit status $$status)"; exit $$status

# 2 workers train LeNet on the embedded digits (scikit-learn's, scaled to 28x28) and
# write the loss/accuracy curves to runs/mnist.png.
demo: setup
	OMP_NUM_THREADS=1 $(PY) -m dist_gluon.launch -n 2 --backend horovod -- \
		$(PY) examples/mnist/train_gluon.py --plot runs/mnist.png

# 2 workers train a word-level LSTM language model with row_sparse embedding gradients
# (a 13,371-word vocabulary) on the English text that ships with Python: a small model
# on the first quarter of every training document for 3 epochs; perplexity per epoch,
# curves in runs/lm.png.
lm-demo: setup
	OMP_NUM_THREADS=1 $(PY) -m dist_gluon.launch -n 2 --backend horovod -- \
		$(PY) examples/language_model/train_lm.py --train-fraction 0.25 --emsize 64 \
		--nhid 64 --batch-size 5 --epochs 3 --plot runs/lm.png

lint: setup
	$(PY) -m ruff check dist_gluon tests examples benchmarks tools

bench: setup
	$(PY) benchmarks/run.py

# Collectives and ResNet-50/VGG-16 training on 2 and 4 emulated hosts (network namespaces,
# rate-limited links) against the link bound and the peers: one report per part,
# benchmarks/RESULTS-cluster-<part>.md, so that rerunning one part (--only lm) keeps the
# others' figures.
# Needs root; about 25 minutes.
bench-cluster: setup
	$(PY) benchmarks/run_cluster.py

# dist_gluon on this machine's GPUs with a CUDA build of MXNet in .venv-gpu (MNIST, a
# ResNet-50 step with 2-bit and SyncBatchNorm on dist_sync and p3, one process on every
# GPU); says so and exits 0 where there is no GPU. See tools/gpu_check.py.
gpu-check:
	$(PYTHON) tools/gpu_check.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

# The pinned mxnet and numpy wheels (and their dependencies), which
# tests/test_packaging.py installs into a fresh environment without network.
WHEELHOUSE := $(VENV)/wheelhouse
setup: $(WHEELHOUSE)/.complete
$(WHEELHOUSE)/.complete: constraints.txt | $(STAMP)
	$(PIP) download -q -d $(WHEELHOUSE) -c constraints.txt mxnet==1.9.1 numpy==1.23.5
	@touch $@
