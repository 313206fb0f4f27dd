# Front door. `make demo` builds and runs the embedded model; `make test`
# builds and runs every test. Both install missing Debian packages first.
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=

# Sanitizer build (clang, ASan + UBSan, no CUDA): the whole test suite runs
# in it, and the same objects, also instrumented for libFuzzer, make the fuzz
# targets, so one build serves both.
ASAN_BUILD ?= build-asan
SAN_FLAGS = -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
COV_IGNORE = -fsanitize-coverage-ignorelist=$(CURDIR)/fuzz/coverage_ignore.txt
# Seconds per fuzz target: `make test` runs each for 5 s (a smoke run in CI),
# `make fuzz` for 60 s; FUZZ_SECONDS=N overrides both.
FUZZ_SECONDS ?=
FUZZ_TARGETS = safetensors gguf config tokenizer_load tokenizer_encode chat_template manifest openai_request json_schema

.PHONY: all deps configure build demo test test-cpu test-asan asan-build fuzz bench clean

all: build

deps:
	@scripts/install-deps.sh

# New build directories use Ninja (Debian's ninja-build): it starts a
# target's compiles without waiting for the libraries it links to be archived,
# which make's per-target order does not, so both cores stay busy through
# the layer chain. A directory configured before keeps its generator (CMake
# cannot change it in place).
GENERATOR = $(if $(wildcard $(1)/CMakeCache.txt),,-G Ninja)

configure: deps
	@cmake -S . -B $(BUILD) $(call GENERATOR,$(BUILD)) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS) >/dev/null

build: configure
	@cmake --build $(BUILD) -j $(JOBS)

DEMO_PROMPT = class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n

demo: build
	$(BUILD)/flashmoe run -m models/coder-mini -p "$$(printf '$(DEMO_PROMPT)')" -n 160 --temp 0.6 --repeat-penalty 1.1 --seed 7 --show-prompt

test: test-cpu test-asan

test-cpu: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

# The whole ctest suite under AddressSanitizer + UndefinedBehaviorSanitizer
# (leak checking on), then every fuzz target for a short run. FLASHMOE_SANITIZER=1
# is set for tests that would be too slow under ASan to shorten themselves.
asan-build:
	@scripts/install-deps.sh fuzz
	@cmake -S . -B $(ASAN_BUILD) $(call GENERATOR,$(ASAN_BUILD)) -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
	  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" -DFLASHMOE_CUDA=OFF \
	  -DFLASHMOE_FUZZ=ON -DCMAKE_CXX_FLAGS="$(SAN_FLAGS) -fsanitize=fuzzer-no-link $(COV_IGNORE)" \
	  -DCMAKE_EXE_LINKER_FLAGS="$(SAN_FLAGS)" -DCMAKE_DISABLE_FIND_PACKAGE_benchmark=ON \
	  -DFLASHMOE_TESTS_OPT=-O0 >/dev/null
	@cmake --build $(ASAN_BUILD) -j $(JOBS)

test-asan: asan-build
	cd $(ASAN_BUILD) && FLASHMOE_SANITIZER=1 ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 ctest --output-on-failure -j $(JOBS)
	@JOBS=$(JOBS) fuzz/run.sh $(ASAN_BUILD) $(or $(FUZZ_SECONDS),5) $(FUZZ_TARGETS)

# Each target runs FUZZ_SECONDS (default 60) from its seed corpus; new inputs
# go to $(ASAN_BUILD)/corpus/<target>, crashes to $(ASAN_BUILD)/crashes/.
fuzz: asan-build
	@JOBS=$(JOBS) fuzz/run.sh $(ASAN_BUILD) $(or $(FUZZ_SECONDS),60) $(FUZZ_TARGETS)

bench: build
	bench/run.sh

clean:
	rm -rf $(BUILD) $(ASAN_BUILD)
