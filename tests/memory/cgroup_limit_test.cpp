// The memory limit of a process's cgroup, read from /proc's text for cgroup v1, v2 and both.

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>

#include "tensormem/memory/detail/cgroup_limit.hpp"
#include "tensormem/memory/pinned_host_resource.hpp"

namespace {

using tensormem::memory::detail::cgroup_memory_limit;
constexpr std::uint64_t none = std::numeric_limits<std::uint64_t>::max();

// A file system of a few files; every path read is recorded.
struct fake_files {
  std::map<std::string, std::string> files;
  std::map<std::string, int> reads;
  tensormem::memory::detail::read_file_fn reader() {
    return [this](const std::string& path) -> std::optional<std::string> {
      ++reads[path];
      const auto it = files.find(path);
      if (it == files.end()) return std::nullopt;
      return it->second;
    };
  }
};

const char* const v2_mount = "30 23 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n";
const char* const v1_mounts =
    "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
    "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
    "35 31 0:30 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
    "40 31 0:31 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n";

TEST(cgroup_limit, v2_takes_the_lowest_limit_of_the_cgroup_and_its_ancestors) {
  fake_files fs;
  fs.files["/sys/fs/cgroup/user.slice/app.scope/memory.max"] = "max\n";
  fs.files["/sys/fs/cgroup/user.slice/memory.max"] = "1073741824\n";
  fs.files["/sys/fs/cgroup/memory.max"] = "2147483648\n";  // (the root has none; a lower one above wins)
  EXPECT_EQ(cgroup_memory_limit("0::/user.slice/app.scope\n", v2_mount, fs.reader()), 1073741824U);
  EXPECT_EQ(fs.reads.size(), 3U);  // the cgroup, its parent and the root, each once
  fs.files["/sys/fs/cgroup/user.slice/app.scope/memory.max"] = "67108864";  // no newline
  EXPECT_EQ(cgroup_memory_limit("0::/user.slice/app.scope\n", v2_mount, fs.reader()), 67108864U);
}

TEST(cgroup_limit, v1_reads_the_memory_hierarchy_also_among_other_controllers) {
  fake_files fs;
  fs.files["/sys/fs/cgroup/memory/process_api/abc/memory.limit_in_bytes"] = "67108864\n";
  fs.files["/sys/fs/cgroup/memory/process_api/memory.limit_in_bytes"] = "9223372036854771712\n";  // v1's "none"
  const char* cgroup = "9:name=systemd:/\n8:pids:/\n4:memory:/process_api/abc\n1:cpu:/\n0::/\n";
  EXPECT_EQ(cgroup_memory_limit(cgroup, v1_mounts, fs.reader()), 67108864U);
  EXPECT_EQ(cgroup_memory_limit("4:cpu,memory:/process_api/abc\n", v1_mounts, fs.reader()), 67108864U);
  // "memory" must be a controller of the line, not part of a name.
  EXPECT_EQ(cgroup_memory_limit("4:name=memoryish:/process_api/abc\n", v1_mounts, fs.reader()), none);
  // A v1 mount must name the memory controller among its options.
  EXPECT_EQ(cgroup_memory_limit("4:memory:/process_api/abc\n",
                                "32 31 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n", fs.reader()),
            none);
}

TEST(cgroup_limit, a_hybrid_layout_takes_the_lowest_of_both) {
  fake_files fs;
  fs.files["/sys/fs/cgroup/memory/job/memory.limit_in_bytes"] = "500000000\n";
  fs.files["/sys/fs/cgroup/unified/job/memory.max"] = "400000000\n";
  EXPECT_EQ(cgroup_memory_limit("4:memory:/job\n0::/job\n", v1_mounts, fs.reader()), 400000000U);
  fs.files.erase("/sys/fs/cgroup/unified/job/memory.max");  // the memory controller on v1 only
  EXPECT_EQ(cgroup_memory_limit("4:memory:/job\n0::/job\n", v1_mounts, fs.reader()), 500000000U);
}

TEST(cgroup_limit, a_container_sees_its_own_cgroup_at_the_mount_point) {
  // In a cgroup namespace or a bind mount, the mount's root is the container's cgroup.
  fake_files fs;
  fs.files["/sys/fs/cgroup/memory.max"] = "268435456\n";
  fs.files["/sys/fs/cgroup/docker/c0ffee/memory.max"] = "1";  // never read: not where the mount shows it
  const char* mount = "30 23 0:26 /docker/c0ffee /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
  EXPECT_EQ(cgroup_memory_limit("0::/docker/c0ffee\n", mount, fs.reader()), 268435456U);
  const char* slashed = "30 23 0:26 /docker/c0ffee/ /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
  EXPECT_EQ(cgroup_memory_limit("0::/docker/c0ffee\n", slashed, fs.reader()), 268435456U);
  fs.files["/sys/fs/cgroup/job/memory.max"] = "1000";
  EXPECT_EQ(cgroup_memory_limit("0::/docker/c0ffee/job\n", mount, fs.reader()), 1000U);
  // A path outside the mount's root (or only sharing its prefix) has no file here.
  EXPECT_EQ(cgroup_memory_limit("0::/docker/other\n", mount, fs.reader()), none);
  EXPECT_EQ(cgroup_memory_limit("0::/docker/c0ffeeX\n", mount, fs.reader()), none);
}

TEST(cgroup_limit, an_escaped_mount_point_is_read_where_it_is) {
  fake_files fs;
  fs.files["/mnt/cgroup two\\x/a/memory.max"] = "4096\n";
  const char* mount = "30 23 0:26 / /mnt/cgroup\\040two\\134x rw - cgroup2 cgroup2 rw\n";
  EXPECT_EQ(cgroup_memory_limit("0::/a\n", mount, fs.reader()), 4096U);
  // Every octal digit counts, 0 to 7 (\047 is an apostrophe; the kernel escapes only the
  // four characters above, but the decoding is the same for any).
  fs.files["/mnt/it's/a/memory.max"] = "2048\n";
  EXPECT_EQ(cgroup_memory_limit("0::/a\n", "30 23 0:26 / /mnt/it\\047s rw - cgroup2 cgroup2 rw\n", fs.reader()), 2048U);
  // A backslash not followed by three octal digits stays as it is, at the end of the field or
  // before three more characters.
  fs.files["/mnt/c\\9x/a/memory.max"] = "8192\n";
  EXPECT_EQ(cgroup_memory_limit("0::/a\n", "30 23 0:26 / /mnt/c\\9x rw - cgroup2 cgroup2 rw\n", fs.reader()), 8192U);
  fs.files["/mnt/c\\9xy/a/memory.max"] = "12288\n";
  EXPECT_EQ(cgroup_memory_limit("0::/a\n", "30 23 0:26 / /mnt/c\\9xy rw - cgroup2 cgroup2 rw\n", fs.reader()), 12288U);
  fs.files["/mnt/c\\08y/a/memory.max"] = "20480\n";
  EXPECT_EQ(cgroup_memory_limit("0::/a\n", "30 23 0:26 / /mnt/c\\08y rw - cgroup2 cgroup2 rw\n", fs.reader()), 20480U);
  fs.files["/mnt/c\\04/a/memory.max"] = "16384\n";
  EXPECT_EQ(cgroup_memory_limit("0::/a\n", "30 23 0:26 / /mnt/c\\04 rw - cgroup2 cgroup2 rw\n", fs.reader()), 16384U);
}

TEST(cgroup_limit, no_limit_from_max_text_missing_files_or_malformed_lines) {
  fake_files fs;
  fs.files["/sys/fs/cgroup/a/memory.max"] = "max\n";
  EXPECT_EQ(cgroup_memory_limit("0::/a\n", v2_mount, fs.reader()), none);
  for (const char* text : {"", "\n", "12abc\n", "-5\n", "99999999999999999999999\n", " 12\n"}) {
    fs.files["/sys/fs/cgroup/a/memory.max"] = text;
    EXPECT_EQ(cgroup_memory_limit("0::/a\n", v2_mount, fs.reader()), none) << text;
  }
  fs.files["/sys/fs/cgroup/a/memory.max"] = "0\n";  // a limit of nothing is a limit
  EXPECT_EQ(cgroup_memory_limit("0::/a\n", v2_mount, fs.reader()), 0U);
  EXPECT_EQ(cgroup_memory_limit("", v2_mount, fs.reader()), none);
  EXPECT_EQ(cgroup_memory_limit("0::/a\n", "", fs.reader()), none);
  EXPECT_EQ(cgroup_memory_limit("garbage\n0:/a\n", v2_mount, fs.reader()), none);
  EXPECT_EQ(cgroup_memory_limit("0::/a\n", "30 23 0:26 / /sys/fs/cgroup rw cgroup2 cgroup2 rw\n", fs.reader()),
            none);  // no " - " separator
  EXPECT_EQ(cgroup_memory_limit("0::/a\n", "30 23 - cgroup2 cgroup2 rw\n", fs.reader()), none);  // too few fields
  // The mount's root and mount point are the fourth and fifth fields: five before the
  // separator are enough, four are not; after it, the type, the source and the options.
  fs.files["/sys/fs/cgroup/a/memory.max"] = "4096\n";
  EXPECT_EQ(cgroup_memory_limit("0::/a\n", "30 23 0:26 / /sys/fs/cgroup - cgroup2 cgroup2 rw\n", fs.reader()), 4096U);
  EXPECT_EQ(cgroup_memory_limit("0::/a\n", "30 23 0:26 / - cgroup2 cgroup2 rw\n", fs.reader()), none);
  EXPECT_EQ(cgroup_memory_limit("0::/a\n", "30 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2\n", fs.reader()), none);
  // A line of cgroup v2 is hierarchy 0 with no controllers; another hierarchy without
  // controllers is not v2's.
  EXPECT_EQ(cgroup_memory_limit("1::/a\n", v2_mount, fs.reader()), none);
}

// What a cgroup leaves: limit - (usage - inactive file cache), the lowest over the cgroup and
// its ancestors that have a limit, clamped to [0, limit].
TEST(cgroup_available, v2_is_the_limit_less_usage_with_the_inactive_file_cache_counted_free) {
  using tensormem::memory::detail::cgroup_memory_available;
  fake_files fs;
  const std::string app = "/sys/fs/cgroup/user.slice/app.scope/";
  const std::string slice = "/sys/fs/cgroup/user.slice/";
  const char* cgroup = "0::/user.slice/app.scope\n";
  EXPECT_EQ(cgroup_memory_available(cgroup, v2_mount, fs.reader()), none);  // no limit anywhere
  fs.files[app + "memory.max"] = "1000000\n";
  EXPECT_EQ(cgroup_memory_available(cgroup, v2_mount, fs.reader()), 1000000U);  // no usage: the whole limit
  fs.files[app + "memory.current"] = "600000\n";
  EXPECT_EQ(cgroup_memory_available(cgroup, v2_mount, fs.reader()), 400000U);
  fs.files[app + "memory.stat"] = "anon 400000\nfile 200000\nactive_file 50000\ninactive_file 150000\nslab 10\n";
  EXPECT_EQ(cgroup_memory_available(cgroup, v2_mount, fs.reader()), 550000U);
  // An ancestor with less left wins, though its limit is higher.
  fs.files[slice + "memory.max"] = "2000000\n";
  fs.files[slice + "memory.current"] = "1800000\n";
  EXPECT_EQ(cgroup_memory_available(cgroup, v2_mount, fs.reader()), 200000U);
  fs.files[slice + "memory.max"] = "max\n";  // no limit there: its usage does not count
  EXPECT_EQ(cgroup_memory_available(cgroup, v2_mount, fs.reader()), 550000U);
  // Usage past the limit (read just after the limit was lowered) leaves nothing, not 2^64 - x.
  fs.files[app + "memory.current"] = "1300000\n";
  EXPECT_EQ(cgroup_memory_available(cgroup, v2_mount, fs.reader()), 0U);
  // More cache than usage (counters read at different moments) leaves the limit, not more.
  fs.files[app + "memory.current"] = "100000\n";
  EXPECT_EQ(cgroup_memory_available(cgroup, v2_mount, fs.reader()), 1000000U);
  // A stat line that is not a number, or a name that only starts the same, counts no cache.
  fs.files[app + "memory.current"] = "600000\n";
  fs.files[app + "memory.stat"] = "inactive_file_x 150000\ninactive_file 15e4\n";
  EXPECT_EQ(cgroup_memory_available(cgroup, v2_mount, fs.reader()), 400000U);
}

TEST(cgroup_available, v1_reads_usage_in_bytes_and_total_inactive_file) {
  using tensormem::memory::detail::cgroup_memory_available;
  fake_files fs;
  const std::string abc = "/sys/fs/cgroup/memory/process_api/abc/";
  fs.files[abc + "memory.limit_in_bytes"] = "67108864\n";
  fs.files[abc + "memory.usage_in_bytes"] = "50000000\n";
  fs.files[abc + "memory.stat"] = "cache 9000000\ninactive_file 1000\ntotal_inactive_file 8000000\n";
  EXPECT_EQ(cgroup_memory_available("4:memory:/process_api/abc\n", v1_mounts, fs.reader()), 67108864U - 42000000U);
  // Of a hybrid layout, the lower of both.
  fs.files["/sys/fs/cgroup/unified/process_api/abc/memory.max"] = "20000000\n";
  EXPECT_EQ(cgroup_memory_available("4:memory:/process_api/abc\n0::/process_api/abc\n", v1_mounts, fs.reader()),
            20000000U);
}

TEST(cgroup_limit, the_process_memory_is_at_most_the_machine_and_the_cgroup) {
  // What the cgroups leave is at most their lowest limit (UINT64_MAX for both without one).
  EXPECT_LE(tensormem::memory::cgroup_memory_available_bytes(), tensormem::memory::cgroup_memory_limit_bytes());
  const std::size_t memory = tensormem::memory::physical_memory_bytes();
  EXPECT_GT(memory, 0U);
  EXPECT_LE(memory, tensormem::memory::cgroup_memory_limit_bytes());
  const long pages = sysconf(_SC_PHYS_PAGES);
  ASSERT_GT(pages, 0);
  EXPECT_LE(memory, static_cast<std::size_t>(pages) * static_cast<std::size_t>(sysconf(_SC_PAGESIZE)));
}

// The rule the command line and the Python module refuse by: count x bytes_each against the
// memory, exact at the boundary, saturated where the product overflows.
TEST(memory_shortfall, is_reported_exactly_past_the_memory_and_saturates) {
  using tensormem::memory::shortfall_against;
  constexpr std::size_t memory = 1000;
  EXPECT_FALSE(shortfall_against(0, 160, memory));
  EXPECT_FALSE(shortfall_against(6, 160, memory));  // 960 bytes fit
  const auto past = shortfall_against(7, 160, memory);  // 1120 do not
  ASSERT_TRUE(past);
  EXPECT_EQ(past->need_bytes, 1120U);
  EXPECT_EQ(past->memory_bytes, memory);
  EXPECT_FALSE(shortfall_against(1000, 1, memory));
  EXPECT_TRUE(shortfall_against(1001, 1, memory));
  // A product past 2^64 is reported as UINT64_MAX, not wrapped round to a small number.
  const std::size_t huge = std::numeric_limits<std::size_t>::max() / 2;
  const auto saturated = shortfall_against(huge, 160, memory);
  ASSERT_TRUE(saturated);
  EXPECT_EQ(saturated->need_bytes, none);
  // The largest count whose product still fits is reported exactly.
  const auto exact = shortfall_against(none / 160, 160, memory);
  ASSERT_TRUE(exact);
  EXPECT_EQ(exact->need_bytes, none / 160 * 160);
  EXPECT_NE(exact->need_bytes, none);
  // Memory that cannot be read refuses nothing; neither does an item of no bytes.
  EXPECT_FALSE(shortfall_against(huge, 160, std::numeric_limits<std::size_t>::max()));
  EXPECT_FALSE(shortfall_against(huge, 0, memory));
  // The process's own memory: the largest count that fits and the next one.
  const std::size_t mine = tensormem::memory::physical_memory_bytes();
  ASSERT_NE(mine, std::numeric_limits<std::size_t>::max());
  EXPECT_FALSE(tensormem::memory::memory_shortfall_for(mine / 160, 160));
  const auto over = tensormem::memory::memory_shortfall_for(mine / 160 + 1, 160);
  ASSERT_TRUE(over);
  EXPECT_EQ(over->memory_bytes, mine);
  EXPECT_EQ(over->need_bytes, (mine / 160 + 1) * 160);
}

}  // namespace
