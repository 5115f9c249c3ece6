// mkernel/device/launch.cuh - per-launch context, signals, barriers and time limits.
//
// Every mkernel kernel is a persistent grid whose CTAs are "channels": channel c of rank r talks
// to channel c of its peers (ring attention: a channel per copy share, whatever the CTA count).
// A launch begins with Launch::begin() and ends with Launch::end():
//
//   begin: read this rank's epoch (launches completed) -> this launch is epoch + 1
//   ...    signal(peer, id, step) / wait(src, id, step) with values signal_value(epoch, step)
//   end:   the last CTA to finish bumps the epoch, so the next launch (or graph replay) uses the
//          next value without any host involvement and without resetting a single flag.
//
// Signal values only grow, so "reached" is a wrap-safe >=. Every wait gives up after the
// communicator's time limit: it records who waited for whom (first failure wins), raises the
// abort flag so every other wait of this rank gives up at once, and returns false. Kernels then
// skip the rest of their work and still call end().
#pragma once

#include <cstdint>
#include <initializer_list>

#include "mkernel/device/sync.cuh"
#include "mkernel/device_comm.h"

namespace mk::dev {

__host__ __device__ constexpr uint64_t signal_value(uint64_t epoch, uint32_t step) {
  return (epoch << 32) | step;
}

// An op's signature for the entry barriers that compare them (EntryOp; host code): the op in the
// top byte (so that an error can name what each rank was in), FNV-1a over the sizes every rank must
// call it with in the other 24 bits. Never 0 or a small step: the top byte is not 0.
inline uint32_t entry_signature(EntryOp op, std::initializer_list<int64_t> sizes) {
  uint32_t h = 2166136261u;
  const auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i, v >>= 8) h = (h ^ static_cast<uint32_t>(v & 0xff)) * 16777619u;
  };
  for (const int64_t v : sizes) mix(static_cast<uint64_t>(v));
  return (static_cast<uint32_t>(op) << 24) | (h & 0xffffffu);
}

__device__ __forceinline__ bool reached(uint64_t value, uint64_t expected) {
  return static_cast<int64_t>(value - expected) >= 0;
}

__device__ __forceinline__ uint32_t signal_index(SignalId id, int channel) {
  return static_cast<uint32_t>(id) + static_cast<uint32_t>(channel);
}

// Records an error in an op's data (DeviceErrorCode::kCapacity, kBadIndex; the fields as
// DeviceErrorRecord says) for launch `epoch`: the first one of the launch wins, unless an earlier
// launch's is still unread by Communicator::check(). Nothing aborts: the launch completes.
__device__ inline void record_data_error(const DeviceComm& comm, uint64_t epoch,
                                         DeviceErrorCode code, int32_t peer, uint32_t signal,
                                         uint64_t expected, uint64_t observed) {
  DeviceErrorRecord* rec = comm.data_error;
  if (rec == nullptr) return;
  if (*reinterpret_cast<volatile int32_t*>(&rec->code) != 0) return;  // not yet raised
  if (atomicMax(reinterpret_cast<unsigned long long*>(&comm.state->data_error_epoch),
                static_cast<unsigned long long>(epoch)) >= epoch) {
    return;  // this launch's first error is someone else's
  }
  rec->rank = comm.rank;
  rec->peer = peer;
  rec->signal = signal;
  rec->expected = expected;
  rec->observed = observed;
  rec->waited_ns = 0;
  __threadfence_system();
  *reinterpret_cast<volatile int32_t*>(&rec->code) = static_cast<int32_t>(code);
  __threadfence_system();
}

struct Launch {
  DeviceComm comm;
  uint64_t epoch;  // this launch's number (1 for the first launch on a communicator)

  __device__ static Launch begin(const DeviceComm& comm) {
    return Launch{comm, ld_relaxed_gpu(&comm.state->epoch) + 1};
  }

  __device__ bool aborted() const { return ld_relaxed_gpu(&comm.state->abort) != 0; }

  // A wait of this launch failed, on any thread of this rank (the flags a failing wait leaves
  // behind stay set: the abort, or the inter-node path's). After a barrier, every participant
  // sees what a failing participant saw - a barrier's OR without the reduction.
  __device__ bool failed() const {
    return aborted() || (comm.host_abort != nullptr && ld_relaxed_sys(comm.host_abort) != 0);
  }

  // Raise signal `signal` on local rank `peer_local` (this rank's word in the peer's pad) to
  // signal_value(epoch, step), after every write this thread has made or observed.
  __device__ void signal(int peer_local, uint32_t signal, uint32_t step) const {
    uint64_t* pad = comm.peer_signals[peer_local];
    st_release_sys(pad + static_cast<uint64_t>(signal) * comm.world_size + comm.rank,
                   signal_value(epoch, step));
  }

  // The same, raised in rank `column`'s word of the peer's pad: a relay standing in for a rank
  // of another node (its rows or counts forwarded), so the peer waits for that rank as usual.
  __device__ void signal_as(int peer_local, uint32_t signal, int column, uint32_t step) const {
    uint64_t* pad = comm.peer_signals[peer_local];
    st_release_sys(pad + static_cast<uint64_t>(signal) * comm.world_size + column,
                   signal_value(epoch, step));
  }

  // Rank `src`'s word of signal `signal` in this rank's pad.
  __device__ const uint64_t* word(uint32_t signal, int src) const {
    return comm.signals + static_cast<uint64_t>(signal) * comm.world_size + src;
  }

  // Wait until rank `src` raised `signal` to at least (epoch, step). False on time-out / abort,
  // and across nodes once this rank's inter-node path failed: a local signal may stand for data
  // that crossed the network (a relay's copy), and the operation cannot finish anyway.
  __device__ bool wait(int src, uint32_t signal, uint32_t step) const {
    return wait_for(comm.signals + static_cast<uint64_t>(signal) * comm.world_size + src, src,
                    signal, step, comm.host_abort);
  }

  // Wait until rank `src` on another node raised host-pad signal `signal` to at least (epoch,
  // step) - its puts counted on that signal have landed here (DeviceComm::host_signals). False on
  // time-out, abort, or a failed inter-node path (it will never arrive; Communicator::check()
  // then names the path's error).
  __device__ bool wait_remote(int src, uint32_t signal, uint32_t step) const {
    return wait_for(comm.host_signals + static_cast<uint64_t>(signal) * comm.world_size + src, src,
                    signal | kHostPadSignalBit, step, comm.host_abort);
  }

  // Wait until `word` - written on this GPU by this rank's own CTAs, e.g. an arrival counter -
  // reaches `expected` (wrap-safe >=). False on time-out or abort; a time-out is recorded as
  // this rank waiting for itself on local counter `counter` (kLocalCounterBit).
  __device__ bool wait_local(const uint64_t* word, uint64_t expected, uint32_t counter) const {
    return wait_value(word, comm.rank, counter | kLocalCounterBit, expected, nullptr);
  }

  // The same for a count that rank `src` (on this node) raises - in its memory, mapped here, or
  // in this rank's; a time-out is recorded as this rank waiting for rank `src` on counter
  // `counter`.
  __device__ bool wait_counter(const uint64_t* word, int src, uint64_t expected,
                               uint32_t counter) const {
    return wait_value(word, src, counter | kLocalCounterBit, expected, nullptr);
  }

  // All local ranks' channel `channel` meet: every thread of the CTA calls it. Thread t <
  // local_size signals local rank t and waits for it. Orders all prior writes of the CTA (to any
  // GPU) before the peers' subsequent reads. Returns false (on every thread) if any wait failed.
  __device__ bool channel_barrier(SignalId id, int channel, uint32_t step) const {
    __syncthreads();
    for (int t = threadIdx.x; t < comm.local_size; t += blockDim.x) {
      if (t != comm.local_rank) announce(t, id, channel, step);
    }
    bool ok = true;
    for (int t = threadIdx.x; t < comm.local_size; t += blockDim.x) {
      if (t != comm.local_rank)
        ok = wait(comm.node_ranks[t], signal_index(id, channel), step) && ok;
    }
    return __syncthreads_and(ok) != 0;
  }

  // channel_barrier whose signal carries this rank's `signature` of the op (nonzero: what its
  // kind and the sizes every rank must share hash to, entry_signature above) instead of a step:
  // announce() to every local peer, then agrees() with each. False on every thread when a peer
  // disagrees or a wait failed, and once this rank's launch has failed elsewhere (a sibling CTA
  // found a difference first).
  __device__ bool channel_barrier_agreeing(SignalId id, int channel, uint32_t signature) const {
    __syncthreads();
    for (int t = threadIdx.x; t < comm.local_size; t += blockDim.x) {
      if (t != comm.local_rank) announce(t, id, channel, signature);
    }
    bool ok = true;
    for (int t = threadIdx.x; t < comm.local_size; t += blockDim.x) {
      if (t != comm.local_rank) ok = agrees(t, id, channel, signature) && ok;
    }
    return __syncthreads_and(ok) != 0 && !failed();
  }

  // `value` (a barrier's step, or an entry signature: agrees() on the other side) in signal
  // (id, channel) of local rank t, after every prior write of this thread.
  __device__ void announce(int t, SignalId id, int channel, uint32_t value) const {
    fence_acq_rel_sys();
    signal(t, signal_index(id, channel), value);
  }

  // Waits for local rank t's announce() of this launch on (id, channel) and compares its
  // signature with this rank's. A peer that entered the same launch with another value - other
  // sizes, another op at this point of its stream (whose buffers this rank would read and write
  // at other offsets), or an op whose entry barrier signals a step - is recorded as
  // DeviceErrorCode::kMismatch, which aborts this rank's waits as a time-out does. A peer already
  // past this launch (its next value in the slot) compared this rank's signature itself, and
  // left its verdict in kVerdict before it went on. False on a difference or a failed wait.
  __device__ bool agrees(int t, SignalId id, int channel, uint32_t signature) const {
    const uint32_t sig = signal_index(id, channel);
    const uint32_t verdict = signal_index(SignalId::kVerdict, channel);
    const int src = comm.node_ranks[t];
    if (!wait(src, sig, 0)) return false;
    const uint64_t seen = ld_acquire_sys(word(sig, src));
    uint32_t theirs = static_cast<uint32_t>(seen);
    bool differs = theirs != signature;
    if (static_cast<uint32_t>(seen >> 32) != static_cast<uint32_t>(epoch)) {  // past it
      theirs = 0;  // (unknown here: its slot holds its next launch's)
      differs = static_cast<uint32_t>(ld_acquire_sys(word(verdict, src)) >> 32) ==
                static_cast<uint32_t>(epoch);
    }
    if (!differs) return true;
    record_fatal(DeviceErrorCode::kMismatch, src, sig, signature, theirs, 0);
    signal(t, verdict, 1);  // for the peer, should it find this rank past the launch
    return false;
  }

  // Every CTA calls this last (all threads). The last CTA to arrive publishes epoch + 1.
  __device__ void end() const {
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      const uint32_t done = atomicAdd(&comm.state->blocks_done, 1u);
      if (done == gridDim.x * gridDim.y * gridDim.z - 1) {
        comm.state->blocks_done = 0;
        comm.state->epoch = epoch;
        __threadfence();
      }
    }
  }

 private:
  // Polls `word` (rank src's, recorded as signal `tag` on a time-out) until it reaches (epoch,
  // step). False on time-out, on this rank's abort, or once `*path_abort` (when given) is set.
  __device__ bool wait_for(const uint64_t* word, int src, uint32_t tag, uint32_t step,
                           const int32_t* path_abort) const {
    return wait_value(word, src, tag, signal_value(epoch, step), path_abort);
  }

  __device__ bool wait_value(const uint64_t* word, int src, uint32_t tag, uint64_t expected,
                             const int32_t* path_abort) const {
    uint64_t seen = ld_acquire_sys(word);
    if (reached(seen, expected)) return true;
    const uint64_t start = global_timer_ns();
    for (uint32_t spins = 0;; ++spins) {
      seen = ld_acquire_sys(word);
      if (reached(seen, expected)) return true;
      if ((spins & 63) == 0) {
        if (aborted() || (path_abort != nullptr && ld_relaxed_sys(path_abort) != 0)) return false;
        const uint64_t waited = global_timer_ns() - start;
        if (comm.timeout_ns != 0 && waited > comm.timeout_ns) {
          record_fatal(DeviceErrorCode::kTimeout, src, tag, expected, seen, waited);
          return false;
        }
      }
    }
  }

  // The communicator's first fatal error (a time-out, a mismatch): the record, and this rank's
  // abort, which every other wait of this rank sees.
  __device__ void record_fatal(DeviceErrorCode code, int src, uint32_t signal, uint64_t expected,
                               uint64_t seen, uint64_t waited) const {
    if (atomicCAS(&comm.state->abort, 0, 1) != 0) return;  // someone else reports
    DeviceErrorRecord* rec = comm.error;
    rec->rank = comm.rank;
    rec->peer = src;
    rec->signal = signal;
    rec->expected = expected;
    rec->observed = seen;
    rec->waited_ns = waited;
    __threadfence_system();
    *reinterpret_cast<volatile int32_t*>(&rec->code) = static_cast<int32_t>(code);
    __threadfence_system();
  }
};

}  // namespace mk::dev
