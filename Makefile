# Two commands: `make demo` runs the sidecar with simulated ranks; `make test` runs the tests.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test serve venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[cache,test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/hicache-exporter demo --tp 2 --pp 2 --dp 2

serve: $(STAMP)
	$(VENV)/bin/hicache-exporter serve

test: $(STAMP)
	$(PY) -m pytest

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
