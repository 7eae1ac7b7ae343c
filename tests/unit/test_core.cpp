// test_core.cpp: dtypes (bf16 and fp8 conversions), tensors and views, memory tracking, arena, RNG,
// checks and runtime dispatch.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "moetron/check.h"
#include "moetron/dtype.h"
#include "moetron/memory.h"
#include "moetron/rng.h"
#include "moetron/runtime.h"
#include "moetron/tensor.h"

using namespace moetron;

TEST(DType, Bf16RoundsToNearestEven) {
  EXPECT_EQ(to_bf16(1.0f).bits, 0x3f80);
  // 1 + 2^-8 is exactly halfway between 1 and 1 + 2^-7: ties to even (1.0).
  EXPECT_EQ(to_bf16(1.0f + std::ldexp(1.0f, -8)).bits, 0x3f80);
  // 1 + 3*2^-8 is halfway between 1+2^-7 (odd) and 1+2^-6 (even): rounds up.
  EXPECT_EQ(to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)).bits, 0x3f82);
  EXPECT_TRUE(std::isnan(from_bf16(to_bf16(NAN))));
  EXPECT_EQ(from_bf16(to_bf16(INFINITY)), INFINITY);
  EXPECT_EQ(from_bf16(to_bf16(-2.5f)), -2.5f);
}

TEST(DType, Fp8DecodeKnownValues) {
  EXPECT_EQ(e4m3_bits_to_float(0x7e), 448.0f);
  EXPECT_TRUE(std::isnan(e4m3_bits_to_float(0x7f)));
  EXPECT_EQ(e4m3_bits_to_float(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(e4m3_bits_to_float(0x08), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(e4m3_bits_to_float(0x38), 1.0f);
  EXPECT_EQ(e5m2_bits_to_float(0x7b), 57344.0f);
  EXPECT_EQ(e5m2_bits_to_float(0x7c), INFINITY);
  EXPECT_EQ(e5m2_bits_to_float(0x3c), 1.0f);
  EXPECT_EQ(e5m2_bits_to_float(0x01), std::ldexp(1.0f, -16));
}

TEST(DType, Fp8EveryCodeRoundTrips) {
  for (int b = 0; b < 256; ++b) {
    float f4 = e4m3_bits_to_float(uint8_t(b));
    if (!std::isnan(f4)) {
      uint8_t back = float_to_e4m3_bits(f4);
      if (f4 == 0.0f) EXPECT_EQ(back & 0x7f, 0);
      else EXPECT_EQ(back, b) << "e4m3 code " << b;
    }
    float f5 = e5m2_bits_to_float(uint8_t(b));
    if (!std::isnan(f5) && !std::isinf(f5)) {
      uint8_t back = float_to_e5m2_bits(f5);
      if (f5 == 0.0f) EXPECT_EQ(back & 0x7f, 0);
      else EXPECT_EQ(back, b) << "e5m2 code " << b;
    }
  }
}

TEST(DType, Fp8RoundsToNearestAndSaturates) {
  // Between 1.0 (0x38) and 1.125 (0x39) in e4m3: 1.0625 is a tie, to even (0x38); 1.07 rounds up.
  EXPECT_EQ(float_to_e4m3_bits(1.0625f), 0x38);
  EXPECT_EQ(float_to_e4m3_bits(1.07f), 0x39);
  EXPECT_EQ(float_to_e4m3_bits(1e6f), 0x7e);
  EXPECT_EQ(float_to_e4m3_bits(-1e6f), 0xfe);
  EXPECT_EQ(float_to_e4m3_bits(INFINITY), 0x7e);
  EXPECT_EQ(float_to_e5m2_bits(1e9f), 0x7b);
  EXPECT_TRUE(std::isnan(e4m3_bits_to_float(float_to_e4m3_bits(NAN))));
  // Relative error bound for normal values: half an ulp, 2^-4 for e4m3 and 2^-3 for e5m2.
  auto key = rng_key(3, "fp8");
  for (int i = 0; i < 20000; ++i) {
    float x = (rng_uniform(key, i) * 2 - 1) * 400.0f;
    if (std::fabs(x) < 0.02f) continue;
    float y = e4m3_bits_to_float(float_to_e4m3_bits(x));
    EXPECT_LE(std::fabs(y - x), std::fabs(x) * 0.0625f + 1e-7f) << x;
    float z = e5m2_bits_to_float(float_to_e5m2_bits(x));
    EXPECT_LE(std::fabs(z - x), std::fabs(x) * 0.125f + 1e-7f) << x;
  }
}

TEST(DType, Names) {
  EXPECT_EQ(dtype_from_name("bf16"), DType::BF16);
  EXPECT_EQ(dtype_size(DType::F8E5M2), 1u);
  EXPECT_THROW(dtype_from_name("f16"), Error);
}

TEST(Tensor, ViewsShareStorage) {
  Tensor t = Tensor::zeros({2, 3, 4}, DType::F32, MemCategory::Other, "t");
  float* p = t.data<float>();
  for (int i = 0; i < 24; ++i) p[i] = float(i);
  EXPECT_EQ(t.get({1, 2, 3}), 23.0f);
  Tensor v = t.view({6, 4});
  EXPECT_EQ(v.get({5, 3}), 23.0f);
  EXPECT_EQ(t.view({-1, 12}).size(0), 2);
  Tensor s = t.slice(1, 1, 3);  // [2, 2, 4]
  EXPECT_EQ(s.get({0, 0, 0}), 4.0f);
  EXPECT_FALSE(s.is_contiguous());
  Tensor tr = t.transpose(0, 2);  // [4, 3, 2]
  EXPECT_EQ(tr.get({3, 2, 1}), 23.0f);
  EXPECT_EQ(tr.get({1, 0, 1}), 13.0f);
  Tensor c = tr.contiguous();
  EXPECT_TRUE(c.is_contiguous());
  EXPECT_EQ(c.data<float>()[1 * 6 + 0 * 2 + 1], 13.0f);
  Tensor row = t.select(0, 1);
  EXPECT_EQ(row.shape(), (Shape{3, 4}));
  EXPECT_EQ(row.get({0, 0}), 12.0f);
  s.zero_();
  EXPECT_EQ(t.get({0, 1, 0}), 0.0f);
  EXPECT_EQ(t.get({0, 0, 3}), 3.0f);
}

TEST(Tensor, BadShapesAndTypesAreRejectedWithContext) {
  Tensor t = Tensor::zeros({2, 3}, DType::F32, MemCategory::Other, "weights");
  try {
    t.view({4, 2});
    FAIL() << "view accepted a wrong element count";
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("Tensor::view"), std::string::npos) << m;
    EXPECT_NE(m.find("[2, 3]"), std::string::npos) << m;
    EXPECT_NE(m.find("tensor.cpp:"), std::string::npos) << m;
  }
  EXPECT_THROW(t.data<bf16>(), Error);
  EXPECT_THROW(t.slice(1, 2, 5), Error);
  EXPECT_THROW(t.transpose(0, 1).view({6}), Error);
  EXPECT_THROW(Tensor::zeros({-1}, DType::F32, MemCategory::Other), Error);
}

TEST(Memory, CategoriesAreExact) {
  auto& mt = MemoryTracker::global();
  int64_t p0 = mt.current(MemCategory::Params), g0 = mt.current(MemCategory::Grads);
  mt.reset_peaks();
  {
    Tensor a = Tensor::zeros({100, 7}, DType::F32, MemCategory::Params);
    Tensor b = Tensor::zeros({33}, DType::BF16, MemCategory::Grads);
    EXPECT_EQ(mt.current(MemCategory::Params) - p0, 2800);
    EXPECT_EQ(mt.current(MemCategory::Grads) - g0, 66);
    Tensor v = a.view({700});  // views allocate nothing
    EXPECT_EQ(mt.current(MemCategory::Params) - p0, 2800);
  }
  EXPECT_EQ(mt.current(MemCategory::Params), p0);
  EXPECT_EQ(mt.peak(MemCategory::Params) - p0, 2800);
  EXPECT_EQ(mt.current(MemCategory::Grads), g0);
}

TEST(Memory, ArenaChargesUsedBytesAndReleases) {
  auto& mt = MemoryTracker::global();
  int64_t a0 = mt.current(MemCategory::Activations);
  {
    Arena ar(4096, MemCategory::Activations);
    EXPECT_EQ(mt.current(MemCategory::Activations), a0);
    void* p = ar.alloc(100);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % kAlignment, 0u);
    size_t m = ar.mark();
    ar.alloc(10);  // starts at 128 after alignment: 28 bytes padding + 10
    EXPECT_EQ(mt.current(MemCategory::Activations) - a0, 138);
    ar.release(m);
    EXPECT_EQ(mt.current(MemCategory::Activations) - a0, 100);
    EXPECT_EQ(ar.peak_used(), 138u);
    EXPECT_THROW(ar.alloc(5000), Error);
  }
  EXPECT_EQ(mt.current(MemCategory::Activations), a0);
}

TEST(Rng, DeterministicAndShardInvariant) {
  uint64_t k = rng_key(42, "layers.3.mlp.w1");
  std::vector<float> full(1000), lo(400), hi(600);
  fill_normal(full.data(), 1000, k, 0, 0.0f, 0.02f);
  fill_normal(lo.data(), 400, k, 0, 0.0f, 0.02f);
  fill_normal(hi.data(), 600, k, 400, 0.0f, 0.02f);
  EXPECT_EQ(std::memcmp(full.data(), lo.data(), 400 * 4), 0);
  EXPECT_EQ(std::memcmp(full.data() + 400, hi.data(), 600 * 4), 0);
  EXPECT_NE(rng_key(42, "a"), rng_key(42, "b"));
  EXPECT_NE(rng_key(42, "a"), rng_key(43, "a"));
  // Moments of 200k normals.
  std::vector<float> v(200000);
  fill_normal(v.data(), 200000, rng_key(7, "moments"), 0, 0.0f, 1.0f);
  double s = 0, s2 = 0;
  for (float x : v) s += x, s2 += double(x) * x;
  EXPECT_NEAR(s / 200000, 0.0, 0.01);
  EXPECT_NEAR(s2 / 200000, 1.0, 0.02);
}

TEST(Rng, PhiloxKnownAnswer) {
  // Random123 known-answer test vector for philox4x32-10 with counter and key all ones... here we
  // use the all-zero vector: ctr = 0, key = 0 -> 6627e8d5 e169c58d bc57ac4c 9b00dbd8.
  auto r = philox4x32(0, 0, 0);
  EXPECT_EQ(r[0], 0x6627e8d5u);
  EXPECT_EQ(r[1], 0xe169c58du);
  EXPECT_EQ(r[2], 0xbc57ac4cu);
  EXPECT_EQ(r[3], 0x9b00dbd8u);
}

TEST(Runtime, IsaOverrideClampsToCpu) {
  Isa before = active_isa();
  set_isa_override(Isa::Scalar);
  EXPECT_EQ(active_isa(), Isa::Scalar);
  set_isa_override(Isa::Avx512);
  EXPECT_LE(int(active_isa()), int(Isa::Avx512));
  set_isa_override(before);
  EXPECT_GE(init_threads(1), 1);
  EXPECT_EQ(num_threads(), 1);
  init_threads(2);
}

TEST(Check, MessageNamesFileOpAndValues) {
  try {
    int got = 7;
    MT_CHECK(got == 3, "my_op", "got ", got, " expected ", 3);
    FAIL();
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("test_core.cpp:"), std::string::npos) << m;
    EXPECT_NE(m.find("[my_op]"), std::string::npos) << m;
    EXPECT_NE(m.find("got 7 expected 3"), std::string::npos) << m;
  }
}

#include "moetron/gemm.h"

TEST(Convert, VectorBf16IsBitwiseTheScalarCodecAtEveryIsa) {
  // Random bit patterns cover normals, denormals, infinities and NaNs; plus exact ties.
  std::vector<float> x(300007);
  auto key = rng_key(11, "convert");
  for (size_t i = 0; i < x.size(); ++i) {
    auto r = philox4x32(key, i);
    uint32_t u = r[0];
    if (i % 7 == 0) u = (u & 0xffff0000u) | 0x8000u;  // halfway cases
    if (i % 11 == 0) u &= 0x807fffffu;                // denormals
    std::memcpy(&x[i], &u, 4);
  }
  Isa before = active_isa();
  for (Isa isa : {Isa::Scalar, Isa::Avx2, Isa::Avx512}) {
    set_isa_override(isa);
    std::vector<bf16> y(x.size());
    std::vector<float> back(x.size());
    f32_to_bf16(y.data(), x.data(), int64_t(x.size()));
    bf16_to_f32(back.data(), y.data(), int64_t(y.size()));
    int bad = 0;
    for (size_t i = 0; i < x.size() && bad < 5; ++i) {
      uint16_t want = to_bf16(x[i]).bits;
      if (y[i].bits != want) {
        ++bad;
        ADD_FAILURE() << isa_name(active_isa()) << " element " << i << " got " << y[i].bits << " want " << want;
      }
      float f = from_bf16(y[i]);
      if (std::memcmp(&f, &back[i], 4) != 0) ++bad, ADD_FAILURE() << "bf16_to_f32 mismatch at " << i;
    }
  }
  set_isa_override(before);
}
