// Trace CSV reading and writing, including every malformed case.

#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>

#include "tensormem/trace/plan_svg.hpp"
#include "tensormem/trace/trace_io.hpp"
#include "../swap/swap_test_support.hpp"

namespace tensormem::trace {
namespace {

std::string error_of(const std::string& text) {
  std::istringstream in(text);
  try {
    read_trace(in, "t.csv");
  } catch (const trace_error& e) {
    return e.what();
  }
  return "no error";
}

TEST(trace_io, reads_buffers_and_offsets) {
  std::istringstream in("id,lower,upper,size\nb1,0,3,4\r\n\nb2, 3 ,9,18446744073709551615\n");
  const auto b = read_trace(in, "t.csv");
  ASSERT_EQ(b.size(), 2U);
  EXPECT_EQ(b[0].id, "b1");
  EXPECT_EQ(b[1].lower, 3U);
  EXPECT_EQ(b[1].bytes, 18446744073709551615ULL);
  EXPECT_FALSE(b[0].offset.has_value());
  std::istringstream with("id,lower,upper,size,offset\n7,0,1,10,20\n");
  EXPECT_EQ(read_trace(with, "w.csv")[0].offset.value_or(0), 20U);
  // A byte order mark before the header (spreadsheet programs write one) is skipped.
  std::istringstream bom("\xEF\xBB\xBFid,lower,upper,size\nb1,0,3,4\n");
  const auto c = read_trace(bom, "bom.csv");
  ASSERT_EQ(c.size(), 1U);
  EXPECT_EQ(c[0].id, "b1");
}

TEST(trace_io, malformed_input_names_file_and_line) {
  EXPECT_EQ(error_of(""), "t.csv:1: empty file: expected a header");
  EXPECT_EQ(error_of("id,lower,upper\n"),
            "t.csv:1: expected the header 'id,lower,upper,size' or 'id,lower,upper,size,offset'");
  EXPECT_EQ(error_of("id,lower,upper,size\n"), "t.csv:1: no buffers after the header");
  EXPECT_EQ(error_of("id,lower,upper,size\na,0,1\n"), "t.csv:2: expected 4 columns, found 3");
  EXPECT_EQ(error_of("id,lower,upper,size\na,0,1,2,3\n"), "t.csv:2: expected 4 columns, found 5");
  // A bad field is quoted whole up to 40 bytes; a longer one is cut there and its size given.
  const std::string forty(40, 'x');
  EXPECT_EQ(error_of("id,lower,upper,size\na,0,1," + forty + "\n"),
            "t.csv:2: size is not an unsigned integer: '" + forty + "'");
  EXPECT_EQ(error_of("id,lower,upper,size\na,0,1," + forty + "y\n"),
            "t.csv:2: size is not an unsigned integer: '" + forty + "...' (41 bytes)");
  // More fields than the reader keeps (six) are counted, not stored.
  EXPECT_EQ(error_of("id,lower,upper,size\na,0,1,2,3,4,5\n"), "t.csv:2: expected 4 columns, found 7");
  EXPECT_EQ(error_of("id,lower,upper,size\na,0,1,2,3,4,5,6,7,8,9\n"), "t.csv:2: expected 4 columns, found 11");
  EXPECT_EQ(error_of("id,lower,upper,size,offset,x,y\na,0,1,2,0\n"),
            "t.csv:1: expected the header 'id,lower,upper,size' or 'id,lower,upper,size,offset'");
  EXPECT_EQ(error_of("id,lower,upper,size\n\"a,b\",0,1,2\n"),
            "t.csv:2: expected 4 columns, found 5 (quotes are not read: an id cannot hold a comma)");
  // Only before the header is a byte order mark skipped.
  EXPECT_EQ(error_of("id,lower,upper,size\na,0,1,2\n\xEF\xBB\xBFid,lower,upper,size\n"),
            "t.csv:3: lower is not an unsigned integer: 'lower'");
  EXPECT_EQ(error_of("id,lower,upper,size\na,0,1,2\nb,x,1,2\n"),
            "t.csv:3: lower is not an unsigned integer: 'x'");
  EXPECT_EQ(error_of("id,lower,upper,size\na,0,1,1.5\n"),
            "t.csv:2: size is not an unsigned integer: '1.5'");
  EXPECT_EQ(error_of("id,lower,upper,size\na,0,-1,2\n"), "t.csv:2: upper is negative: '-1'");
  EXPECT_EQ(error_of("id,lower,upper,size\na,0,1,99999999999999999999\n"),
            "t.csv:2: size does not fit in 64 bits: '99999999999999999999'");
  EXPECT_EQ(error_of("id,lower,upper,size\na,5,5,2\n"),
            "t.csv:2: lower 5 is not below upper 5 (lifetimes are half-open)");
  EXPECT_EQ(error_of("id,lower,upper,size\na,0,1,2\n\na,1,2,3\n"),
            "t.csv:4: duplicate id 'a' (first on line 2)");
  EXPECT_EQ(error_of("id,lower,upper,size\n,0,1,2\n"), "t.csv:2: empty id column");
  EXPECT_EQ(error_of("id,lower,upper,size,offset\na,0,1,2\n"),
            "t.csv:2: expected 5 columns, found 4");
}

// An independent reading of UTF-8: decode each sequence by its bit pattern, then refuse
// overlong forms, surrogates, code points past U+10FFFF and control characters.
std::size_t oracle_first_non_text(const std::string& s) {
  std::size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    const std::size_t length = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
    if (length == 0 || i + length > s.size()) return i;
    std::uint32_t code = length == 1 ? c : c & (0x7FU >> length);
    for (std::size_t k = 1; k < length; ++k) {
      const auto t = static_cast<unsigned char>(s[i + k]);
      if ((t & 0xC0) != 0x80) return i;
      code = (code << 6) | (t & 0x3FU);
    }
    static constexpr std::uint32_t least[] = {0, 0, 0x80, 0x800, 0x10000};
    if (code < least[length] || code > 0x10FFFF || (code >= 0xD800 && code <= 0xDFFF)) return i;
    if (code < 0x20 || code == 0x7F) return i;
    i += length;
  }
  return s.size();
}

// Every string of one and two bytes, every one of three bytes from a lead byte E0-EF, and a
// million random strings of up to six bytes (leads F0-F7 favoured), with text around them.
TEST(trace_io, text_bytes_agree_with_an_independent_utf8_decoder) {
  auto check = [](const std::string& s) {
    ASSERT_EQ(first_non_text_byte(s), oracle_first_non_text(s)) << ::testing::PrintToString(s);
    const std::string framed = "ok " + s + " ok";
    ASSERT_EQ(first_non_text_byte(framed), oracle_first_non_text(framed)) << ::testing::PrintToString(s);
  };
  for (unsigned a = 0; a < 256; ++a) {
    check(std::string(1, static_cast<char>(a)));
    for (unsigned b = 0; b < 256; ++b) check({static_cast<char>(a), static_cast<char>(b)});
  }
  for (unsigned a = 0xE0; a < 0xF0; ++a) {
    for (unsigned b = 0x70; b < 0xD0; ++b) {
      for (unsigned c = 0x70; c < 0xD0; ++c) check({static_cast<char>(a), static_cast<char>(b), static_cast<char>(c)});
    }
  }
  std::mt19937_64 rng(7);
  for (int n = 0; n < 1'000'000; ++n) {
    std::string s(1 + rng() % 6, ' ');
    for (auto& ch : s) {
      const unsigned pick = rng() % 4;
      ch = static_cast<char>(pick == 0 ? 0xF0 + rng() % 8 : pick == 1 ? 0x80 + rng() % 64 : rng() % 256);
    }
    check(s);
  }
  EXPECT_EQ(first_non_text_byte("caf\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80"), 14U);  // all text: cafe, euro, emoji
}

// An id that is not text is refused by file and line; the message itself is UTF-8, so that
// Python can show it (a byte 0xFF in it used to give an empty ValueError).
TEST(trace_io, ids_and_fields_that_are_not_text_are_named_in_a_utf8_message) {
  EXPECT_EQ(error_of("id,lower,upper,size\nok,0,1,2\na\x01" "b,0,1,2\n"),
            "t.csv:3: the id 'a\\x01b' is not UTF-8 text without control characters (byte 2)");
  EXPECT_EQ(error_of("id,lower,upper,size\n\xFF\xC3,0,1,2\n"),
            "t.csv:2: the id '\\xFF\\xC3' is not UTF-8 text without control characters (byte 1)");
  EXPECT_EQ(error_of("id,lower,upper,size\na\xED\xA0\x80,0,1,2\n"),  // a surrogate
            "t.csv:2: the id 'a\\xED\\xA0\\x80' is not UTF-8 text without control characters (byte 2)");
  EXPECT_EQ(error_of("id,lower,upper,size\na,\xFF\x01,1,2\n"), "t.csv:2: lower is not an unsigned integer: '\\xFF\\x01'");
  const std::string message = error_of("id,lower,upper,size\na,0,1," + std::string(50, '\xFF') + "\n");
  EXPECT_EQ(first_non_text_byte(message), message.size()) << message;
  EXPECT_NE(message.find("(50 bytes)"), std::string::npos) << message;
  // Text that is not ASCII is an id like any other.
  std::istringstream in("id,lower,upper,size\ncaf\xC3\xA9.\xE2\x82\xAC,0,1,2\n");
  EXPECT_EQ(read_trace(in, "t.csv").at(0).id, "caf\xC3\xA9.\xE2\x82\xAC");
}

// The first error in file order is the one reported, whatever it is: a repeated id on line d
// (of the id on line 2) against a bad field or a line too long on line e, for every d and e
// up to 50 (the reader adds ids to its index a few lines late).
TEST(trace_io, the_first_error_in_file_order_wins) {
  const std::string too_long(max_line_bytes + 1, 'x');
  for (std::size_t d = 3; d <= 50; ++d) {
    for (std::size_t e = 2; e <= 51; ++e) {
      if (e == d) continue;
      for (const bool long_line : {false, true}) {
        std::string text = "id,lower,upper,size\n";
        for (std::size_t line = 2; line <= 52; ++line) {
          if (line == e) text += long_line ? too_long + "\n" : "b" + std::to_string(line) + ",0,1,x\n";
          else if (line == d) text += "b2,0,1,1\n";
          else text += "b" + std::to_string(line) + ",0,1,1\n";
        }
        const std::string expected =
            d < e ? "t.csv:" + std::to_string(d) + ": duplicate id 'b2' (first on line 2)"
                  : "t.csv:" + std::to_string(e) + (long_line ? ": line longer than 65536 bytes"
                                                                : ": size is not an unsigned integer: 'x'");
        ASSERT_EQ(error_of(text), expected) << "repeat on line " << d << ", bad line " << e;
      }
    }
    // The repeat alone, on any line, also the last.
    std::string text = "id,lower,upper,size\n";
    for (std::size_t line = 2; line <= d; ++line) text += "b" + std::to_string(line == d ? 2 : line) + ",0,1,1\n";
    ASSERT_EQ(error_of(text), "t.csv:" + std::to_string(d) + ": duplicate id 'b2' (first on line 2)") << d;
  }
}

TEST(trace_io, missing_file_is_named_with_its_errno) {
  try {
    read_trace(std::string("/nonexistent/trace.csv"));
    FAIL();
  } catch (const std::system_error& e) {
    EXPECT_EQ(e.code().value(), ENOENT);
    EXPECT_STREQ(e.what(), "/nonexistent/trace.csv:0: cannot open: No such file or directory");
  }
}

// The system reads a path up to its first NUL: reading "t.csv\0x" would read t.csv, and
// writing it would overwrite t.csv. Such paths, and empty ones, are refused.
TEST(trace_io, empty_paths_and_paths_with_a_nul_byte_are_refused) {
  const swap::testing::scratch_dir dir;
  const std::string kept = dir.file("t.csv");
  const std::string text = "id,lower,upper,size\nx,0,2,10\n";
  std::ofstream(kept) << text;
  const std::string nul = kept + std::string(1, '\0') + "x";
  const std::vector<core::buffer> b = {{"y", 0, 3, 20, 0}};
  const std::vector<std::uint64_t> offsets = {0};
  for (const std::string& path : {nul, std::string()}) {
    EXPECT_THROW(read_trace(path), std::invalid_argument);
    EXPECT_THROW(write_trace(path, b), std::invalid_argument);
    EXPECT_THROW(write_plan_svg(path, b, offsets, 20, 20), std::invalid_argument);
    EXPECT_THROW(write_plan_html(path, b, offsets, 20, 20, "plan"), std::invalid_argument);
  }
  try {
    read_trace(nul);
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("holds a NUL byte"), std::string::npos) << e.what();
  }
  std::ifstream in(kept);
  const std::string after((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(after, text);
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.path), {}), 1);
}

// A trace of several MiB is read in blocks: lines that straddle a block boundary, a line of
// exactly max_line_bytes there, a last line without '\n', and repeated ids found after the id
// index has grown many times.
TEST(trace_io, large_traces_read_across_blocks) {
  constexpr std::size_t count = 150000;
  std::string text = "id,lower,upper,size\n";
  std::vector<core::buffer> want;
  std::size_t long_line = 0;
  for (std::size_t i = 0; i < count; ++i) {
    core::buffer b{"t" + std::to_string(i), i, i + 1 + i % 97, (i * 7919) % 100003 + 1, std::nullopt};
    std::string tail = "," + std::to_string(b.lower) + "," + std::to_string(b.upper) + "," + std::to_string(b.bytes);
    // The first line that would end past 2 MiB is made exactly max_line_bytes long.
    if (long_line == 0 && text.size() + max_line_bytes > (std::size_t{2} << 20)) {
      b.id += std::string(max_line_bytes - b.id.size() - tail.size(), 'x');
      long_line = want.size() + 2;
    }
    text += b.id + tail + (i + 1 < count ? (i % 5 == 0 ? "\r\n" : "\n") : "");
    want.push_back(b);
  }
  ASSERT_GT(text.size(), std::size_t{3} << 20);
  std::istringstream in(text);
  const auto got = read_trace(in, "big.csv");
  ASSERT_EQ(got.size(), count);
  for (std::size_t i = 0; i < count; ++i) {
    ASSERT_EQ(got[i].id, want[i].id) << i;
    ASSERT_EQ(got[i].lower, want[i].lower) << i;
    ASSERT_EQ(got[i].upper, want[i].upper) << i;
    ASSERT_EQ(got[i].bytes, want[i].bytes) << i;
  }
  // That line was exactly max_line_bytes long and crossed the boundary.
  const std::size_t start = text.find("\n" + want[long_line - 2].id) + 1;
  EXPECT_EQ(text.find('\n', start) - start, max_line_bytes);
  EXPECT_LT(start, std::size_t{2} << 20);
  EXPECT_GT(start + max_line_bytes, std::size_t{2} << 20);
  // One byte more on that line is refused, naming it.
  std::string longer = text;
  longer.insert(longer.find(std::string(64, 'x')), "x");
  EXPECT_EQ(error_of(longer), "t.csv:" + std::to_string(long_line) + ": line longer than 65536 bytes");
  // An id repeated far down the file names both lines.
  EXPECT_EQ(error_of(text + "\nt4321,0,1,1\n"),
            "t.csv:" + std::to_string(count + 2) + ": duplicate id 't4321' (first on line 4323)");
}

TEST(trace_io, round_trip) {
  std::vector<core::buffer> b = {{"x", 0, 2, 10, 0}, {"y", 1, 3, 20, 10}};
  std::ostringstream out;
  write_trace(out, b);
  EXPECT_EQ(out.str(), "id,lower,upper,size,offset\nx,0,2,10,0\ny,1,3,20,10\n");
  std::istringstream in(out.str());
  const auto back = read_trace(in, "rt.csv");
  ASSERT_EQ(back.size(), 2U);
  EXPECT_EQ(back[1].offset.value_or(0), 10U);
  b[0].offset.reset();
  std::ostringstream partial;
  write_trace(partial, b);
  EXPECT_EQ(partial.str().substr(0, 20), "id,lower,upper,size\n");
}

TEST(trace_io, shared_traces_read) {
  const auto b = read_trace(std::string(TENSORMEM_TEST_DATA) + "/traces/minimalloc_A.csv");
  EXPECT_EQ(b.size(), 154U);
}

}  // namespace
}  // namespace tensormem::trace
