# Front door. `make demo` builds and runs the embedded model; `make test`
# builds and runs every test. Both install missing Debian packages first.
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=

# Sanitizer build (ASan + UBSan, no CUDA) and libFuzzer build (clang).
ASAN_BUILD ?= build-asan
FUZZ_BUILD ?= build-fuzz
SAN_FLAGS = -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
# Seconds per fuzz target for `make fuzz`; `make test` runs the fuzzers too
# only when FUZZ_SECONDS is set (e.g. `make test FUZZ_SECONDS=20`).
FUZZ_SECONDS ?=
FUZZ_TARGETS = safetensors config tokenizer_load tokenizer_encode chat_template manifest openai_request

.PHONY: all deps configure build demo test test-cpu test-asan fuzz fuzz-build bench clean

all: build

deps:
	@scripts/install-deps.sh

configure: deps
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS) >/dev/null

build: configure
	@cmake --build $(BUILD) -j $(JOBS)

DEMO_PROMPT = class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n

demo: build
	$(BUILD)/flashmoe run -m models/coder-mini -p "$$(printf '$(DEMO_PROMPT)')" -n 160 --temp 0.6 --repeat-penalty 1.1 --seed 7 --show-prompt

test: test-cpu test-asan $(if $(FUZZ_SECONDS),fuzz)

test-cpu: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

# The whole ctest suite under AddressSanitizer + UndefinedBehaviorSanitizer
# (leak checking on). FLASHMOE_SANITIZER=1 is set for tests that would be too
# slow under ASan to shorten themselves; none needs it today (slowest: 23 s).
test-asan: deps
	@cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFLASHMOE_CUDA=OFF \
	  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g" -DCMAKE_CXX_FLAGS="$(SAN_FLAGS)" \
	  -DCMAKE_EXE_LINKER_FLAGS="$(SAN_FLAGS)" -DCMAKE_DISABLE_FIND_PACKAGE_benchmark=ON >/dev/null
	@cmake --build $(ASAN_BUILD) -j $(JOBS)
	cd $(ASAN_BUILD) && FLASHMOE_SANITIZER=1 ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 ctest --output-on-failure -j $(JOBS)

fuzz-build:
	@scripts/install-deps.sh fuzz
	@cmake -S . -B $(FUZZ_BUILD) -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
	  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g" -DFLASHMOE_CUDA=OFF \
	  -DFLASHMOE_FUZZ=ON -DCMAKE_CXX_FLAGS="-fsanitize=fuzzer-no-link,address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined" \
	  -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" >/dev/null
	@cmake --build $(FUZZ_BUILD) -j $(JOBS) --target fuzz_all

# Each target runs FUZZ_SECONDS (default 20) from its seed corpus; new inputs
# go to $(FUZZ_BUILD)/corpus/<target>, crashes to $(FUZZ_BUILD)/crashes/.
fuzz: fuzz-build
	@fuzz/run.sh $(FUZZ_BUILD) $(or $(FUZZ_SECONDS),20) $(FUZZ_TARGETS)

bench: build
	bench/run.sh

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(FUZZ_BUILD)
