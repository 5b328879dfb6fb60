# One-command set-up: every target that needs Python depends on `setup`, which
# creates .venv and installs the pinned stack (see ../shared/DESIGN.md).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
STAMP := $(VENV)/.dist_gluon-setup
HOROVOD_BUILD_ENV := HOROVOD_WITH_MXNET=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
	HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
	MAKEFLAGS=-j2
PYTEST_ARGS ?=

.PHONY: setup system-packages test demo lint bench clean

# Debian packages behind the emulated-cluster tests (tools/emulated_cluster.py): sshd and
# the ssh client for the ssh launch path, ip and tc for namespaces and rate limits.
SYSTEM_PACKAGES := openssh-server openssh-client iproute2

setup: system-packages $(STAMP)

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
		echo "==> not root: skipping apt-get install of $$missing (multi-host tests will skip)"; \
	elif ! command -v apt-get >/dev/null; then \
		echo "==> no apt-get: install $$missing by hand (multi-host tests will skip)"; \
	else \
		echo "==> installing system packages with apt-get: $$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

$(STAMP): setup.py constraints.txt
	@test -x $(PY) || { echo "==> creating $(VENV)"; $(PYTHON) -m venv $(VENV); }
	@echo "==> installing mxnet, numpy, gluoncv and tools (pinned by constraints.txt)"
	$(PIP) install -q --upgrade pip wheel setuptools
	$(PIP) install -q -c constraints.txt numpy==1.23.5 mxnet==1.9.1
	$(PIP) install -q -c constraints.txt -e '.[examples,test]'
	@if $(PY) -c 'import horovod.mxnet' 2>/dev/null; then \
		echo "==> horovod.mxnet already importable"; \
	else \
		echo "==> building horovod 0.28.1 with MXNet and Gloo (about 10 minutes the first time;"; \
		echo "    pip's wheel cache makes later builds fast)"; \
		$(HOROVOD_BUILD_ENV) $(PIP) install -c constraints.txt --no-build-isolation \
			horovod==0.28.1 || exit 1; \
	fi
	$(PY) -c 'import mxnet, numpy, horovod.mxnet, gluoncv, dist_gluon; assert numpy.__version__ == "1.23.5", numpy.__version__'
	@touch $(STAMP)
	@echo "==> environment ready in $(VENV)"

test: setup
	$(PY) -m pytest -q tests $(PYTEST_ARGS)

# 2 workers train LeNet on the embedded digits (scikit-learn's, scaled to 28x28) and
# write the loss/accuracy curves to runs/mnist.png.
demo: setup
	OMP_NUM_THREADS=1 $(PY) -m dist_gluon.launch -n 2 --backend horovod -- \
		$(PY) examples/mnist/train_gluon.py --plot runs/mnist.png

lint: setup
	$(PY) -m ruff check dist_gluon tests examples benchmarks tools

bench: setup
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

# The pinned mxnet and numpy wheels (and their dependencies), which
# tests/test_packaging.py installs into a fresh environment without network.
WHEELHOUSE := $(VENV)/wheelhouse
setup: $(WHEELHOUSE)/.complete
$(WHEELHOUSE)/.complete: constraints.txt | $(STAMP)
	$(PIP) download -q -d $(WHEELHOUSE) -c constraints.txt mxnet==1.9.1 numpy==1.23.5
	@touch $@
