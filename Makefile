# Two entry points that work on a fresh clone: `make demo` and `make test`.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
CORE    := $(VENV)/.installed-core
STAMP   := $(VENV)/.installed

.PHONY: demo test lint bench bench-spec bench-full golden clean

# what the demo needs: torch and v4parity's own dependencies (no C/C++ build, no apt)
$(CORE): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e .
	touch $(CORE)

# everything the tests need: the dev tools, the llamacpp / hf / ray extras (llama-cpp-python built from its
# sdist: a C/C++ toolchain and cmake) and Debian chromium for the HTML tests (apt, as root)
$(STAMP): $(CORE)
	CMAKE_ARGS="-DGGML_NATIVE=OFF" $(VPY) -m pip install -q --no-binary llama-cpp-python -e '.[dev,llamacpp,hf,ray]'
	command -v chromium >/dev/null || (apt-get update -q && apt-get install -y -q chromium) \
		|| echo "warning: Debian chromium not installed; the HTML tests fail in CI without it"
	touch $(STAMP)

demo: $(CORE)
	$(VENV)/bin/v4parity demo --out out/demo

test: $(STAMP)
	$(VENV)/bin/ruff check parity reference_cpu gpu_engine llamacpp_engine hf_engine tests
	$(VENV)/bin/lint-imports
	$(VPY) -m pytest -q -n 2 --dist loadfile

lint: $(STAMP)
	$(VENV)/bin/ruff check parity reference_cpu gpu_engine llamacpp_engine hf_engine tests
	$(VENV)/bin/lint-imports

bench: $(STAMP)
	$(VENV)/bin/v4parity bench --out out/bench

# spec's fitted-drafter acceptance grid (docs/spec.md): out/bench/spec_acceptance.json + .md
bench-spec: $(STAMP)
	OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 $(VPY) -m parity.bench.spec_acceptance --out out/bench

# both engines at full depth on the V4-Flash-shaped file (docs/bench.md "Full depth"; tens of minutes to hours on
# 2 cores; FLASH is synthesized when missing, 12.66 GiB): out/bench-full/full_depth.json + .md
FLASH   ?= .bench/flash.gguf
bench-full: $(STAMP)
	$(VPY) -m parity.bench.full_depth --model $(FLASH) --out out/bench-full

golden: $(STAMP)
	$(VENV)/bin/v4parity golden --out traces

clean:
	rm -rf $(VENV) out build *.egg-info
