# Two commands: `make demo` runs the sidecar with simulated ranks; `make test` runs the linters
# (`make lint`: ruff and mypy), then the tests.
# `make bench` runs the benchmarks (`make bench BENCH_ARGS=--quick` for a short pass).
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo lint test bench serve venv clean upstream-wheel

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[cache,test,bench]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/hicache-exporter demo --tp 2 --pp 2 --dp 2

serve: $(STAMP)
	$(VENV)/bin/hicache-exporter serve

lint: $(STAMP)
	$(VENV)/bin/ruff check exporter cache_core bench tests
	$(VENV)/bin/mypy exporter cache_core

test: $(STAMP) lint
	$(PY) -m pytest

# The released SGLang wheel (39 MB, without its dependencies) whose collectors tests/integrations run,
# cached in .cache/sglang/. The tests fetch it themselves on first use, and fail (never skip) without it.
upstream-wheel: $(STAMP)
	$(PY) -m tests.upstream_sglang

# Every benchmark, one table of ratios against anchors measured in the same run (a few minutes on
# 2 cores); writes bench/results/latest.json and bench/results/scrape_vs_ranks.png.
bench: $(STAMP)
	$(PY) -m bench.run $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis .mypy_cache .ruff_cache
