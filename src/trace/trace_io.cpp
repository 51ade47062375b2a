#include "tensormem/trace/trace_io.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <fstream>
#include <string_view>
#include <system_error>
#include <unordered_map>

#include "tensormem/io/path_argument.hpp"
#include "write_file.hpp"

namespace tensormem::trace {

namespace {

std::vector<std::string_view> split(std::string_view line) {
  std::vector<std::string_view> fields;
  std::size_t start = 0;
  while (true) {
    const std::size_t comma = line.find(',', start);
    if (comma == std::string_view::npos) {
      fields.push_back(line.substr(start));
      return fields;
    }
    fields.push_back(line.substr(start, comma - start));
    start = comma + 1;
  }
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r'))
    s.remove_suffix(1);
  return s;
}

}  // namespace

std::ifstream open_input(const std::string& path) {
  io::check_path_argument("cannot read a trace", path);
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) {
    const std::error_code ec(errno, std::generic_category());
    throw trace_error(path + ":0: cannot open: " + ec.message());
  }
  if (!S_ISREG(st.st_mode) && !S_ISFIFO(st.st_mode)) {
    throw trace_error(path + ":0: not a regular file or a pipe");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const std::error_code ec(errno, std::generic_category());
    throw trace_error(path + ":0: cannot open: " + ec.message());
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

std::string brief(std::string_view field) {
  constexpr std::size_t shown = 40;
  if (field.size() <= shown) return "'" + std::string(field) + "'";
  return "'" + std::string(field.substr(0, shown)) + "...' (" + std::to_string(field.size()) + " bytes)";
}

std::vector<core::buffer> read_trace(std::istream& in, const std::string& name) {
  std::string line;
  std::size_t line_number = 0;
  auto fail = [&](const std::string& what) -> trace_error {
    return trace_error(name + ":" + std::to_string(line_number) + ": " + what);
  };

  bool has_offset = false;
  bool header_seen = false;
  std::vector<core::buffer> buffers;
  std::unordered_map<std::string, std::size_t> line_of_id;

  while (read_line(in, line, max_line_bytes, name, line_number + 1)) {
    ++line_number;
    std::string_view text = trim(line);
    if (!header_seen && starts_with_byte_order_mark(text)) text = trim(text.substr(3));
    if (text.empty()) continue;
    std::vector<std::string_view> fields = split(text);
    for (auto& f : fields) f = trim(f);
    if (!header_seen) {
      header_seen = true;
      const bool base = fields.size() >= 4 && fields[0] == "id" && fields[1] == "lower" &&
                        fields[2] == "upper" && fields[3] == "size";
      has_offset = fields.size() == 5 && fields[4] == "offset";
      if (!base || (fields.size() != 4 && !has_offset)) {
        throw fail("expected the header 'id,lower,upper,size' or 'id,lower,upper,size,offset'");
      }
      continue;
    }
    const std::size_t want = has_offset ? 5 : 4;
    if (fields.size() != want) {
      const bool quoted = text.find('"') != std::string_view::npos;
      throw fail("expected " + std::to_string(want) + " columns, found " + std::to_string(fields.size()) +
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
    if (const auto [it, inserted] = line_of_id.emplace(b.id, line_number); !inserted) {
      throw fail("duplicate id " + brief(b.id) + " (first on line " + std::to_string(it->second) +
                 ")");
    }
    buffers.push_back(std::move(b));
  }
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
