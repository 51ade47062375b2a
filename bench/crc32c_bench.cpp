// CRC-32C throughput: the swapper's checksum, on 4 KiB to 16 MiB buffers (bytes/s counter).

#include <benchmark/benchmark.h>

#include <cstddef>
#include <vector>

#include "tensormem/swap/crc32c.hpp"

namespace {

void crc32c_bytes(benchmark::State& state) {
  std::vector<unsigned char> data(static_cast<std::size_t>(state.range(0)));
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<unsigned char>(i * 131);
  for (auto _ : state) {
    benchmark::DoNotOptimize(tensormem::swap::crc32c(data.data(), data.size()));
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * state.range(0));
}
BENCHMARK(crc32c_bytes)->Arg(4096)->Arg(65536)->Arg(1 << 20)->Arg(16 << 20);

void crc32c_combine_blocks(benchmark::State& state) {
  // What a swap-in of a 1 GiB tensor in 1 MiB blocks does at its end: 1,024 combines.
  std::uint32_t crc = 1;
  for (auto _ : state) {
    for (int b = 0; b < 1024; ++b) crc = tensormem::swap::crc32c_combine(crc, static_cast<std::uint32_t>(b), 1 << 20);
    benchmark::DoNotOptimize(crc);
  }
}
BENCHMARK(crc32c_combine_blocks);

}  // namespace

BENCHMARK_MAIN();
