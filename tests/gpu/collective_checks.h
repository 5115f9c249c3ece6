// Bodies of the collective tests, shared by the in-process (threads) and mkrun (processes) suites.
// Inputs are fresh random data per rank (the seed mixes rank and case, so every rank can rebuild
// everyone's inputs), outputs are poisoned before each call, and every element is checked.
#pragma once

#include <chrono>
#include <functional>
#include <thread>

#include "gpu_test_util.h"

namespace mk::test {

// Ends a test's setup: its stream is idle and every rank is ready. Ranks sharing a GPU inside one
// process need this: an implicitly synchronising call (cudaMalloc, cudaFree, cudaMemset) made by
// one rank while a peer's kernel already waits for it would stall both until the time limit.
inline void ready(Communicator& comm, cudaStream_t stream) {
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  comm.bootstrap().barrier();
}

// Ends an op: this rank's stream is idle and so is every rank's. Ranks sharing a GPU inside one
// process need this across nodes before an implicitly synchronising call (cudaMalloc, cudaFree):
// a rank's kernel may end while its transport threads still owe a peer a put, and a device-wide
// synchronisation of that GPU stalls their staging copies while the peer's kernel waits for it.
inline void finished(Communicator& comm, cudaStream_t stream) {
  comm.synchronize(stream);
  comm.bootstrap().barrier();
}

// `call` (which enqueues one op on `stream`) `calls` times back to back, with no host
// synchronisation between them; the last rank sleeps 50 ms before each of its calls. So the
// others' streams hold whole calls - launches that wait for the late rank, and whatever the op
// puts on the stream after them (copies, memsets, the next call's launches) - before the late
// rank's work of the same call is queued. Ranks sharing a GPU share its queues: nothing of a
// rank's may wait behind a peer's that waits for it (communicator.h; RingNodes 3x2 deadlocked
// that way with stream copies through pinned host memory). A deadlock ends in the time limit's
// error, raised here. `call(i)` should give call i inputs and outputs of its own (buffers set up
// before ready(): nothing but the op on the stream here), so that a call reading what the call
// before it left - a chunk, a row, a count - shows as wrong bits, not only a deadlock or an
// unwritten output. Call after ready(); ends with every rank's stream idle and a barrier.
inline void call_back_to_back_one_late(Communicator& comm, cudaStream_t stream, int calls,
                                       const std::function<void(int)>& call) {
  const bool late = comm.rank() == comm.world_size() - 1;
  for (int i = 0; i < calls; ++i) {
    if (late) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    call(i);
  }
  finished(comm, stream);
}

// Every rank but the last runs `launch` (which enqueues one op on `stream`); the last never does.
// The others must fail with kTimeout naming the missing rank (and `signal`, when given) within
// the communicator's time limit. Call after ready(); ends with a barrier of all ranks.
inline void expect_missing_rank_times_out(Communicator& comm, cudaStream_t stream,
                                          const std::function<void()>& launch,
                                          const std::string& signal = "") {
  const int rank = comm.rank(), missing = comm.world_size() - 1;
  if (rank != missing) {
    const auto start = std::chrono::steady_clock::now();
    launch();
    try {
      comm.synchronize(stream);
      ADD_FAILURE() << "rank " << rank << ": no time-out although rank " << missing
                    << " never joined";
    } catch (const Error& e) {
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      const std::string msg = e.what();
      EXPECT_EQ(e.code(), ErrorCode::kTimeout) << msg;
      EXPECT_NE(msg.find("for rank " + std::to_string(missing)), std::string::npos) << msg;
      if (!signal.empty()) EXPECT_NE(msg.find(signal), std::string::npos) << msg;
      EXPECT_LT(seconds, comm.timeout_seconds() + 5.0) << "time-out came too late";
    }
  }
  comm.bootstrap().barrier();
}

// Ranks 0 and 1 entered one launch with different operations or sizes (`launch` enqueued this
// rank's part on `stream`): synchronize() must raise kInvalidArgument naming this rank and the
// other, and `op` (when given), well inside the communicator's time limit - found at the entry,
// not by a time-out. A `launch` that enqueues a second call may instead see that verdict when it
// enqueues it (the first launch's kernel recorded it already: a race the host does not control):
// then the second call raises kNotInitialized ("an earlier kernel of this communicator failed")
// with the same words. `label` goes into the failures.
inline void expect_ranks_disagree(Communicator& comm, cudaStream_t stream,
                                  const std::function<void()>& launch, const std::string& op,
                                  const std::string& label) {
  const int me = comm.rank(), peer = 1 - me;
  const auto start = std::chrono::steady_clock::now();
  bool enqueued = false;
  try {
    launch();
    enqueued = true;
    comm.synchronize(stream);
    ADD_FAILURE() << label << ", rank " << me << ": no error although the ranks disagree";
  } catch (const Error& e) {
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const std::string msg = e.what();
    if (enqueued) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << label << ": " << msg;
    } else {  // a later call of `launch`, refused at the host: the first one's recorded verdict
      EXPECT_EQ(e.code(), ErrorCode::kNotInitialized) << label << ": " << msg;
      EXPECT_NE(msg.find("an earlier kernel of this communicator failed"), std::string::npos)
          << label << ": " << msg;
      try {  // the stream still holds the first launch; its error was raised above already
        comm.synchronize(stream);
      } catch (const Error&) {
      }
    }
    EXPECT_NE(msg.find("rank " + std::to_string(me) + " and rank " + std::to_string(peer) +
                       " entered the same launch with different operations or sizes"),
              std::string::npos)
        << label << ": " << msg;
    if (!op.empty()) EXPECT_NE(msg.find(op), std::string::npos) << label << ": " << msg;
    EXPECT_LT(seconds, comm.timeout_seconds() / 2) << label << ": the mismatch took a time-out";
  }
}

struct Case {
  std::size_t count;
  DType dtype;
};

// Sizes: a single element, odd counts (vector tails), one not a multiple of any tile, and ~1M.
inline std::vector<Case> collective_cases() {
  std::vector<Case> cases;
  for (DType t : {DType::kBF16, DType::kF16, DType::kF32}) {
    for (std::size_t n : {std::size_t{1}, std::size_t{7}, std::size_t{1000}, std::size_t{4097},
                          std::size_t{(1 << 20) + 3}}) {
      cases.push_back({n, t});
    }
  }
  return cases;
}

// Draws a fresh base seed on rank 0 and shares it, so data differ on every run.
inline uint64_t shared_seed(Communicator& comm) {
  uint64_t mine = std::random_device{}() * 0x100000001ull + std::random_device{}();
  std::vector<uint64_t> all(comm.world_size());
  comm.bootstrap().allgather(&mine, all.data(), sizeof(mine));
  return all[0];
}

inline void expect_all_gather(Communicator& comm, const Case& c, uint64_t seed, bool in_place) {
  const int world = comm.world_size(), rank = comm.rank();
  const std::size_t es = dtype_size(c.dtype), bytes = c.count * es;
  SymmetricBuffer out = comm.alloc(bytes * world);
  cudaStream_t stream;
  MKT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<unsigned char> expected;
  for (int r = 0; r < world; ++r) {
    auto d = random_elements(c.count, c.dtype, seed + r);
    expected.insert(expected.end(), d.begin(), d.end());
  }
  char* out_ptr = static_cast<char*>(out.data());
  void* input = out_ptr + rank * bytes;
  if (!in_place) MKT_CUDA(cudaMalloc(&input, bytes));
  MKT_CUDA(cudaMemsetAsync(out_ptr, 0xFF, bytes * world, stream));  // poison
  MKT_CUDA(cudaMemcpyAsync(input, expected.data() + rank * bytes, bytes, cudaMemcpyHostToDevice,
                           stream));
  ready(comm, stream);
  all_gather(comm, input, out_ptr, c.count, c.dtype, stream);
  comm.synchronize(stream);
  std::vector<unsigned char> got(bytes * world);
  MKT_CUDA(cudaMemcpy(got.data(), out_ptr, got.size(), cudaMemcpyDeviceToHost));
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (got[i] != expected[i] && bad++ == 0) first = i;
  }
  EXPECT_EQ(bad, 0u) << "all_gather rank " << rank << " world " << world << " count " << c.count
                     << " " << dtype_name(c.dtype) << (in_place ? " in place" : "")
                     << ": first wrong byte " << first << " (source rank " << first / bytes << ")";
  if (!in_place) cudaFree(input);
  cudaStreamDestroy(stream);
}

// Checks `got` (count elements) against the exact sum of `inputs` at [offset, offset + count).
inline std::size_t count_bad_sums(const std::vector<unsigned char>& got,
                                  const std::vector<std::vector<unsigned char>>& inputs,
                                  std::size_t offset, std::size_t count, DType t,
                                  std::size_t* first_bad) {
  std::size_t bad = 0;
  for (std::size_t i = 0; i < count; ++i) {
    double exact = 0, abs_sum = 0;
    for (const auto& in : inputs) {
      const double x = element(in, offset + i, t);
      exact += x;
      abs_sum += std::fabs(x);
    }
    if (!sum_close(element(got, i, t), exact, abs_sum, t) && bad++ == 0) *first_bad = i;
  }
  return bad;
}

// Keeps this rank's output in *result when given, for comparisons between paths.
inline void expect_reduce_scatter(Communicator& comm, const Case& c, uint64_t seed,
                                  const CollectiveConfig& config = {},
                                  std::vector<unsigned char>* result = nullptr) {
  const int world = comm.world_size(), rank = comm.rank();
  const std::size_t es = dtype_size(c.dtype), bytes = c.count * es;
  SymmetricBuffer in = comm.alloc(bytes * world);
  cudaStream_t stream;
  MKT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<std::vector<unsigned char>> inputs;
  for (int r = 0; r < world; ++r)
    inputs.push_back(random_elements(c.count * world, c.dtype, seed + r));
  void* out = nullptr;
  MKT_CUDA(cudaMalloc(&out, bytes));
  MKT_CUDA(cudaMemsetAsync(out, 0xFF, bytes, stream));
  MKT_CUDA(cudaMemcpyAsync(in.data(), inputs[rank].data(), bytes * world, cudaMemcpyHostToDevice,
                           stream));
  std::vector<unsigned char> first_run;
  for (int repeat = 0; repeat < 2; ++repeat) {
    ready(comm, stream);
    reduce_scatter(comm, in.data(), out, c.count, c.dtype, stream, config);
    comm.synchronize(stream);
    std::vector<unsigned char> got(bytes);
    MKT_CUDA(cudaMemcpy(got.data(), out, bytes, cudaMemcpyDeviceToHost));
    std::size_t first = 0;
    const std::size_t bad = count_bad_sums(got, inputs, rank * c.count, c.count, c.dtype, &first);
    EXPECT_EQ(bad, 0u) << "reduce_scatter rank " << rank << " world " << world << " count "
                       << c.count << " " << dtype_name(c.dtype) << ": first bad element " << first;
    if (repeat == 0)
      first_run = got;
    else
      EXPECT_EQ(first_run, got) << "reduce_scatter is not deterministic";
  }
  cudaFree(out);
  cudaStreamDestroy(stream);
  if (result != nullptr) *result = first_run;
}

inline void expect_all_reduce(Communicator& comm, const Case& c, uint64_t seed, bool in_place) {
  const int world = comm.world_size(), rank = comm.rank();
  const std::size_t es = dtype_size(c.dtype), bytes = c.count * es;
  SymmetricBuffer in = comm.alloc(bytes);
  SymmetricBuffer out_buf = in_place ? SymmetricBuffer() : comm.alloc(bytes);
  void* out = in_place ? in.data() : out_buf.data();
  cudaStream_t stream;
  MKT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<std::vector<unsigned char>> inputs;
  for (int r = 0; r < world; ++r) inputs.push_back(random_elements(c.count, c.dtype, seed + r));
  if (!in_place) MKT_CUDA(cudaMemsetAsync(out, 0xFF, bytes, stream));
  MKT_CUDA(cudaMemcpyAsync(in.data(), inputs[rank].data(), bytes, cudaMemcpyHostToDevice, stream));
  ready(comm, stream);
  all_reduce(comm, in.data(), out, c.count, c.dtype, stream);
  comm.synchronize(stream);
  std::vector<unsigned char> got(bytes);
  MKT_CUDA(cudaMemcpy(got.data(), out, bytes, cudaMemcpyDeviceToHost));
  std::size_t first = 0;
  const std::size_t bad = count_bad_sums(got, inputs, 0, c.count, c.dtype, &first);
  EXPECT_EQ(bad, 0u) << "all_reduce rank " << rank << " world " << world << " count " << c.count
                     << " " << dtype_name(c.dtype) << (in_place ? " in place" : "")
                     << ": first bad element " << first;
  // Every rank must hold bitwise the same result.
  const uint64_t h = fnv1a(got.data(), got.size());
  std::vector<uint64_t> hashes(world);
  comm.bootstrap().allgather(&h, hashes.data(), sizeof(h));
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(hashes[r], hashes[0]) << "all_reduce results differ between rank 0 and rank " << r;
  }
  cudaStreamDestroy(stream);
}

inline void expect_collectives(Communicator& comm) {
  const uint64_t seed = shared_seed(comm);
  const auto cases = collective_cases();
  for (std::size_t k = 0; k < cases.size(); ++k) {
    const uint64_t s = seed + 1000 * k;
    expect_all_gather(comm, cases[k], s, /*in_place=*/false);
    expect_all_gather(comm, cases[k], s + 1, /*in_place=*/true);
    expect_reduce_scatter(comm, cases[k], s + 2);
    expect_all_reduce(comm, cases[k], s + 3, /*in_place=*/false);
    expect_all_reduce(comm, cases[k], s + 4, /*in_place=*/true);
  }
}

}  // namespace mk::test
