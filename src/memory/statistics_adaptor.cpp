#include "tensormem/memory/statistics_adaptor.hpp"

#include <algorithm>
#include <ostream>
#include <sstream>
#include <vector>

namespace tensormem::memory {

void* statistics_adaptor::do_allocate(std::size_t bytes, std::size_t alignment) {
  void* p = upstream_.allocate(bytes, alignment);
  const std::lock_guard lock(mutex_);
  c_.current_bytes += bytes;
  c_.peak_bytes = std::max(c_.peak_bytes, c_.current_bytes);
  c_.total_bytes += bytes;
  ++c_.current_allocations;
  c_.peak_allocations = std::max(c_.peak_allocations, c_.current_allocations);
  ++c_.total_allocations;
  return p;
}

void statistics_adaptor::do_deallocate(void* p, std::size_t bytes, std::size_t alignment) noexcept {
  upstream_.deallocate(p, bytes, alignment);
  const std::lock_guard lock(mutex_);
  c_.current_bytes -= std::min<std::uint64_t>(c_.current_bytes, bytes);
  if (c_.current_allocations != 0) --c_.current_allocations;
  ++c_.total_deallocations;
}

resource_counters statistics_adaptor::counters() const {
  const std::lock_guard lock(mutex_);
  return c_;
}

void* tracking_adaptor::do_allocate(std::size_t bytes, std::size_t alignment) {
  void* p = upstream_.allocate(bytes, alignment);
  try {
    const std::lock_guard lock(mutex_);
    live_.emplace(p, record{bytes, sequence_});
    ++sequence_;  // (only once recorded: a failed allocation leaves no gap in the numbers)
  } catch (...) {
    upstream_.deallocate(p, bytes, alignment);
    throw;
  }
  return p;
}

void tracking_adaptor::do_deallocate(void* p, std::size_t bytes, std::size_t alignment) noexcept {
  {
    const std::lock_guard lock(mutex_);
    live_.erase(p);
  }
  upstream_.deallocate(p, bytes, alignment);
}

std::size_t tracking_adaptor::outstanding() const {
  const std::lock_guard lock(mutex_);
  return live_.size();
}

std::size_t tracking_adaptor::outstanding_bytes() const {
  const std::lock_guard lock(mutex_);
  std::size_t total = 0;
  for (const auto& [p, r] : live_) total += r.bytes;
  return total;
}

std::string tracking_adaptor::leak_report() const {
  std::vector<std::pair<std::uint64_t, std::pair<void*, std::size_t>>> rows;
  {
    const std::lock_guard lock(mutex_);
    for (const auto& [p, r] : live_) rows.push_back({r.sequence, {p, r.bytes}});
  }
  std::sort(rows.begin(), rows.end());
  std::ostringstream out;
  for (const auto& [seq, info] : rows) {
    out << '#' << seq << ' ' << info.first << ' ' << info.second << " bytes\n";
  }
  return out.str();
}

trace_log_adaptor::trace_log_adaptor(memory_resource& upstream, std::ostream& out)
    : upstream_(upstream), out_(out) {
  out_ << "id,lower,upper,size\n";
}

trace_log_adaptor::~trace_log_adaptor() { flush(); }

void* trace_log_adaptor::do_allocate(std::size_t bytes, std::size_t alignment) {
  void* p = upstream_.allocate(bytes, alignment);
  try {
    const std::lock_guard lock(mutex_);
    live_.emplace(p, open_buffer{next_id_, clock_, bytes});
    ++next_id_;  // (only once recorded: a failed allocation takes no id and no time step)
    ++clock_;
  } catch (...) {
    upstream_.deallocate(p, bytes, alignment);
    throw;
  }
  return p;
}

void trace_log_adaptor::do_deallocate(void* p, std::size_t bytes, std::size_t alignment) noexcept {
  {
    const std::lock_guard lock(mutex_);
    if (const auto it = live_.find(p); it != live_.end()) {
      const open_buffer b = it->second;
      live_.erase(it);
      out_ << 'a' << b.id << ',' << b.lower << ',' << clock_++ << ',' << b.bytes << '\n';
    }
  }
  upstream_.deallocate(p, bytes, alignment);
}

void trace_log_adaptor::flush() {
  const std::lock_guard lock(mutex_);
  std::vector<open_buffer> open;
  for (const auto& [p, b] : live_) open.push_back(b);
  std::sort(open.begin(), open.end(),
            [](const open_buffer& a, const open_buffer& b) { return a.id < b.id; });
  for (const open_buffer& b : open) {
    out_ << 'a' << b.id << ',' << b.lower << ',' << clock_ + 1 << ',' << b.bytes << '\n';
  }
  live_.clear();
  out_.flush();
}

}  // namespace tensormem::memory
