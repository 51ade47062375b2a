// The swapper is asynchronous for real: transfers progress while the caller sleeps,
// checksums hold when blocks arrive in any order, and thousands of tensors pass through a
// small open-file limit.

#include <gtest/gtest.h>

#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <poll.h>
#include <sys/fanotify.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "tensormem/memory/pinned_pool.hpp"
#include "tensormem/swap/tensor_swapper.hpp"
#include "swap_test_support.hpp"

namespace tensormem::swap {
namespace {

namespace fs = std::filesystem;

using testing::pattern;
using testing::scratch_dir;

class async_test : public ::testing::TestWithParam<io::engine_kind> {};

TEST_P(async_test, a_swap_out_progresses_while_the_caller_sleeps) {
  scratch_dir dir;
  memory::pinned_pool pool({.slab_bytes = std::size_t{64} << 20});
  tensor_swapper s(pool, {.engine = GetParam(), .queue_depth = 8, .block_bytes = std::size_t{1} << 20,
                          .staging_buffers = 4});
  constexpr int count = 32;
  std::vector<std::vector<std::byte>> tensors;
  std::vector<tensor_ref> refs;
  std::vector<std::string> paths;
  for (int i = 0; i < count; ++i) {
    tensors.push_back(pattern(std::size_t{1} << 20, static_cast<std::uint64_t>(i)));
    refs.push_back({tensors.back().data(), tensors.back().size()});
    paths.push_back(dir.file("t" + std::to_string(i)));
  }
  const std::uint64_t ticket = s.swap_out(refs, paths);
  // No call into the swapper from here until every file is in place: only its own thread
  // can move the bytes. Files appear (renamed) only once complete.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  int complete = 0;
  std::size_t unfinished = s.unfinished(ticket);
  EXPECT_LE(unfinished, static_cast<std::size_t>(count));
  while (complete < count && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    // The count of unfinished tensors only goes down (what a progress display reads).
    const std::size_t now = s.unfinished(ticket);
    EXPECT_LE(now, unfinished);
    unfinished = now;
    complete = static_cast<int>(std::count_if(paths.begin(), paths.end(), [](const std::string& p) {
      return fs::exists(p) && fs::file_size(p) == 4096 + (std::size_t{1} << 20);
    }));
  }
  EXPECT_EQ(complete, count) << "bytes reached the disk only while the caller was inside the swapper";
  EXPECT_TRUE(s.done(ticket));
  EXPECT_EQ(s.unfinished(ticket), 0u);
  EXPECT_TRUE(s.outstanding(ticket));  // done, but not collected yet
  for (const auto& r : s.wait(ticket)) EXPECT_EQ(r.error, 0) << r.message;
  EXPECT_FALSE(s.outstanding(ticket));
  EXPECT_FALSE(s.outstanding(ticket + 1));  // never started
  EXPECT_THROW((void)s.unfinished(ticket), std::invalid_argument);  // already waited
}

// Completes every outstanding request at once, in reverse order of submission.
class reversing_engine final : public testing::forwarding_engine {
 public:
  using forwarding_engine::forwarding_engine;
  std::vector<io::io_completion> wait(std::size_t min_completions) override {
    std::vector<io::io_completion> all;
    // Give the swapper time to queue more, then take everything that is outstanding.
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    while (all.size() < std::max<std::size_t>(min_completions, 1) || inner_->outstanding() != 0) {
      auto some = inner_->wait(inner_->outstanding());
      all.insert(all.end(), some.begin(), some.end());
      if (inner_->outstanding() == 0) break;
    }
    std::reverse(all.begin(), all.end());
    reversed_ += all.size() > 1 ? 1 : 0;
    return all;
  }
  int reversed() const { return reversed_; }

 private:
  int reversed_ = 0;
};

TEST(async_checksums, hold_when_blocks_arrive_in_any_order) {
  scratch_dir dir;
  memory::pinned_pool pool({.slab_bytes = std::size_t{32} << 20});
  auto engine = std::make_unique<reversing_engine>(io::make_thread_engine(16, 4));
  reversing_engine* probe = engine.get();
  tensor_swapper s(pool, {.queue_depth = 16, .block_bytes = std::size_t{64} << 10, .staging_buffers = 4},
                   std::move(engine));
  auto t = pattern((std::size_t{3} << 20) + 123, 11);  // 49 blocks, the last one short
  const std::string path = dir.file("t");
  const tensor_ref out{t.data(), t.size()};
  ASSERT_EQ(s.wait(s.swap_out({&out, 1}, {&path, 1})).at(0).error, 0);
  std::vector<std::byte> back(t.size());
  const tensor_ref in{back.data(), back.size()};
  const auto r = s.wait(s.swap_in({&path, 1}, {&in, 1}));
  EXPECT_EQ(r.at(0).error, 0) << r.at(0).message;
  EXPECT_EQ(back, t);
  EXPECT_GT(probe->reversed(), 0);
  // One flipped bit in the middle block: found, whatever the order.
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(4096 + (std::size_t{3} << 19));
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x10);
    f.seekp(4096 + (std::size_t{3} << 19));
    f.write(&c, 1);
  }
  const auto bad = s.wait(s.swap_in({&path, 1}, {&in, 1}));
  EXPECT_EQ(bad.at(0).error, EBADMSG) << bad.at(0).message;
}

// A wait with a deadline (what Python's wait uses, in slices, to answer Ctrl-C) gives up
// without collecting anything: the ticket stays outstanding, and any thread may wait for it
// again, while one wait at a time is still the rule.
TEST(async_wait, a_wait_that_gives_up_leaves_the_ticket_to_be_waited_for_again) {
  using clock = std::chrono::steady_clock;
  using std::chrono::milliseconds;
  scratch_dir dir;
  memory::pinned_pool pool({.slab_bytes = std::size_t{16} << 20});
  auto gate = std::make_shared<testing::gate>();
  tensor_swapper s(pool, {.queue_depth = 4, .block_bytes = 4096, .staging_buffers = 2},
                   std::make_unique<testing::gated_engine>(io::make_thread_engine(4, 1), gate));
  auto t = pattern(100000, 61);
  const std::string path = dir.file("t");
  const tensor_ref ref{t.data(), t.size()};
  const std::uint64_t ticket = s.swap_out({&ref, 1}, {&path, 1});
  auto start = clock::now();
  EXPECT_FALSE(s.wait_until(ticket, start + milliseconds(100)).has_value());
  EXPECT_GE(clock::now() - start, milliseconds(100));
  EXPECT_TRUE(s.outstanding(ticket));
  EXPECT_FALSE(s.done(ticket));
  start = clock::now();
  EXPECT_FALSE(s.synchronize_until(start + milliseconds(50)));
  EXPECT_GE(clock::now() - start, milliseconds(50));
  EXPECT_TRUE(s.outstanding(ticket));
  EXPECT_FALSE(s.wait_until(ticket, clock::now() - milliseconds(1)).has_value());  // a deadline passed

  // A wait in slices keeps the ticket between slices: another wait is refused, synchronize
  // cannot take it; let go, the ticket is outstanding and free.
  {
    tensor_swapper::ticket_wait slices(s, ticket);
    EXPECT_FALSE(slices.until(clock::now() + milliseconds(50)).has_value());
    EXPECT_THROW((void)s.wait_until(ticket, clock::now()), std::invalid_argument);
    EXPECT_FALSE(s.synchronize_until(clock::now() + milliseconds(50)));
    EXPECT_FALSE(slices.until(clock::now() + milliseconds(50)).has_value());
  }
  EXPECT_TRUE(s.outstanding(ticket));

  // While a wait with a deadline runs, the ticket is taken: another wait is refused.
  std::thread waiting([&] { EXPECT_FALSE(s.wait_until(ticket, clock::now() + milliseconds(300)).has_value()); });
  std::this_thread::sleep_for(milliseconds(100));
  EXPECT_THROW((void)s.wait(ticket), std::invalid_argument);
  waiting.join();

  // Given up, it is free again: another thread waits for it, and the transfer ends.
  std::vector<swap_result> results;
  std::thread other([&] { results = s.wait(ticket); });
  std::this_thread::sleep_for(milliseconds(50));
  gate->open();
  other.join();
  ASSERT_EQ(results.size(), 1U);
  EXPECT_EQ(results[0].error, 0) << results[0].message;
  EXPECT_FALSE(s.outstanding(ticket));
  EXPECT_THROW((void)s.wait_until(ticket, clock::now()), std::invalid_argument);  // collected
  EXPECT_TRUE(s.synchronize_until(clock::now()));                                // nothing left

  // A wait in slices holds the ticket between its slices: another thread's wait is refused
  // and its synchronize cannot collect the ticket, even once the transfer has ended.
  {
    const std::uint64_t held = s.swap_out({&ref, 1}, {&path, 1});
    std::optional<tensor_swapper::ticket_wait> slices(std::in_place, s, held);
    EXPECT_THROW(tensor_swapper::ticket_wait(s, held), std::invalid_argument);
    while (!s.done(held)) std::this_thread::sleep_for(milliseconds(1));
    EXPECT_THROW((void)s.wait(held), std::invalid_argument);
    EXPECT_FALSE(s.synchronize_until(clock::now() + milliseconds(50)));
    EXPECT_TRUE(s.outstanding(held));
    const auto got = slices->until(clock::now() - milliseconds(1));  // finished: collected
    ASSERT_TRUE(got.has_value());
    EXPECT_EQ(got->at(0).error, 0) << got->at(0).message;
    EXPECT_FALSE(s.outstanding(held));
    EXPECT_THROW((void)slices->until(clock::now()), std::logic_error);
    slices.reset();  // collected: nothing to let go
    EXPECT_THROW(tensor_swapper::ticket_wait(s, held), std::invalid_argument);
  }
  // Let go uncollected, the ticket is any thread's to wait for.
  {
    const std::uint64_t kept = s.swap_out({&ref, 1}, {&path, 1});
    { const tensor_swapper::ticket_wait slices(s, kept); }
    EXPECT_TRUE(s.outstanding(kept));
    EXPECT_EQ(s.wait(kept).at(0).error, 0);
  }

  // A finished ticket is collected even at a deadline already passed; synchronize_until
  // collects every ticket in time.
  std::vector<std::byte> back(t.size());
  const tensor_ref in{back.data(), back.size()};
  const std::uint64_t read = s.swap_in({&path, 1}, {&in, 1});
  while (!s.done(read)) std::this_thread::sleep_for(milliseconds(1));
  const auto got = s.wait_until(read, clock::now() - milliseconds(1));
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->at(0).error, 0);
  EXPECT_EQ(back, t);
  const std::uint64_t again = s.swap_in({&path, 1}, {&in, 1});
  EXPECT_TRUE(s.synchronize_until(clock::now() + std::chrono::seconds(60)));
  EXPECT_FALSE(s.outstanding(again));
}

// Anonymous memory whose pages, at their first touch, hold the touching thread until
// `release` (a userfaultfd in missing mode): a swapper's worker that checksums or copies
// these bytes stays inside that checksum or copy for as long as a test wants.
class stalled_memory {
 public:
  explicit stalled_memory(std::size_t bytes) : bytes_(bytes) {
    base_ = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base_ == MAP_FAILED) {
      base_ = nullptr;
      why_ = std::string("mmap: ") + std::strerror(errno);
      return;
    }
    fd_ = static_cast<int>(syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK));
    uffdio_api api{.api = UFFD_API, .features = 0, .ioctls = 0};
    uffdio_register reg{};
    reg.range = {reinterpret_cast<std::uint64_t>(base_), bytes_};
    reg.mode = UFFDIO_REGISTER_MODE_MISSING;
    if (fd_ < 0 || ioctl(fd_, UFFDIO_API, &api) != 0 || ioctl(fd_, UFFDIO_REGISTER, &reg) != 0) {
      why_ = std::string("userfaultfd: ") + std::strerror(errno);
    }
  }
  ~stalled_memory() {
    if (fd_ >= 0) close(fd_);
    if (base_ != nullptr) munmap(base_, bytes_);
  }
  stalled_memory(const stalled_memory&) = delete;
  stalled_memory& operator=(const stalled_memory&) = delete;
  /// Empty where the memory stalls as it should; else why not (no userfaultfd here).
  const std::string& unusable() const { return why_; }
  std::byte* data() const { return static_cast<std::byte*>(base_); }
  /// True once some thread is held by a touch of the memory (within `limit`).
  bool a_thread_is_held(std::chrono::seconds limit) const {
    pollfd p{fd_, POLLIN, 0};
    return poll(&p, 1, static_cast<int>(limit.count() * 1000)) == 1;
  }
  /// Fills every page with `content` (bytes_ of it) and lets the held threads go on.
  void release(const std::vector<std::byte>& content) {
    if (released_) return;
    released_ = true;
    uffdio_copy copy{};
    copy.dst = reinterpret_cast<std::uint64_t>(base_);
    copy.src = reinterpret_cast<std::uint64_t>(content.data());
    copy.len = bytes_;
    EXPECT_EQ(ioctl(fd_, UFFDIO_COPY, &copy), 0) << std::strerror(errno);
  }

 private:
  std::size_t bytes_;
  void* base_ = nullptr;
  int fd_ = -1;
  bool released_ = false;
  std::string why_;
};

// While the swapper's worker is held (inside a checksum, a copy or a submission), a caller's
// done() and unfinished() of `ticket` and a swap-out of `other` to `other_path` are answered:
// each on a thread of its own, which would wait under the lock until `release` is called.
// Calls `release` either way; returns the new swap-out's ticket.
template <class Release>
std::uint64_t expect_answered_while_held(tensor_swapper& s, std::uint64_t ticket, std::vector<std::byte>& other,
                                         const std::string& other_path, Release release) {
  auto answered = std::async(std::launch::async, [&] {
    const bool done = s.done(ticket);
    const std::size_t unfinished = s.unfinished(ticket);
    const tensor_ref second{other.data(), other.size()};
    const std::uint64_t queued = s.swap_out({&second, 1}, {&other_path, 1});
    return std::tuple{done, unfinished, queued};
  });
  const bool in_time = answered.wait_for(std::chrono::seconds(30)) == std::future_status::ready;
  EXPECT_TRUE(in_time) << "done(), unfinished() and swap_out() waited for the held worker";
  release();
  const auto [done, unfinished, queued] = answered.get();
  EXPECT_FALSE(done);
  EXPECT_EQ(unfinished, 1U);
  return queued;
}

// The worker checksums and copies a job's blocks with the swapper's lock released: while it
// is held inside one (its tensor's memory stalled), the callers' done(), unfinished() and a
// new transfer answer at once. Under the lock, each of them waited for the worker's whole
// round of checksums (milliseconds a call).
struct stalled_case {
  const char* name;
  bool out;            // a swap-out (checksummed, or staged) or a swap-in (staged, copied)
  std::size_t offset;  // of the tensor in the stalled pages: 0 is aligned (written straight)
  bool checksums;
};

class stalled_worker : public ::testing::TestWithParam<stalled_case> {};

TEST_P(stalled_worker, callers_are_answered_while_the_worker_checksums_or_copies) {
  const stalled_case c = GetParam();
  constexpr std::size_t bytes = std::size_t{2} << 20;  // two blocks
  const std::size_t pages = bytes + 4096;
  scratch_dir dir;
  stalled_memory memory(pages);
  if (!memory.unusable().empty()) GTEST_SKIP() << "no stalled memory here: " << memory.unusable();
  auto content = pattern(pages, 71);
  auto other = pattern(bytes, 72);
  memory::pinned_pool pool({.slab_bytes = std::size_t{16} << 20});
  tensor_swapper s(pool, {.queue_depth = 8, .block_bytes = std::size_t{1} << 20, .staging_buffers = 2,
                          .checksums = c.checksums});
  // Whatever happens below, the held worker is let go before the swapper is destroyed.
  struct release_at_exit {
    stalled_memory& m;
    const std::vector<std::byte>& content;
    ~release_at_exit() { m.release(content); }
  } guard{memory, content};
  const std::string path = dir.file("stalled");
  const std::string other_path = dir.file("other");
  const tensor_ref stalled{memory.data() + c.offset, bytes};
  if (!c.out) {  // what the swap-in reads: the bytes the pages will hold once released
    const tensor_ref source{content.data() + c.offset, bytes};
    ASSERT_EQ(s.wait(s.swap_out({&source, 1}, {&path, 1})).at(0).error, 0);
  }
  const std::uint64_t ticket = c.out ? s.swap_out({&stalled, 1}, {&path, 1}) : s.swap_in({&path, 1}, {&stalled, 1});
  ASSERT_TRUE(memory.a_thread_is_held(std::chrono::seconds(60))) << "the worker never touched the tensor";
  const std::uint64_t queued =
      expect_answered_while_held(s, ticket, other, other_path, [&] { memory.release(content); });
  const auto r = s.wait(ticket);
  ASSERT_EQ(r.at(0).error, 0) << r.at(0).message;
  EXPECT_EQ(s.wait(queued).at(0).error, 0);
  // The bytes went through whole: out, read back; in, the tensor holds the file's bytes.
  std::vector<std::byte> back(bytes);
  if (c.out) {
    const tensor_ref in{back.data(), bytes};
    ASSERT_EQ(s.wait(s.swap_in({&path, 1}, {&in, 1})).at(0).error, 0);
  } else {
    std::memcpy(back.data(), memory.data() + c.offset, bytes);
  }
  EXPECT_TRUE(std::equal(back.begin(), back.end(), content.begin() + static_cast<std::ptrdiff_t>(c.offset)));
  std::vector<std::byte> second_back(bytes);
  const tensor_ref in{second_back.data(), bytes};
  ASSERT_EQ(s.wait(s.swap_in({&other_path, 1}, {&in, 1})).at(0).error, 0);
  EXPECT_EQ(second_back, other);
}

INSTANTIATE_TEST_SUITE_P(
    swapper, stalled_worker,
    ::testing::Values(stalled_case{"out_checksummed", true, 0, true}, stalled_case{"out_staged", true, 512, false},
                      stalled_case{"in_staged", false, 512, true}),
    [](const ::testing::TestParamInfo<stalled_case>& param) { return std::string(param.param.name); });


// The worker hands requests to the engine with the lock released: a submission can take
// milliseconds (the kernel starts the transfers in it), and under the lock the callers waited
// for it. Two blocks are submitted at the end of the worker's round; sixteen, eight at a time
// as they are queued.
class held_worker : public ::testing::TestWithParam<std::size_t> {};

TEST_P(held_worker, callers_are_answered_while_the_worker_submits) {
  scratch_dir dir;
  auto arrived = std::make_shared<testing::gate>();
  auto go = std::make_shared<testing::gate>();
  memory::pinned_pool pool({.slab_bytes = std::size_t{16} << 20});
  tensor_swapper s(pool, {.queue_depth = 16, .block_bytes = std::size_t{1} << 20, .staging_buffers = 2},
                   std::make_unique<testing::held_submit_engine>(io::make_thread_engine(16, 2), arrived, go));
  struct open_at_exit {
    testing::gate& g;
    ~open_at_exit() { g.open(); }
  } guard{*go};
  // In pinned memory, aligned: its blocks are written straight, none waits for staging.
  const auto t = pattern(GetParam() << 20, 81);
  auto* pinned = static_cast<std::byte*>(pool.allocate(t.size(), 4096));
  std::copy(t.begin(), t.end(), pinned);
  auto other = pattern(std::size_t{1} << 20, 82);
  const std::string path = dir.file("held");
  const std::string other_path = dir.file("other");
  const tensor_ref ref{pinned, t.size()};
  const std::uint64_t ticket = s.swap_out({&ref, 1}, {&path, 1});
  {
    const testing::hang_guard hang("the worker's first submission", std::chrono::seconds(60));
    arrived->pass();
  }
  const std::uint64_t queued = expect_answered_while_held(s, ticket, other, other_path, [&] { go->open(); });
  ASSERT_EQ(s.wait(ticket).at(0).error, 0);
  ASSERT_EQ(s.wait(queued).at(0).error, 0);
  std::vector<std::byte> back(t.size());
  const tensor_ref in{back.data(), back.size()};
  ASSERT_EQ(s.wait(s.swap_in({&path, 1}, {&in, 1})).at(0).error, 0);
  EXPECT_EQ(back, t);
  pool.free(pinned);
}

INSTANTIATE_TEST_SUITE_P(blocks, held_worker, ::testing::Values(std::size_t{2}, std::size_t{16}));

// Opens of the files in a folder wait until `release` (a fanotify listener that takes the
// permission events of the folder's files and answers none; root only): a swapper's worker
// that opens a swap file there stays inside open().
class held_opens {
 public:
  explicit held_opens(const std::string& folder) {
    fd_ = fanotify_init(FAN_CLASS_CONTENT | FAN_CLOEXEC, O_RDONLY);
    if (fd_ < 0 || fanotify_mark(fd_, FAN_MARK_ADD, FAN_OPEN_PERM | FAN_EVENT_ON_CHILD, AT_FDCWD, folder.c_str()) != 0) {
      why_ = std::string("fanotify: ") + std::strerror(errno);
    }
  }
  ~held_opens() { release(); }
  held_opens(const held_opens&) = delete;
  held_opens& operator=(const held_opens&) = delete;
  /// Empty where opens are held as they should be; else why not.
  const std::string& unusable() const { return why_; }
  /// True once an open of a file in the folder is held (within `limit`).
  bool an_open_is_held(std::chrono::seconds limit) {
    pollfd p{fd_, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(limit.count() * 1000)) != 1) return false;
    alignas(fanotify_event_metadata) char buffer[4096];
    ssize_t n = read(fd_, buffer, sizeof buffer);
    const bool any = n > 0;
    for (auto* m = reinterpret_cast<fanotify_event_metadata*>(buffer); n > 0 && FAN_EVENT_OK(m, n);
         m = FAN_EVENT_NEXT(m, n)) {
      if (m->fd >= 0) close(m->fd);
    }
    return any;
  }
  /// Lets every held open, and every later one, go on: closing the listener allows them all.
  void release() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
  std::string why_;
};

// The worker opens a swap file with the lock released: creating a file can take the file
// system a millisecond or more, and under the lock the callers waited for it.
class held_open : public ::testing::TestWithParam<bool> {};

TEST_P(held_open, callers_are_answered_while_the_worker_opens_a_file) {
  const bool out = GetParam();
  scratch_dir dir;    // the held folder
  scratch_dir other_dir;
  memory::pinned_pool pool({.slab_bytes = std::size_t{16} << 20});
  tensor_swapper s(pool, {.queue_depth = 8, .block_bytes = std::size_t{1} << 20, .staging_buffers = 2});
  auto t = pattern(std::size_t{1} << 20, 91);
  auto other = pattern(std::size_t{1} << 20, 92);
  const std::string path = dir.file("held");
  const std::string other_path = other_dir.file("other");
  const tensor_ref ref{t.data(), t.size()};
  std::vector<std::byte> back(t.size());
  const tensor_ref in{back.data(), back.size()};
  if (!out) {
    ASSERT_EQ(s.wait(s.swap_out({&ref, 1}, {&path, 1})).at(0).error, 0);
  }
  held_opens held(dir.path.string());
  if (!held.unusable().empty()) GTEST_SKIP() << "opens cannot be held here: " << held.unusable();
  const std::uint64_t ticket = out ? s.swap_out({&ref, 1}, {&path, 1}) : s.swap_in({&path, 1}, {&in, 1});
  ASSERT_TRUE(held.an_open_is_held(std::chrono::seconds(60))) << "the worker never opened the file";
  const std::uint64_t queued = expect_answered_while_held(s, ticket, other, other_path, [&] { held.release(); });
  ASSERT_EQ(s.wait(ticket).at(0).error, 0);
  ASSERT_EQ(s.wait(queued).at(0).error, 0);
  if (out) {
    ASSERT_EQ(s.wait(s.swap_in({&path, 1}, {&in, 1})).at(0).error, 0);
  }
  EXPECT_EQ(back, t);
}

INSTANTIATE_TEST_SUITE_P(swapper, held_open, ::testing::Values(true, false),
                         [](const ::testing::TestParamInfo<bool>& param) {
                           return std::string(param.param ? "swap_out" : "swap_in");
                         });

TEST_P(async_test, two_thousand_tensors_through_an_open_file_limit_of_256) {
  scratch_dir dir;
  const io::engine_kind kind = GetParam();
  const pid_t pid = fork();
  if (pid == 0) {
    rlimit limit{256, 256};
    if (setrlimit(RLIMIT_NOFILE, &limit) != 0) _exit(10);
    memory::pinned_pool pool({.slab_bytes = std::size_t{16} << 20});
    // Enough staging buffers and queue depth that only the open-file budget bounds the open files.
    tensor_swapper s(pool, {.engine = kind, .queue_depth = 512, .block_bytes = 4096, .staging_buffers = 1024});
    constexpr int count = 2000;
    std::vector<std::vector<std::byte>> tensors;
    std::vector<tensor_ref> refs;
    std::vector<std::string> paths;
    for (int i = 0; i < count; ++i) {
      tensors.push_back(pattern(4096 + static_cast<std::size_t>(i % 7) * 1000, static_cast<std::uint64_t>(i)));
      refs.push_back({tensors.back().data(), tensors.back().size()});
      paths.push_back(dir.file(std::to_string(i)));
    }
    // The files open under the folder, sampled while the tensors move: never more than the
    // swapper's budget, a quarter of the limit.
    std::atomic<bool> moving{true};
    std::size_t most_open = 0;
    std::thread sampler([&] {
      const std::string folder = dir.path.string() + "/";
      while (moving) {
        std::size_t open = 0;
        std::error_code ec;
        for (const auto& e : fs::directory_iterator("/proc/self/fd", ec)) {
          std::error_code link_ec;
          open += fs::read_symlink(e.path(), link_ec).string().starts_with(folder) ? 1U : 0U;
        }
        most_open = std::max(most_open, open);
      }
    });
    bool failed_out = false, failed_in = false;
    for (const auto& r : s.wait(s.swap_out(refs, paths))) failed_out = failed_out || r.error != 0;
    std::vector<std::vector<std::byte>> back;
    std::vector<tensor_ref> in;
    for (const auto& t : tensors) back.emplace_back(t.size());
    for (auto& b : back) in.push_back({b.data(), b.size()});
    for (const auto& r : s.wait(s.swap_in(paths, in))) failed_in = failed_in || r.error != 0;
    moving = false;
    sampler.join();
    if (failed_out) _exit(1);
    if (failed_in) _exit(2);
    if (most_open > 256U / 4 || most_open == 0) _exit(4);
    _exit(back == tensors ? 0 : 3);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0)
      << "1: swap-out failed, 2: swap-in failed, 3: contents differ, 4: more files open than the budget of 64 "
         "(or none seen), 10: setrlimit";
}

INSTANTIATE_TEST_SUITE_P(engines, async_test,
                         ::testing::Values(io::engine_kind::uring, io::engine_kind::threads),
                         [](const auto& p) { return std::string(io::to_string(p.param)); });

}  // namespace
}  // namespace tensormem::swap
