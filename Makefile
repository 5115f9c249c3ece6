# mkernel - the make front of the original mKernel, driving the CMake build in build/.
#
#   make setup                                          install build dependencies (Debian 12)
#   make [BACKEND=socket|cx7|efa] [PYTHON=python3] all   configure (when needed) and build
#   make test | test-cpu | test-gpu                     build, then run ctest (test: + pytest)
#   make test-asan                                      the CPU suite under ASan + UBSan (build-asan)
#   make python                                         pip-install the Python package
#   make bench | check | plots                          bench/run.sh and bench/plot.py
#   make format | format-check | clean | distclean | help
#
# Variables (command line or environment): BACKEND (socket), CUDA_HOME (/usr/local/cuda),
# EFA_HOME (/opt/amazon/efa), PYTHON (.venv/bin/python3 if scripts/setup.sh made one, else python3),
# BUILD_DIR (build), BUILD_TYPE (Release), JOBS (all cores), CMAKE_ARGS (extra -D flags),
# CTEST_ARGS (extra ctest flags), KERNEL (all) and NODES (1) for bench/check.
# Changing BACKEND, CUDA_HOME, EFA_HOME, PYTHON, BUILD_TYPE or CMAKE_ARGS re-configures afresh.

BACKEND    ?= socket
CUDA_HOME  ?= /usr/local/cuda
EFA_HOME   ?= /opt/amazon/efa
PYTHON     ?= $(if $(wildcard .venv/bin/python3),.venv/bin/python3,python3)
BUILD_DIR  ?= build
BUILD_TYPE ?= Release
JOBS       ?= $(shell nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2)
CMAKE      ?= cmake
CTEST      ?= ctest
CMAKE_ARGS ?=
CTEST_ARGS ?=
KERNEL     ?= all
NODES      ?= 1
CLANG_FORMAT ?= clang-format

NVCC       := $(CUDA_HOME)/bin/nvcc
GENERATOR  := $(if $(shell command -v ninja 2>/dev/null),Ninja,Unix Makefiles)
# Absolute path of the interpreter; symlinks are kept, so a virtual environment stays itself.
PYTHON_EXE := $(shell command -v $(PYTHON) 2>/dev/null)
PYTHON_EXE := $(strip $(if $(filter /%,$(PYTHON_EXE)),$(PYTHON_EXE),\
                $(if $(PYTHON_EXE),$(abspath $(PYTHON_EXE)))))

FORMAT_DIRS := include src tests tools bench
FORMAT_EXTS := h hh hpp cuh c cc cpp cxx cu

# Everything that, when changed, needs a fresh configure. Kept in $(STAMP).
CONFIG := backend=$(BACKEND) cuda=$(CUDA_HOME) efa=$(EFA_HOME) python=$(PYTHON_EXE) \
          type=$(BUILD_TYPE) generator=$(GENERATOR) args=$(CMAKE_ARGS)
STAMP  := $(BUILD_DIR)/.mkernel-config
CACHE  := $(BUILD_DIR)/CMakeCache.txt

.DEFAULT_GOAL := all

# Installs what a fresh Debian 12 machine needs (scripts/setup.sh says what).
setup:
	bash scripts/setup.sh
.PHONY: setup all configure python test test-cpu test-gpu test-asan bench check plots format \
        format-check clean distclean help FORCE

all: $(CACHE)
	$(CMAKE) --build $(BUILD_DIR) -j $(JOBS)

configure: $(CACHE)

# Rewritten only when the configuration differs, so its time stamp marks the last change.
$(STAMP): FORCE
	@mkdir -p $(BUILD_DIR)
	@if [ "$$(cat $@ 2>/dev/null)" != "$(CONFIG)" ]; then echo "$(CONFIG)" > $@; fi

$(CACHE): $(STAMP)
	@if [ ! -x "$(NVCC)" ]; then \
	  echo "error: no nvcc at $(NVCC). Install the CUDA toolkit (12.4 or newer; 13.0 is tested)" \
	       "and pass CUDA_HOME=/path/to/cuda." >&2; exit 1; fi
	@echo "-- configuring $(BUILD_DIR): $(CONFIG)"
	$(CMAKE) --fresh -S . -B $(BUILD_DIR) -G "$(GENERATOR)" \
	  -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) \
	  -DMKERNEL_BACKEND=$(BACKEND) \
	  -DMKERNEL_EFA_HOME=$(EFA_HOME) \
	  -DCMAKE_CUDA_COMPILER=$(NVCC) \
	  -DCUDAToolkit_ROOT=$(CUDA_HOME) \
	  $(if $(PYTHON_EXE),-DPython3_EXECUTABLE=$(PYTHON_EXE)) \
	  $(CMAKE_ARGS) || { rm -f $@; exit 1; }

test: all python
	$(CTEST) --test-dir $(BUILD_DIR) --output-on-failure $(CTEST_ARGS)
	$(PYTHON) -m pytest -q -rs tests/python

# The Python package (import mkernel), built by scikit-build-core into the current interpreter.
python:
	CUDA_HOME=$(CUDA_HOME) $(PYTHON) -m pip install -q --no-build-isolation --no-deps .

test-cpu: all
	$(CTEST) --test-dir $(BUILD_DIR) --output-on-failure -LE gpu $(CTEST_ARGS)

test-gpu: all
	$(CTEST) --test-dir $(BUILD_DIR) --output-on-failure -L gpu $(CTEST_ARGS)

# The CPU suite built with AddressSanitizer and UndefinedBehaviorSanitizer (scripts/asan_cpu_tests.sh).
test-asan:
	CUDA_HOME=$(CUDA_HOME) JOBS=$(JOBS) bash scripts/asan_cpu_tests.sh

bench: all python
	@test -f bench/run.sh || { echo "error: bench/run.sh does not exist yet" >&2; exit 1; }
	bash bench/run.sh $(KERNEL) bench $(NODES)

check: all python
	@test -f bench/run.sh || { echo "error: bench/run.sh does not exist yet" >&2; exit 1; }
	bash bench/run.sh $(KERNEL) check $(NODES)

plots:
	@test -f bench/plot.py || { echo "error: bench/plot.py does not exist yet" >&2; exit 1; }
	$(PYTHON) bench/plot.py

# C++/CUDA sources under $(FORMAT_DIRS), NUL-separated (names may hold spaces).
# Generated files (tools/gen_*.py writes them; a ctest checks they are current) are left out.
FIND_SOURCES = find $(or $(wildcard $(FORMAT_DIRS)),/dev/null) -type f \
               \( $(foreach e,$(FORMAT_EXTS),-name '*.$(e)' -o) -false \) \
               ! -name 'wgmma_ops.cuh' -print0

format:
	@$(FIND_SOURCES) | xargs -0 -r $(CLANG_FORMAT) -i --style=file
	@echo "formatted: $$($(FIND_SOURCES) | tr -cd '\0' | wc -c) files"

format-check:
	@bad="$$($(FIND_SOURCES) | xargs -0 -r -n 1 sh -c \
	  '$(CLANG_FORMAT) --style=file --dry-run --Werror "$$0" >/dev/null 2>&1 || echo "$$0"')"; \
	if [ -n "$$bad" ]; then \
	  echo "format-check: these files need 'make format' (see: $(CLANG_FORMAT) --dry-run FILE):"; \
	  echo "$$bad" | sed 's/^/  /'; exit 1; \
	fi; echo "format-check: clean"

clean:
	rm -rf $(BUILD_DIR)

# Also every other build*/ tree, the packed GPU-machine dependencies and device-run results.
distclean: clean
	rm -rf $(wildcard build*/) .deps out

help:
	@sed -n '3,15s/^# \{0,1\}//p' $(firstword $(MAKEFILE_LIST))
	@echo
	@echo "now: BACKEND=$(BACKEND) CUDA_HOME=$(CUDA_HOME) EFA_HOME=$(EFA_HOME) PYTHON=$(PYTHON)" \
	      "BUILD_DIR=$(BUILD_DIR) JOBS=$(JOBS) generator=$(GENERATOR)"
