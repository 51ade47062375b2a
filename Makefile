# tensormem: `make demo` runs the main job, `make test` builds and runs every test.
# Each target installs missing Debian packages first (scripts/install-deps.sh).
JOBS ?= $(shell nproc)

.PHONY: all deps build demo test test-release test-asan bench clean

all: build

deps:
	@bash scripts/install-deps.sh

build: deps
	cmake --preset release
	cmake --build --preset release -j $(JOBS)

demo: build
	./build/bin/tensormem demo

test-release: deps
	cmake --preset release
	cmake --build --preset release -j $(JOBS)
	ctest --preset release -j $(JOBS)

test-asan: deps
	cmake --preset asan
	cmake --build --preset asan -j $(JOBS)
	ctest --preset asan -j $(JOBS)

test: test-release test-asan

bench: deps
	cmake --preset release
	cmake --build --preset release -j $(JOBS) --target benchmarks

clean:
	rm -rf build build-debug build-asan
