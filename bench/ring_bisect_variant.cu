// One variant of bench_ring_bisect (ring_bisect.cuh), compiled once a variant with
// RING_BISECT_BITS set (bench/CMakeLists.txt): its kernel and a launcher that registers itself.
#include <cstring>
#include <type_traits>

#include "attention/attention_launch.cuh"
#include "ring_bisect.cuh"

#ifndef RING_BISECT_BITS
#error "RING_BISECT_BITS: the variant's bits (ring_bisect.cuh), or -1 for the engine"
#endif

namespace mk::bench::ring_bisect {
namespace {

using Cfg = attention_engine::AttentionConfig<128>;

// (A template, so that only this object's kernel is instantiated.)
template <int kBits>
void launch(const Setup& s, cudaStream_t stream) {
  if constexpr (kBits == kEngine) {
    auto kernel = attention_host::prepared<Cfg, attention_engine::PlainAttention<128>>();
    kernel<<<s.ctas, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(s.plain, s.scale_log2);
  } else if constexpr (kBits == kOneRoundRing) {
    // The same fields as the ring's (the template's flag changes no member).
    using OneRound = attention_engine::RingAttention<128, true>;
    static_assert(sizeof(OneRound) == sizeof(s.ring) && std::is_trivially_copyable_v<OneRound> &&
                  std::is_trivially_copyable_v<attention_engine::RingAttention<128>>);
    OneRound r;
    std::memcpy(&r, &s.ring, sizeof r);
    auto kernel = attention_host::prepared<Cfg, OneRound>();
    kernel<<<s.ctas, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(r, s.scale_log2);
  } else {
    using Variant = RingVariant<128, kBits>;
    Variant v{};
    static_cast<attention_engine::RingAttention<128>&>(v) = s.ring;
    v.q4 = s.q4;
    v.k4 = s.k4;
    v.v4 = s.v4;
    v.o4 = s.o4;
    auto kernel = attention_host::prepared<Cfg, Variant>();
    kernel<<<s.ctas, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(v, s.scale_log2);
  }
}

const bool kRegistered =
    (registry().push_back({RING_BISECT_BITS, &launch<RING_BISECT_BITS>}), true);

}  // namespace
}  // namespace mk::bench::ring_bisect
