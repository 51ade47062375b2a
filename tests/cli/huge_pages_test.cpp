// The CLI's choice of huge pages for its heap (tools/tensormem/huge_pages.cpp), in the cases
// where it decides without running the program again. The run that does happen is checked end
// to end by cli_huge_pages_test.sh.

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "huge_pages.hpp"

namespace {

constexpr const char* marker = "TENSORMEM_HUGE_PAGES_RUN";

// A second run is this test binary again, told to run only the sentinel below, which fails
// when it finds itself in such a run: a choice that ran the program again fails its test.
char* sentinel_argv[] = {const_cast<char*>("tensormem_tests"),
                         const_cast<char*>("--gtest_filter=cli_huge_pages.sentinel_not_a_second_run"), nullptr};

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? "<unset>" : v;
}

class cli_huge_pages : public ::testing::Test {
 protected:
  void SetUp() override {
    saved_tunables_ = env("GLIBC_TUNABLES");
    saved_switch_ = env("TENSORMEM_HUGE_PAGES");
  }
  void TearDown() override {
    restore("GLIBC_TUNABLES", saved_tunables_);
    restore("TENSORMEM_HUGE_PAGES", saved_switch_);
    unsetenv(marker);
  }
  static void restore(const char* name, const std::string& value) {
    if (value == "<unset>") unsetenv(name);
    else setenv(name, value.c_str(), 1);
  }
  // Runs the choice as a second run would: with the first run's marker and the tunables it
  // was started with.
  static void as_second_run(const std::string& saved, const char* tunables) {
    setenv(marker, saved.c_str(), 1);
    if (tunables != nullptr) setenv("GLIBC_TUNABLES", tunables, 1);
    else unsetenv("GLIBC_TUNABLES");
    tensormem::cli::use_huge_pages(sentinel_argv);
  }
  // The status, or empty in a build whose allocator ignores the tunable (sanitizers).
  static std::string decided() {
    const std::string& s = tensormem::cli::huge_pages_status();
    return s == "off (a sanitizer's allocator)" ? std::string() : s;
  }
  std::string saved_tunables_;
  std::string saved_switch_;
};

TEST_F(cli_huge_pages, sentinel_not_a_second_run) {
  EXPECT_EQ(env(marker), "<unset>") << "the program was run again where it should not have been";
}

TEST_F(cli_huge_pages, the_second_run_puts_the_callers_tunables_back) {
  as_second_run(tensormem::cli::second_run_marker("glibc.malloc.mmap_threshold=4096"),
                "glibc.malloc.mmap_threshold=4096:glibc.malloc.hugetlb=1");
  EXPECT_EQ(env("GLIBC_TUNABLES"), "glibc.malloc.mmap_threshold=4096");
  EXPECT_EQ(env(marker), "<unset>");
  if (const std::string s = decided(); !s.empty()) {
    EXPECT_EQ(s, "on (GLIBC_TUNABLES: glibc.malloc.hugetlb=1)");
  }
}

TEST_F(cli_huge_pages, a_caller_without_tunables_gets_none_back) {
  as_second_run(tensormem::cli::second_run_marker(nullptr), "glibc.malloc.hugetlb=1");
  EXPECT_EQ(env("GLIBC_TUNABLES"), "<unset>");
  EXPECT_EQ(env(marker), "<unset>");
  // Set but empty is not unset.
  as_second_run(tensormem::cli::second_run_marker(""), "glibc.malloc.hugetlb=1");
  EXPECT_EQ(env("GLIBC_TUNABLES"), "");
  EXPECT_EQ(env(marker), "<unset>");
}

// glibc drops GLIBC_TUNABLES for some programs (set-user-ID ones): the second run must not
// try a third time.
TEST_F(cli_huge_pages, a_second_run_without_the_tunable_does_not_run_again) {
  unsetenv("TENSORMEM_HUGE_PAGES");
  as_second_run("-", nullptr);
  if (const std::string s = decided(); !s.empty()) {
    EXPECT_EQ(s, "off (GLIBC_TUNABLES did not reach the second run)");
  }
  EXPECT_EQ(env(marker), "<unset>");
}

TEST_F(cli_huge_pages, the_callers_own_setting_is_kept) {
  unsetenv(marker);
  setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=0", 1);
  tensormem::cli::use_huge_pages(sentinel_argv);
  EXPECT_EQ(env("GLIBC_TUNABLES"), "glibc.malloc.hugetlb=0");
  if (const std::string s = decided(); !s.empty()) {
    EXPECT_EQ(s, "off (GLIBC_TUNABLES: glibc.malloc.hugetlb=0)");
  }
  // The last setting counts, as in glibc.
  setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=0:glibc.malloc.check=0:glibc.malloc.hugetlb=2", 1);
  tensormem::cli::use_huge_pages(sentinel_argv);
  if (const std::string s = decided(); !s.empty()) {
    EXPECT_EQ(s, "on (GLIBC_TUNABLES: glibc.malloc.hugetlb=2)");
  }
  // A name that only ends like the tunable's is not it; the switch then turns it off.
  setenv("GLIBC_TUNABLES", "glibc.malloc.xhugetlb=1", 1);
  setenv("TENSORMEM_HUGE_PAGES", "0", 1);
  tensormem::cli::use_huge_pages(sentinel_argv);
  if (const std::string s = decided(); !s.empty()) {
    EXPECT_EQ(s, "off (TENSORMEM_HUGE_PAGES=0)");
  }
  EXPECT_EQ(env("GLIBC_TUNABLES"), "glibc.malloc.xhugetlb=1");
}

}  // namespace
