// test_gemm_shape.cpp: the measured GEMM shape table (GemmShapeTable in plan/hardware.h, hardware.cpp): its grid
// rules, its trilinear log-space interpolation, the TOML form, and the catalog's Hopper / Blackwell tables held to
// their source's figures (XLA's matmul performance table; the raw FLOP/s below are that file's).
#include <gtest/gtest.h>

#include "../unit/test_util.h"

#include <cmath>
#include <string>
#include <vector>

#include "moetron/check.h"
#include "moetron/plan/hardware.h"

using namespace moetron;
using namespace moetron::plan;

namespace {

using moetron::testing::error_of;

// A 2 x 2 x 2 grid at m, n, k in {100, 400}; eff = 0.1 + 0.4 [m big] + 0.2 [n big] + 0.1 [k big].
std::vector<std::vector<double>> cube() {
  std::vector<std::vector<double>> p;
  for (double m : {400.0, 100.0})  // any order
    for (double n : {100.0, 400.0})
      for (double k : {100.0, 400.0})
        p.push_back({m, n, k, 0.1 + (m > 100 ? 0.4 : 0) + (n > 100 ? 0.2 : 0) + (k > 100 ? 0.1 : 0)});
  return p;
}

TEST(GemmShapeTable, GridPointsAndTrilinearLogInterpolation) {
  const GemmShapeTable t = GemmShapeTable::from_points(cube(), "t");
  EXPECT_EQ(t.m, (std::vector<double>{100, 400}));
  EXPECT_DOUBLE_EQ(t.at(100, 100, 100), 0.1);
  EXPECT_DOUBLE_EQ(t.at(400, 400, 400), 0.8);
  EXPECT_DOUBLE_EQ(t.at(400, 100, 400), 0.6);
  // 200 is half-way from 100 to 400 in log space; the effects add, so the interpolation is their half sum.
  EXPECT_NEAR(t.at(200, 100, 100), 0.1 + 0.2, 1e-12);
  EXPECT_NEAR(t.at(200, 200, 200), 0.1 + 0.2 + 0.1 + 0.05, 1e-12);
  EXPECT_NEAR(t.at(400, 200, 100), 0.5 + 0.1, 1e-12);
  // Above an axis: clamped. Below it: the time of the smallest measured GEMM, so eff scales with the dimension.
  EXPECT_DOUBLE_EQ(t.at(1e6, 1e6, 1e6), 0.8);
  EXPECT_NEAR(t.at(50, 400, 400), 0.5 * 0.4, 1e-12);
  EXPECT_NEAR(t.at(25, 400, 50), 0.25 * 0.5 * 0.3, 1e-12);
  EXPECT_DOUBLE_EQ(GemmShapeTable{}.at(1, 2, 3), 1.0);  // empty: no effect
}

TEST(GemmShapeTable, PointsMustFillTheGridOnce) {
  auto p = cube();
  p.pop_back();
  std::string msg = error_of([&] { GemmShapeTable::from_points(p, "gemm_shape_efficiency"); });
  EXPECT_NE(msg.find("gemm_shape_efficiency: 7 points do not fill the grid of 2 m x 2 n x 2 k values"),
            std::string::npos) << msg;
  p = cube();
  p[1] = p[0];  // one cell twice, another missing: 8 points, but not a grid
  msg = error_of([&] { GemmShapeTable::from_points(p, "g"); });
  EXPECT_NE(msg.find("is given twice"), std::string::npos) << msg;
  p = cube();
  p[2][1] = -4;
  msg = error_of([&] { GemmShapeTable::from_points(p, "g"); });
  EXPECT_NE(msg.find("every dimension must be > 0"), std::string::npos) << msg;
  msg = error_of([&] { GemmShapeTable::from_points({{1, 2, 3}}, "g"); });
  EXPECT_NE(msg.find("each point is [m, n, k, eff]"), std::string::npos) << msg;
}

TEST(GemmShapeTable, TomlReadsWritesAndRefuses) {
  const std::string base = R"(name = "lab"
hbm_gb = 96
hbm_bw_gbps = 4000
peak_bf16_tflops = 1000
achievable_bf16_tflops = 700
gemm_efficiency = [[128, 0.4], [1024, 0.9]]
gemm_shape_efficiency = [[100, 100, 100, 0.1], [100, 100, 400, 0.2], [100, 400, 100, 0.3], [100, 400, 400, 0.4],
  [400, 100, 100, 0.5], [400, 100, 400, 0.6], [400, 400, 100, 0.7], [400, 400, 400, 0.8]]

[scale_up]
domain = 4
bw_gbps = 300

[scale_out]
domain = 1024
bw_gbps = 25
)";
  const Hardware h = hardware_from_toml(base, "lab.toml");
  validate_hardware(h, "lab.toml");
  // The table replaces the smallest-dimension curve for the rate.
  EXPECT_DOUBLE_EQ(h.gemm_rate(400, 400, 100, false), 700e12 * 0.7);
  EXPECT_DOUBLE_EQ(h.gemm_rate(100, 400, 400, false), 700e12 * 0.4);
  const Hardware back = hardware_from_toml(hardware_to_toml(h), "back.toml");
  EXPECT_EQ(back.gemm_shape_efficiency.eff, h.gemm_shape_efficiency.eff);
  EXPECT_EQ(back.gemm_shape_efficiency.k, h.gemm_shape_efficiency.k);
  std::string bad = base;
  bad.replace(bad.find("0.8]]"), 5, "1.5]]");
  const Hardware over = hardware_from_toml(bad, "lab.toml");
  std::string msg = error_of([&] { validate_hardware(over, "lab.toml"); });
  EXPECT_NE(msg.find("gemm_shape_efficiency[400, 400, 400] = 1.5: must be in (0, 1]"), std::string::npos) << msg;
  bad = base;
  bad.replace(bad.find(", [400, 400, 400, 0.8]"), 22, "");
  msg = error_of([&] { hardware_from_toml(bad, "lab.toml"); });
  EXPECT_NE(msg.find("lab.toml: gemm_shape_efficiency: 7 points do not fill the grid"), std::string::npos) << msg;
}

// The catalog's tables against the source file's FLOP/s (bf16, batch 1): each point is the shape's rate over the
// table's best (4096^3), so the catalog rate is achievable x that ratio, to the table's four decimals.
TEST(HardwareCatalog, GemmShapeTablesFromXlasMeasurements) {
  const Hardware h100 = catalog_hardware("h100"), b200 = catalog_hardware("b200");
  const double sm90_best = 780193877565849.0, sm100_best = 1416867213789406.0;
  auto ratio = [](const Hardware& h, double m, double n, double k) {
    return h.gemm_rate(m, n, k, false) / h.achievable_bf16;
  };
  EXPECT_NEAR(ratio(h100, 2048, 2048, 2048), 641039894925373.0 / sm90_best, 5e-5);
  EXPECT_NEAR(ratio(h100, 4096, 512, 1024), 377546351617440.0 / sm90_best, 5e-5);
  EXPECT_NEAR(ratio(h100, 4096, 4096, 4096), 1.0, 1e-12);
  EXPECT_NEAR(ratio(h100, 8192, 7168, 16384), 1.0, 1e-12);  // clamped above 4096
  EXPECT_NEAR(ratio(b200, 256, 256, 256), 6765006451612.0 / sm100_best, 5e-5);
  EXPECT_NEAR(ratio(b200, 4096, 4096, 4096), 1.0, 1e-12);
  for (const char* name : {"h200", "h800"})
    EXPECT_EQ(catalog_hardware(name).gemm_shape_efficiency.eff, h100.gemm_shape_efficiency.eff) << name;
  for (const char* name : {"gb200", "gb300"})
    EXPECT_EQ(catalog_hardware(name).gemm_shape_efficiency.eff, b200.gemm_shape_efficiency.eff) << name;
  for (const char* name : {"a100", "mi300x", "mi325x", "mi355x"})
    EXPECT_TRUE(catalog_hardware(name).gemm_shape_efficiency.empty()) << name;
  EXPECT_EQ(h100.gemm_shape_efficiency.eff.size(), 125u);
}

}  // namespace
