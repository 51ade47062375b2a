#include "tensormem/core/replay.hpp"

#include <algorithm>
#include <tuple>

namespace tensormem::core {

std::vector<replay_event> replay_order(std::span<const buffer> buffers) {
  struct keyed {
    std::uint64_t time;
    bool allocate;
    std::uint32_t index;
  };
  std::vector<keyed> events;
  events.reserve(buffers.size() * 2);
  for (std::size_t i = 0; i < buffers.size(); ++i) {
    const auto index = static_cast<std::uint32_t>(i);
    events.push_back({buffers[i].lower, true, index});
    events.push_back({buffers[i].upper, false, index});
  }
  std::sort(events.begin(), events.end(), [](const keyed& a, const keyed& b) {
    return std::tie(a.time, a.allocate, a.index) < std::tie(b.time, b.allocate, b.index);
  });
  std::vector<replay_event> order;
  order.reserve(events.size());
  for (const keyed& e : events) order.push_back({e.index, e.allocate});
  return order;
}

}  // namespace tensormem::core
