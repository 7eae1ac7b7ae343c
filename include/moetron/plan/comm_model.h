// plan/comm_model.h: alpha-beta cost of the collectives a training step uses, per tier (scale-up domain,
// scale-out network), for a group of ranks placed on the cluster. Pure arithmetic over plan::Hardware: no
// simulation and no overlap (plan/cost.h decides what hides behind what).
//
// Conventions: `bytes` is the size of the full buffer of ONE rank as the collective's user sees it (the
// all-reduce input, the reduce-scatter input, the all-gather output, the all-to-all send buffer). A group
// of `size` ranks has `per_node` of them in each scale-up domain (size = per_node x nodes; per_node = size
// when the group fits in one domain). Times are seconds.
//   ring all-reduce          2 (p-1) alpha + 2 (p-1)/p * bytes / bw
//   reduce-scatter / all-gather  (p-1) alpha + (p-1)/p * bytes / bw
//   hierarchical all-reduce  reduce-scatter in the domain, all-reduce of bytes/per_node over the nodes at
//                            scale-out, all-gather in the domain
//   flat all-to-all          (p-1) alpha + max over tiers of (the bytes that cross the tier / its bw)
//   hierarchical all-to-all  tokens cross the scale-out network once per distinct destination node
//                            (node-deduplicated, DeepEP style), then fan out inside the domain
// where bw is the bottleneck tier's per-GPU bandwidth: pair_bw() at scale-up for rings, all_peers_bw() for
// all-to-all, scale_out.bw when the group spans domains.
#pragma once
#include <cstdint>

#include "moetron/plan/hardware.h"

namespace moetron::plan {

struct Group {
  int64_t size = 1;
  int64_t per_node = 1;  // ranks of the group inside one scale-up domain (divides size)
  int64_t nodes() const { return size / per_node; }
};

double all_reduce_ring(const Hardware& h, double bytes, Group g);
double all_reduce_hierarchical(const Hardware& h, double bytes, Group g);
double all_reduce(const Hardware& h, double bytes, Group g);  // the cheaper of the two
double reduce_scatter(const Hardware& h, double bytes, Group g);
double all_gather(const Hardware& h, double bytes, Group g);
// Flat all-to-all: each rank sends bytes/size to every rank (itself included, which costs nothing).
double all_to_all(const Hardware& h, double bytes, Group g);
// MoE dispatch of `bytes` per rank (token rows x topk copies) where each token's copies land on
// `nodes_per_token` distinct nodes on average (expected_nodes_per_token below): the scale-out leg carries
// each token once per remote node, the scale-up leg fans the copies out.
double all_to_all_hierarchical(const Hardware& h, double bytes, int64_t topk, double nodes_per_token, Group g);
// Expected distinct nodes among a token's topk experts drawn uniformly without replacement from E experts
// spread evenly over `nodes` nodes; with node-limited routing (max_nodes > 0) at most max_nodes.
double expected_nodes_per_token(int64_t n_experts, int64_t topk, int64_t nodes, int64_t max_nodes = 0);
// One point-to-point message (pipeline activation / gradient): alpha + bytes / bw of the tier it crosses.
double p2p(const Hardware& h, double bytes, bool cross_node);

}  // namespace moetron::plan
