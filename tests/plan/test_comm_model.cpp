// test_comm_model.cpp: the planner's alpha-beta collective costs (plan/comm_model.h) against hand-counted
// values on small synthetic machines built here, plus a brute-force check of expected_nodes_per_token.
// Not a test of any catalog entry or of the hardware loader: every Hardware below is written out in full.
#include <gtest/gtest.h>

#include "../unit/test_util.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "moetron/check.h"
#include "moetron/plan/comm_model.h"

namespace {
using namespace moetron::plan;

// 8 GPUs behind a switch at 100 GB/s, alpha 10 us; one 25 GB/s NIC per GPU, alpha 20 us.
Hardware switch8(double nic_bw = 25e9) {
  Hardware h;
  h.name = "test-switch8";
  h.scale_up.domain = 8;
  h.scale_up.topology = "switch";
  h.scale_up.bw = 100e9;
  h.scale_up.alpha = 10e-6;
  h.scale_out.domain = 1024;
  h.scale_out.bw = nic_bw;
  h.scale_out.alpha = 20e-6;
  return h;
}

// 8 GPUs in a full mesh: 7 links of 50 GB/s derated to 80% -> 40 GB/s per peer, 280 GB/s to all peers;
// alpha 5 us. One 50 GB/s NIC per GPU, alpha 15 us.
Hardware mesh8() {
  Hardware h;
  h.name = "test-mesh8";
  h.scale_up.domain = 8;
  h.scale_up.topology = "full_mesh";
  h.scale_up.links = 7;
  h.scale_up.link_bw = 50e9;
  h.scale_up.link_efficiency = 0.8;
  h.scale_up.bw = 1;  // a full mesh is costed from its links; this figure must not be used
  h.scale_up.alpha = 5e-6;
  h.scale_out.domain = 1024;
  h.scale_out.bw = 50e9;
  h.scale_out.alpha = 15e-6;
  return h;
}

using moetron::testing::error_of;  // the message of the moetron::Error f throws, or ""

// Relative comparison: every expected value below is a hand-counted double.
void expect_close(double got, double want) {
  EXPECT_NEAR(got, want, 1e-12 * std::max(1.0, std::abs(want))) << "got " << got << " want " << want;
}

// ---- bandwidths ----

TEST(CommModel, DomainGroupBandwidth) {
  const Hardware s = switch8(), m = mesh8();
  expect_close(domain_group_bw(s.scale_up, 8), 100e9);  // a switch: bw whatever the group
  expect_close(domain_group_bw(s.scale_up, 2), 100e9);
  expect_close(domain_group_bw(m.scale_up, 8), 280e9);  // 7 links x 40 GB/s = all_peers_bw()
  expect_close(domain_group_bw(m.scale_up, 8), m.scale_up.all_peers_bw());
  expect_close(domain_group_bw(m.scale_up, 4), 120e9);  // only the 3 links to group members
  expect_close(domain_group_bw(m.scale_up, 2), 40e9);   // one link = pair_bw()
  EXPECT_EQ(domain_group_bw(m.scale_up, 1), 0.0);       // nobody to talk to
}

TEST(CommModel, RingBandwidth) {
  const Hardware s = switch8(), m = mesh8();
  expect_close(ring_bw(s, {8, 8}), 100e9);
  // 2 nodes x 8: min(8 NICs x 25 = 200, 8/7 x 100 = 114.29) GB/s: the switch port is the bottleneck.
  expect_close(ring_bw(s, {16, 8}), 800e9 / 7);
  // 8 nodes x 2: min(2 x 25 = 50, 2/1 x 100 = 200) GB/s: the NICs are.
  expect_close(ring_bw(s, {16, 2}), 50e9);
  expect_close(ring_bw(s, {4, 1}), 25e9);  // one rank per node: its NIC alone
  // Full mesh, 2 nodes x 8: min(8 x 50 = 400, 8/7 x 280 = 320) GB/s.
  expect_close(ring_bw(m, {16, 8}), 320e9);
}

// ---- rings ----

TEST(CommModel, RingAllReduceInOneSwitchDomain) {
  // 8 ranks, 1 GB: 2 x 7 x 10 us + 2 x 7/8 x 1e9 / 100e9 s = 140 us + 17.5 ms = 17.64 ms.
  expect_close(all_reduce_ring(switch8(), 1e9, {8, 8}), 0.01764);
}

TEST(CommModel, ReduceScatterAndAllGatherInOneSwitchDomain) {
  // 8 ranks, 1 GB: 7 x 10 us + 7/8 x 1e9 / 100e9 = 70 us + 8.75 ms = 8.82 ms; half of the all-reduce.
  expect_close(reduce_scatter(switch8(), 1e9, {8, 8}), 0.00882);
  expect_close(all_gather(switch8(), 1e9, {8, 8}), 0.00882);
  expect_close(2 * reduce_scatter(switch8(), 1e9, {8, 8}), all_reduce_ring(switch8(), 1e9, {8, 8}));
  // 4 of the 8 ranks, 2 GB: 3 x 10 us + 3/4 x 2e9 / 100e9 = 30 us + 15 ms.
  expect_close(reduce_scatter(switch8(), 2e9, {4, 4}), 0.01503);
}

TEST(CommModel, RingsInOneFullMeshDomain) {
  const Hardware m = mesh8();
  // 8 ranks, 1 GB, 7 concurrent rings at 40 GB/s each = 280 GB/s:
  // 2 x 7 x 5 us + 2 x 7/8 x 1e9 / 280e9 = 70 us + 6.25 ms = 6.32 ms.
  expect_close(all_reduce_ring(m, 1e9, {8, 8}), 0.00632);
  // 4 ranks (3 links to the group), 1.2 GB all-gather: 3 x 5 us + 3/4 x 1.2e9 / 120e9 = 15 us + 7.5 ms.
  expect_close(all_gather(m, 1.2e9, {4, 4}), 0.007515);
  // 2 ranks (one link), 1 GB reduce-scatter: 5 us + 1/2 x 1e9 / 40e9 = 5 us + 12.5 ms.
  expect_close(reduce_scatter(m, 1e9, {2, 2}), 0.012505);
}

TEST(CommModel, RingsSpanningDomains) {
  const Hardware s = switch8(), m = mesh8();
  // 2 nodes x 8 on the switch machine, 1 GB: steps pay max(10, 20) us = 20 us; bw 800/7 GB/s.
  // 2 x 15 x 20 us + 2 x 15/16 x 1e9 x 7 / 800e9 = 600 us + 16.40625 ms.
  expect_close(all_reduce_ring(s, 1e9, {16, 8}), 0.01700625);
  // 4 nodes x 1, 1 GB: 2 x 3 x 20 us + 2 x 3/4 x 1e9 / 25e9 = 120 us + 60 ms.
  expect_close(all_reduce_ring(s, 1e9, {4, 1}), 0.06012);
  // 8 nodes x 2, 1 GB reduce-scatter, NIC-bound at 50 GB/s: 15 x 20 us + 15/16 x 1e9 / 50e9 = 300 us + 18.75 ms.
  expect_close(reduce_scatter(s, 1e9, {16, 2}), 0.01905);
  // Full mesh, 2 nodes x 8, 1 GB all-gather: 15 x 15 us + 15/16 x 1e9 / 320e9 = 225 us + 2.9296875 ms.
  expect_close(all_gather(m, 1e9, {16, 8}), 0.0031546875);
}

// ---- hierarchical all-reduce ----

TEST(CommModel, HierarchicalAllReduceHandCounted) {
  // 2 nodes x 8, 1 GB. In the domain: reduce-scatter + all-gather = 2 x (7 x 10 us + 7/8 x 1e9 / 100e9)
  // = 17.64 ms. Across: all-reduce of 1e9/8 over 2 nodes = 2 x 1 x 20 us + 2 x 1/2 x 1.25e8 / 25e9
  // = 40 us + 5 ms. Total 22.68 ms; the flat ring (17.00625 ms) is cheaper here.
  const Hardware s = switch8();
  expect_close(all_reduce_hierarchical(s, 1e9, {16, 8}), 0.02268);
  expect_close(all_reduce(s, 1e9, {16, 8}), 0.01700625);
}

TEST(CommModel, HierarchicalBeatsRingWhenScaleOutIsSlow) {
  // NIC at 5 GB/s, 2 nodes x 8, 1 GB. Ring: bw min(8 x 5 = 40, 114.29) = 40 GB/s:
  // 600 us + 1.875e9 / 40e9 = 47.475 ms. Hierarchical: 17.64 ms + 40 us + 1.25e8 / 5e9 = 42.68 ms.
  const Hardware slow = switch8(5e9);
  expect_close(all_reduce_ring(slow, 1e9, {16, 8}), 0.047475);
  expect_close(all_reduce_hierarchical(slow, 1e9, {16, 8}), 0.04268);
  EXPECT_LT(all_reduce_hierarchical(slow, 1e9, {16, 8}), all_reduce_ring(slow, 1e9, {16, 8}));
  expect_close(all_reduce(slow, 1e9, {16, 8}), 0.04268);
  // Many nodes: the hierarchical one pays 2 x 7 scale-out latencies instead of 2 x 63.
  EXPECT_LT(all_reduce_hierarchical(slow, 1e3, {64, 8}), all_reduce_ring(slow, 1e3, {64, 8}));
}

TEST(CommModel, HierarchicalEqualsRingWithOneTier) {
  for (const Hardware& h : {switch8(), mesh8()}) {
    for (Group g : {Group{8, 8}, Group{4, 4}, Group{2, 2}, Group{4, 1}, Group{32, 1}}) {
      expect_close(all_reduce_hierarchical(h, 3e8, g), all_reduce_ring(h, 3e8, g));
    }
  }
}

TEST(CommModel, AllReduceIsTheCheaperOfTheTwo) {
  for (const Hardware& h : {switch8(), switch8(2e9), mesh8()}) {
    for (Group g : {Group{16, 8}, Group{16, 2}, Group{64, 8}, Group{32, 4}}) {
      for (double b : {1e3, 1e6, 1e9}) {
        const double r = all_reduce_ring(h, b, g), x = all_reduce_hierarchical(h, b, g);
        EXPECT_EQ(all_reduce(h, b, g), std::min(r, x));
      }
    }
  }
}

// ---- all-to-all ----

TEST(CommModel, FlatAllToAllInOneDomain) {
  // Switch, 8 ranks, 1 GB: 7 x 10 us + 7/8 x 1e9 / 100e9 = 70 us + 8.75 ms.
  expect_close(all_to_all(switch8(), 1e9, {8, 8}), 0.00882);
  // Full mesh, 8 ranks, 1 GB at all_peers_bw 280 GB/s: 7 x 5 us + 7/8 x 1e9 / 280e9 = 35 us + 3.125 ms.
  expect_close(all_to_all(mesh8(), 1e9, {8, 8}), 0.00316);
}

TEST(CommModel, FlatAllToAllSpanningDomains) {
  // 2 nodes x 8, 1.6 GB. Latency 7 x 10 us + 8 x 20 us = 230 us. In the domain 7/16 x 1.6e9 / 100e9 = 7 ms;
  // across 8/16 x 1.6e9 / 25e9 = 32 ms; concurrent -> 32 ms. Total 32.23 ms.
  expect_close(all_to_all(switch8(), 1.6e9, {16, 8}), 0.03223);
  // 4 nodes x 1, 1 GB: 3 x 20 us + 3/4 x 1e9 / 25e9 = 60 us + 30 ms.
  expect_close(all_to_all(switch8(), 1e9, {4, 1}), 0.03006);
}

TEST(CommModel, HierarchicalAllToAllHandCounted) {
  // 2 nodes x 8, topk 8, 8e8 bytes per rank (1e8 of token rows), 1.5 nodes per token on average.
  // Remote nodes per token 1.5 x 1/2 = 0.75 -> 7.5e7 bytes over the NIC: 3 ms.
  // Fan-out 8e8 x 7/8 = 7e8 bytes over the switch: 7 ms. Latency 7 x 10 us + 1 x 20 us = 90 us.
  const Hardware s = switch8();
  expect_close(all_to_all_hierarchical(s, 8e8, 8, 1.5, {16, 8}), 0.00709);
  // Same with a 5 GB/s NIC: the scale-out leg, 7.5e7 / 5e9 = 15 ms, now dominates: 15.09 ms.
  expect_close(all_to_all_hierarchical(switch8(5e9), 8e8, 8, 1.5, {16, 8}), 0.01509);
  // The flat one for the same buffer: 230 us + max(7/16 x 8e8 / 100e9, 8/16 x 8e8 / 25e9) = 16.23 ms.
  expect_close(all_to_all(s, 8e8, {16, 8}), 0.01623);
}

TEST(CommModel, HierarchicalAllToAllReducesToFlatWithoutDeduplication) {
  const Hardware s = switch8(), m = mesh8();
  // One domain: nothing crosses scale-out, the fan-out is the flat all-to-all.
  expect_close(all_to_all_hierarchical(s, 1e9, 8, 1.0, {8, 8}), all_to_all(s, 1e9, {8, 8}));
  expect_close(all_to_all_hierarchical(m, 1e9, 4, 1.0, {8, 8}), all_to_all(m, 1e9, {8, 8}));
  // One rank per node and every copy on its own node: each copy crosses once, as in the flat one.
  expect_close(all_to_all_hierarchical(s, 1e9, 4, 4.0, {8, 1}), all_to_all(s, 1e9, {8, 1}));
}

// An EP leg moves its bytes at the tier's measured share of the bandwidth (Tier::ep_eff, by the exchange's ranks at
// that tier); a plain all-to-all and a leg without a curve at the line rate; the latency is not scaled.
TEST(CommModel, EpLegsMoveAtTheirMeasuredShareOfTheTier) {
  Hardware s = switch8();
  s.scale_up.alpha = 0, s.scale_out.alpha = 0;  // transfer terms alone
  const double plain = all_to_all(s, 1e9, {8, 8});
  s.scale_up.ep_dispatch_efficiency = {{8, 0.5}};
  s.scale_up.ep_combine_efficiency = {{2, 0.8}, {8, 0.25}};
  expect_close(all_to_all(s, 1e9, {8, 8}), plain);
  expect_close(all_to_all(s, 1e9, {8, 8}, EpLeg::Dispatch), plain / 0.5);
  expect_close(all_to_all(s, 1e9, {8, 8}, EpLeg::Combine), plain / 0.25);
  // 4 ranks in the domain: log-linear half-way between 2 and 8.
  expect_close(all_to_all(s, 1e9, {4, 4}, EpLeg::Combine), all_to_all(s, 1e9, {4, 4}) / 0.525);
  expect_close(all_to_all_hierarchical(s, 1e9, 8, 1.0, {8, 8}, EpLeg::Dispatch), plain / 0.5);
  // Across nodes: the scale-out leg by the group's size; with no scale-out curve it keeps the NIC's line rate.
  Hardware slow_nic = switch8(2e9);  // the scale-out leg dominates
  slow_nic.scale_up.alpha = 0, slow_nic.scale_out.alpha = 0;
  Hardware d = slow_nic;
  d.scale_up.ep_dispatch_efficiency = {{8, 0.5}};
  expect_close(all_to_all(d, 1e9, {32, 8}, EpLeg::Dispatch), all_to_all(slow_nic, 1e9, {32, 8}));
  d.scale_out.ep_dispatch_efficiency = {{16, 1.0}, {64, 0.5}};  // 32 ranks: 0.75
  expect_close(all_to_all(d, 1e9, {32, 8}, EpLeg::Dispatch), all_to_all(slow_nic, 1e9, {32, 8}) / 0.75);
  expect_close(all_to_all_hierarchical(d, 1e9, 8, 2.0, {32, 8}, EpLeg::Dispatch),
               all_to_all_hierarchical(slow_nic, 1e9, 8, 2.0, {32, 8}) / 0.75);
}

TEST(CommModel, HierarchicalAllToAllGrowsWithNodesPerToken) {
  const Hardware s = switch8(2e9);  // slow NIC: the scale-out leg dominates
  double last = 0;
  for (double npt : {1.0, 1.5, 2.0, 3.0, 4.0}) {
    const double t = all_to_all_hierarchical(s, 1e9, 8, npt, {32, 8});
    EXPECT_GT(t, last) << npt;
    last = t;
  }
}

// ---- expected nodes per token ----

// Mean distinct nodes over every topk-subset of E experts (expert e lives on node e / (E / nodes)).
double brute_force_nodes(int64_t E, int64_t topk, int64_t nodes) {
  const int64_t per_node = E / nodes;
  double sum = 0, count = 0;
  for (uint32_t mask = 0; mask < (uint32_t(1) << E); ++mask) {
    if (std::popcount(mask) != topk) continue;
    std::set<int64_t> hit;
    for (int64_t e = 0; e < E; ++e) {
      if (mask & (uint32_t(1) << e)) hit.insert(e / per_node);
    }
    sum += double(hit.size());
    count += 1;
  }
  return sum / count;
}

TEST(CommModel, ExpectedNodesPerTokenHandCounted) {
  // E 16, topk 4, 4 nodes of 4: P(a node is missed) = C(12,4)/C(16,4) = 495/1820;
  // 4 x (1 - 495/1820) = 5300/1820 = 2.9120879...
  expect_close(expected_nodes_per_token(16, 4, 4), 5300.0 / 1820.0);
}

TEST(CommModel, ExpectedNodesPerTokenMatchesBruteForce) {
  struct Case {
    int64_t E, topk, nodes;
  };
  for (Case c : {Case{16, 4, 4}, Case{16, 2, 8}, Case{16, 3, 2}, Case{12, 3, 3}, Case{12, 5, 2},
                 Case{20, 6, 5}, Case{18, 4, 6}, Case{16, 8, 16}}) {
    EXPECT_NEAR(expected_nodes_per_token(c.E, c.topk, c.nodes), brute_force_nodes(c.E, c.topk, c.nodes), 1e-12)
        << c.E << " " << c.topk << " " << c.nodes;
  }
}

TEST(CommModel, ExpectedNodesPerTokenEdgeCases) {
  EXPECT_EQ(expected_nodes_per_token(64, 8, 1), 1.0);  // one node holds everything
  EXPECT_EQ(expected_nodes_per_token(64, 1, 8), 1.0);  // one expert, one node
  expect_close(expected_nodes_per_token(16, 16, 4), 4.0);  // every expert -> every node
  expect_close(expected_nodes_per_token(16, 13, 4), 4.0);  // 13 > 12 experts off any one node
  expect_close(expected_nodes_per_token(8, 8, 8), 8.0);
  // One expert per node: every chosen expert is its own node.
  expect_close(expected_nodes_per_token(32, 5, 32), 5.0);
}

TEST(CommModel, ExpectedNodesPerTokenLargeIsStable) {
  // 256 experts, topk 8, 8 nodes: the product form against the log-gamma form of the binomial ratio.
  const double miss = std::exp(std::lgamma(225.0) - std::lgamma(217.0) - std::lgamma(257.0) + std::lgamma(249.0));
  EXPECT_NEAR(expected_nodes_per_token(256, 8, 8), 8 * (1 - miss), 1e-10);
  // Sizes whose binomials overflow a double: C(65536, 512) is far beyond 1e308.
  const double big = expected_nodes_per_token(65536, 512, 256);
  EXPECT_TRUE(std::isfinite(big));
  const double approx = 256 * (1 - std::pow(1 - 1.0 / 256, 512));  // with replacement: close for large E
  EXPECT_NEAR(big, approx, 0.5);
  EXPECT_LE(big, 256.0);
}

TEST(CommModel, ExpectedNodesPerTokenMonotone) {
  double last = 0;
  for (int64_t k = 1; k <= 32; ++k) {  // more experts per token -> more nodes
    const double v = expected_nodes_per_token(256, k, 8);
    EXPECT_GT(v, last) << k;
    last = v;
  }
  last = 0;
  for (int64_t n : {1, 2, 4, 8, 16, 32}) {  // finer split -> more nodes
    const double v = expected_nodes_per_token(256, 8, n);
    EXPECT_GT(v, last) << n;
    last = v;
  }
}

TEST(CommModel, ExpectedNodesPerTokenNodeLimited) {
  const double free = expected_nodes_per_token(256, 8, 8);  // about 5.29
  EXPECT_EQ(expected_nodes_per_token(256, 8, 8, 4), 4.0);   // capped by the 4 picked nodes
  EXPECT_EQ(expected_nodes_per_token(256, 8, 8, 8), free);  // a limit that never binds
  EXPECT_EQ(expected_nodes_per_token(256, 8, 8, 16), free);
  EXPECT_EQ(expected_nodes_per_token(16, 4, 4, 2), 2.0);
}

TEST(CommModel, ExpectedNodesPerTokenErrors) {
  EXPECT_NE(error_of([] { expected_nodes_per_token(10, 2, 4); }).find("do not split evenly over 4 nodes"),
            std::string::npos);
  EXPECT_NE(error_of([] { expected_nodes_per_token(16, 0, 4); }).find("topk 0 must be in [1, n_experts 16]"),
            std::string::npos);
  EXPECT_NE(error_of([] { expected_nodes_per_token(16, 17, 4); }).find("topk 17"), std::string::npos);
  EXPECT_NE(error_of([] { expected_nodes_per_token(16, 4, 0); }).find("nodes must be >= 1"), std::string::npos);
  EXPECT_NE(error_of([] { expected_nodes_per_token(0, 1, 1); }).find("n_experts must be >= 1"), std::string::npos);
  EXPECT_NE(error_of([] { expected_nodes_per_token(16, 4, 4, -1); }).find("max_nodes must be >= 0"),
            std::string::npos);
  // 2 nodes of 2 experts cannot hold 8 experts.
  EXPECT_NE(error_of([] { expected_nodes_per_token(16, 8, 8, 2); }).find("cannot hold topk 8"), std::string::npos);
}

// ---- p2p ----

TEST(CommModel, PointToPoint) {
  // Switch, 100 MB: 10 us + 1e8 / 100e9 = 1.01 ms inside; 20 us + 1e8 / 25e9 = 4.02 ms across.
  expect_close(p2p(switch8(), 1e8, false), 0.00101);
  expect_close(p2p(switch8(), 1e8, true), 0.00402);
  // Full mesh: one link, 40 GB/s: 5 us + 1e8 / 40e9 = 2.505 ms.
  expect_close(p2p(mesh8(), 1e8, false), 0.002505);
  expect_close(p2p(mesh8(), 0, true), 15e-6);  // an empty message still pays alpha
}

// ---- cross-cutting ----

using Cost = std::function<double(const Hardware&, double, Group)>;
std::vector<std::pair<std::string, Cost>> all_costs() {
  return {{"all_reduce_ring", all_reduce_ring},
          {"all_reduce_hierarchical", all_reduce_hierarchical},
          {"all_reduce", all_reduce},
          {"reduce_scatter", reduce_scatter},
          {"all_gather", all_gather},
          {"all_to_all", [](const Hardware& h, double b, Group g) { return all_to_all(h, b, g); }},
          {"all_to_all_hierarchical",
           [](const Hardware& h, double b, Group g) { return all_to_all_hierarchical(h, b, 8, 1.0, g); }}};
}

TEST(CommModel, SingleRankCostsNothing) {
  Hardware h = switch8();
  h.scale_out.bw = 0;  // never consulted for one rank
  for (const auto& [name, f] : all_costs()) EXPECT_EQ(f(h, 1e9, {1, 1}), 0.0) << name;
  for (const auto& [name, f] : all_costs()) EXPECT_EQ(f(mesh8(), 1e9, {1, 1}), 0.0) << name;
}

TEST(CommModel, MonotoneInBytes) {
  for (const Hardware& h : {switch8(), mesh8()}) {
    for (Group g : {Group{8, 8}, Group{4, 4}, Group{16, 8}, Group{16, 2}, Group{4, 1}}) {
      for (const auto& [name, f] : all_costs()) {
        double last = f(h, 0, g);
        EXPECT_GT(last, 0.0) << name;  // latency alone
        for (double b : {1e3, 1e6, 1e8, 1e10}) {
          const double t = f(h, b, g);
          EXPECT_GT(t, last) << name << " " << g.size << "/" << g.per_node << " " << b;
          last = t;
        }
      }
    }
  }
}

TEST(CommModel, SpanningCostsMoreThanOneDomain) {
  // The same 8 ranks spread over 2 nodes instead of one domain: slower NIC, bigger alpha.
  const Hardware s = switch8();
  for (const auto& [name, f] : all_costs()) {
    if (name == "all_to_all_hierarchical") continue;  // below
    EXPECT_GT(f(s, 1e8, {8, 4}), f(s, 1e8, {8, 8})) << name;
  }
  // The deduplicated dispatch is the exception while the NIC is fast: the NIC adds its bandwidth to the
  // switch port's, and a quarter of the remote copies arrive on their final GPU. 64 experts, topk 8:
  // npt 1.99 over 2 nodes. 2 x 4: NIC 1e8/8 x 1.99/2 / 25e9 = 0.50 ms, switch 1e8 x 3/4 / 100e9 = 0.75 ms,
  // + 50 us; one domain: 1e8 x 7/8 / 100e9 + 70 us = 0.945 ms.
  const double npt = expected_nodes_per_token(64, 8, 2);
  EXPECT_LT(all_to_all_hierarchical(s, 1e8, 8, npt, {8, 4}), all_to_all_hierarchical(s, 1e8, 8, 1.0, {8, 8}));
  // With a 5 GB/s NIC the scale-out leg (2.5 ms) dominates and spanning costs more.
  const Hardware slow = switch8(5e9);
  EXPECT_GT(all_to_all_hierarchical(slow, 1e8, 8, npt, {8, 4}),
            all_to_all_hierarchical(slow, 1e8, 8, 1.0, {8, 8}));
}

TEST(CommModel, ImpossibleGroupsAreErrors) {
  const Hardware s = switch8();
  for (const auto& [name, f] : all_costs()) {
    EXPECT_NE(error_of([&] { f(s, 1e6, {12, 8}); }).find("group of 12 ranks with 8 per node: per_node must divide"),
              std::string::npos)
        << name;
    EXPECT_NE(error_of([&] { f(s, 1e6, {32, 16}); }).find("has only 8 GPUs per scale-up domain"), std::string::npos)
        << name;
    EXPECT_NE(error_of([&] { f(s, 1e6, {0, 1}); }).find("at least one rank"), std::string::npos) << name;
    EXPECT_NE(error_of([&] { f(s, 1e6, {8, 0}); }).find("per_node must be >= 1"), std::string::npos) << name;
    EXPECT_NE(error_of([&] { f(s, -1, {8, 8}); }).find("finite number of bytes >= 0"), std::string::npos) << name;
  }
  EXPECT_NE(error_of([&] { validate_group(s, {9, 9}); }).find("has only 8 GPUs"), std::string::npos);
  EXPECT_EQ(error_of([&] { validate_group(s, {64, 8}); }), "");
}

TEST(CommModel, MissingBandwidthIsAnError) {
  Hardware h = switch8();
  h.scale_out.bw = 0;
  EXPECT_EQ(error_of([&] { all_reduce(h, 1e6, {8, 8}); }), "");  // one domain: the NIC is not needed
  EXPECT_NE(error_of([&] { all_reduce(h, 1e6, {16, 8}); }).find("scale_out.bw is 0"), std::string::npos);
  EXPECT_NE(error_of([&] { p2p(h, 1e6, true); }).find("scale_out.bw is 0"), std::string::npos);
  Hardware m = mesh8();
  m.scale_up.links = 0;
  EXPECT_NE(error_of([&] { all_to_all(m, 1e6, {8, 8}); }).find("no scale-up bandwidth for 8 ranks"),
            std::string::npos);
}

TEST(CommModel, NodesPerTokenOutOfRangeIsAnError) {
  const Hardware s = switch8();
  EXPECT_NE(error_of([&] { all_to_all_hierarchical(s, 1e6, 8, 0.5, {16, 8}); }).find("nodes_per_token 0.5"),
            std::string::npos);
  // 2 nodes: a token cannot reach 3 of them.
  EXPECT_NE(error_of([&] { all_to_all_hierarchical(s, 1e6, 8, 3.0, {16, 8}); }).find("min(topk 8, nodes 2)"),
            std::string::npos);
  EXPECT_NE(error_of([&] { all_to_all_hierarchical(s, 1e6, 0, 1.0, {16, 8}); }).find("topk >= 1"),
            std::string::npos);
}

}  // namespace
