// The attention engine's plan (mk::attention_plan): the problem checked before any launch, each
// refusal naming what is wrong, and the tiles, stages, work items and CTAs it picks - host code,
// tested without a GPU (config.sms given, so no device is asked for its SM count).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>

#include "mkernel/attention.h"
#include "mkernel/error.h"

namespace mk {
namespace {

AttentionProblem problem(int64_t batch, int64_t seq_q, int64_t seq_kv, int64_t heads,
                         int64_t kv_heads, int64_t head_dim, bool causal = false) {
  AttentionProblem p;
  p.batch = batch;
  p.seq_q = seq_q;
  p.seq_kv = seq_kv;
  p.heads = heads;
  p.kv_heads = kv_heads;
  p.head_dim = head_dim;
  p.causal = causal;
  return p;
}

AttentionConfig sms(int n) {
  AttentionConfig c;
  c.sms = n;
  return c;
}

void expect_refused(const AttentionProblem& p, const AttentionConfig& c, const std::string& what) {
  try {
    attention_plan(p, c);
    ADD_FAILURE() << "expected a refusal naming '" << what << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("attention"), std::string::npos) << e.what();
  }
}

TEST(AttentionPlan, TilesStagesItemsAndCtas) {
  // D 128: 128 x 128 tiles, two K / V stages (Q, 2 x (K + V) and the epilogue's buffers fill
  // the shared memory); one work item per (batch, head, 128-row query tile).
  const AttentionPlan p128 = attention_plan(problem(4, 4096, 4096, 16, 16, 128), sms(132));
  EXPECT_EQ(p128.head_dim, 128);
  EXPECT_EQ(p128.block_m, 128);
  EXPECT_EQ(p128.block_n, 128);
  EXPECT_EQ(p128.stages, 2);
  EXPECT_EQ(p128.items, 4 * 16 * 32);
  EXPECT_EQ(p128.ctas, 132);
  EXPECT_LE(p128.smem_bytes, 227 * 1024);
  // D 64: half the bytes a stage, more stages (at most 4).
  const AttentionPlan p64 = attention_plan(problem(1, 1000, 3000, 8, 2, 64, true), sms(132));
  EXPECT_EQ(p64.stages, 4);
  EXPECT_EQ(p64.items, 8 * 8);     // ceil(1000 / 128) tiles a head
  EXPECT_EQ(p64.ctas, 64);         // no more CTAs than items
  EXPECT_EQ(p64.split_items, 64);  // one wave of at most half the CTAs: all of it split
  EXPECT_EQ(p64.split_pieces, 2);  // 132 / 64 CTAs an item (17-24 blocks each)
  EXPECT_LE(p64.smem_bytes, 227 * 1024);
  // One row, one key: one item, one CTA.
  const AttentionPlan tiny = attention_plan(problem(1, 1, 1, 1, 1, 64), sms(132));
  EXPECT_EQ(tiny.items, 1);
  EXPECT_EQ(tiny.ctas, 1);
  // describe() says it all.
  const std::string d = p128.describe();
  for (const char* part : {"D 128", "128 queries x 128 keys", "2 KV stages", "2048 work items",
                           "132 persistent CTAs"}) {
    EXPECT_NE(d.find(part), std::string::npos) << d;
  }
}

// The last wave split (split_attention.cuh): only a tail of at most half a wave, only items of
// at least 2 x 8 KV blocks, pieces of at least 8 blocks and at most one CTA each.
TEST(AttentionPlan, LastWaveSplit) {
  // 4096 items on 132 CTAs: 31 whole waves, 4 items left, 128 blocks each -> 16 pieces of 8.
  const AttentionPlan gqa = attention_plan(problem(1, 16384, 16384, 32, 8, 128), sms(132));
  EXPECT_EQ(gqa.items, 4096);
  EXPECT_EQ(gqa.ctas, 132);
  EXPECT_EQ(gqa.split_items, 4);
  EXPECT_EQ(gqa.split_pieces, 16);
  EXPECT_NE(gqa.describe().find("the last 4 split into 16 pieces"), std::string::npos)
      << gqa.describe();
  // Causal: the tail is the last head's shortest tiles (1-4 blocks): nothing split.
  const AttentionPlan causal = attention_plan(problem(1, 16384, 16384, 32, 8, 128, true), sms(132));
  EXPECT_EQ(causal.split_items, 0);
  EXPECT_EQ(causal.split_pieces, 0);
  // A last wave more than half full (2048 items: 68 of 132): nothing split.
  const AttentionPlan half = attention_plan(problem(4, 4096, 4096, 16, 16, 128), sms(132));
  EXPECT_EQ(half.split_items, 0);
  // Short items (8 blocks) are not worth two more launches.
  const AttentionPlan shorter = attention_plan(problem(1, 133 * 128, 1024, 1, 1, 64), sms(132));
  EXPECT_EQ(shorter.items, 133);
  EXPECT_EQ(shorter.split_items, 0);
  // Pieces bounded by the CTAs: 1 item left on 8 CTAs, 64 blocks -> 8 pieces.
  const AttentionPlan few = attention_plan(problem(1, 128, 8192, 9, 9, 128), sms(8));
  EXPECT_EQ(few.split_items, 1);
  EXPECT_EQ(few.split_pieces, 8);
}

TEST(AttentionPlan, RefusesBadProblemsNamingThem) {
  expect_refused(problem(1, 128, 128, 4, 4, 96), sms(8), "head_dim = 96");
  expect_refused(problem(1, 128, 128, 4, 4, 256), sms(8), "expected 64 or 128");
  expect_refused(problem(1, 128, 128, 6, 4, 128), sms(8), "not a multiple of kv_heads = 4");
  expect_refused(problem(0, 128, 128, 4, 4, 128), sms(8), "expected each >= 1");
  expect_refused(problem(1, 0, 128, 4, 4, 128), sms(8), "seq_q 0");
  expect_refused(problem(1, 128, 0, 4, 4, 128), sms(8), "seq_kv 0");
  expect_refused(problem(1, 128, 128, 4, 0, 128), sms(8), "kv_heads 0");
  expect_refused(problem(1, int64_t{1} << 31, 128, 4, 4, 128), sms(8), "too large");
  expect_refused(problem(4096, 1 << 20, 128, 64, 64, 128), sms(8), "too large");
  // Products that would wrap 64 bits: batch x heads x query tiles = 2^20 x 2^30 x 2^23 (2^73,
  // 0 modulo 2^64), and a key sequence of 2^40 rows a head over the batch.
  expect_refused(problem(int64_t{1} << 20, int64_t{1} << 30, 128, int64_t{1} << 30, 1, 128), sms(8),
                 "too large");
  expect_refused(problem(1 << 12, 128, int64_t{1} << 30, 1 << 8, 1 << 8, 128), sms(8),
                 "seq_kv < 2^40");
  for (float scale : {-1.0f, std::numeric_limits<float>::infinity(), std::nanf("")}) {
    AttentionProblem p = problem(1, 128, 128, 4, 4, 128);
    p.softmax_scale = scale;
    expect_refused(p, sms(8), "softmax_scale");
  }
  expect_refused(problem(1, 128, 128, 4, 4, 128), sms(-1), "config.sms = -1");
}

}  // namespace
}  // namespace mk
