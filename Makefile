# Two commands: `make demo` runs the sidecar with simulated ranks; `make test` runs the linters
# (`make lint`: ruff, mypy and the import contracts), then the tests (it first installs or names promtool, Prometheus, Chromium, podman, buildah and mmdebstrap).
# The tests run in 3 processes, a test file to a process (pytest-xdist, PYTEST_ARGS): 253-271 s for 1,959 tests on
# 2 cores, a fresh clone (688 s in one process before their waits were shortened); `make test PYTEST_ARGS=` runs them in one.
# `make bench` runs the benchmarks (`make bench BENCH_ARGS=--quick` for a short pass).
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
# Three workers, not two: many tests wait on processes, sockets and Prometheus rather than compute
# (on 2 cores: 265 s with -n 2, 217 s with -n 3, 213 s with -n 4, which costs more CPU time). A whole
# file goes to one worker, so a module's fixtures (the image build, the benchmark smoke run) run once.
PYTEST_ARGS ?= -n 3 --dist loadfile

.PHONY: demo lint test bench serve venv clean upstream-wheel prometheus-tools chromium image-tools screenshot

venv: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# Everything: the cache, test and bench extras (the full install includes what the demo needs).
$(STAMP): pyproject.toml | $(PY)
	@echo "installing hicache-exporter with its cache, test and bench extras into $(VENV)/"
	$(PY) -m pip install --quiet -e '.[cache,test,bench]'
	touch $(STAMP) $(DEMO_STAMP)

# The demo needs only the `cache` extra (torch, CPU build, and numpy): not the test or bench tools.
$(DEMO_STAMP): pyproject.toml | $(PY)
	@echo "make demo: installing hicache-exporter with its cache extra (torch==2.13.0 CPU build, numpy) into $(VENV)/"
	$(PY) -m pip install --quiet -e '.[cache]'
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(VENV)/bin/hicache-exporter demo --tp 2 --pp 2 --dp 2

# promtool and the Prometheus server: installed (Debian package, as root) or named, before anything else.
prometheus-tools:
	@$(SHELL) .ci/prometheus-tools

# Chromium, for the status page's browser test: installed (Debian package, as root) or named, the same way.
chromium:
	@$(SHELL) .ci/chromium

# podman, buildah and mmdebstrap, for the image test (tests/deploy/test_image.py): the same way.
image-tools:
	@$(SHELL) .ci/image-tools

# `make test` checks them when the Makefile is read (not under -n), so that a missing tool stops
# it at once with one line, before any install or lint.
ifneq ($(filter test,$(MAKECMDGOALS)),)
ifeq ($(findstring n,$(firstword -$(MAKEFLAGS))),)
PROMETHEUS_TOOLS_MISSING := $(shell $(SHELL) .ci/prometheus-tools --make)
ifneq ($(PROMETHEUS_TOOLS_MISSING),)
$(error $(PROMETHEUS_TOOLS_MISSING))
endif
CHROMIUM_MISSING := $(shell $(SHELL) .ci/chromium --make)
ifneq ($(CHROMIUM_MISSING),)
$(error $(CHROMIUM_MISSING))
endif
IMAGE_TOOLS_MISSING := $(shell $(SHELL) .ci/image-tools --make)
ifneq ($(IMAGE_TOOLS_MISSING),)
$(error $(IMAGE_TOOLS_MISSING))
endif
endif
endif

serve: $(STAMP)
	$(VENV)/bin/hicache-exporter serve

lint: $(STAMP)
	$(VENV)/bin/ruff check exporter cache_core bench tests config
	$(VENV)/bin/mypy exporter cache_core
	$(VENV)/bin/lint-imports

test: prometheus-tools chromium image-tools $(STAMP) lint
	$(PY) -m pytest $(PYTEST_ARGS)

# The README's screenshot of the status page (docs/status_page.png, 1280 px wide): the browser test of
# the demo's server (tp 2 x pp 2 x dp 2, 20 streams) takes it in headless Chromium.
screenshot: chromium $(STAMP)
	HICACHE_SCREENSHOT=docs/status_page.png $(PY) -m pytest -q \
		tests/e2e/test_status_page_browser.py::test_the_demo_server_is_8_rank_cells_each_listing_its_streams

# The released SGLang and LMCache wheels (39 MB and 18 MB, without their dependencies) whose metrics code
# tests/integrations run, cached in .cache/sglang/ and .cache/lmcache/. The tests fetch them themselves on
# first use, and fail (never skip) without them.
upstream-wheel: $(STAMP)
	$(PY) -m tests.upstream_sglang
	$(PY) -m tests.upstream_lmcache

# Every benchmark, one table of ratios against anchors measured in the same run (a few minutes on
# 2 cores); writes bench/results/latest.json and bench/results/scrape_vs_ranks.png.
bench: $(STAMP)
	$(PY) -m bench.run $(BENCH_ARGS)

# The rules, PrometheusRule, dashboard and Kubernetes examples for the default namespace, and README's
# proxy pod, from config/generator/ (`config/generate.py --check` is what the tests run), the
# status API's schema from its model (exporter/api/v1.py; tests/exporter/api checks it), and the
# packaged profiles pre-built for the rank client from their YAML (tests/exporter/test_catalog_prebuilt.py).
.PHONY: generate
generate: $(STAMP)
	$(PY) config/generate.py
	$(PY) -m exporter.api.v1 --write-schema docs/api/v1.schema.json
	$(PY) -m exporter.catalog

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis .mypy_cache .ruff_cache
