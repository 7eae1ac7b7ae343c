// tests/plan/test_hardware.cpp: the planner's hardware catalog and its TOML loader: every entry loads and
// names a source for each figure it sets, TOML round trips, refusals name the key, the GEMM efficiency
// interpolation, the whitepaper's all-to-all figures, and user files. Not the collective cost model.
#include <gtest/gtest.h>

#include "../unit/test_util.h"

#include <toml++/toml.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include <unistd.h>

#include "moetron/check.h"
#include "moetron/plan/hardware.h"

using namespace moetron;
using namespace moetron::plan;

namespace {

using moetron::testing::error_of;  // the message of the moetron::Error f throws, or ""

// A small valid user file; tests break one thing at a time.
const char* const kUserToml = R"(name = "lab"
description = "test cluster"
hbm_gb = 96
hbm_bw_gbps = 4000
peak_bf16_tflops = 1000
peak_fp8_tflops = 2000
achievable_bf16_tflops = 700
achievable_fp8_tflops = 1300
kernel_overhead_us = 5
gemm_efficiency = [[128, 0.4], [1024, 0.9]]

[scale_up]
domain = 4
bw_gbps = 300
alpha_us = 2

[scale_out]
domain = 1024
bw_gbps = 25
alpha_us = 12
)";

std::string replace(std::string s, const std::string& from, const std::string& to) {
  const size_t at = s.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  if (at != std::string::npos) s.replace(at, from.size(), to);
  return s;
}

void expect_same(const Hardware& a, const Hardware& b) {
  EXPECT_EQ(a.name, b.name);
  EXPECT_EQ(a.description, b.description);
  EXPECT_DOUBLE_EQ(a.hbm_bytes, b.hbm_bytes);
  EXPECT_DOUBLE_EQ(a.hbm_bw, b.hbm_bw);
  EXPECT_DOUBLE_EQ(a.hbm_efficiency, b.hbm_efficiency);
  EXPECT_DOUBLE_EQ(a.peak_bf16, b.peak_bf16);
  EXPECT_DOUBLE_EQ(a.peak_fp8, b.peak_fp8);
  EXPECT_DOUBLE_EQ(a.achievable_bf16, b.achievable_bf16);
  EXPECT_DOUBLE_EQ(a.achievable_fp8, b.achievable_fp8);
  EXPECT_DOUBLE_EQ(a.kernel_overhead, b.kernel_overhead);
  ASSERT_EQ(a.gemm_efficiency.size(), b.gemm_efficiency.size());
  for (size_t i = 0; i < a.gemm_efficiency.size(); ++i) {
    EXPECT_DOUBLE_EQ(a.gemm_efficiency[i].dim, b.gemm_efficiency[i].dim);
    EXPECT_DOUBLE_EQ(a.gemm_efficiency[i].eff, b.gemm_efficiency[i].eff);
  }
  for (Tier Hardware::*t : {&Hardware::scale_up, &Hardware::scale_out}) {
    const Tier& x = a.*t;
    const Tier& y = b.*t;
    EXPECT_EQ(x.domain, y.domain);
    EXPECT_DOUBLE_EQ(x.bw, y.bw);
    EXPECT_DOUBLE_EQ(x.alpha, y.alpha);
    EXPECT_EQ(x.topology, y.topology);
    EXPECT_EQ(x.links, y.links);
    EXPECT_DOUBLE_EQ(x.link_bw, y.link_bw);
    EXPECT_DOUBLE_EQ(x.link_efficiency, y.link_efficiency);
    EXPECT_DOUBLE_EQ(x.gather_bw, y.gather_bw);
    EXPECT_DOUBLE_EQ(x.scatter_bw, y.scatter_bw);
    for (auto cv : {&Tier::ep_dispatch_efficiency, &Tier::ep_combine_efficiency}) {
      ASSERT_EQ((x.*cv).size(), (y.*cv).size());
      for (size_t i = 0; i < (x.*cv).size(); ++i) {
        EXPECT_DOUBLE_EQ((x.*cv)[i].dim, (y.*cv)[i].dim);
        EXPECT_DOUBLE_EQ((x.*cv)[i].eff, (y.*cv)[i].eff);
      }
    }
  }
  EXPECT_EQ(a.gemm_shape_efficiency.m, b.gemm_shape_efficiency.m);
  EXPECT_EQ(a.gemm_shape_efficiency.n, b.gemm_shape_efficiency.n);
  EXPECT_EQ(a.gemm_shape_efficiency.k, b.gemm_shape_efficiency.k);
  EXPECT_EQ(a.gemm_shape_efficiency.eff, b.gemm_shape_efficiency.eff);
  EXPECT_DOUBLE_EQ(a.attention_efficiency, b.attention_efficiency);
  EXPECT_DOUBLE_EQ(a.loss_efficiency, b.loss_efficiency);
  EXPECT_DOUBLE_EQ(a.elementwise_bw, b.elementwise_bw);
  EXPECT_DOUBLE_EQ(a.optimizer_per_param, b.optimizer_per_param);
  EXPECT_DOUBLE_EQ(a.grad_norm_per_param, b.grad_norm_per_param);
  EXPECT_DOUBLE_EQ(a.expert_pack_per_param, b.expert_pack_per_param);
  EXPECT_DOUBLE_EQ(a.expert_pack_fused_per_param, b.expert_pack_fused_per_param);
  for (auto cv : {&Hardware::grouped_gemm_efficiency, &Hardware::grouped_fwd_efficiency,
                  &Hardware::grouped_bwd_efficiency, &Hardware::attention_seq_efficiency}) {
    ASSERT_EQ((a.*cv).size(), (b.*cv).size());
    for (size_t i = 0; i < (a.*cv).size(); ++i) {
      EXPECT_DOUBLE_EQ((a.*cv)[i].dim, (b.*cv)[i].dim);
      EXPECT_DOUBLE_EQ((a.*cv)[i].eff, (b.*cv)[i].eff);
    }
  }
  EXPECT_EQ(a.sources, b.sources);
}

struct TempDir {
  std::filesystem::path path;
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "moetron_hw_XXXXXX").string();
    if (!mkdtemp(tmpl.data())) ADD_FAILURE() << "mkdtemp failed";
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

}  // namespace

// ---- the catalog ------------------------------------------------------------------------------------------
TEST(HardwareCatalog, HasTheElevenEntries) {
  const std::vector<std::string> want = {"mi300x", "mi325x", "mi355x", "a100", "a100_nccl", "h100",
                                         "h200",   "h800",   "b200",   "gb200", "gb300"};
  EXPECT_EQ(catalog_names(), want);
}

TEST(HardwareCatalog, EveryEntryLoadsAndValidates) {
  for (const auto& name : catalog_names()) {
    SCOPED_TRACE(name);
    Hardware h;
    ASSERT_NO_THROW(h = catalog_hardware(name));
    EXPECT_EQ(h.name, name);
    EXPECT_FALSE(h.description.empty());
    EXPECT_NO_THROW(validate_hardware(h, name));
    // Measured rates sit below the datasheet peaks, and FP8 above BF16 (where the GPU has FP8: not A100).
    EXPECT_LT(h.achievable_bf16, h.peak_bf16);
    if (name == "a100" || name == "a100_nccl") {
      EXPECT_EQ(h.peak_fp8, 0.0);
      EXPECT_EQ(h.achievable_fp8, 0.0);
    } else {
      EXPECT_LT(h.achievable_fp8, h.peak_fp8);
      EXPECT_GT(h.achievable_fp8, h.achievable_bf16);
    }
    EXPECT_GE(h.scale_up.domain, 8);
    EXPECT_GT(h.scale_up.bw, h.scale_out.bw);
  }
  EXPECT_EQ(catalog_hardware("MI300X").name, "mi300x");  // names are case-insensitive
}

TEST(HardwareCatalog, EverySetFigureNamesASource) {
  for (const auto& name : catalog_names()) {
    SCOPED_TRACE(name);
    const toml::table root = toml::parse(catalog_toml(name));
    const Hardware h = catalog_hardware(name);
    std::set<std::string> set_keys;
    for (const auto& [k, v] : root) {
      const std::string key(k.str());
      if (key == "name" || key == "description" || key == "sources") continue;
      if (const auto* tier = v.as_table()) {
        for (const auto& [tk, tv] : *tier) set_keys.insert(key + "." + std::string(tk.str()));
      } else {
        set_keys.insert(key);
      }
    }
    EXPECT_GE(set_keys.size(), 17u);  // 9 top-level figures + 4 per tier at least
    for (const auto& key : set_keys) {
      auto it = h.sources.find(key);
      ASSERT_NE(it, h.sources.end()) << "no source for " << key;
      EXPECT_GE(it->second.size(), 20u) << key << ": '" << it->second << "'";
    }
    for (const auto& [key, text] : h.sources) EXPECT_TRUE(set_keys.count(key)) << "source for unset key " << key;
    // An achievable rate is a measurement or says how it was derived; never a bare datasheet figure. A GPU
    // without the format says "none:" (its rate is 0).
    for (const char* key : {"achievable_bf16_tflops", "achievable_fp8_tflops"}) {
      const std::string& s = h.sources.at(key);
      const bool none = std::string(key) == "achievable_fp8_tflops" && h.achievable_fp8 == 0;
      EXPECT_TRUE(none ? s.rfind("none:", 0) == 0 : s.rfind("measured", 0) == 0 || s.rfind("derived:", 0) == 0)
          << key << ": " << s;
    }
  }
  EXPECT_EQ(catalog_hardware("mi355x").sources.at("achievable_fp8_tflops").rfind("derived:", 0), 0u);
}

// A figure chosen because it makes a comparison with a published result pass is fitted: its source begins
// "fitted:" and the entry's description says FITTED, so that no output on that entry reads as sourced. Every
// scale-up bandwidth but the fitted one is a line rate (the same kind of source in every entry).
TEST(HardwareCatalog, FittedFiguresAreLabelled) {
  std::vector<std::string> fitted;
  for (const auto& name : catalog_names()) {
    const Hardware h = catalog_hardware(name);
    bool any = false;
    for (const auto& [key, text] : h.sources)
      if (text.rfind("fitted:", 0) == 0) any = true, fitted.push_back(name + " " + key);
    EXPECT_EQ(any, h.description.find("FITTED") != std::string::npos) << name << ": " << h.description;
    if (!any) {
      const std::string& bw = h.sources.at("scale_up.bw_gbps");
      EXPECT_EQ(bw.find("measured"), std::string::npos) << name << ": " << bw;
    }
  }
  EXPECT_EQ(fitted, std::vector<std::string>{"a100_nccl scale_up.bw_gbps"});
}

TEST(HardwareCatalog, DatasheetFigures) {
  const Hardware mi300x = catalog_hardware("mi300x"), mi355x = catalog_hardware("mi355x");
  EXPECT_DOUBLE_EQ(mi300x.hbm_bytes, 192e9);
  EXPECT_DOUBLE_EQ(mi300x.hbm_bw, 5.3e12);
  EXPECT_DOUBLE_EQ(mi355x.hbm_bytes, 288e9);
  EXPECT_DOUBLE_EQ(mi355x.hbm_bw, 8.0e12);
  EXPECT_NEAR(mi300x.peak_bf16, 1.3e15, 0.01e15);
  EXPECT_NEAR(mi355x.peak_fp8, 5.0e15, 0.01e15);
  const Hardware h100 = catalog_hardware("h100"), gb200 = catalog_hardware("gb200");
  EXPECT_DOUBLE_EQ(h100.scale_up.bw, 450e9);  // NVLink 4: 900 GB/s bidirectional
  EXPECT_DOUBLE_EQ(gb200.scale_up.bw, 900e9);  // NVLink 5: 1.8 TB/s bidirectional
  EXPECT_EQ(gb200.scale_up.domain, 72);
  EXPECT_DOUBLE_EQ(h100.scale_out.bw, 50e9);   // 400 Gb/s per GPU
  // A100 SXM 80GB in a DGX A100 node (Selene): NVLink 3 600 GB/s bidirectional, one 200 Gb/s HDR NIC per GPU.
  const Hardware a100 = catalog_hardware("a100");
  EXPECT_DOUBLE_EQ(a100.hbm_bytes, 80e9);
  EXPECT_DOUBLE_EQ(a100.hbm_bw, 2039e9);
  EXPECT_DOUBLE_EQ(a100.peak_bf16, 312e12);
  EXPECT_DOUBLE_EQ(a100.scale_up.bw, 300e9);
  EXPECT_EQ(a100.scale_up.domain, 8);
  EXPECT_DOUBLE_EQ(a100.scale_out.bw, 25e9);
  // a100_nccl: the same GPU and node, the scale-up bandwidth fitted to the public dense anchors (200 GB/s, about
  // a measured NCCL all-reduce bus bandwidth); its source and its description say it is fitted.
  const Hardware nccl = catalog_hardware("a100_nccl");
  EXPECT_DOUBLE_EQ(nccl.scale_up.bw, 200e9);
  EXPECT_EQ(nccl.sources.at("scale_up.bw_gbps").rfind("fitted:", 0), 0u);
  EXPECT_NE(nccl.sources.at("scale_up.bw_gbps").find("nccl-tests issue 149"), std::string::npos);
  EXPECT_NE(nccl.description.find("FITTED"), std::string::npos) << nccl.description;
  Hardware same = nccl;
  same.name = a100.name, same.description = a100.description, same.scale_up.bw = a100.scale_up.bw;
  same.sources = a100.sources;
  EXPECT_EQ(hardware_to_toml(same), hardware_to_toml(a100));
}

// H800 (the published DeepSeek-V3 run) and GB300 NVL72 (Megatron-Bridge's DGX-GB300 rows): their spec-sheet figures.
// The H800's scale-up figure is the datasheet's line rate (400 GB/s bidirectional), not the 160 GB/s the DeepSeek-V3
// report states for its cluster: that paper is the source of a compared row (docs/planner.md, rules 1 and 2), so its
// system description is an input, named as such, and never the catalog figure.
TEST(HardwareCatalog, H800AndGb300DatasheetFigures) {
  const Hardware h800 = catalog_hardware("h800"), h100 = catalog_hardware("h100");
  EXPECT_DOUBLE_EQ(h800.hbm_bytes, 80e9);
  EXPECT_DOUBLE_EQ(h800.hbm_bw, 3350e9);
  EXPECT_DOUBLE_EQ(h800.peak_bf16, h100.peak_bf16);  // the same GH100 compute: 1979 sparse / 989.5 dense
  EXPECT_DOUBLE_EQ(h800.peak_fp8, h100.peak_fp8);
  EXPECT_DOUBLE_EQ(h800.achievable_bf16, h100.achievable_bf16);  // derived from H100's measurement, and says so
  EXPECT_EQ(h800.sources.at("achievable_bf16_tflops").rfind("derived:", 0), 0u);
  EXPECT_DOUBLE_EQ(h800.scale_up.bw, 200e9);  // NVLink 400 GB/s bidirectional
  EXPECT_EQ(h800.scale_up.domain, 8);
  EXPECT_DOUBLE_EQ(h800.scale_out.bw, 50e9);  // 400 Gb/s per GPU
  EXPECT_NE(h800.sources.at("scale_up.bw_gbps").find("not used"), std::string::npos);
  EXPECT_NE(h800.sources.at("scale_out.bw_gbps").find("an input from the paper of the compared row"), std::string::npos);

  const Hardware gb300 = catalog_hardware("gb300"), gb200 = catalog_hardware("gb200");
  EXPECT_DOUBLE_EQ(gb300.hbm_bytes, 277.8e9);  // 20 TB / 72
  EXPECT_DOUBLE_EQ(gb300.hbm_bw, 8000e9);      // 576 TB/s / 72
  EXPECT_DOUBLE_EQ(gb300.peak_bf16, 2500e12);
  EXPECT_DOUBLE_EQ(gb300.peak_fp8, 5000e12);
  EXPECT_DOUBLE_EQ(gb300.achievable_bf16, gb200.achievable_bf16);  // derived from GB200's measurement
  EXPECT_DOUBLE_EQ(gb300.achievable_fp8, gb200.achievable_fp8);
  EXPECT_EQ(gb300.sources.at("achievable_fp8_tflops").rfind("derived:", 0), 0u);
  EXPECT_EQ(gb300.scale_up.domain, 72);
  EXPECT_DOUBLE_EQ(gb300.scale_up.bw, 900e9);   // NVLink 5: 130 TB/s / 72 = 1.8 TB/s bidirectional
  EXPECT_DOUBLE_EQ(gb300.scale_out.bw, 100e9);  // one ConnectX-8 at 800 Gb/s per GPU
}

// The EP exchanges' share of the scale-up line rate, from the dispatchers' published bandwidths, each over its
// GPU's per-direction NVLink rate: DeepEP V1 on H800 at EP 8 (153 / 158 of 200 GB/s); HybridEP with 16 SMs through
// the Torch API on B200 at EP 8 and on GB200 at EP 8-36, whose "algorithm bandwidth" counts the rank's own 1/n, so
// (n - 1) / n of it crosses NVLink. Every entry's scale-up tier has both curves (the 8-GPU domains without a
// measurement take H800's, rule 2), each with a source that says whether it was measured or derived; no scale-out
// tier has one (DeepEP's and HybridEP's RDMA figures reach the NIC's line rate). Hardware figures, not a
// comparison with a published result.
TEST(HardwareCatalog, EpExchangeSharesFromTheDispatchersMeasurements) {
  auto near3 = [](double got, double want) { EXPECT_NEAR(got, want, 5e-4); };  // the catalog's three decimals
  const Hardware h800 = catalog_hardware("h800"), b200 = catalog_hardware("b200"), gb200 = catalog_hardware("gb200");
  near3(h800.scale_up.ep_eff(false, 8), 153.0 / 200);
  near3(h800.scale_up.ep_eff(true, 8), 158.0 / 200);
  near3(b200.scale_up.ep_eff(false, 8), 535.94 * 7 / 8 / 900);
  near3(b200.scale_up.ep_eff(true, 8), 530.86 * 7 / 8 / 900);
  near3(gb200.scale_up.ep_eff(false, 8), 550.10 * 7 / 8 / 900);
  near3(gb200.scale_up.ep_eff(false, 32), 485.50 * 31 / 32 / 900);
  near3(gb200.scale_up.ep_eff(true, 32), 423.19 * 31 / 32 / 900);
  near3(gb200.scale_up.ep_eff(true, 36), 418.27 * 35 / 36 / 900);
  EXPECT_DOUBLE_EQ(gb200.scale_up.ep_eff(true, 64), gb200.scale_up.ep_eff(true, 36));  // no wider measurement
  const double at12 = gb200.scale_up.ep_eff(false, 12), f = std::log(12.0 / 8) / std::log(2.0);  // log-linear
  EXPECT_DOUBLE_EQ(at12, gb200.scale_up.ep_eff(false, 8) + f * (gb200.scale_up.ep_eff(false, 16) -
                                                                gb200.scale_up.ep_eff(false, 8)));
  const Hardware gb300 = catalog_hardware("gb300");  // GB300 takes GB200's curves
  for (double n : {8.0, 20.0, 36.0}) {
    EXPECT_DOUBLE_EQ(gb300.scale_up.ep_eff(false, n), gb200.scale_up.ep_eff(false, n));
    EXPECT_DOUBLE_EQ(gb300.scale_up.ep_eff(true, n), gb200.scale_up.ep_eff(true, n));
  }
  for (const auto& name : catalog_names()) {
    SCOPED_TRACE(name);
    const Hardware h = catalog_hardware(name);
    EXPECT_FALSE(h.scale_up.ep_dispatch_efficiency.empty());
    EXPECT_FALSE(h.scale_up.ep_combine_efficiency.empty());
    EXPECT_TRUE(h.scale_out.ep_dispatch_efficiency.empty() && h.scale_out.ep_combine_efficiency.empty());
    for (const char* key : {"scale_up.ep_dispatch_efficiency", "scale_up.ep_combine_efficiency"}) {
      const std::string& src = h.sources.at(key);
      EXPECT_TRUE(src.rfind("measured", 0) == 0 || src.rfind("derived:", 0) == 0) << key << ": " << src;
    }
  }
}

// The full mesh's all-to-all bandwidth is its links at line rate: 7 x 64 GB/s = 448 GB/s (MI300X) and 7 x 76.8 =
// 537.6 GB/s (MI355X), the data sheets' link figures; the whitepaper prints the same two numbers. A hardware
// figure, not a comparison with a published result.
TEST(HardwareCatalog, FullMeshAllToAllIsSevenLinksAtLineRate) {
  const Hardware mi300x = catalog_hardware("mi300x"), mi355x = catalog_hardware("mi355x");
  EXPECT_EQ(mi300x.scale_up.topology, "full_mesh");
  EXPECT_EQ(mi300x.scale_up.links, 7);
  EXPECT_NEAR(mi300x.scale_up.all_peers_bw(), 448e9, 448e9 * 0.01);
  EXPECT_NEAR(mi355x.scale_up.all_peers_bw(), 537.6e9, 537.6e9 * 0.01);
  EXPECT_NEAR(mi300x.scale_up.pair_bw(), 64e9, 64e9 * 0.01);  // one link, one direction
  // A switch gives every pair, and all peers together, the same per-GPU bandwidth.
  const Hardware h100 = catalog_hardware("h100");
  EXPECT_DOUBLE_EQ(h100.scale_up.all_peers_bw(), h100.scale_up.pair_bw());
}

TEST(HardwareCatalog, UnknownNameListsTheCatalog) {
  for (const std::string& msg : {error_of([] { catalog_hardware("mi400x"); }),
                                error_of([] { resolve_hardware("mi400x"); })}) {
    EXPECT_NE(msg.find("'mi400x'"), std::string::npos) << msg;
    for (const auto& name : catalog_names()) EXPECT_NE(msg.find(name), std::string::npos) << name << ": " << msg;
  }
}

// ---- TOML round trip -------------------------------------------------------------------------------------
TEST(HardwareToml, CatalogRoundTrips) {
  for (const auto& name : catalog_names()) {
    SCOPED_TRACE(name);
    const Hardware h = catalog_hardware(name);
    const std::string text = hardware_to_toml(h);
    const Hardware back = hardware_from_toml(text, "roundtrip.toml");
    expect_same(h, back);
    EXPECT_EQ(hardware_to_toml(back), text);  // stable after one trip
  }
}

TEST(HardwareToml, AwkwardValuesRoundTrip) {
  Hardware h = hardware_from_toml(kUserToml, "lab.toml");
  h.description = "quote \" backslash \\ tab \t end";
  h.hbm_bytes = 123456789012.345;
  h.hbm_bw = 1.0 / 3.0 * 1e13;
  h.kernel_overhead = 1.7e-6;
  h.scale_up.alpha = 0.1e-6;
  h.scale_out.topology = "full_mesh";
  h.scale_out.links = 3;
  h.scale_out.link_bw = 12.5e9;
  h.scale_out.link_efficiency = 0.85;
  h.sources["hbm_gb"] = "a \"quoted\" source";
  const Hardware back = hardware_from_toml(hardware_to_toml(h), "x.toml");
  expect_same(h, back);
}

TEST(HardwareToml, MeasuredPerOpFiguresRoundTrip) {
  // The figures `plan calibrate` measures per op: written only when set, read back exactly, in their TOML units.
  Hardware h = hardware_from_toml(kUserToml, "lab.toml");
  EXPECT_EQ(hardware_to_toml(h).find("loss_efficiency"), std::string::npos);  // unset: not written
  h.grouped_fwd_efficiency = {{4, 0.1}, {64, 0.9}};
  h.grouped_bwd_efficiency = {{4, 0.08}, {64, 0.7}};
  h.attention_seq_efficiency = {{128, 0.4}, {512, 0.6}};
  h.loss_efficiency = 0.85;
  h.elementwise_bw = 13.5e9;
  h.optimizer_per_param = 2.6e-9;
  h.grad_norm_per_param = 1.6e-9;
  h.expert_pack_per_param = 4.3e-9;
  h.expert_pack_fused_per_param = 1.7e-9;
  h.scale_up.ep_dispatch_efficiency = {{8, 0.6}, {32, 0.4}};
  h.scale_out.ep_combine_efficiency = {{16, 0.9}};
  h.scale_up.gather_bw = 3.5e9, h.scale_up.scatter_bw = 2.25e9;
  const std::string text = hardware_to_toml(h);
  EXPECT_NE(text.find("gather_bw_gbps = 3.5\n"), std::string::npos) << text;
  EXPECT_NE(text.find("scatter_bw_gbps = 2.25\n"), std::string::npos) << text;
  EXPECT_EQ(text.find("gather_bw_gbps", text.find("[scale_out]")), std::string::npos) << text;  // unset: not written
  EXPECT_NE(text.find("ep_dispatch_efficiency = [[8.0, 0.6], [32.0, 0.4]]\n"), std::string::npos) << text;
  EXPECT_EQ(text.find("ep_combine_efficiency", text.find("[scale_up]")),
            text.find("ep_combine_efficiency", text.find("[scale_out]")))  // the scale-up one is unset: not written
      << text;
  EXPECT_NE(text.find("expert_pack_fused_ns_per_param = "), std::string::npos) << text;
  EXPECT_NE(text.find("elementwise_bw_gbps = 13.5\n"), std::string::npos) << text;
  EXPECT_NE(text.find("optimizer_ns_per_param = 2.6\n"), std::string::npos) << text;
  const Hardware back = hardware_from_toml(text, "lab.toml");
  expect_same(h, back);
  validate_hardware(back, "lab.toml");
  // The split curves fall back to the combined one, which falls back to "not measured".
  double f = 0, b = 0;
  EXPECT_TRUE(back.grouped_split_eff(16, &f, &b));
  EXPECT_DOUBLE_EQ(f, 0.1 + 0.5 * (0.9 - 0.1));  // 16 is half-way from 4 to 64 in log space
  EXPECT_DOUBLE_EQ(b, 0.08 + 0.5 * (0.7 - 0.08));
  Hardware only_both = hardware_from_toml(kUserToml, "lab.toml");
  EXPECT_FALSE(only_both.grouped_split_eff(16, &f, &b));
  only_both.grouped_gemm_efficiency = {{1, 0.3}};
  EXPECT_TRUE(only_both.grouped_split_eff(16, &f, &b));
  EXPECT_DOUBLE_EQ(f, 0.3);
  EXPECT_DOUBLE_EQ(b, 0.3);
  // Attention: the curve by sequence length when set, else the scalar.
  EXPECT_DOUBLE_EQ(back.attention_eff(128), 0.4);
  EXPECT_DOUBLE_EQ(back.attention_eff(4096), 0.6);
  EXPECT_DOUBLE_EQ(only_both.attention_eff(4096), only_both.attention_efficiency);
}

// ---- refusals ---------------------------------------------------------------------------------------------
TEST(HardwareToml, UserFileParses) {
  const Hardware h = hardware_from_toml(kUserToml, "lab.toml");
  EXPECT_EQ(h.name, "lab");
  EXPECT_DOUBLE_EQ(h.hbm_bytes, 96e9);
  EXPECT_DOUBLE_EQ(h.hbm_bw, 4e12);
  EXPECT_DOUBLE_EQ(h.achievable_bf16, 700e12);
  EXPECT_DOUBLE_EQ(h.kernel_overhead, 5e-6);
  EXPECT_DOUBLE_EQ(h.scale_up.alpha, 2e-6);
  EXPECT_EQ(h.scale_up.topology, "switch");
  EXPECT_DOUBLE_EQ(h.hbm_efficiency, 1.0);  // optional keys keep their defaults
  EXPECT_NO_THROW(validate_hardware(h, "lab.toml"));
}

TEST(HardwareToml, UnknownKeyNamesItAndSuggests) {
  std::string msg = error_of([] { hardware_from_toml(replace(kUserToml, "hbm_gb =", "hbm_gbs ="), "lab.toml"); });
  EXPECT_NE(msg.find("lab.toml"), std::string::npos) << msg;
  EXPECT_NE(msg.find("unknown key 'hbm_gbs'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("did you mean 'hbm_gb'"), std::string::npos) << msg;
  msg = error_of([] { hardware_from_toml(replace(kUserToml, "bw_gbps = 300", "bw_gpbs = 300"), "lab.toml"); });
  EXPECT_NE(msg.find("'scale_up.bw_gpbs'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("did you mean 'scale_up.bw_gbps'"), std::string::npos) << msg;
  msg = error_of([] {
    hardware_from_toml(std::string(kUserToml) + "\n[sources]\nhbm_bw = \"x\"\n", "lab.toml");
  });
  EXPECT_NE(msg.find("'sources.hbm_bw'"), std::string::npos) << msg;
  msg = error_of([] { hardware_from_toml(std::string(kUserToml) + "\n[network]\nx = 1\n", "lab.toml"); });
  EXPECT_NE(msg.find("unknown key 'network'"), std::string::npos) << msg;
}

TEST(HardwareToml, NegativeBandwidthNamesTheKey) {
  const Hardware h = hardware_from_toml(replace(kUserToml, "bw_gbps = 300", "bw_gbps = -1"), "mi300x.toml");
  const std::string msg = error_of([&] { validate_hardware(h, "mi300x.toml"); });
  EXPECT_NE(msg.find("mi300x.toml: scale_up.bw_gbps = -1: must be > 0"), std::string::npos) << msg;
  // resolve_hardware validates too.
  TempDir dir;
  const auto path = dir.path / "bad.toml";
  std::ofstream(path) << replace(kUserToml, "hbm_bw_gbps = 4000", "hbm_bw_gbps = 0");
  const std::string msg2 = error_of([&] { resolve_hardware(path.string()); });
  EXPECT_NE(msg2.find("hbm_bw_gbps = 0: must be > 0"), std::string::npos) << msg2;
}

TEST(HardwareToml, MissingRequiredFigureNamesTheKey) {
  std::string msg = error_of([] { hardware_from_toml(replace(kUserToml, "hbm_gb = 96\n", ""), "lab.toml"); });
  EXPECT_NE(msg.find("missing required key 'hbm_gb'"), std::string::npos) << msg;
  msg = error_of([] { hardware_from_toml(replace(kUserToml, "domain = 4\n", ""), "lab.toml"); });
  EXPECT_NE(msg.find("'scale_up.domain'"), std::string::npos) << msg;
  msg = error_of([] { hardware_from_toml(replace(kUserToml, "bw_gbps = 25\n", ""), "lab.toml"); });
  EXPECT_NE(msg.find("'scale_out.bw_gbps'"), std::string::npos) << msg;
  msg = error_of([] {
    hardware_from_toml(replace(kUserToml, "bw_gbps = 300", "topology = \"full_mesh\"\nlinks = 3"), "lab.toml");
  });
  EXPECT_NE(msg.find("'scale_up.link_bw_gbps'"), std::string::npos) << msg;
}

TEST(HardwareToml, WrongTypeNamesTheKey) {
  std::string msg = error_of([] { hardware_from_toml(replace(kUserToml, "hbm_gb = 96", "hbm_gb = \"96\""), "lab.toml"); });
  EXPECT_NE(msg.find("hbm_gb: expected a number, got string"), std::string::npos) << msg;
  msg = error_of([] { hardware_from_toml(replace(kUserToml, "domain = 4", "domain = 4.5"), "lab.toml"); });
  EXPECT_NE(msg.find("scale_up.domain: expected an integer, got float"), std::string::npos) << msg;
  msg = error_of([] {
    hardware_from_toml(replace(kUserToml, "[[128, 0.4], [1024, 0.9]]", "[128, 0.4]"), "lab.toml");
  });
  EXPECT_NE(msg.find("gemm_efficiency: expected a [dim, eff] pair"), std::string::npos) << msg;
  msg = error_of([] { hardware_from_toml("hbm_gb = = 3\n", "broken.toml"); });
  EXPECT_NE(msg.find("broken.toml:1: TOML syntax error"), std::string::npos) << msg;
}

TEST(HardwareToml, OutOfRangeFiguresAreRefused) {
  auto refuse = [](const std::string& from, const std::string& to, const std::string& want) {
    const Hardware h = hardware_from_toml(replace(kUserToml, from, to), "lab.toml");
    const std::string msg = error_of([&] { validate_hardware(h, "lab.toml"); });
    EXPECT_NE(msg.find(want), std::string::npos) << msg;
  };
  refuse("achievable_bf16_tflops = 700", "achievable_bf16_tflops = 1200",
         "achievable_bf16_tflops = 1200: must be <= peak_bf16_tflops = 1000");
  refuse("kernel_overhead_us = 5", "kernel_overhead_us = -1", "kernel_overhead_us = -1: must be >= 0");
  refuse("[[128, 0.4], [1024, 0.9]]", "[[1024, 0.9], [128, 0.4]]", "gemm_efficiency[1].dim = 128: must be >");
  refuse("[[128, 0.4], [1024, 0.9]]", "[[128, 1.5]]", "gemm_efficiency[0].eff = 1.5: must be in (0, 1]");
  refuse("kernel_overhead_us = 5", "kernel_overhead_us = 5\nloss_efficiency = 1.2",
         "loss_efficiency = 1.2: must lie in [0, 1]");
  refuse("kernel_overhead_us = 5", "kernel_overhead_us = 5\noptimizer_ns_per_param = -2",
         "optimizer_ns_per_param = -2: must be >= 0");
  refuse("kernel_overhead_us = 5", "kernel_overhead_us = 5\nelementwise_bw_gbps = -1",
         "elementwise_bw_gbps = -1: must be >= 0");
  refuse("kernel_overhead_us = 5", "kernel_overhead_us = 5\ngrouped_gemm_bwd_efficiency = [[64, 0.5], [16, 0.2]]",
         "grouped_gemm_bwd_efficiency[1].dim = 16: must be >");
  refuse("[scale_up]", "[scale_up]\ngather_bw_gbps = -2", "scale_up.gather_bw_gbps = -2: must be >= 0");
  refuse("[scale_up]", "[scale_up]\nep_combine_efficiency = [[8, 1.5]]",
         "scale_up.ep_combine_efficiency[0].eff = 1.5: must be in (0, 1]");
  refuse("[scale_out]", "[scale_out]\nep_dispatch_efficiency = [[8, 0.5], [4, 0.6]]",
         "scale_out.ep_dispatch_efficiency[1].dim = 4: must be >");
}

TEST(HardwareToml, FullMeshWithoutAggregateUsesTheLinks) {
  const Hardware h = hardware_from_toml(
      replace(kUserToml, "bw_gbps = 300", "topology = \"full_mesh\"\nlinks = 3\nlink_bw_gbps = 50\nlink_efficiency = 0.8"),
      "lab.toml");
  EXPECT_DOUBLE_EQ(h.scale_up.bw, 3 * 50e9 * 0.8);
  EXPECT_DOUBLE_EQ(h.scale_up.pair_bw(), 40e9);
  EXPECT_NO_THROW(validate_hardware(h, "lab.toml"));
  Hardware bad = h;
  bad.scale_up.links = 4;  // a 4-GPU mesh has 3 peers
  const std::string msg = error_of([&] { validate_hardware(bad, "lab.toml"); });
  EXPECT_NE(msg.find("scale_up.links = 4: must be <= domain - 1 = 3"), std::string::npos) << msg;
}

// ---- GEMM efficiency ---------------------------------------------------------------------------------------
TEST(HardwareGemm, LogLinearInterpolationClampedAtTheEnds) {
  Hardware h = hardware_from_toml(kUserToml, "lab.toml");  // [[128, 0.4], [1024, 0.9]]
  // Hand-computed: ln(256/128)/ln(1024/128) = 1/3, ln(512/128)/ln(8) = 2/3, sqrt(128*1024) is the midpoint.
  EXPECT_DOUBLE_EQ(h.gemm_eff(128), 0.4);
  EXPECT_DOUBLE_EQ(h.gemm_eff(1024), 0.9);
  EXPECT_NEAR(h.gemm_eff(256), 0.4 + 0.5 / 3, 1e-12);
  EXPECT_NEAR(h.gemm_eff(512), 0.4 + 0.5 * 2 / 3, 1e-12);
  EXPECT_NEAR(h.gemm_eff(std::sqrt(128.0 * 1024.0)), 0.65, 1e-12);
  EXPECT_DOUBLE_EQ(h.gemm_eff(16), 0.4);    // clamped below
  EXPECT_DOUBLE_EQ(h.gemm_eff(0), 0.4);
  EXPECT_DOUBLE_EQ(h.gemm_eff(1e6), 0.9);   // clamped above
  // The rate uses the smallest of m, n, k.
  EXPECT_NEAR(h.gemm_rate(8192, 256, 4096, false), 700e12 * (0.4 + 0.5 / 3), 1e3);
  EXPECT_NEAR(h.gemm_rate(8192, 8192, 512, true), 1300e12 * (0.4 + 0.5 * 2 / 3), 1e3);
  // Three points: the middle segment is used between its own ends.
  h.gemm_efficiency = {{100, 0.2}, {1000, 0.5}, {10000, 1.0}};
  EXPECT_NEAR(h.gemm_eff(std::sqrt(1000.0 * 10000.0)), 0.75, 1e-12);
  EXPECT_NEAR(h.gemm_eff(std::sqrt(100.0 * 1000.0)), 0.35, 1e-12);
  h.gemm_efficiency.clear();
  EXPECT_DOUBLE_EQ(h.gemm_eff(7), 1.0);  // empty table: 1.0 everywhere
  EXPECT_DOUBLE_EQ(h.gemm_rate(10, 10, 10, false), 700e12);
  h.achievable_fp8 = 0;
  const std::string msg = error_of([&] { h.gemm_rate(4096, 4096, 4096, true); });
  EXPECT_NE(msg.find("achievable_fp8_tflops"), std::string::npos) << msg;
}

TEST(HardwareGemm, CatalogCurve) {
  const Hardware h = catalog_hardware("h100");
  EXPECT_DOUBLE_EQ(h.gemm_eff(8), 0.25);
  EXPECT_DOUBLE_EQ(h.gemm_eff(8192), 1.0);
  EXPECT_NEAR(h.gemm_eff(std::sqrt(1024.0 * 2048.0)), (0.9 + 0.96) / 2, 1e-12);
  EXPECT_DOUBLE_EQ(h.gemm_rate(8192, 8192, 8192, false), h.achievable_bf16);
}

// ---- --hw resolution --------------------------------------------------------------------------------------
TEST(HardwareResolve, ReadsAUserFile) {
  TempDir dir;
  const auto path = dir.path / "my_cluster.toml";
  std::ofstream(path) << replace(kUserToml, "name = \"lab\"\n", "");
  const Hardware h = resolve_hardware(path.string());
  EXPECT_EQ(h.name, "my_cluster");  // no name key: the file's stem
  EXPECT_DOUBLE_EQ(h.hbm_bytes, 96e9);
  EXPECT_EQ(h.scale_up.domain, 4);
  EXPECT_EQ(resolve_hardware("h100").name, "h100");
}

TEST(HardwareResolve, UnreadableFileNamesThePath) {
  TempDir dir;
  const std::string missing = (dir.path / "nope.toml").string();
  std::string msg = error_of([&] { resolve_hardware(missing); });
  EXPECT_NE(msg.find(missing), std::string::npos) << msg;
  EXPECT_NE(msg.find("cannot read"), std::string::npos) << msg;
  msg = error_of([] { resolve_hardware("cluster.toml"); });  // .toml: a path, not a catalog name
  EXPECT_NE(msg.find("'cluster.toml'"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("unknown hardware"), std::string::npos) << msg;
}

// The example in docs/hardware.md is a valid file.
TEST(HardwareResolve, DocsExampleIsValid) {
  std::ifstream in(std::string(MOETRON_SOURCE_DIR) + "/docs/hardware.md");
  ASSERT_TRUE(in) << "docs/hardware.md";
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string doc = ss.str();
  const size_t begin = doc.find("```toml\n");
  ASSERT_NE(begin, std::string::npos);
  const size_t end = doc.find("```", begin + 8);
  ASSERT_NE(end, std::string::npos);
  TempDir dir;
  const auto path = dir.path / "my_cluster.toml";
  std::ofstream(path) << doc.substr(begin + 8, end - begin - 8);
  const Hardware h = resolve_hardware(path.string());
  EXPECT_EQ(h.name, "my_cluster");
  EXPECT_NEAR(h.scale_up.bw, 7 * 64e9 * 0.9, 1.0);
  EXPECT_DOUBLE_EQ(h.scale_out.bw, 100e9);
  EXPECT_FALSE(h.sources.at("scale_out.bw_gbps").empty());
}
