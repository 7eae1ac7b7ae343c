// comm_model.cpp: the alpha-beta collective costs declared in plan/comm_model.h (formulas and their
// reasoning there and in docs/planner_comm.md). Arithmetic only: no hardware loading, no overlap.
#include "moetron/plan/comm_model.h"

#include <algorithm>
#include <cmath>

#include "moetron/check.h"

namespace moetron::plan {
namespace {

constexpr const char* kOp = "plan.comm";

void check_bytes(double bytes) {
  MT_CHECK(std::isfinite(bytes) && bytes >= 0, kOp, "buffer size must be a finite number of bytes >= 0, got ",
           bytes);
}

double scale_out_bw(const Hardware& h) {
  MT_CHECK(h.scale_out.bw > 0, kOp, "hardware '", h.name,
           "': the cost crosses the scale-out network but scale_out.bw is ", h.scale_out.bw);
  return h.scale_out.bw;
}

double scale_up_bw(const Hardware& h, int64_t ranks) {
  const double bw = domain_group_bw(h.scale_up, ranks);
  MT_CHECK(bw > 0, kOp, "hardware '", h.name, "': no scale-up bandwidth for ", ranks,
           " ranks in one domain (topology ", h.scale_up.topology, ", bw ", h.scale_up.bw, ", links ",
           h.scale_up.links, ", link_bw ", h.scale_up.link_bw, ", link_efficiency ", h.scale_up.link_efficiency,
           ")");
  return bw;
}

// The fraction of a tier's bandwidth an exchange of `leg` reaches with `ranks` taking part at that tier.
double ep_share(const Tier& t, EpLeg leg, double ranks) {
  return leg == EpLeg::None ? 1.0 : t.ep_eff(leg == EpLeg::Combine, ranks);
}

// Per-step latency of a ring over g: a step ends when its slowest hop does.
double ring_alpha(const Hardware& h, Group g) {
  if (g.nodes() == 1) return h.scale_up.alpha;
  if (g.per_node == 1) return h.scale_out.alpha;
  return std::max(h.scale_up.alpha, h.scale_out.alpha);
}

// A ring pass that moves (p-1)/p * bytes per rank, `passes` times (2 for all-reduce, 1 for RS / AG).
double ring_time(const Hardware& h, double bytes, Group g, int passes, RingKind kind = RingKind::AllReduce) {
  validate_group(h, g);
  check_bytes(bytes);
  if (g.size == 1) return 0;
  const double p = double(g.size);
  return passes * ((p - 1) * ring_alpha(h, g) + (p - 1) / p * bytes / ring_bw(h, g, kind));
}

}  // namespace

void validate_group(const Hardware& h, Group g) {
  MT_CHECK(g.size >= 1, kOp, "a group needs at least one rank, got size ", g.size);
  MT_CHECK(g.per_node >= 1, kOp, "group of ", g.size, " ranks: per_node must be >= 1, got ", g.per_node);
  MT_CHECK(g.size % g.per_node == 0, kOp, "group of ", g.size, " ranks with ", g.per_node,
           " per node: per_node must divide the group size");
  MT_CHECK(g.per_node <= h.scale_up.domain, kOp, "group of ", g.size, " ranks with ", g.per_node,
           " per node: hardware '", h.name, "' has only ", h.scale_up.domain, " GPUs per scale-up domain");
}

double domain_group_bw(const Tier& t, int64_t ranks) {
  MT_CHECK(ranks >= 1, kOp, "domain_group_bw needs ranks >= 1, got ", ranks);
  if (t.topology != "full_mesh") return t.bw;
  const int64_t used = std::min<int64_t>(t.links, ranks - 1);
  return used > 0 ? double(used) * t.pair_bw() : 0.0;
}

double ring_bw(const Hardware& h, Group g, RingKind kind) {
  validate_group(h, g);
  const double own = kind == RingKind::Gather    ? h.scale_up.gather_bw
                     : kind == RingKind::Scatter ? h.scale_up.scatter_bw
                                                 : 0.0;
  const auto up = [&] { return own > 0 ? own : scale_up_bw(h, g.per_node); };
  if (g.nodes() == 1) return g.size == 1 ? 0.0 : up();
  const double nic = scale_out_bw(h);
  if (g.per_node == 1) return nic;
  const double q = double(g.per_node);
  return std::min(q * nic, q / (q - 1) * up());
}

double all_reduce_ring(const Hardware& h, double bytes, Group g) { return ring_time(h, bytes, g, 2); }
double reduce_scatter(const Hardware& h, double bytes, Group g) { return ring_time(h, bytes, g, 1, RingKind::Scatter); }
double all_gather(const Hardware& h, double bytes, Group g) { return ring_time(h, bytes, g, 1, RingKind::Gather); }

double all_reduce_hierarchical(const Hardware& h, double bytes, Group g) {
  validate_group(h, g);
  check_bytes(bytes);
  const double q = double(g.per_node), n = double(g.nodes());
  double t = 0;
  if (g.per_node > 1) {  // reduce-scatter, then (at the end) all-gather inside the domain
    t += 2 * ((q - 1) * h.scale_up.alpha + (q - 1) / q * bytes / scale_up_bw(h, g.per_node));
  }
  if (g.nodes() > 1) {  // q rings of n ranks at once, one per local rank, each on its own NIC
    t += 2 * (n - 1) * h.scale_out.alpha + 2 * (n - 1) / n * (bytes / q) / scale_out_bw(h);
  }
  return t;
}

double all_reduce(const Hardware& h, double bytes, Group g) {
  return std::min(all_reduce_ring(h, bytes, g), all_reduce_hierarchical(h, bytes, g));
}

double all_to_all(const Hardware& h, double bytes, Group g, EpLeg leg) {
  validate_group(h, g);
  check_bytes(bytes);
  if (g.size == 1) return 0;
  const double p = double(g.size), q = double(g.per_node);
  double latency = 0, up = 0, out = 0;
  if (g.per_node > 1) {
    latency += (q - 1) * h.scale_up.alpha;
    up = (q - 1) / p * bytes / (scale_up_bw(h, g.per_node) * ep_share(h.scale_up, leg, q));
  }
  if (g.nodes() > 1) {
    latency += (p - q) * h.scale_out.alpha;
    out = (p - q) / p * bytes / (scale_out_bw(h) * ep_share(h.scale_out, leg, p));
  }
  return latency + std::max(up, out);
}

double all_to_all_hierarchical(const Hardware& h, double bytes, int64_t topk, double nodes_per_token, Group g,
                               EpLeg leg) {
  validate_group(h, g);
  check_bytes(bytes);
  MT_CHECK(topk >= 1, kOp, "hierarchical all-to-all needs topk >= 1, got ", topk);
  const int64_t nodes = g.nodes();
  const double most = double(std::min<int64_t>(topk, nodes));
  MT_CHECK(std::isfinite(nodes_per_token) && nodes_per_token >= 1 - 1e-9 && nodes_per_token <= most + 1e-9,
           kOp, "nodes_per_token ", nodes_per_token, " is outside [1, min(topk ", topk, ", nodes ", nodes,
           ")] for a group of ", g.size, " ranks with ", g.per_node, " per node");
  if (g.size == 1) return 0;
  const double q = double(g.per_node), n = double(nodes);
  double latency = 0, up = 0, out = 0;
  if (g.per_node > 1) {
    latency += (q - 1) * h.scale_up.alpha;
    up = bytes * (q - 1) / q / (scale_up_bw(h, g.per_node) * ep_share(h.scale_up, leg, q));
  }
  if (nodes > 1) {
    const double remote_nodes = nodes_per_token * (n - 1) / n;
    latency += (n - 1) * h.scale_out.alpha;
    out = bytes / double(topk) * remote_nodes / (scale_out_bw(h) * ep_share(h.scale_out, leg, double(g.size)));
  }
  return latency + std::max(up, out);
}

double expected_nodes_per_token(int64_t n_experts, int64_t topk, int64_t nodes, int64_t max_nodes) {
  MT_CHECK(n_experts >= 1, kOp, "expected_nodes_per_token: n_experts must be >= 1, got ", n_experts);
  MT_CHECK(nodes >= 1, kOp, "expected_nodes_per_token: nodes must be >= 1, got ", nodes);
  MT_CHECK(n_experts % nodes == 0, kOp, "expected_nodes_per_token: ", n_experts,
           " experts do not split evenly over ", nodes, " nodes");
  MT_CHECK(topk >= 1 && topk <= n_experts, kOp, "expected_nodes_per_token: topk ", topk,
           " must be in [1, n_experts ", n_experts, "]");
  MT_CHECK(max_nodes >= 0, kOp, "expected_nodes_per_token: max_nodes must be >= 0 (0 = no limit), got ",
           max_nodes);
  const int64_t per_node = n_experts / nodes;
  MT_CHECK(max_nodes == 0 || max_nodes * per_node >= topk, kOp, "expected_nodes_per_token: ", max_nodes,
           " nodes of ", per_node, " experts each cannot hold topk ", topk, " experts");
  // P(a given node holds none of the topk) = C(E - m, k) / C(E, k) = prod_{i<k} (E - m - i) / (E - i).
  double miss = 1;
  for (int64_t i = 0; i < topk && miss > 0; ++i) {
    const int64_t others = n_experts - per_node - i;
    miss = others <= 0 ? 0.0 : miss * double(others) / double(n_experts - i);
  }
  const double expected = double(nodes) * (1 - miss);
  return max_nodes > 0 ? std::min(expected, double(max_nodes)) : expected;
}

double p2p(const Hardware& h, double bytes, bool cross_node) {
  check_bytes(bytes);
  if (cross_node) return h.scale_out.alpha + bytes / scale_out_bw(h);
  const double bw = h.scale_up.pair_bw();
  MT_CHECK(bw > 0, kOp, "hardware '", h.name, "': scale_up has no point-to-point bandwidth (topology ",
           h.scale_up.topology, ")");
  return h.scale_up.alpha + bytes / bw;
}

}  // namespace moetron::plan
