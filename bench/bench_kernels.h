#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace mk::bench {

// p[i] = bf16 of a hash of (seed, rank, i) in [-1, 1).
void launch_fill(void* p, std::size_t n, uint64_t seed, int rank, cudaStream_t s);
// *max_err_bits = max(previous, max_i |got[i] - sum_r fill(seed, r, base + i)|) as double bits.
void launch_max_error(const void* got, std::size_t n, std::size_t base, uint64_t seed, int world,
                      unsigned long long* max_err_bits, cudaStream_t s);
// *diffs += number of 16-byte vectors that differ between a and b.
void launch_count_diff(const void* a, const void* b, std::size_t n16, unsigned long long* diffs,
                       cudaStream_t s);

}  // namespace mk::bench

namespace mk::bench {

// out[0] = max |a[i] - b[i]|, out[1] = max |b[i]| over `n` bf16 values (as float bits, >= 0).
void launch_max_diff_bf16(const void* a, const void* b, std::size_t n, unsigned int* out,
                          cudaStream_t s);

// *far += the elements of a, b (`n` bf16 values) where |a - b| > 4 bf16 steps at |b| + 1e-4: a
// check that holds at every element, whatever the magnitudes elsewhere (a causal attention's
// first rows dwarf its last: a bound on the whole tensor's largest |b| misses wrong late rows).
void launch_count_far(const void* a, const void* b, std::size_t n, unsigned long long* far,
                      cudaStream_t s);
// The same, synchronously on `s`: the count.
unsigned long long count_far(const void* a, const void* b, std::size_t n, cudaStream_t s);
// The elements of `rows` rows of `row_len` bf16 values where |a - b| > 4 bf16 steps at the row's
// largest |b|, + 1e-4, synchronously on `s`: for outputs whose rows are computed apart (an
// attention's rows of D values), where an element small by cancellation carries its row's
// roundings; one row's scale never sets another's.
unsigned long long count_far_rows(const void* a, const void* b, std::size_t rows, int row_len,
                                  cudaStream_t s);

// The same, synchronously on the default stream: {max |a - b|, max |b|}.
struct MaxDiff {
  float diff;
  float mag;
};
MaxDiff max_diff_bf16(const void* a, const void* b, std::size_t n);

}  // namespace mk::bench
