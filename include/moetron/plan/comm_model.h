// plan/comm_model.h: alpha-beta cost of the collectives a training step uses, per tier (scale-up domain,
// scale-out network), for a group of ranks placed on the cluster. Pure arithmetic over plan::Hardware: no
// simulation and no overlap (plan/cost.h decides what hides behind what). Not a network simulator: no
// congestion, no adaptive routing, no in-network reduction (docs/planner_comm.md lists what is left out).
//
// Conventions: `bytes` is the size of the full buffer of ONE rank as the collective's user sees it (the
// all-reduce input, the reduce-scatter input, the all-gather output, the all-to-all send buffer). A group
// of `size` ranks has `per_node` of them in each scale-up domain (size = per_node x nodes; per_node = size
// when the group fits in one domain). Times are seconds. Below p = size, q = per_node, n = nodes().
//   ring all-reduce          2 (p-1) alpha + 2 (p-1)/p * bytes / ring_bw
//   reduce-scatter / all-gather  (p-1) alpha + (p-1)/p * bytes / ring_bw
//   hierarchical all-reduce  reduce-scatter in the domain (q ranks), ring all-reduce of bytes/q over the n
//                            nodes at scale-out, all-gather in the domain
//   flat all-to-all          sum over peers of their tier's alpha + max over tiers of (the bytes that
//                            cross the tier / its bw): the tiers move data concurrently
//   hierarchical all-to-all  tokens cross the scale-out network once per distinct REMOTE destination node
//                            (node-deduplicated, DeepEP style), then fan out inside the domain; the two
//                            legs stream concurrently (same form as the flat one)
// Bandwidths (per GPU, per direction):
//   inside one domain  domain_group_bw(scale_up, q): a switch gives bw; a full mesh gives the links that
//                      lead to the other q-1 group members, min(links, q-1) x pair_bw(), which is
//                      all_peers_bw() for a whole domain. Rings use it too, not a single link's pair_bw():
//                      a collective library runs several rings at once over a full mesh (the complete
//                      directed graph on q GPUs splits into q-1 directed Hamiltonian rings for q != 4, 6,
//                      one per outgoing link) or direct reduce-scatter/all-gather steps that use every
//                      link, so a ring collective reaches every link's bandwidth.
//   spanning domains   every GPU has its own NIC at scale_out.bw. A flat ring runs q channels, each
//                      leaving a node through a different GPU's NIC, so a GPU's NIC carries 1/q of the ring
//                      traffic and its scale-up port the other (q-1)/q: ring_bw = min(q x scale_out.bw,
//                      q/(q-1) x domain_group_bw(scale_up, q)); every ring step pays the slower tier's alpha.
//   one message        p2p: pair_bw() inside a domain, scale_out.bw across.
// Every function throws moetron::Error for an impossible group (validate_group) or a tier it needs that
// has no bandwidth. A group of one rank costs 0.
#pragma once
#include <cstdint>

#include "moetron/plan/hardware.h"

namespace moetron::plan {

struct Group {
  int64_t size = 1;
  int64_t per_node = 1;  // ranks of the group inside one scale-up domain (divides size)
  int64_t nodes() const { return size / per_node; }
};

// Throws moetron::Error unless size >= 1, 1 <= per_node <= scale_up.domain and per_node divides size.
void validate_group(const Hardware& h, Group g);
// What one GPU pushes at once to the other ranks-1 group members in its scale-up domain (see above).
double domain_group_bw(const Tier& scale_up, int64_t ranks);
// The per-GPU bandwidth a ring collective over g moves its (p-1)/p * bytes per pass at (see above).
// `kind`: an all-gather or reduce-scatter takes the scale-up tier's gather_bw / scatter_bw where it is set.
enum class RingKind { AllReduce, Gather, Scatter };
double ring_bw(const Hardware& h, Group g, RingKind kind = RingKind::AllReduce);

double all_reduce_ring(const Hardware& h, double bytes, Group g);
double all_reduce_hierarchical(const Hardware& h, double bytes, Group g);
double all_reduce(const Hardware& h, double bytes, Group g);  // the cheaper of the two
double reduce_scatter(const Hardware& h, double bytes, Group g);
double all_gather(const Hardware& h, double bytes, Group g);
// Flat all-to-all: each rank sends bytes/size to every rank (itself included, which costs nothing).
//   time = (q-1) scale_up.alpha + (p-q) scale_out.alpha
//          + max((q-1)/p * bytes / domain_group_bw(scale_up, q), (p-q)/p * bytes / scale_out.bw)
// `leg`: an EP dispatch or combine reaches each tier's ep_*_efficiency of its bandwidth (Tier::ep_eff, by the
// ranks of the exchange at that tier: q inside the domain, p across); a plain all-to-all (None) the line rate.
enum class EpLeg { None, Dispatch, Combine };
double all_to_all(const Hardware& h, double bytes, Group g, EpLeg leg = EpLeg::None);
// MoE dispatch of `bytes` per rank (token rows x topk copies x row bytes) where each token's copies land
// on `nodes_per_token` distinct nodes on average (expected_nodes_per_token below, 1 <= it <= min(topk, n)):
// the scale-out leg carries each token once per remote node, the scale-up leg fans the copies out.
//   remote nodes per token  r = nodes_per_token x (n-1)/n   (each node is hit with probability npt/n)
//   scale-out bytes         bytes / topk x r                 at scale_out.bw
//   scale-up bytes          bytes x (q-1)/q                  at domain_group_bw(scale_up, q) (a copy
//                           moves inside the domain unless it already sits on the GPU that received it)
//   time = (q-1) scale_up.alpha + (n-1) scale_out.alpha + max(the two transfer times)
// The combine (the way back) costs the same.
double all_to_all_hierarchical(const Hardware& h, double bytes, int64_t topk, double nodes_per_token, Group g,
                               EpLeg leg = EpLeg::None);
// Expected distinct nodes among a token's topk experts drawn uniformly without replacement from E experts
// spread evenly over `nodes` nodes: nodes x (1 - C(E - E/nodes, topk) / C(E, topk)), the binomial ratio
// taken as a product of topk ratios. With node-limited routing (max_nodes > 0) the value is
// min(that, max_nodes): the router picks the max_nodes nodes whose best experts score highest, so a token
// nearly always uses every picked node (an upper bound; docs/planner_comm.md gives the lower one).
// Throws unless nodes >= 1 divides E, 1 <= topk <= E, max_nodes >= 0 and max_nodes x E/nodes >= topk.
double expected_nodes_per_token(int64_t n_experts, int64_t topk, int64_t nodes, int64_t max_nodes = 0);
// One point-to-point message (pipeline activation / gradient): alpha + bytes / bw of the tier it crosses
// (scale_up.pair_bw() inside a domain, scale_out.bw across).
double p2p(const Hardware& h, double bytes, bool cross_node);

}  // namespace moetron::plan
