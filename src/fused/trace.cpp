// Host side of the fused kernels' timelines (fused/trace_layout.h).
#include <cuda_runtime_api.h>

#include <mutex>

#include "fused/trace_layout.h"
#include "runtime/cuda_check.h"
#include "runtime/overrides.h"

namespace mk::fused {
namespace {

// One per host thread: ranks driven by threads of one process (InProcessGroup) each trace their
// own launches.
struct TraceState {
  std::mutex mutex;
  uint64_t* buffer = nullptr;
  std::size_t words = 0;
  int ctas = 0;
  ~TraceState() {
    if (buffer != nullptr) cudaFree(buffer);  // (an error at process exit is of no interest)
  }
};

TraceState& state() {
  thread_local TraceState s;
  return s;
}

}  // namespace

uint64_t* trace_arm(const Communicator& comm, int ctas, cudaStream_t stream) {
  if (!comm.overrides().trace) return nullptr;
  TraceState& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  const std::size_t words = static_cast<std::size_t>(ctas) * kTraceLanes * kTraceWordsPerLane;
  if (words > s.words) {
    if (s.buffer != nullptr) MK_CUDA_CHECK(cudaFree(s.buffer));
    MK_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&s.buffer), words * sizeof(uint64_t)));
    s.words = words;
  }
  MK_CUDA_CHECK(cudaMemsetAsync(s.buffer, 0, words * sizeof(uint64_t), stream));
  s.ctas = ctas;
  return s.buffer;
}

std::vector<uint64_t> trace_read(int& ctas) {
  TraceState& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  ctas = s.ctas;
  std::vector<uint64_t> host(static_cast<std::size_t>(s.ctas) * kTraceLanes * kTraceWordsPerLane);
  if (s.buffer == nullptr) return host;
  MK_CUDA_CHECK(cudaDeviceSynchronize());
  MK_CUDA_CHECK(
      cudaMemcpy(host.data(), s.buffer, host.size() * sizeof(uint64_t), cudaMemcpyDeviceToHost));
  return host;
}

}  // namespace mk::fused
