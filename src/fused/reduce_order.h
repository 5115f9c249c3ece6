// The order in which a reducing fused GEMM (gemm_rs, gemm_ar) walks its work: P tiles owned by
// each of the w - 1 peers ("remote": their partials leave this rank) and P tiles of its own
// (which wait for the peers' partials). Position t of the persistent schedule -> (owner, index).
//
// Blocked (lag < 0): every remote tile first, owner by owner (r + 1, r + 2, ...), own tiles last:
// no own tile ever waits, but all the NVLink traffic of the partials falls in the first
// (w - 1) / w of the kernel, when the link is the bottleneck.
// Interleaved (lag L >= 0, a multiple of w - 1): L remote tiles, then groups of w - 1 remote
// tiles (one per peer, the same index) and one own tile, then the own tiles left. Remote tiles
// go index-major (index j for peers r + 1, ..., r - 1), so every rank produces the partials of
// index j at about the position where their owner consumes index j - L / (w - 1): an own tile
// waits only for partials made at least max(1, L / (w - 1)) positions earlier (L + 1 before the
// tail), so no wait forms a cycle (each points to a strictly earlier position), and the traffic
// spreads over the whole kernel. At least the last L / (w - 1) positions are own tiles after
// every remote one (gemm_rs stages its outbox in them).
// The persistent schedule gives CTA b the positions b, b + grid, b + 2 grid, ...: with a grid that
// shares a factor with w, a CTA sits on the same slot of every group (w = 2, grid 132: half of the
// CTAs make every remote tile, and their side threads send everything while the others' idle).
// The plans therefore interleave on a grid coprime to w (interleave_grid): CTA b's slot then
// walks through all w slots and every CTA makes one own tile in w. Host-testable
// (tests/cpu/test_reduce_order.cpp).
#pragma once

#include "mkernel/host_device.h"

namespace mk::fused {

struct ReduceOrder {
  int world;
  int per_owner;  // P
  int lag;        // L, or -1: blocked

  MK_HOST_DEVICE int remote_count() const { return (world - 1) * per_owner; }
  MK_HOST_DEVICE int groups() const { return (remote_count() - lag) / (world - 1); }

  // Position t -> step (owner = rank + step mod w; 0: own) and the index within that owner's P.
  MK_HOST_DEVICE void at(int t, int& step, int& index) const {
    const int remote = remote_count();
    int i = -1;  // remote position, or -1 with `index` set (own)
    if (lag < 0) {
      if (t < remote) {
        step = 1 + t / per_owner;
        index = t % per_owner;
      } else {
        step = 0;
        index = t - remote;
      }
      return;
    }
    if (t < lag) {
      i = t;
    } else {
      const int u = t - lag, g = groups();
      if (u < g * world) {
        const int group = u / world, pos = u % world;
        if (pos < world - 1) {
          i = lag + group * (world - 1) + pos;
        } else {
          index = group;
        }
      } else {
        index = g + (u - g * world);
      }
    }
    if (i >= 0) {
      step = 1 + i % (world - 1);
      index = i / (world - 1);
    } else {
      step = 0;
    }
  }

  // The largest grid <= `budget` coprime to `world` (budget itself when it is).
  MK_HOST_DEVICE static int interleave_grid(int budget, int world) {
    auto gcd = [](int a, int b) {
      while (b != 0) {
        const int r = a % b;
        a = b;
        b = r;
      }
      return a;
    };
    int grid = budget;
    while (grid > 1 && gcd(grid, world) != 1) --grid;
    return grid;
  }

  // The last position holding a remote tile (-1: none).
  MK_HOST_DEVICE int last_remote() const {
    if (lag < 0) return remote_count() - 1;
    const int g = groups();
    return g > 0 ? lag + (g - 1) * world + (world - 2) : lag - 1;
  }
};

}  // namespace mk::fused
