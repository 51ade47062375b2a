// The CLI's figures as it prints them (tools/tensormem/report.cpp): sizes in binary units and
// ratios against a lower bound, at the edges of their ranges.

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "report.hpp"

namespace tensormem::cli {
namespace {

TEST(cli_report, sizes_take_the_largest_unit_they_fill) {
  EXPECT_EQ(human_bytes(0), "0 B");
  EXPECT_EQ(human_bytes(1023), "1023 B");
  EXPECT_EQ(human_bytes(1024), "1.00 KiB");
  EXPECT_EQ(human_bytes(1536), "1.50 KiB");
  EXPECT_EQ(human_bytes((std::uint64_t{1} << 20) - 1), "1024.00 KiB");  // (rounded: just under a MiB)
  EXPECT_EQ(human_bytes(std::uint64_t{1} << 20), "1.00 MiB");
  EXPECT_EQ(human_bytes(std::uint64_t{3} << 40), "3.00 TiB");
  EXPECT_EQ(human_bytes(std::uint64_t{1} << 60), "1.00 EiB");
  // The largest 64-bit size, in the largest unit.
  EXPECT_EQ(human_bytes(std::numeric_limits<std::uint64_t>::max()), "16.00 EiB");
}

TEST(cli_report, a_ratio_against_no_bound_is_met_when_nothing_is_used_and_undefined_otherwise) {
  EXPECT_EQ(ratio_text(0, 0), "1.0000");
  EXPECT_EQ(ratio_text(5, 0), "n/a");
  EXPECT_EQ(ratio_text(0, 5), "0.0000");
  EXPECT_EQ(ratio_text(3, 2), "1.5000");
  EXPECT_EQ(ratio_of(0, 0), 1.0);
  EXPECT_TRUE(std::isinf(ratio_of(5, 0)));
  EXPECT_EQ(ratio_of(0, 5), 0.0);
  EXPECT_EQ(ratio_of(3, 2), 1.5);
}

}  // namespace
}  // namespace tensormem::cli
