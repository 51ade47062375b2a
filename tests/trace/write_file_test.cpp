// Output files (plans, traces, pictures): a failed write keeps what was there, a replacement
// keeps the old file's permissions and links, devices are written in place.

#include <gtest/gtest.h>

#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include "tensormem/trace/trace_io.hpp"
#include "../../src/trace/write_file.hpp"
#include "../swap/swap_test_support.hpp"

namespace tensormem::trace {
namespace {

namespace fs = std::filesystem;
using swap::testing::file_bytes;
using swap::testing::scratch_dir;

std::vector<core::buffer> buffers(std::size_t n) {
  std::vector<core::buffer> b;
  for (std::size_t i = 0; i < n; ++i) b.push_back({"b" + std::to_string(i), i, i + 3, 1000 + i, std::nullopt});
  return b;
}

// The names in `dir`, sorted: what a write left behind.
std::vector<std::string> names_in(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// The errno and message of the system_error `write` throws; {0, ""} when it throws none.
template <class Write>
std::pair<int, std::string> write_error(Write&& write) {
  try {
    write();
  } catch (const std::system_error& e) {
    return {e.code().value(), e.what()};
  }
  return {0, ""};
}

// In a child running as root: becomes user nobody, so that permissions apply (true where it
// did, or where the process was not root).
bool drop_root() {
  return geteuid() != 0 || (setgroups(0, nullptr) == 0 && setgid(65534) == 0 && setuid(65534) == 0);
}

// Under a file-size limit (SIGXFSZ ignored: the write fails with EFBIG instead of ending the
// process), restored when it goes.
struct file_size_limit {
  rlimit old{};
  void (*old_handler)(int) = nullptr;
  explicit file_size_limit(rlim_t bytes) {
    getrlimit(RLIMIT_FSIZE, &old);
    old_handler = std::signal(SIGXFSZ, SIG_IGN);
    const rlimit limit{bytes, old.rlim_max};
    setrlimit(RLIMIT_FSIZE, &limit);
  }
  ~file_size_limit() {
    setrlimit(RLIMIT_FSIZE, &old);
    std::signal(SIGXFSZ, old_handler);
  }
};

TEST(write_file, a_write_cut_short_by_a_size_limit_keeps_the_old_file_and_leaves_nothing_else) {
  const scratch_dir dir;
  ASSERT_FALSE(dir.path.empty());
  const std::string path = dir.file("plan.csv");
  write_trace(path, buffers(3));
  const auto before = file_bytes(path);
  ASSERT_FALSE(before.empty());
  std::pair<int, std::string> error;
  {
    const file_size_limit limit(4096);  // the new text is about 25 KiB: its first 64 KiB block fails
    error = write_error([&] { write_trace(path, buffers(1000)); });
  }
  EXPECT_EQ(error.first, EFBIG);
  EXPECT_EQ(error.second.rfind("cannot write " + path + ": ", 0), 0u) << error.second;
  EXPECT_EQ(file_bytes(path), before);
  EXPECT_EQ(names_in(dir.path), std::vector<std::string>{"plan.csv"});
  // The same through a symbolic link to the file.
  const std::string link = dir.file("link.csv");
  fs::create_symlink("plan.csv", link);
  {
    const file_size_limit limit(4096);
    error = write_error([&] { write_trace(link, buffers(1000)); });
  }
  EXPECT_EQ(error.first, EFBIG);
  EXPECT_EQ(file_bytes(path), before);
  fs::remove(link);
  EXPECT_EQ(names_in(dir.path), std::vector<std::string>{"plan.csv"});
  // Nothing there before: nothing there after.
  const std::string fresh = dir.file("fresh.csv");
  {
    const file_size_limit limit(4096);
    error = write_error([&] { write_trace(fresh, buffers(1000)); });
  }
  EXPECT_EQ(error.first, EFBIG);
  EXPECT_EQ(names_in(dir.path), std::vector<std::string>{"plan.csv"});
  // Without the limit both are written whole.
  write_trace(path, buffers(1000));
  write_trace(fresh, buffers(1000));
  EXPECT_EQ(read_trace(path).size(), 1000u);
  EXPECT_EQ(file_bytes(fresh), file_bytes(path));
}

TEST(write_file, a_full_disk_keeps_the_old_file) {
  const scratch_dir dir(fs::perms::all);
  ASSERT_FALSE(dir.path.empty());
  const int status = swap::testing::in_small_tmpfs(dir.path, "size=64k", [&] {
    const std::string path = dir.file("plan.csv");
    write_trace(path, buffers(3));
    const auto before = file_bytes(path);
    const auto [error, message] = write_error([&] { write_trace(path, buffers(20000)); });  // ~400 KiB
    return error == ENOSPC && message == "cannot write " + path + ": No space left on device" &&
           file_bytes(path) == before && names_in(dir.path) == std::vector<std::string>{"plan.csv"};
  });
  EXPECT_FULL_DISK_CHILD(status);
}

TEST(write_file, an_exception_from_the_writer_keeps_the_old_file) {
  const scratch_dir dir;
  ASSERT_FALSE(dir.path.empty());
  const std::string path = dir.file("picture.svg");
  detail::write_file(path, [](std::ostream& out) { out << "old"; });
  EXPECT_THROW(detail::write_file(path,
                                  [](std::ostream& out) {
                                    out << std::string(200000, 'x');  // past the buffer: written
                                    throw std::runtime_error("the writer failed");
                                  }),
               std::runtime_error);
  EXPECT_EQ(file_bytes(path).size(), 3u);
  EXPECT_EQ(names_in(dir.path), std::vector<std::string>{"picture.svg"});
}

TEST(write_file, a_replacement_keeps_the_permission_bits_and_a_link_stays_a_link) {
  const scratch_dir dir;
  ASSERT_FALSE(dir.path.empty());
  const std::string path = dir.file("plan.csv");
  write_trace(path, buffers(2));
  fs::permissions(path, fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read);
  write_trace(path, buffers(5));
  EXPECT_EQ(read_trace(path).size(), 5u);
  EXPECT_EQ(fs::status(path).permissions(), fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read);
  // Through a symbolic link: the file it names is replaced, the link stays.
  const std::string link = dir.file("link.csv");
  fs::create_symlink("plan.csv", link);
  write_trace(link, buffers(7));
  EXPECT_TRUE(fs::is_symlink(link));
  EXPECT_EQ(read_trace(path).size(), 7u);
  EXPECT_EQ(fs::status(path).permissions(), fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read);
  // A dangling link is written through: the file it names is made.
  const std::string dangling = dir.file("dangling.csv");
  fs::create_symlink("made.csv", dangling);
  write_trace(dangling, buffers(1));
  EXPECT_TRUE(fs::is_symlink(dangling));
  EXPECT_EQ(read_trace(dir.file("made.csv")).size(), 1u);
  // A new file gets what the creation mask leaves of rw-rw-rw-, as any file a program makes.
  const mode_t mask = umask(027);
  write_trace(dir.file("new.csv"), buffers(1));
  umask(mask);
  EXPECT_EQ(fs::status(dir.file("new.csv")).permissions(),
            fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read);
  EXPECT_EQ(names_in(dir.path), (std::vector<std::string>{"dangling.csv", "link.csv", "made.csv", "new.csv", "plan.csv"}));
}

TEST(write_file, a_name_with_no_room_for_the_temporary_suffix_is_written) {
  const scratch_dir dir;
  ASSERT_FALSE(dir.path.empty());
  const std::string name(250, 'n');
  write_trace(dir.file(name), buffers(2));
  write_trace(dir.file(name), buffers(4));
  EXPECT_EQ(read_trace(dir.file(name)).size(), 4u);
  EXPECT_EQ(names_in(dir.path), std::vector<std::string>{name});
}

// A temporary file's name taken (a file left by a process killed while writing, whose id this
// process now has) is passed over for the next; the file there is not touched.
TEST(write_file, a_temporary_name_already_taken_is_passed_over) {
  const swap::testing::named_temporaries named;  // (an unnamed file's name: the next test)
  const scratch_dir dir;
  ASSERT_FALSE(dir.path.empty());
  const std::string path = dir.file("plan.csv");
  const std::string prefix = "plan.csv.tensormem-tmp." + std::to_string(getpid()) + ".";
  // The name a write uses, seen from inside it (the writer runs while the file exists).
  const auto name_used = [&](const char* text) {
    std::string used;
    detail::write_file(path, [&](std::ostream& out) {
      for (const std::string& name : names_in(dir.path)) {
        if (name.rfind(prefix, 0) == 0 && file_bytes(dir.file(name)).empty()) used = name;
      }
      out << text;
    });
    return used;
  };
  const std::string first = name_used("one");
  ASSERT_FALSE(first.empty());
  const unsigned long n = std::stoul(first.substr(prefix.size()));
  for (unsigned long taken = n + 1; taken <= n + 5; ++taken) {
    std::ofstream(dir.file(prefix + std::to_string(taken))) << "someone else's";
  }
  EXPECT_EQ(name_used("two"), prefix + std::to_string(n + 6));
  EXPECT_EQ(file_bytes(path).size(), 3u);
  for (unsigned long taken = n + 1; taken <= n + 5; ++taken) {
    EXPECT_EQ(file_bytes(dir.file(prefix + std::to_string(taken))).size(), 14u);
  }
  EXPECT_EQ(names_in(dir.path).size(), 6u);
}

// Where the file system can, the new file has no name while it is written (a process killed
// then leaves nothing): only once it is whole is it named beside the file, past names others
// hold (each untouched), and renamed onto it.
TEST(write_file, the_new_file_has_no_name_until_it_is_whole) {
  const scratch_dir dir;
  ASSERT_FALSE(dir.path.empty());
  const std::string path = dir.file("plan.csv");
  std::ofstream(path) << "old";
  const std::vector<std::string> taken = swap::testing::next_temporary_names(path, 3);
  for (const std::string& name : taken) std::ofstream(name) << "someone else's";
  std::vector<std::string> while_written;
  detail::write_file(path, [&](std::ostream& out) {
    while_written = names_in(dir.path);
    out << "new";
  });
  EXPECT_EQ(while_written.size(), 4u);  // the old file and the three taken names, nothing else
  const std::vector<std::byte> text = file_bytes(path);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(text.data()), text.size()), "new");
  for (const std::string& name : taken) EXPECT_EQ(file_bytes(name).size(), 14u) << name;
  EXPECT_EQ(names_in(dir.path).size(), 4u);
}

TEST(write_file, devices_are_written_in_place) {
  write_trace("/dev/null", buffers(3));
  const auto [error, message] = write_error([] { write_trace("/dev/full", buffers(3)); });
  EXPECT_EQ(error, ENOSPC);
  EXPECT_EQ(message, "cannot write /dev/full: No space left on device");
  EXPECT_EQ(fs::status("/dev/full").type(), fs::file_type::character);
}

// `/dev/stdout` where the standard output is a file (a shell's `> out`): opened and written
// as such, so that the process's standard output still names the file at that path (a rename
// would leave it on a file no longer there, and what it wrote afterwards would be lost).
TEST(write_file, the_standard_output_sent_to_a_file_is_written_in_place) {
  const scratch_dir dir;
  ASSERT_FALSE(dir.path.empty());
  const std::string out = dir.file("out.txt");
  // A link to it, and a link to that link.
  const std::string link = dir.file("link.csv"), link_of_link = dir.file("link_of_link.csv");
  fs::create_symlink("/dev/stdout", link);
  fs::create_symlink("link.csv", link_of_link);
  for (const std::string& name : {std::string("/dev/stdout"), std::string("/proc/self/fd/1"), std::string("/dev/fd/1"),
                                  std::string("/dev/../dev/stdout"), link, link_of_link}) {
    SCOPED_TRACE(name);
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      const int fd = open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd < 0 || dup2(fd, 1) != 1) _exit(90);
      try {
        write_trace(name, buffers(2));
      } catch (...) {
        _exit(1);
      }
      struct stat standard_output {}, there {};
      _exit(fstat(1, &standard_output) == 0 && stat(out.c_str(), &there) == 0 &&
                    standard_output.st_ino == there.st_ino
                ? 0
                : 2);
    }
    int status = 0;
    waitpid(child, &status, 0);
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 0);
    std::ostringstream expected;
    write_trace(expected, buffers(2));
    const auto bytes = file_bytes(out);
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size()), expected.str());
    EXPECT_EQ(names_in(dir.path), (std::vector<std::string>{"link.csv", "link_of_link.csv", "out.txt"}));
  }
}

TEST(write_file, a_writable_file_in_a_folder_closed_to_new_files_is_written_in_place) {
  const scratch_dir dir(fs::perms::all);
  ASSERT_FALSE(dir.path.empty());
  const std::string path = dir.file("plan.csv");
  write_trace(path, buffers(2));
  fs::permissions(path, fs::perms::all);
  // Folder r-x for everyone: no file can be added (root excepted: the child drops it).
  fs::permissions(dir.path, fs::perms::owner_read | fs::perms::owner_exec | fs::perms::group_read |
                                fs::perms::group_exec | fs::perms::others_read | fs::perms::others_exec);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (!drop_root()) _exit(91);
    bool ok = true;
    try {
      write_trace(path, buffers(6));
    } catch (...) {
      ok = false;
    }
    const auto [error, message] = write_error([&] { write_trace(dir.file("new.csv"), buffers(1)); });
    _exit(ok && error == EACCES && read_trace(path).size() == 6 ? 0 : 1);
  }
  int status = 0;
  waitpid(child, &status, 0);
  fs::permissions(dir.path, fs::perms::all);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_EQ(read_trace(path).size(), 6u);
  EXPECT_EQ(names_in(dir.path), std::vector<std::string>{"plan.csv"});
}

// A file the writer may not write, in a folder where it may add files (so that a rename could
// replace it): refused with EACCES as its open would be, the file as it was.
TEST(write_file, a_file_the_writer_may_not_write_is_refused_though_its_folder_is_open) {
  const scratch_dir dir(fs::perms::all);
  ASSERT_FALSE(dir.path.empty());
  const std::string path = dir.file("plan.csv");
  write_trace(path, buffers(2));
  const auto before = file_bytes(path);
  // r--r--r--: as root, the child writes as nobody, for whom it is closed anyway.
  fs::permissions(path, fs::perms::owner_read | fs::perms::group_read | fs::perms::others_read);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (!drop_root()) _exit(91);
    const auto [error, message] = write_error([&] { write_trace(path, buffers(6)); });
    _exit(error == EACCES && message == "cannot write " + path + ": Permission denied" ? 0 : 1);
  }
  int status = 0;
  waitpid(child, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_EQ(file_bytes(path), before);
  EXPECT_EQ(names_in(dir.path), std::vector<std::string>{"plan.csv"});
}

// Where the new file cannot be linked to a name (a file system with unnamed files but no hard
// links: linkat refused), its bytes are copied into a new named file with its mode, through
// copy_file_range or, where that is refused too, through a buffer. A copy that fails (a
// write of it) fails the write, and leaves the old file and nothing else.
TEST(write_file, a_new_file_that_cannot_be_linked_is_copied_under_its_name) {
  const scratch_dir dir;
  ASSERT_FALSE(dir.path.empty());
  const std::string path = dir.file("plan.csv");
  struct way {
    std::vector<std::pair<long, int>> failing;
    bool written;
  };
  for (const way& w : {way{{{SYS_linkat, EPERM}}, true}, way{{{SYS_linkat, EMLINK}, {SYS_copy_file_range, ENOSYS}}, true},
                       way{{{SYS_linkat, EPERM}, {SYS_copy_file_range, EIO}}, false},
                       way{{{SYS_linkat, EPERM}, {SYS_copy_file_range, EXDEV}, {SYS_pwrite64, ENOSPC}}, false}}) {
    write_trace(path, buffers(2));
    ASSERT_EQ(::chmod(path.c_str(), 0640), 0);
    const auto before = file_bytes(path);
    const int status = swap::testing::with_failing_syscalls(w.failing, [&] {
      ::umask(077);  // (the copy's mode is set, not left to the mask)
      try {
        write_trace(path, buffers(300));
        return w.written;
      } catch (const std::system_error& e) {
        return !w.written && e.code().value() == w.failing.back().second &&
               std::string(e.what()).rfind("cannot write " + path + ": ", 0) == 0;
      }
    });
    if (status == 77) GTEST_SKIP() << "no seccomp filter here";
    EXPECT_EQ(status, 0) << w.failing.size() << " failing, the last " << w.failing.back().first;
    if (w.written) {
      EXPECT_EQ(read_trace(path).size(), 300u);
    } else {
      EXPECT_EQ(file_bytes(path), before);
    }
    struct stat st {};
    ASSERT_EQ(::stat(path.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 07777, 0640U);
    EXPECT_EQ(names_in(dir.path), std::vector<std::string>{"plan.csv"});
  }
}

// Each step of the replacement failing (made, its permissions set, synced, closed, renamed):
// the old file stays, no temporary file is left, and the error names the path with the
// step's errno.
TEST(write_file, a_failed_step_of_the_replacement_keeps_the_old_file) {
  const scratch_dir dir;
  ASSERT_FALSE(dir.path.empty());
  const std::string path = dir.file("plan.csv");
  write_trace(path, buffers(2));
  const auto before = file_bytes(path);
  struct step {
    long nr;
    int error;
  };
  for (const step s : {step{SYS_openat, EEXIST}, step{SYS_fsync, EIO}, step{SYS_rename, EXDEV}, step{SYS_close, EIO},
                       step{SYS_fchmod, EPERM}}) {
    const int status = swap::testing::with_failing_syscall(s.nr, s.error, [&] {
      const auto [error, message] = write_error([&] { write_trace(path, buffers(9)); });
      return error == s.error && message.rfind("cannot write " + path + ": ", 0) == 0;
    });
    if (status == 77) GTEST_SKIP() << "no seccomp filter here";
    EXPECT_EQ(status, 0) << "system call " << s.nr;
    EXPECT_EQ(file_bytes(path), before) << "system call " << s.nr;
    EXPECT_EQ(names_in(dir.path), std::vector<std::string>{"plan.csv"}) << "system call " << s.nr;
  }
}

}  // namespace
}  // namespace tensormem::trace
