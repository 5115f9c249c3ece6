// Internal: small text helpers for error messages and command lines (header-only, so that
// tools/mkrun can use them without the library's private include path).
#pragma once

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace mk::detail {

// "[0, 2-5, 7]": the ranks in the given order, runs of three or more consecutive ranks as "a-b".
inline std::string format_ranks(const std::vector<int>& ranks) {
  std::string out = "[";
  for (std::size_t i = 0; i < ranks.size();) {
    std::size_t run = i;
    while (run + 1 < ranks.size() && ranks[run + 1] == ranks[run] + 1) ++run;
    if (i > 0) out += ", ";
    if (run - i >= 2) {
      out += std::to_string(ranks[i]) + "-" + std::to_string(ranks[run]);
      i = run + 1;
    } else {
      out += std::to_string(ranks[i]);
      ++i;
    }
  }
  return out + "]";
}

// "rank 3" for one rank, "ranks [0, 2-5]" for several.
inline std::string format_rank_list(const std::vector<int>& ranks) {
  return ranks.size() == 1 ? "rank " + std::to_string(ranks[0]) : "ranks " + format_ranks(ranks);
}

// Seconds as a person would write them: "300", "0.5", "1.25".
inline std::string format_seconds(double seconds) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", seconds);
  return text;
}

// Strict parse of a whole string as a decimal integer in [min, max]. False on anything else
// (empty, trailing characters, out of range).
inline bool parse_int(const char* text, long long min, long long max, long long* out) {
  if (text == nullptr || !(std::isdigit(static_cast<unsigned char>(*text)) || *text == '-')) {
    return false;  // strtoll would skip leading blanks and accept a '+'
  }
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(text, &end, 10);
  if (errno != 0 || *end != '\0' || value < min || value > max) return false;
  *out = value;
  return true;
}

// Strict parse of a whole string as a finite, non-negative number of seconds.
inline bool parse_seconds(const char* text, double* out) {
  if (text == nullptr || !(std::isdigit(static_cast<unsigned char>(*text)) || *text == '.')) {
    return false;  // no blanks, signs, "inf" or "nan"
  }
  char* end = nullptr;
  errno = 0;
  const double value = std::strtod(text, &end);
  if (errno != 0 || *end != '\0' || !std::isfinite(value) || value < 0) return false;
  *out = value;
  return true;
}

}  // namespace mk::detail
