#pragma once
// Sub-commands of the `tensormem` command-line tool.

#include <unistd.h>

#include <bit>
#include <cerrno>
#include <charconv>
#include <cstdint>
#include <filesystem>
#include <stdexcept>
#include <system_error>
#include <limits>
#include <string>

#include <CLI/CLI.hpp>

namespace tensormem::cli {

/// The command ran but did not succeed (failed steps, a verification that found damage):
/// its report is printed, the message goes to stderr and the process exits with `code`.
class command_failed : public std::runtime_error {
 public:
  command_failed(int code, const std::string& message) : std::runtime_error(message), code_(code) {}
  int code() const noexcept { return code_; }

 private:
  int code_;
};

/// Validator of a time limit: a number of seconds >= 0 (not NaN), at most `most`; the error
/// names the value briefly (CLI11's own range check prints the 309 digits of DBL_MAX).
inline CLI::Validator non_negative_seconds(double most = std::numeric_limits<double>::infinity()) {
  return CLI::Validator(
      [most](std::string& text) -> std::string {
        double value = 0;
        std::size_t used = 0;
        try {
          value = std::stod(text, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        if (used != text.size() || !(value >= 0)) {
          return "must be a number of seconds >= 0, not '" + text.substr(0, 40) + "'";
        }
        if (value > most) {
          return "must be at most " + std::to_string(static_cast<long long>(most)) + " seconds, not '" +
                 text.substr(0, 40) + "'";
        }
        return {};
      },
      "SECONDS>=0");
}

/// What is wrong with `text` as a whole number of at least `least` in decimal digits that
/// fits in 64 bits (empty when nothing is, `value` then set); the message names the value
/// briefly.
inline std::string whole_number_problem(const std::string& text, std::uint64_t least, std::uint64_t& value) {
  value = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  const bool digits = !text.empty() && text.front() >= '0' && text.front() <= '9';
  if (digits && ptr == end && ec == std::errc::result_out_of_range) {
    return "'" + text.substr(0, 40) + "' does not fit in 64 bits";
  }
  if (!digits || ec != std::errc() || ptr != end || value < least) {
    return "must be a whole number >= " + std::to_string(least) + ", not '" + text.substr(0, 40) + "'";
  }
  return {};
}

/// Validator of a count or a size: a whole number >= 1 in decimal digits, at most `most`
/// (the largest value of the option's type) and a multiple of `multiple`; the error names
/// the value briefly (CLI11's PositiveNumber answers "not in range 0.000000 to" the 309
/// digits of DBL_MAX, and accepts "1.5"; a value past a 32-bit option's type got "Could not
/// convert").
inline CLI::Validator positive_count(std::uint64_t most = std::numeric_limits<std::uint64_t>::max(),
                                     std::uint64_t multiple = 1) {
  return CLI::Validator(
      [most, multiple](std::string& text) -> std::string {
        std::uint64_t value = 0;
        if (std::string problem = whole_number_problem(text, 1, value); !problem.empty()) return problem;
        if (value > most) return "must be at most " + std::to_string(most) + ", not '" + text + "'";
        if (value % multiple != 0) return "must be a multiple of " + std::to_string(multiple) + ", not '" + text + "'";
        return {};
      },
      "N>=1");
}

/// Validator of an alignment: a whole number >= 1 in decimal digits that is a power of two,
/// refused by the option's name ("--alignment: must be a power of two, not '6'") rather than
/// later by the part of the library that takes it.
inline CLI::Validator power_of_two_count() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        std::uint64_t value = 0;
        if (std::string problem = whole_number_problem(text, 1, value); !problem.empty()) return problem;
        if (!std::has_single_bit(value)) return "must be a power of two, not '" + text + "'";
        return {};
      },
      "2^K");
}

/// Validator of a 64-bit option that may be 0 (a seed, a size where 0 means "off"): a whole
/// number from 0 to 2^64 - 1 in decimal digits. CLI11 alone took "-1" as 2^64 - 1 and a number
/// past 2^64 - 1 without a word. `label` names the value in the help ("SEED>=0").
inline CLI::Validator whole_number(const std::string& label) {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        std::uint64_t value = 0;
        return whole_number_problem(text, 0, value);
      },
      label);
}

/// Validator of a file or folder name: an empty one is refused ("an empty path"), not taken
/// for an option that was left out.
inline CLI::Validator path_given() {
  return CLI::Validator(
      [](std::string& text) -> std::string { return text.empty() ? "an empty path" : std::string{}; },
      "PATH");
}

/// Checks, before a long run, that an output file named by `option` can be written (its
/// folder exists and is writable, the path is not a folder), so that a typo does not cost the
/// run's result: std::invalid_argument "--out: ...". Writing can still fail later (a full
/// disk); that is reported then.
inline void check_output_path(const std::string& option, const std::string& path) {
  if (path.empty()) return;  // not asked for
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path p(path);
  if (fs::is_directory(p, ec)) throw std::invalid_argument(option + ": " + path + " is a folder");
  const fs::path folder = p.has_parent_path() ? p.parent_path() : fs::path(".");
  if (!fs::is_directory(folder, ec)) {
    throw std::invalid_argument(option + ": cannot write " + path + ": folder " + folder.string() +
                                " does not exist");
  }
  const bool exists = fs::exists(p, ec);
  if (::access(exists ? path.c_str() : folder.c_str(), W_OK) != 0) {
    const std::error_code why(errno, std::generic_category());
    throw std::invalid_argument(option + ": cannot write " + path + ": " + why.message());
  }
}

void add_replay_command(CLI::App& app);
void add_demo_command(CLI::App& app);
void add_plan_command(CLI::App& app);
void add_pinned_bench_command(CLI::App& app);
void add_arena_command(CLI::App& app);
void add_swap_bench_command(CLI::App& app);

}  // namespace tensormem::cli
