// Helpers shared by the transport tests: deterministic byte patterns, sparse buffers, a clock.
#pragma once

#include <sys/mman.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>

namespace mk::test {

// Byte i of a pattern that encodes (seed, i): any misplaced, missing or stale byte shows.
inline uint8_t pattern_byte(uint64_t seed, uint64_t i) {
  uint64_t x = (seed * 0x9E3779B97F4A7C15ull) ^ (i * 0xC2B2AE3D27D4EB4Full);
  x ^= x >> 29;
  return static_cast<uint8_t>(x ^ (x >> 17) ^ (i >> 8));
}

inline void fill_pattern(void* dst, uint64_t bytes, uint64_t seed) {
  auto* p = static_cast<uint8_t*>(dst);
  for (uint64_t i = 0; i < bytes; ++i) p[i] = pattern_byte(seed, i);
}

// Index of the first byte that differs from the pattern, or -1.
inline int64_t first_mismatch(const void* src, uint64_t bytes, uint64_t seed) {
  const auto* p = static_cast<const uint8_t*>(src);
  for (uint64_t i = 0; i < bytes; ++i) {
    if (p[i] != pattern_byte(seed, i)) return static_cast<int64_t>(i);
  }
  return -1;
}

// A large anonymous mapping that only costs the pages touched (MAP_NORESERVE).
class SparseBuffer {
 public:
  explicit SparseBuffer(uint64_t bytes) : bytes_(bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    data_ = p == MAP_FAILED ? nullptr : static_cast<char*>(p);
  }
  ~SparseBuffer() {
    if (data_ != nullptr) munmap(data_, bytes_);
  }
  SparseBuffer(const SparseBuffer&) = delete;
  SparseBuffer& operator=(const SparseBuffer&) = delete;
  char* data() const { return data_; }
  uint64_t size() const { return bytes_; }

 private:
  uint64_t bytes_;
  char* data_ = nullptr;
};

class Stopwatch {
 public:
  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

 private:
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

inline bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace mk::test
