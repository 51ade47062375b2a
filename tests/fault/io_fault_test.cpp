// Injected faults of the system calls that move and size files. This executable defines
// pread, pwrite, preadv, pwritev, fallocate, ftruncate, fsync, close and statvfs, so the library's
// calls in it come here first. Armed for the files under chosen folders, a call is
// interrupted (EINTR, as a signal makes it on a file system whose calls can be interrupted),
// moves fewer bytes than asked (as a network or user-space file system may), fails with a
// given errno, writes nothing, or reports a given free space; disarmed, or for any other file,
// each goes straight to the C library's. Regular files on a local disk never do most of these,
// so without the injection the code that handles them would never run.

#include <gtest/gtest.h>

#include <dlfcn.h>
#include <fcntl.h>
#include <sys/statvfs.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <vector>

#include "tensormem/io/file_io.hpp"
#include "tensormem/io/io_engine.hpp"
#include "tensormem/memory/pinned_pool.hpp"
#include "tensormem/offload/offloaded_optimizer.hpp"
#include "tensormem/offload/swap_space.hpp"
#include "tensormem/swap/tensor_swapper.hpp"
#include "../swap/swap_test_support.hpp"

namespace {

// What the armed calls do. The folders are set while disarmed; the rest may change while armed.
struct injection {
  std::atomic<bool> armed{false};
  std::vector<std::string> folders;           // canonical, each with a trailing '/'
  std::atomic<unsigned> interrupt_every{0};   // every k-th armed call fails with EINTR (0: none)
  std::atomic<unsigned> interrupt_next{0};    // this many armed calls fail with EINTR first
  std::atomic<unsigned> interrupt_sizing{0};  // this many armed fallocate, ftruncate and fsync calls,
                                              // each let through when repeated
  std::atomic<int> fail_fsync{0};             // an errno every armed fsync fails with (0: none)
  std::atomic<std::size_t> most_bytes{0};     // moved per call at most (0: no limit)
  std::atomic<int> fail_reads{0};             // an errno every armed read fails with (0: none)
  std::atomic<int> fail_writes{0};            // the same for writes
  std::atomic<bool> writes_move_nothing{false};  // armed writes return 0
  std::atomic<long long> free_bytes{-1};      // what statvfs says is free (-1: the truth)
  std::atomic<int> fail_statvfs{0};           // an errno statvfs fails with (0: none)
  std::atomic<long long> cut_before_read{-1};  // the next armed pread or preadv cuts its file to this first
  std::atomic<int> fail_close{0};             // an errno every armed close fails with, after
                                              // closing (as a network file system's may)
  std::atomic<long long> fallocate_room{-1};   // an armed fallocate past this many bytes fails
                                               // with fallocate_error (-1: the disk's own room)
  std::atomic<int> fallocate_error{ENOSPC};    // ENOSPC: the disk is full; EFBIG: past a file
                                               // size limit
  std::atomic<std::uint64_t> calls{0}, interrupted{0}, shortened{0}, failed{0};
};
injection inject;
std::atomic<bool> passed_last{true};  // the last fallocate, ftruncate or fsync was let through

// Arms the injection for the files under `folders` (the counters start at 0) until destroyed.
struct armed_for {
  explicit armed_for(const std::filesystem::path& folder) : armed_for(std::vector{folder}) {}
  explicit armed_for(const std::vector<std::filesystem::path>& folders) {
    inject.folders.clear();
    for (const auto& f : folders) inject.folders.push_back(std::filesystem::canonical(f).string() + "/");
    inject.calls = inject.interrupted = inject.shortened = inject.failed = 0;
    inject.armed = true;
  }
  ~armed_for() {
    inject.armed = false;
    inject.interrupt_every = inject.interrupt_next = inject.interrupt_sizing = 0;
    passed_last = true;
    inject.most_bytes = 0;
    inject.fail_reads = inject.fail_writes = inject.fail_fsync = 0;
    inject.writes_move_nothing = false;
    inject.free_bytes = -1;
    inject.fail_statvfs = 0;
    inject.cut_before_read = -1;
    inject.fallocate_room = -1;
    inject.fallocate_error = ENOSPC;
    inject.fail_close = 0;
  }
  armed_for(const armed_for&) = delete;
  armed_for& operator=(const armed_for&) = delete;
};

// The file an open descriptor names (empty where it cannot be told).
std::string path_of(int fd) {
  char link[40];
  std::snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  char path[4096];
  const ssize_t n = ::readlink(link, path, sizeof path);
  return n > 0 ? std::string(path, static_cast<std::size_t>(n)) : std::string();
}

bool under_a_folder(std::string_view path) {
  return std::any_of(inject.folders.begin(), inject.folders.end(),
                     [&](const std::string& f) { return path.starts_with(f) || f == std::string(path) + "/"; });
}

bool targeted(int fd) {
  if (!inject.armed.load()) return false;
  const std::string path = path_of(fd);
  return !path.empty() && under_a_folder(path);
}



// -1 with errno set where the call is to fail; otherwise 0, and `limit` is what it may move.
int decide(bool write, std::size_t asked, std::size_t& limit) {
  limit = asked;
  const std::uint64_t k = ++inject.calls;
  const unsigned every = inject.interrupt_every.load();
  unsigned next = inject.interrupt_next.load();
  bool interrupt = every != 0 && k % every == 0;
  while (!interrupt && next != 0) {
    if (inject.interrupt_next.compare_exchange_weak(next, next - 1)) interrupt = true;
  }
  if (interrupt) {
    ++inject.interrupted;
    errno = EINTR;
    return -1;
  }
  if (const int e = write ? inject.fail_writes.load() : inject.fail_reads.load(); e != 0) {
    ++inject.failed;
    errno = e;
    return -1;
  }
  if (write && inject.writes_move_nothing) {
    limit = 0;
    ++inject.shortened;
    return 0;
  }
  if (const std::size_t most = inject.most_bytes.load(); most != 0 && most < asked) {
    limit = most;
    ++inject.shortened;
  }
  return 0;
}

// The first segments of `iov` that hold `limit` bytes (the last one cut), into `out`.
int cut(const iovec* iov, int count, std::size_t limit, std::vector<iovec>& out) {
  for (int i = 0; i < count && limit != 0; ++i) {
    out.push_back({iov[i].iov_base, std::min(iov[i].iov_len, limit)});
    limit -= out.back().iov_len;
  }
  return static_cast<int>(out.size());
}

std::size_t total(const iovec* iov, int count) {
  std::size_t sum = 0;
  for (int i = 0; i < count; ++i) sum += iov[i].iov_len;
  return sum;
}

template <class F>
F next_definition(const char* name) {
  return reinterpret_cast<F>(::dlsym(RTLD_NEXT, name));
}

}  // namespace

extern "C" ssize_t pread(int fd, void* buffer, std::size_t bytes, off_t offset) {
  static const auto real = next_definition<ssize_t (*)(int, void*, std::size_t, off_t)>("pread");
  std::size_t limit = bytes;
  if (!targeted(fd)) return real(fd, buffer, bytes, offset);
  if (const long long cut = inject.cut_before_read.exchange(-1); cut >= 0) {
    ::truncate(path_of(fd).c_str(), static_cast<off_t>(cut));  // (as another process may, at any time)
  }
  if (decide(false, bytes, limit) < 0) return -1;
  return real(fd, buffer, limit, offset);
}

extern "C" ssize_t pwrite(int fd, const void* buffer, std::size_t bytes, off_t offset) {
  static const auto real = next_definition<ssize_t (*)(int, const void*, std::size_t, off_t)>("pwrite");
  std::size_t limit = bytes;
  if (targeted(fd) && decide(true, bytes, limit) < 0) return -1;
  if (limit == 0 && bytes != 0) return 0;
  return real(fd, buffer, limit, offset);
}

extern "C" ssize_t preadv(int fd, const iovec* iov, int count, off_t offset) {
  static const auto real = next_definition<ssize_t (*)(int, const iovec*, int, off_t)>("preadv");
  if (!targeted(fd)) return real(fd, iov, count, offset);
  if (const long long cut = inject.cut_before_read.exchange(-1); cut >= 0) {
    ::truncate(path_of(fd).c_str(), static_cast<off_t>(cut));
  }
  std::size_t limit = 0;
  if (decide(false, total(iov, count), limit) < 0) return -1;
  std::vector<iovec> part;
  return real(fd, part.data(), cut(iov, count, limit, part), offset);
}

extern "C" ssize_t pwritev(int fd, const iovec* iov, int count, off_t offset) {
  static const auto real = next_definition<ssize_t (*)(int, const iovec*, int, off_t)>("pwritev");
  if (!targeted(fd)) return real(fd, iov, count, offset);
  const std::size_t asked = total(iov, count);
  std::size_t limit = 0;
  if (decide(true, asked, limit) < 0) return -1;
  if (limit == 0 && asked != 0) return 0;
  std::vector<iovec> part;
  return real(fd, part.data(), cut(iov, count, limit, part), offset);
}

// fallocate, ftruncate and fsync: while interrupt_sizing lasts, every other call is
// interrupted (the first, then not its repetition, then the next), otherwise left alone.
bool interrupt_sizing(int fd) {
  if (!targeted(fd)) return false;
  if (!passed_last.exchange(true)) return false;  // the repetition of an interrupted call
  unsigned left = inject.interrupt_sizing.load();
  while (left != 0) {
    if (inject.interrupt_sizing.compare_exchange_weak(left, left - 1)) {
      passed_last = false;
      ++inject.interrupted;
      errno = EINTR;
      return true;
    }
  }
  return false;
}

extern "C" int fallocate(int fd, int mode, off_t offset, off_t length) {
  static const auto real = next_definition<int (*)(int, int, off_t, off_t)>("fallocate");
  if (interrupt_sizing(fd)) return -1;
  if (const long long room = inject.fallocate_room.load(); room >= 0 && offset + length > room && targeted(fd)) {
    ++inject.failed;
    errno = inject.fallocate_error.load();
    return -1;
  }
  return real(fd, mode, offset, length);
}

extern "C" int close(int fd) {
  static const auto real = next_definition<int (*)(int)>("close");
  const int e = inject.fail_close.load();
  const bool fail = e != 0 && targeted(fd);
  const int rc = real(fd);
  if (!fail) return rc;
  ++inject.failed;
  errno = e;
  return -1;
}

extern "C" int ftruncate(int fd, off_t length) {
  static const auto real = next_definition<int (*)(int, off_t)>("ftruncate");
  return interrupt_sizing(fd) ? -1 : real(fd, length);
}

extern "C" int fsync(int fd) {
  static const auto real = next_definition<int (*)(int)>("fsync");
  if (interrupt_sizing(fd)) return -1;
  if (const int e = inject.fail_fsync.load(); e != 0 && targeted(fd)) {
    errno = e;
    return -1;
  }
  return real(fd);
}

extern "C" int statvfs(const char* path, struct statvfs* out) {
  static const auto real = next_definition<int (*)(const char*, struct statvfs*)>("statvfs");
  const bool target = inject.armed.load() && under_a_folder(std::filesystem::weakly_canonical(path).string());
  if (target && inject.fail_statvfs != 0) {
    errno = inject.fail_statvfs;
    return -1;
  }
  const int rc = real(path, out);
  if (rc == 0 && target && inject.free_bytes >= 0) {
    out->f_frsize = 1;
    out->f_bavail = static_cast<fsblkcnt_t>(inject.free_bytes.load());
  }
  return rc;
}

namespace tensormem {
namespace {

using swap::testing::pattern;
using swap::testing::scratch_dir;
using swap::testing::aligned_buffer;
using swap::testing::file_bytes;
using io::io_completion;
using io::io_request;

// async_file_io on the thread engine, through the page cache: every transfer goes through the
// calls defined above.
io::file_io_options buffered_on_threads() {
  io::file_io_options options;
  options.engine = io::engine_kind::threads;
  options.direct = false;
  return options;
}

// The injection itself: a call on a file outside the folder is left alone, one inside it
// is cut and interrupted as told (so that the tests below test what they say).
TEST(injected_io, reaches_the_files_under_its_folder_only) {
  scratch_dir dir, other;
  const int in = ::open((dir.path / "f").c_str(), O_RDWR | O_CREAT, 0600);
  const int out = ::open((other.path / "f").c_str(), O_RDWR | O_CREAT, 0600);
  ASSERT_GE(in, 0);
  ASSERT_GE(out, 0);
  const auto data = pattern(10000, 1);
  {
    armed_for armed(dir.path);
    inject.most_bytes = 1000;
    inject.interrupt_next = 1;
    EXPECT_EQ(::pwrite(out, data.data(), data.size(), 0), 10000);
    EXPECT_EQ(::pwrite(in, data.data(), data.size(), 0), -1);
    EXPECT_EQ(errno, EINTR);
    EXPECT_EQ(::pwrite(in, data.data(), data.size(), 0), 1000);
    const iovec two[] = {{const_cast<std::byte*>(data.data()), 600}, {const_cast<std::byte*>(data.data()) + 600, 900}};
    EXPECT_EQ(::pwritev(in, two, 2, 0), 1000);
    inject.fail_reads = EIO;
    std::byte b[16];
    EXPECT_EQ(::pread(in, b, sizeof b, 0), -1);
    EXPECT_EQ(errno, EIO);
    EXPECT_EQ(::pread(out, b, sizeof b, 0), 16);
    EXPECT_EQ(inject.calls, 4U);
  }
  std::byte b[16];
  EXPECT_EQ(::pread(in, b, sizeof b, 0), 16);  // disarmed
  ::close(in);
  ::close(out);
}

io_request request(int fd, std::uint64_t offset, std::vector<std::byte>& a, std::vector<std::byte>& b, bool write) {
  return {fd, offset, a.data(), a.size(), write, offset, b.data(), b.size()};
}

// The thread engine continues transfers that come back short or interrupted: two-segment
// requests of odd sizes written and read back byte for byte, each completing whole.
TEST(injected_io, the_thread_engine_continues_short_and_interrupted_transfers) {
  scratch_dir dir;
  const std::string path = (dir.path / "data").string();
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT, 0600);
  ASSERT_GE(fd, 0);
  constexpr std::size_t first = 70001, second = 12345, span = first + second;
  std::vector<std::vector<std::byte>> heads, tails;
  for (std::uint64_t i = 0; i < 6; ++i) {
    heads.push_back(pattern(first, 10 + i));
    tails.push_back(pattern(second, 20 + i));
  }
  armed_for armed(dir.path);
  inject.most_bytes = 1000;
  inject.interrupt_every = 3;
  const auto engine = io::make_thread_engine(4, 2);
  const auto run = [&](bool write, std::vector<std::vector<std::byte>>& h, std::vector<std::vector<std::byte>>& t) {
    std::vector<io_request> requests;
    for (std::size_t i = 0; i < h.size(); ++i) requests.push_back(request(fd, i * span, h[i], t[i], write));
    engine->submit(requests);
    std::size_t seen = 0;
    while (engine->outstanding() != 0) {
      for (const io_completion& c : engine->wait(1)) {
        EXPECT_EQ(c.result, static_cast<std::int64_t>(span)) << "request at " << c.user_data;
        EXPECT_EQ(c.bytes, span);
        ++seen;
      }
    }
    EXPECT_EQ(seen, h.size());
  };
  run(true, heads, tails);
  std::vector<std::vector<std::byte>> h2(6, std::vector<std::byte>(first)), t2(6, std::vector<std::byte>(second));
  run(false, h2, t2);
  EXPECT_EQ(h2, heads);
  EXPECT_EQ(t2, tails);
  EXPECT_GT(inject.interrupted, 100U);
  EXPECT_GT(inject.shortened, 500U);
  ::close(fd);
  std::vector<std::byte> whole;
  for (std::size_t i = 0; i < 6; ++i) {
    whole.insert(whole.end(), heads[i].begin(), heads[i].end());
    whole.insert(whole.end(), tails[i].begin(), tails[i].end());
  }
  EXPECT_EQ(file_bytes(path), whole);
}

// A transfer that fails completes with -errno, and a write that moves nothing completes
// short with what it moved (0 here), not as a success and not as a loop.
TEST(injected_io, the_thread_engine_reports_a_failure_and_a_write_that_makes_no_progress) {
  scratch_dir dir;
  const int fd = ::open((dir.path / "data").c_str(), O_RDWR | O_CREAT, 0600);
  ASSERT_GE(fd, 0);
  auto a = pattern(5000, 3), b = pattern(3000, 4);
  const auto engine = io::make_thread_engine(2, 1);
  const auto one = [&](bool write) {
    const io_request r = request(fd, 0, a, b, write);
    engine->submit({&r, 1});
    const auto done = engine->wait(1);
    return done.size() == 1 ? done[0].result : std::int64_t{-99999};
  };
  armed_for armed(dir.path);
  inject.fail_writes = ENOSPC;
  EXPECT_EQ(one(true), -ENOSPC);
  inject.fail_writes = 0;
  inject.fail_reads = EIO;
  EXPECT_EQ(one(false), -EIO);
  inject.fail_reads = 0;
  inject.writes_move_nothing = true;
  inject.interrupt_next = 2;  // interrupted twice first: retried, then no progress
  EXPECT_EQ(one(true), 0);
  EXPECT_EQ(inject.interrupted, 2U);
  ::close(fd);
}

// async_file_io's validation reads the range back: interrupted and short reads are continued
// (the bytes are valid), buffered and with O_DIRECT.
TEST(injected_io, validation_reads_back_through_interruptions) {
  scratch_dir dir;
  for (const bool direct : {false, true}) {
    SCOPED_TRACE(direct ? "O_DIRECT" : "buffered");
    io::file_io_options options;
    options.engine = io::engine_kind::threads;
    options.direct = direct;
    options.block_bytes = 64 << 10;
    io::async_file_io io(options);
    const std::string path = (dir.path / (direct ? "d" : "b")).string();
    const std::size_t bytes = direct ? 300 * 4096 : 300001;
    aligned_buffer out(bytes), back(bytes);
    const auto data = pattern(bytes, 7);
    std::memcpy(out.data, data.data(), bytes);
    armed_for armed(dir.path);
    inject.most_bytes = direct ? 8192 : 777;  // O_DIRECT moves whole blocks
    inject.interrupt_every = 2;
    io.write(out.data, bytes, path, 0, true);
    auto r = io.wait();
    EXPECT_TRUE(r.errors.empty()) << r.errors[0].message;
    io.read(back.data, bytes, path, 0, true);
    r = io.wait();
    EXPECT_TRUE(r.errors.empty()) << r.errors[0].message;
    EXPECT_EQ(std::memcmp(back.data, data.data(), bytes), 0);
    EXPECT_GT(inject.interrupted, 10U);
    EXPECT_EQ(io.stats().failed, 0U);
  }
}

// A validation read that fails is reported with its errno and says it could not read back,
// not that the bytes differ; the operation counts as failed.
TEST(injected_io, a_validation_read_that_fails_is_reported_as_such) {
  scratch_dir dir;
  io::file_io_options options = buffered_on_threads();
  io::async_file_io io(options);
  const std::string path = (dir.path / "v").string();
  const auto data = pattern(20000, 8);
  armed_for armed(dir.path);
  inject.fail_reads = EIO;  // the write goes through; reading it back fails
  io.write(data.data(), data.size(), path, 0, true);
  const auto r = io.wait();
  ASSERT_EQ(r.errors.size(), 1U);
  EXPECT_EQ(r.errors[0].error, EIO);
  EXPECT_EQ(r.errors[0].message, "validation of " + path + " failed: cannot read the file's 20000 bytes at offset 0 "
                                  "back: " + std::generic_category().message(EIO));
  EXPECT_EQ(io.stats().failed, 1U);
  EXPECT_EQ(io.stats().bytes_written, 0U);
  inject.fail_reads = 0;
  EXPECT_EQ(file_bytes(path), data);  // the bytes themselves were written
}

// Validation reads the file again by its path when the operation is collected: a file cut
// short since (its read back interrupted on the way) fails as ending inside the range, and a
// file removed since fails with the errno of opening it (ENOENT), each saying so.
TEST(injected_io, validation_names_a_file_cut_or_removed_since_the_write) {
  scratch_dir dir;
  io::file_io_options options = buffered_on_threads();
  io::async_file_io io(options);
  const auto data = pattern(20000, 10);
  const auto finished = [&](std::uint64_t ops) {
    while (io.stats().ops < ops) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  };
  const std::string cut = (dir.path / "cut").string();
  io.write(data.data(), data.size(), cut, 0, true);
  finished(1);
  std::filesystem::resize_file(cut, 10000);
  {
    armed_for armed(dir.path);
    inject.most_bytes = 4000;
    inject.interrupt_every = 2;  // the read that finds the end comes right after an interrupted one
    const auto r = io.wait();
    ASSERT_EQ(r.errors.size(), 1U);
    EXPECT_EQ(r.errors[0].error, EBADMSG);
    EXPECT_EQ(r.errors[0].message, "validation of " + cut + " failed: the file ends 10000 bytes into the 20000 "
                                   "bytes at offset 0");
    EXPECT_GT(inject.interrupted, 2U);
  }
  const std::string gone = (dir.path / "gone").string();
  io.write(data.data(), data.size(), gone, 100, true);
  finished(2);
  std::filesystem::remove(gone);
  const auto r = io.wait();
  ASSERT_EQ(r.errors.size(), 1U);
  EXPECT_EQ(r.errors[0].error, ENOENT);
  EXPECT_EQ(r.errors[0].message, "validation of " + gone + " failed: cannot read the file's 20000 bytes at offset 100 "
                                 "back: " + std::generic_category().message(ENOENT));
  EXPECT_EQ(io.stats().failed, 2U);
}

// A write that moves nothing (a file system that stops making progress) fails its operation
// as a short write, 0 of its bytes, with EIO; it is never taken for a success.
TEST(injected_io, a_write_that_moves_nothing_fails_as_a_short_write) {
  scratch_dir dir;
  io::file_io_options options = buffered_on_threads();
  options.block_bytes = 4096;
  io::async_file_io io(options);
  const std::string path = (dir.path / "w").string();
  const auto data = pattern(10000, 9);
  armed_for armed(dir.path);
  inject.writes_move_nothing = true;
  io.write(data.data(), data.size(), path, 0);
  const auto r = io.wait();
  ASSERT_EQ(r.errors.size(), 1U);
  EXPECT_EQ(r.errors[0].error, EIO);
  // The blocks complete in any order; the first short one is named (4,096 or 1,808 bytes).
  EXPECT_TRUE(r.errors[0].message == "short write to " + path + ": 0 of 4096 bytes" ||
              r.errors[0].message == "short write to " + path + ": 0 of 1808 bytes")
      << r.errors[0].message;
  EXPECT_EQ(io.stats().failed, 1U);
  EXPECT_EQ(io.stats().bytes_written, 0U);
}

class injected_swap : public ::testing::TestWithParam<bool> {
 protected:
  memory::pinned_pool pool_;
  scratch_dir dir_;
};

swap::swap_result swap_out_result(swap::tensor_swapper& s, std::vector<std::byte>& t, const std::string& path) {
  const swap::tensor_ref refs[] = {{t.data(), t.size()}};
  const std::string paths[] = {path};
  return s.wait(s.swap_out(refs, paths))[0];
}
int swap_out_one(swap::tensor_swapper& s, std::vector<std::byte>& t, const std::string& path) {
  return swap_out_result(s, t, path).error;
}

swap::swap_result swap_in_one(swap::tensor_swapper& s, std::vector<std::byte>& t, const std::string& path) {
  const swap::tensor_ref refs[] = {{t.data(), t.size()}};
  const std::string paths[] = {path};
  return s.wait(s.swap_in(paths, refs))[0];
}

// The swapper on the thread engine, with every third call interrupted and every call short:
// tensors of odd sizes go out and come back byte for byte (checksums verified), buffered and
// with O_DIRECT.
TEST_P(injected_swap, tensors_round_trip_through_short_and_interrupted_transfers) {
  const bool direct = GetParam();
  swap::tensor_swapper s(pool_, {.engine = io::engine_kind::threads, .block_bytes = 64 << 10,
                                 .staging_buffers = 4, .direct = direct});
  armed_for armed(dir_.path);
  inject.most_bytes = direct ? 4096 : 1001;
  inject.interrupt_every = 3;
  for (const std::size_t bytes : {std::size_t{1}, std::size_t{4095}, std::size_t{200003}}) {
    auto t = pattern(bytes, bytes);
    const std::string path = dir_.file("t" + std::to_string(bytes));
    ASSERT_EQ(swap_out_one(s, t, path), 0);
    std::vector<std::byte> back(bytes);
    const swap::swap_result r = swap_in_one(s, back, path);
    EXPECT_EQ(r.error, 0) << r.message;
    EXPECT_EQ(back, t);
  }
  EXPECT_GT(inject.interrupted, 10U);
  EXPECT_GT(inject.shortened, 10U);
}

// A file cut short is still named as such when reading its header is interrupted or short:
// the header read is continued, not taken for a failure or for a file without a header.
TEST_P(injected_swap, a_cut_file_is_named_when_its_header_read_is_interrupted) {
  const bool direct = GetParam();
  swap::tensor_swapper s(pool_, {.engine = io::engine_kind::threads, .staging_buffers = 2, .direct = direct,
                                 .checksums = false});
  const std::size_t bytes = 100000;
  auto t = pattern(bytes, 5);
  const std::string path = dir_.file("cut");
  ASSERT_EQ(swap_out_one(s, t, path), 0);
  std::filesystem::resize_file(path, 3 * 4096);
  std::vector<std::byte> back(bytes);
  armed_for armed(dir_.path);
  inject.interrupt_next = 2;
  if (!direct) inject.most_bytes = 1000;  // (with O_DIRECT a read moves whole blocks)
  const swap::swap_result r = swap_in_one(s, back, path);
  EXPECT_EQ(r.error, EBADMSG) << r.message;
  EXPECT_NE(r.message.find(path + " is cut short: 12288 bytes"), std::string::npos) << r.message;
  EXPECT_EQ(inject.interrupted, 2U);
  EXPECT_EQ(back, std::vector<std::byte>(bytes));
}

// A pack's fallocate and a reused spare's ftruncate, interrupted, are repeated: the swap-outs
// succeed and read back (before, each failed its tensor with EINTR).
TEST_P(injected_swap, an_interrupted_fallocate_or_ftruncate_is_repeated) {
  const bool direct = GetParam();
  swap::tensor_swapper s(pool_, {.engine = io::engine_kind::threads, .staging_buffers = 2, .direct = direct,
                                 .pack_below = 64 << 10});
  auto small = pattern(10000, 11);
  const std::string packed = dir_.file("packed");
  {
    armed_for armed(dir_.path);
    inject.interrupt_sizing = 1;
    ASSERT_EQ(swap_out_one(s, small, packed), 0);
    EXPECT_EQ(inject.interrupted, 1U);  // the pack's fallocate
  }
  std::vector<std::byte> back(small.size());
  EXPECT_EQ(swap_in_one(s, back, packed).error, 0);
  EXPECT_EQ(back, small);
  // A path swapped out twice, larger then smaller: the second write goes into the spare,
  // which is cut to the new length.
  const std::string path = dir_.file("whole");
  auto large = pattern(300000, 12), smaller = pattern(100000, 13);
  ASSERT_EQ(swap_out_one(s, large, path), 0);
  ASSERT_EQ(swap_out_one(s, large, path), 0);  // the first version becomes the spare
  {
    armed_for armed(dir_.path);
    inject.interrupt_sizing = 1;
    ASSERT_EQ(swap_out_one(s, smaller, path), 0);
    EXPECT_EQ(inject.interrupted, 1U);
  }
  EXPECT_EQ(std::filesystem::file_size(path), 4096U + (100000U + 4095U) / 4096U * 4096U);
  back.assign(smaller.size(), std::byte{0});
  EXPECT_EQ(swap_in_one(s, back, path).error, 0);
  EXPECT_EQ(back, smaller);
}

// A file cut (by another process) after the swapper looked at its length: a read that finds
// the end moves 0 bytes, and the swap-in fails as a short read saying so, whether the cut
// leaves nothing or the header and the first block. Checksums are off, so only the read's
// length can tell; one engine thread, so the reads come in order.
TEST_P(injected_swap, a_read_that_finds_the_end_of_a_file_cut_since_fails_as_short) {
  swap::tensor_swapper s(pool_, {.block_bytes = 64 << 10, .staging_buffers = 2, .direct = GetParam(),
                                 .checksums = false},
                         io::make_thread_engine(8, 1));
  auto t = pattern(200000, 23);
  const std::string path = dir_.file("cut");
  for (const long long left : {0LL, 4096LL + (64 << 10)}) {
    SCOPED_TRACE(left);
    ASSERT_EQ(swap_out_one(s, t, path), 0);
    std::vector<std::byte> back(t.size());
    armed_for armed(dir_.path);
    inject.cut_before_read = left;
    const swap::swap_result r = swap_in_one(s, back, path);
    EXPECT_EQ(r.error, EIO);
    const int expected = left == 0 ? 4096 + (64 << 10) : 64 << 10;  // the header and first block, or a block
    EXPECT_EQ(r.message, "short read from " + path + ": 0 of " + std::to_string(expected) + " bytes");
  }
}

// A path whose current version is packed, swapped out again with a tensor too large for the
// pack that fails (EIO): the packed version stays current and reads back.
TEST_P(injected_swap, a_failed_swap_out_past_the_pack_keeps_the_packed_version) {
  swap::tensor_swapper s(pool_, {.engine = io::engine_kind::threads, .staging_buffers = 2, .direct = GetParam(),
                                 .pack_below = 64 << 10});
  auto small = pattern(10000, 24), large = pattern(300000, 25);
  const std::string path = dir_.file("p");
  ASSERT_EQ(swap_out_one(s, small, path), 0);
  ASSERT_EQ(s.stats().packed_tensors, 1U);
  {
    armed_for armed(dir_.path);
    inject.fail_writes = EIO;
    EXPECT_EQ(swap_out_one(s, large, path), EIO);
  }
  std::vector<std::byte> back(small.size());
  const swap::swap_result r = swap_in_one(s, back, path);
  EXPECT_EQ(r.error, 0) << r.message;
  EXPECT_EQ(back, small);
}

// A swap-out whose file fails to close (EIO: a network file system reports a failed write
// there) fails, saying so, and the path's previous version stays.
TEST_P(injected_swap, a_swap_out_whose_file_fails_to_close_fails_and_keeps_the_last_version) {
  swap::tensor_swapper s(pool_, {.engine = io::engine_kind::threads, .staging_buffers = 2, .direct = GetParam()});
  auto first = pattern(100000, 27), second = pattern(100000, 28);
  const std::string path = dir_.file("c");
  ASSERT_EQ(swap_out_one(s, first, path), 0);
  {
    armed_for armed(dir_.path);
    inject.fail_close = EIO;
    const auto r = swap_out_result(s, second, path);
    EXPECT_EQ(r.error, EIO);
    EXPECT_EQ(r.message.rfind("cannot close ", 0), 0U) << r.message;
    EXPECT_NE(r.message.find(std::string(": ") + std::strerror(EIO)), std::string::npos) << r.message;
  }
  std::vector<std::byte> back(first.size());
  EXPECT_EQ(swap_in_one(s, back, path).error, 0);
  EXPECT_EQ(back, first);
}

// A pack grows in steps of at least 64 MiB ahead of its writes. On a disk with room for the
// slot but not for the step (ENOSPC), or under a file size limit between them (EFBIG), the
// slot alone is reserved and the swap-out succeeds; with room for neither, that tensor's
// swap-out fails with the errno, naming it, and the pack's other tensors still read back.
TEST_P(injected_swap, a_pack_reserves_only_its_slot_where_the_step_ahead_does_not_fit) {
  for (const int error : {ENOSPC, EFBIG}) {
    SCOPED_TRACE(error);
    swap::tensor_swapper s(pool_, {.engine = io::engine_kind::threads, .staging_buffers = 2, .direct = GetParam(),
                                   .pack_below = 64 << 10});
    auto first = pattern(10000, 21), second = pattern(20000, 22);
    const std::string a = dir_.file("a"), b = dir_.file("b");
    {
      armed_for armed(dir_.path);
      inject.fallocate_error = error;
      inject.fallocate_room = 1 << 20;
      ASSERT_EQ(swap_out_one(s, first, a), 0);
      EXPECT_EQ(inject.failed, 1U);  // the 64 MiB step; then the slot's own end fits
      inject.fallocate_room = 0;
      const auto r = swap_out_result(s, second, b);
      EXPECT_EQ(r.error, error);
      EXPECT_EQ(r.message, "cannot grow the pack file for " + b + ": " + std::strerror(error));
    }
    std::vector<std::byte> back(first.size());
    EXPECT_EQ(swap_in_one(s, back, a).error, 0);
    EXPECT_EQ(back, first);
  }
}

// A file cut again between the swapper's look at its length and its read of the header (by
// another process), here to 1,000 bytes: named as too short for a swap file, buffered and
// under O_DIRECT (where the read that follows the short one starts at an unaligned offset; at
// the end of the file the kernel returns 0 for it rather than EINVAL).
TEST_P(injected_swap, a_file_cut_below_its_header_while_it_is_looked_at_is_named) {
  const bool direct = GetParam();
  swap::tensor_swapper s(pool_, {.engine = io::engine_kind::threads, .staging_buffers = 2, .direct = direct,
                                 .checksums = false});
  auto t = pattern(100000, 6);
  const std::string path = dir_.file("cut_again");
  ASSERT_EQ(swap_out_one(s, t, path), 0);
  std::filesystem::resize_file(path, 3 * 4096);
  std::vector<std::byte> back(t.size());
  armed_for armed(dir_.path);
  inject.cut_before_read = 1000;
  const swap::swap_result r = swap_in_one(s, back, path);
  EXPECT_EQ(r.error, EBADMSG) << r.message;
  EXPECT_EQ(r.message, path + " is not a tensormem swap file: 1000 bytes, less than a swap file's 4096-byte header");
  EXPECT_EQ(std::filesystem::file_size(path), 1000U);
}

INSTANTIATE_TEST_SUITE_P(buffered_and_direct, injected_swap, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& p) { return p.param ? "direct" : "buffered"; });

offload::optimizer_options optimizer_options_in(const scratch_dir& dir) {
  offload::optimizer_options o;
  o.swap.folders = {dir.path.string()};
  o.swap.stripe_bytes = 8192;
  o.group_bytes = 8192;
  o.pipeline.pinned_budget = 4 * 3 * 8192;
  return o;
}

// A swap space checks each folder's free space before the first write of a generation: a
// folder with one byte less than its share is full (ENOSPC, naming the folder, the tensor and
// the file; nothing queued), exactly its share is enough, and a folder whose free space cannot
// be asked fails the write with that errno. And a write whose stripes fail in two folders is
// reported once, naming the first failed stripe's file, after every stripe has finished.
TEST(injected_io, a_swap_space_checks_free_space_and_names_the_failed_stripe) {
  scratch_dir dir;
  offload::swap_space_options options;
  std::vector<std::filesystem::path> folders;
  for (const char* f : {"a", "b", "c"}) {
    folders.push_back(dir.path / f);
    std::filesystem::create_directory(folders.back());
    options.folders.push_back(folders.back().string());
  }
  options.stripe_bytes = 8192;
  options.io.engine = io::engine_kind::threads;
  offload::swap_space space(options);
  const std::size_t id = space.add("t", 9 * 8192 - 100);  // 9 stripes, 3 per folder, the last in c
  aligned_buffer buffer(space.padded_bytes(id));
  const auto data = pattern(space.padded_bytes(id), 2);
  std::memcpy(buffer.data, data.data(), data.size());
  const std::string b_file = space.path(id, 0, 1);
  {
    armed_for armed(folders[1]);
    inject.free_bytes = 3 * 8192 - 1;
    try {
      space.write(id, buffer.data);
      ADD_FAILURE() << "a write to a full folder was queued";
    } catch (const offload::offload_error& e) {
      EXPECT_EQ(e.error(), ENOSPC);
      EXPECT_EQ(e.tensor(), "t");
      EXPECT_EQ(e.path(), b_file);
      EXPECT_EQ(std::string(e.what()), "swap folder " + options.folders[1] + " is full: writing tensor t needs " +
                                           std::to_string(3 * 8192) + " bytes there, " + std::to_string(3 * 8192 - 1) +
                                           " are free");
    }
    EXPECT_FALSE(std::filesystem::exists(b_file));
    EXPECT_EQ(space.stats().io.requests, 0U);
    inject.free_bytes = -1;
    inject.fail_statvfs = EACCES;
    try {
      space.write(id, buffer.data);
      ADD_FAILURE() << "a write was queued without knowing the free space";
    } catch (const offload::offload_error& e) {
      EXPECT_EQ(e.error(), EACCES);
      EXPECT_NE(std::string(e.what()).find("cannot query the free space of "), std::string::npos) << e.what();
    }
    inject.fail_statvfs = 0;
    inject.free_bytes = 3 * 8192;  // exactly the share
    offload::swap_space::transfer t = space.write(id, buffer.data);
    space.finish(t);
    space.commit(id);
  }
  // The next generation's files are new too: its stripes fail in folders b and c.
  armed_for armed(std::vector{folders[1], folders[2]});
  inject.fail_writes = EIO;
  offload::swap_space::transfer t = space.write(id, buffer.data);
  try {
    space.finish(t);
    ADD_FAILURE() << "failed stripes were not reported";
  } catch (const offload::offload_error& e) {
    EXPECT_EQ(e.error(), EIO);
    EXPECT_EQ(e.tensor(), "t");
    EXPECT_EQ(e.path(), space.path(id, 1, 1)) << e.what();  // stripe 1, the first that failed, is in b
  }
  inject.fail_writes = 0;
  aligned_buffer back(space.padded_bytes(id));
  offload::swap_space::transfer r = space.read(id, back.data);  // the committed generation
  space.finish(r);
  EXPECT_EQ(std::memcmp(back.data, data.data(), space.bytes(id)), 0);
}

// Checkpoints are written and read with pwrite and pread: interrupted and short calls are
// continued (the loaded state equals the saved one), interrupted syncs are repeated, and a
// sync that fails or a write that makes no progress fails the save (EIO), leaving the previous
// checkpoint as it was.
TEST(injected_io, checkpoints_are_saved_and_loaded_through_interruptions) {
  scratch_dir swaps, checkpoints;
  const std::vector<std::uint64_t> numels = {5000, 3, 2048};
  std::vector<std::vector<float>> values;
  std::vector<const float*> initial;
  for (const std::uint64_t n : numels) {
    values.emplace_back(n);
    for (std::uint64_t i = 0; i < n; ++i) values.back()[i] = static_cast<float>(i % 97) * 0.25F - 3.0F;
    initial.push_back(values.back().data());
  }
  const auto records = [](offload::offloaded_optimizer& o) {
    std::vector<float> out;
    const std::size_t fields = o.fields().size();
    o.visit([&](const auto& g, const float* r) { out.insert(out.end(), r, r + fields * g.stride); });
    return out;
  };
  offload::offloaded_optimizer o(numels, optimizer_options_in(swaps));
  o.initialize(initial);
  const std::string ck = (checkpoints.path / "ck").string();
  {
    armed_for armed(checkpoints.path);
    inject.most_bytes = 777;
    inject.interrupt_every = 2;
    o.save(ck, "note");
    EXPECT_GT(inject.interrupted, 5U);
    offload::offloaded_optimizer back(numels, optimizer_options_in(swaps));
    back.load(ck);
    EXPECT_EQ(records(back), records(o));
    EXPECT_EQ(back.steps(), o.steps());
  }
  {
    // The file's sync and then its folder's, each interrupted once: repeated, and saved.
    armed_for armed(checkpoints.path);
    inject.interrupt_sizing = 2;
    o.save(ck, "synced");
    EXPECT_EQ(inject.interrupted, 2U);
    offload::offloaded_optimizer back(numels, optimizer_options_in(swaps));
    EXPECT_EQ(back.load(ck), "synced");
    // A sync that fails: the save fails with its errno, and the checkpoint stays as it was.
    const auto before = file_bytes(ck);
    inject.fail_fsync = EIO;
    try {
      o.save(ck, "not synced");
      ADD_FAILURE() << "a save whose sync failed succeeded";
    } catch (const std::system_error& e) {
      EXPECT_EQ(e.code().value(), EIO) << e.what();
      EXPECT_NE(std::string(e.what()).find("cannot sync " + ck + " (its new file, not yet named)"), std::string::npos) << e.what();
    }
    EXPECT_EQ(file_bytes(ck), before);
    EXPECT_EQ(swap::testing::temporary_files_in(checkpoints.path), std::vector<std::string>{});
  }
  {
    // A checkpoint cut inside its header (the sizes in the header are checked against the
    // file's later), read with every second call interrupted: the read that finds the end
    // follows an interrupted one, and the load says the file is truncated.
    const std::string cut = (checkpoints.path / "cut").string();
    std::filesystem::copy_file(ck, cut);
    std::filesystem::resize_file(cut, 60);
    armed_for armed(checkpoints.path);
    inject.most_bytes = 777;
    inject.interrupt_every = 2;
    offload::offloaded_optimizer back(numels, optimizer_options_in(swaps));
    try {
      back.load(cut);
      ADD_FAILURE() << "a truncated checkpoint was loaded";
    } catch (const std::system_error& e) {
      ADD_FAILURE() << "a truncated checkpoint read as a failed read: " << e.what();
    } catch (const std::runtime_error& e) {
      EXPECT_EQ(std::string(e.what()), "checkpoint " + cut + " is truncated");
    }
  }
  const auto saved = file_bytes(ck);
  armed_for armed(checkpoints.path);
  inject.interrupt_next = 1;  // (the write that moves nothing comes right after an interrupted one)
  inject.writes_move_nothing = true;
  try {
    o.save(ck);
    ADD_FAILURE() << "a save that writes nothing succeeded";
  } catch (const std::system_error& e) {
    EXPECT_EQ(e.code().value(), EIO) << e.what();
  }
  EXPECT_EQ(file_bytes(ck), saved);
  EXPECT_EQ(swap::testing::temporary_files_in(checkpoints.path), std::vector<std::string>{});
}

}  // namespace
}  // namespace tensormem
