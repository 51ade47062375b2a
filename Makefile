# tensormem: `make demo` runs the main job, `make test` builds and runs every test.
# Each target installs missing Debian packages first (scripts/install-deps.sh).
JOBS ?= $(shell nproc)

.PHONY: all deps build demo test test-release test-asan test-tsan fuzz bench coverage clean

all: build

deps:
	@bash scripts/install-deps.sh

build: deps
	cmake --preset release
	cmake --build --preset release -j $(JOBS)

# The demo builds only the command-line tool (the tests, benchmarks and Python module are
# built by `make build` and `make test`).
demo: deps
	cmake --preset release
	cmake --build --preset release -j $(JOBS) --target tensormem_cli
	./build/bin/tensormem demo

test-release: deps
	cmake --preset release
	cmake --build --preset release -j $(JOBS)
	ctest --preset release -j $(JOBS)

test-asan: deps
	cmake --preset asan
	cmake --build --preset asan -j $(JOBS)
	ctest --preset asan -j $(JOBS)

test-tsan: deps
	cmake --preset tsan
	cmake --build --preset tsan -j $(JOBS)
	ctest --preset tsan -j $(JOBS)

# libFuzzer targets (clang): the trace reader, the planner against a brute-force optimum,
# the arena script parser and the online allocators, 60 s each.
fuzz: deps
	cmake -S . -B build-fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DTENSORMEM_FUZZ=ON -DTENSORMEM_PYTHON=OFF -DTENSORMEM_CUDA=OFF -DTENSORMEM_BUILD_TESTS=OFF
	cmake --build build-fuzz -j $(JOBS) --target fuzz_trace fuzz_plan fuzz_arena_ops fuzz_allocators
	mkdir -p build-fuzz/corpus-trace build-fuzz/corpus-plan build-fuzz/corpus-arena build-fuzz/corpus-allocators
	build-fuzz/bin/fuzz_trace -max_total_time=60 -max_len=4096 build-fuzz/corpus-trace tests/fuzz/corpus/trace
	build-fuzz/bin/fuzz_plan -max_total_time=60 -max_len=22 build-fuzz/corpus-plan tests/fuzz/corpus/plan
	build-fuzz/bin/fuzz_arena_ops -max_total_time=60 -max_len=4096 build-fuzz/corpus-arena tests/fuzz/corpus/arena
	build-fuzz/bin/fuzz_allocators -max_total_time=60 -max_len=4096 build-fuzz/corpus-allocators tests/fuzz/corpus/allocators

test: test-release test-asan test-tsan

bench: deps
	cmake --preset release
	cmake --build --preset release -j $(JOBS) --target benchmarks

# Error branches no test reaches: a --coverage build, its tests, and every throwing line of the
# library, the module and the tool that never ran (scripts/error-branch-coverage.sh).
coverage: deps
	bash scripts/error-branch-coverage.sh build-coverage

clean:
	rm -rf build build-debug build-asan build-tsan build-fuzz build-coverage
