// Where a gathered A stage's pieces go (gemm_kernel.cuh, gather_a_stage), host and device: the
// layout a TMA box with the 128-byte swizzle leaves - row r's 16-byte piece c (the k-block's K
// values 8c .. 8c + 7) at r * 128 + (c ^ r % 8) * 16 - and which warp and lane copies which
// piece. tests/cpu/test_gather_layout.cpp holds the mapping to it.
#pragma once

#include <cstdint>

#include "mkernel/host_device.h"

namespace mk::gemm_engine {

// The warps that gather a stage: the producer warpgroup's four (warp 0 from the start, the three
// side warps once their side task is done).
constexpr int kGatherWarps = 4;
// Rows one copy instruction of every gathering warp moves together: four whole rows a warp.
constexpr int kGatherRowsPerStep = 4 * kGatherWarps;

// Row r's piece c in a stage of 128-byte rows with the 128-byte swizzle.
MK_HOST_DEVICE constexpr uint32_t swizzled_piece(int r, int c) {
  return static_cast<uint32_t>(r * 128 + ((c ^ (r % 8)) * 16));
}

// Warp w's i-th copy of a stage: lane l copies piece l % 8 of row 16 i + 4 w + l / 8, so that
// each instruction moves four whole 128-byte rows. A thread copies the same rows in every stage
// of a tile: it looks their addresses up once per tile and keeps them in registers.
MK_HOST_DEVICE constexpr int gather_row(int warp, int lane, int i) {
  return kGatherRowsPerStep * i + 4 * warp + lane / 8;
}

// That piece's offset in the stage: 16 i is a multiple of 8, so the row's r % 8 - and with it the
// swizzle - does not depend on i; the offset is the lane's base plus 2048 i (an immediate of the
// copy instruction).
MK_HOST_DEVICE constexpr uint32_t gather_base(int warp, int lane) {
  return swizzled_piece(4 * warp + lane / 8, lane % 8);
}
MK_HOST_DEVICE constexpr uint32_t gather_offset(int warp, int lane, int i) {
  return gather_base(warp, lane) + static_cast<uint32_t>(kGatherRowsPerStep * 128 * i);
}

}  // namespace mk::gemm_engine
