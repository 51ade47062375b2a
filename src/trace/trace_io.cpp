#include "tensormem/trace/trace_io.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <optional>
#include <string_view>
#include <system_error>

#include "tensormem/io/path_argument.hpp"
#include "write_file.hpp"

namespace tensormem::trace {

namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r'))
    s.remove_suffix(1);
  return s;
}

// The fields of a line split at commas: the first `kept` of them, and how many there are.
struct split_line {
  static constexpr std::size_t kept = 6;
  std::array<std::string_view, kept> fields;
  std::size_t count = 0;
};

split_line split(std::string_view line) {
  split_line out;
  std::size_t start = 0;
  while (true) {
    const std::size_t comma = line.find(',', start);
    const std::string_view field = line.substr(start, comma == std::string_view::npos ? comma : comma - start);
    if (out.count < split_line::kept) out.fields[out.count] = trim(field);
    ++out.count;
    if (comma == std::string_view::npos) return out;
    start = comma + 1;
  }
}

// Lines of a stream read in large blocks (a line is a view into the block, valid until the
// next call). A line longer than max_line_bytes is an error, never buffered whole.
class line_reader {
 public:
  line_reader(std::istream& in, const std::string& name)
      : in_(in), name_(name), block_(max_line_bytes + read_size) {}

  // The next line without its '\n'; false at the end of input. `line_number` names the
  // line in an error.
  bool next(std::string_view& line, std::size_t line_number) {
    std::size_t scanned = begin_;  // no '\n' in [begin_, scanned)
    for (;;) {
      if (const void* nl = std::memchr(block_.data() + scanned, '\n', end_ - scanned)) {
        const auto at = static_cast<std::size_t>(static_cast<const char*>(nl) - block_.data());
        check_length(at - begin_, line_number);
        line = std::string_view(block_.data() + begin_, at - begin_);
        begin_ = at + 1;
        return true;
      }
      check_length(end_ - begin_, line_number);
      if (at_end_) {
        if (begin_ == end_) return false;
        line = std::string_view(block_.data() + begin_, end_ - begin_);
        begin_ = end_;
        return true;
      }
      // Keep the partial line (at most max_line_bytes), at the front, and read more behind it.
      const std::size_t partial = end_ - begin_;
      std::memmove(block_.data(), block_.data() + begin_, partial);
      begin_ = 0;
      end_ = scanned = partial;
      const std::streamsize got = in_.rdbuf()->sgetn(block_.data() + end_, static_cast<std::streamsize>(read_size));
      if (got <= 0) {
        at_end_ = true;
        in_.setstate(std::ios::eofbit);
      } else {
        end_ += static_cast<std::size_t>(got);
      }
    }
  }

 private:
  static constexpr std::size_t read_size = std::size_t{1} << 20;

  void check_length(std::size_t bytes, std::size_t line_number) const {
    if (bytes > max_line_bytes) {
      throw trace_error(name_ + ":" + std::to_string(line_number) + ": line longer than " +
                        std::to_string(max_line_bytes) + " bytes");
    }
  }

  std::istream& in_;
  const std::string& name_;
  std::vector<char> block_;
  std::size_t begin_ = 0;
  std::size_t end_ = 0;
  bool at_end_ = false;
};

// The buffers read so far, indexed by id: open addressing on (hash of the id, position),
// so that a probe or a rehash reads the buffers only when two hashes are equal.
class id_index {
 public:
  explicit id_index(const std::vector<core::buffer>& buffers) : buffers_(buffers), slots_(1024) {}

  static std::size_t hash_of(std::string_view id) { return std::hash<std::string_view>{}(id); }

  // Starts fetching the slot where an id of this hash is looked up (a table of a million ids
  // does not fit in the caches: a miss per line otherwise).
  void prefetch(std::size_t hash) const noexcept { __builtin_prefetch(&slots_[hash & (slots_.size() - 1)]); }

  // Adds buffers_[i], whose id hashes to `hash`; returns the position of an earlier buffer
  // with the same id, if any.
  std::optional<std::size_t> insert(std::size_t i, std::size_t hash) {
    if (2 * (count_ + 1) > slots_.size()) grow();
    const std::string_view id = buffers_[i].id;
    for (std::size_t s = hash & (slots_.size() - 1);; s = (s + 1) & (slots_.size() - 1)) {
      if (slots_[s].position == empty) {
        slots_[s] = {hash, i};
        ++count_;
        return std::nullopt;
      }
      if (slots_[s].hash == hash && buffers_[slots_[s].position].id == id) return slots_[s].position;
    }
  }

 private:
  static constexpr std::size_t empty = ~std::size_t{0};
  struct slot {
    std::size_t hash = 0;
    std::size_t position = empty;
  };

  void grow() {
    std::vector<slot> old(slots_.size() * 2);
    old.swap(slots_);
    for (const slot& x : old) {
      if (x.position == empty) continue;
      std::size_t s = x.hash & (slots_.size() - 1);
      while (slots_[s].position != empty) s = (s + 1) & (slots_.size() - 1);
      slots_[s] = x;
    }
  }

  const std::vector<core::buffer>& buffers_;
  std::vector<slot> slots_;
  std::size_t count_ = 0;
};

}  // namespace

std::ifstream open_input(const std::string& path) {
  io::check_path_argument("cannot read a trace", path);
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) {
    throw std::system_error(errno, std::generic_category(), path + ":0: cannot open");
  }
  if (!S_ISREG(st.st_mode) && !S_ISFIFO(st.st_mode)) {
    throw trace_error(path + ":0: not a regular file or a pipe");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw std::system_error(errno, std::generic_category(), path + ":0: cannot open");
  }
  return in;
}

bool read_line(std::istream& in, std::string& line, std::size_t max_bytes, const std::string& name,
               std::size_t line_number) {
  line.clear();
  std::streambuf* buf = in.rdbuf();
  bool any = false;
  for (;;) {
    const int c = buf->sbumpc();
    if (c == std::char_traits<char>::eof()) {
      in.setstate(std::ios::eofbit);
      return any;
    }
    any = true;
    if (c == '\n') return true;
    if (line.size() >= max_bytes) {
      throw trace_error(name + ":" + std::to_string(line_number) + ": line longer than " +
                        std::to_string(max_bytes) + " bytes");
    }
    line.push_back(static_cast<char>(c));
  }
}

std::size_t first_non_text_byte(std::string_view text) noexcept {
  std::size_t i = 0;
  while (i < text.size()) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7f) {
      ++i;
      continue;
    }
    // A lead byte: how many continuation bytes follow, and the range of the first of them
    // (narrower after E0, ED, F0 and F4: no overlong forms, surrogates or code points past
    // U+10FFFF); the rest lie in 80-BF.
    std::size_t more = 0;
    unsigned low = 0x80;
    unsigned high = 0xbf;
    if (c >= 0xc2 && c <= 0xdf) {
      more = 1;
    } else if (c >= 0xe0 && c <= 0xef) {
      more = 2;
      low = c == 0xe0 ? 0xa0 : 0x80;
      high = c == 0xed ? 0x9f : 0xbf;
    } else if (c >= 0xf0 && c <= 0xf4) {
      more = 3;
      low = c == 0xf0 ? 0x90 : 0x80;
      high = c == 0xf4 ? 0x8f : 0xbf;
    } else {
      return i;  // a control character, a continuation byte alone, C0, C1 or F5-FF
    }
    if (text.size() - i <= more) return i;
    for (std::size_t k = 1; k <= more; ++k) {
      const auto t = static_cast<unsigned char>(text[i + k]);
      if (t < (k == 1 ? low : 0x80U) || t > (k == 1 ? high : 0xbfU)) return i;
    }
    i += more + 1;
  }
  return text.size();
}

std::string brief(std::string_view field) {
  constexpr std::size_t shown = 40;
  const std::string_view head = field.substr(0, shown);
  std::string quoted = "'";
  for_each_text_run(head, [&](std::string_view run) { quoted.append(run); }, [&](unsigned char b) {
    char code[5];
    std::snprintf(code, sizeof code, "\\x%02X", b);
    quoted += code;
  });
  if (field.size() <= shown) return quoted + "'";
  return quoted + "...' (" + std::to_string(field.size()) + " bytes)";
}

std::vector<core::buffer> read_trace(std::istream& in, const std::string& name) {
  std::size_t line_number = 0;

  bool has_offset = false;
  bool header_seen = false;
  std::vector<core::buffer> buffers;
  std::vector<std::size_t> line_of;  // of each buffer, for the duplicate-id message
  id_index ids(buffers);
  // The ids of the last buffers read go into the index a few lines late, their slots fetched
  // meanwhile. Every error first adds them, in order, so that a repeated id on an earlier
  // line is the error reported, as if each id had been added at once.
  constexpr std::size_t batch = 16;
  std::array<std::size_t, batch> hashes{};
  std::size_t waiting = 0;  // the last `waiting` buffers are not in the index yet
  auto error_at = [&](std::size_t line, const std::string& what) {
    return trace_error(name + ":" + std::to_string(line) + ": " + what);
  };
  auto add_waiting = [&] {
    const std::size_t first = buffers.size() - waiting;
    for (std::size_t k = 0; k < waiting; ++k) {
      if (const auto earlier = ids.insert(first + k, hashes[k])) {
        throw error_at(line_of[first + k], "duplicate id " + brief(buffers[first + k].id) + " (first on line " +
                                               std::to_string(line_of[*earlier]) + ")");
      }
    }
    waiting = 0;
  };
  auto fail = [&](const std::string& what) {
    add_waiting();
    return error_at(line_number, what);
  };
  line_reader lines(in, name);
  std::string_view raw;

  for (;;) {
    try {
      if (!lines.next(raw, line_number + 1)) break;
    } catch (const trace_error&) {
      add_waiting();
      throw;
    }
    ++line_number;
    std::string_view text = trim(raw);
    if (!header_seen && starts_with_byte_order_mark(text)) text = trim(text.substr(3));
    if (text.empty()) continue;
    const split_line split_text = split(text);
    const auto& fields = split_text.fields;
    if (!header_seen) {
      header_seen = true;
      const bool base = split_text.count >= 4 && fields[0] == "id" && fields[1] == "lower" &&
                        fields[2] == "upper" && fields[3] == "size";
      has_offset = split_text.count == 5 && fields[4] == "offset";
      if (!base || (split_text.count != 4 && !has_offset)) {
        throw fail("expected the header 'id,lower,upper,size' or 'id,lower,upper,size,offset'");
      }
      continue;
    }
    const std::size_t want = has_offset ? 5 : 4;
    if (split_text.count != want) {
      const bool quoted = text.find('"') != std::string_view::npos;
      throw fail("expected " + std::to_string(want) + " columns, found " + std::to_string(split_text.count) +
                 (quoted ? " (quotes are not read: an id cannot hold a comma)" : ""));
    }
    static constexpr const char* column_names[] = {"id", "lower", "upper", "size", "offset"};
    std::uint64_t values[5] = {};
    for (std::size_t c = 1; c < want; ++c) {
      const std::string_view f = fields[c];
      if (f.empty()) throw fail(std::string("empty ") + column_names[c] + " column");
      if (f.front() == '-')
        throw fail(std::string(column_names[c]) + " is negative: " + brief(f));
      const auto [end, ec] = std::from_chars(f.data(), f.data() + f.size(), values[c]);
      if (ec == std::errc::result_out_of_range)
        throw fail(std::string(column_names[c]) + " does not fit in 64 bits: " + brief(f));
      if (ec != std::errc() || end != f.data() + f.size())
        throw fail(std::string(column_names[c]) + " is not an unsigned integer: " + brief(f));
    }
    if (fields[0].empty()) throw fail("empty id column");
    if (const std::size_t bad = first_non_text_byte(fields[0]); bad != fields[0].size()) {
      throw fail("the id " + brief(fields[0]) + " is not UTF-8 text without control characters (byte " +
                 std::to_string(bad + 1) + ")");
    }
    core::buffer b;
    b.id = std::string(fields[0]);
    b.lower = values[1];
    b.upper = values[2];
    b.bytes = values[3];
    if (has_offset) b.offset = values[4];
    if (b.lower >= b.upper) {
      throw fail("lower " + std::to_string(b.lower) + " is not below upper " +
                 std::to_string(b.upper) + " (lifetimes are half-open)");
    }
    buffers.push_back(std::move(b));
    line_of.push_back(line_number);
    hashes[waiting] = id_index::hash_of(buffers.back().id);
    ids.prefetch(hashes[waiting]);
    if (++waiting == batch) add_waiting();
  }
  add_waiting();
  if (in.bad()) throw fail("read error");
  if (!header_seen) throw trace_error(name + ":1: empty file: expected a header");
  if (buffers.empty()) throw fail("no buffers after the header");
  return buffers;
}

std::vector<core::buffer> read_trace(const std::string& path) {
  std::ifstream in = open_input(path);
  return read_trace(in, path);
}

void write_trace(std::ostream& out, const std::vector<core::buffer>& buffers) {
  const bool with_offset = !buffers.empty() && std::all_of(buffers.begin(), buffers.end(),
                                                           [](const core::buffer& b) {
                                                             return b.offset.has_value();
                                                           });
  out << (with_offset ? "id,lower,upper,size,offset\n" : "id,lower,upper,size\n");
  for (const core::buffer& b : buffers) {
    out << b.id << ',' << b.lower << ',' << b.upper << ',' << b.bytes;
    if (with_offset) out << ',' << *b.offset;
    out << '\n';
  }
}

void write_trace(const std::string& path, const std::vector<core::buffer>& buffers) {
  detail::write_file(path, [&](std::ostream& out) { write_trace(out, buffers); });
}

}  // namespace tensormem::trace
