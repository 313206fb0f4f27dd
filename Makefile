# Front door. `make demo` builds and runs the embedded model; `make test`
# builds and runs every test. Both install missing Debian packages first.
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=

.PHONY: all deps configure build demo test bench clean

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

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

bench: build
	bench/run.sh

clean:
	rm -rf $(BUILD)
