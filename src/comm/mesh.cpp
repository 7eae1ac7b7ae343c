// mesh.cpp: DeviceMesh validation and rank <-> coordinate mapping (the order is documented in mesh.h),
// and the sub-communicators. Not the EP dispatcher.
#include "moetron/mesh.h"

#include <algorithm>
#include <sstream>

#include "moetron/check.h"

namespace moetron {

DeviceMesh::DeviceMesh(const ParallelSpec& spec, int world_size, int64_t n_routed_experts) : spec_(spec) {
  const char* op = "mesh";
  MT_CHECK(world_size >= 1, op, "world size ", world_size, " must be >= 1");
  MT_CHECK(spec.pp >= 1, op, "parallelism.pp = ", spec.pp, " must be >= 1");
  MT_CHECK(spec.dp_replicate >= 1, op, "parallelism.dp_replicate = ", spec.dp_replicate, " must be >= 1");
  MT_CHECK(spec.dp_shard >= 1, op, "parallelism.dp_shard = ", spec.dp_shard, " must be >= 1");
  MT_CHECK(spec.ep >= 1, op, "parallelism.ep = ", spec.ep, " must be >= 1");
  MT_CHECK(spec.cp >= 1, op, "parallelism.cp = ", spec.cp, " must be >= 1");
  MT_CHECK(spec.tp >= 1, op, "parallelism.tp = ", spec.tp, " must be >= 1");
  MT_CHECK(spec.ranks_per_node >= 1, op, "parallelism.ranks_per_node = ", spec.ranks_per_node, " must be >= 1");
  const int64_t prod = spec.pp * spec.dp_replicate * spec.dp_shard * spec.cp * spec.tp;
  MT_CHECK(prod == world_size, op, "world size ", world_size, " != pp (", spec.pp, ") * dp_replicate (",
           spec.dp_replicate, ") * dp_shard (", spec.dp_shard, ") * cp (", spec.cp, ") * tp (", spec.tp, ") = ", prod);
  const int64_t dp = spec.dp_replicate * spec.dp_shard;
  MT_CHECK(dp * spec.cp % spec.ep == 0, op, "ep (", spec.ep, ") must divide dp = dp_replicate * dp_shard (", dp,
           ") times cp (", spec.cp, "): expert parallelism is carved out of data (and context) parallelism");
  if (n_routed_experts == 0)
    MT_CHECK(spec.ep == 1, op, "ep = ", spec.ep, " needs a MoE model (n_routed_experts is 0)");
  if (n_routed_experts > 0)
    MT_CHECK(n_routed_experts % spec.ep == 0, op, "ep (", spec.ep, ") must divide n_routed_experts (",
             n_routed_experts, "): experts are sharded contiguously, E/ep per rank");
  if (world_size > spec.ranks_per_node)
    MT_CHECK(world_size % spec.ranks_per_node == 0, op, "ranks_per_node (", spec.ranks_per_node,
             ") must divide the world size (", world_size, ")");
  world_ = world_size;
  pp_ = int(spec.pp);
  dp_rep_ = int(spec.dp_replicate);
  dp_shard_ = int(spec.dp_shard);
  cp_ = int(spec.cp);
  tp_ = int(spec.tp);
  ep_ = int(spec.ep);
  rpn_ = int(std::min<int64_t>(spec.ranks_per_node, world_size));
  if (spec.ep_dispatcher == EpDispatcher::Hierarchical && ep_ > 1)
    MT_CHECK(cp_ * tp_ == 1, op, "hierarchical dispatch groups an EP group's ranks by node assuming they are adjacent; "
             "with cp (", cp_, ") or tp (", tp_, ") > 1 they are ", cp_ * tp_, " apart: use ep_dispatcher = "
             "\"alltoall\" or \"sync_free\"");
  if (spec.ep_dispatcher == EpDispatcher::Hierarchical)
    MT_CHECK(ep_ % rpn_ == 0 || rpn_ % ep_ == 0, op, "hierarchical dispatch needs the EP group (ep = ", ep_,
             ") to cover whole nodes or lie inside one node (ranks_per_node = ", rpn_,
             "): ep % ranks_per_node == 0 or ranks_per_node % ep == 0");
}

MeshCoord DeviceMesh::coord(int rank) const {
  MT_CHECK(rank >= 0 && rank < world_, "mesh.coord", "rank ", rank, " outside [0, ", world_, ")");
  MeshCoord c;
  c.rank = rank;
  const int dp = this->dp();
  c.tp = rank % tp_;
  c.cp = rank / tp_ % cp_;
  c.pp = rank / (tp_ * cp_ * dp);
  c.dp = rank / (tp_ * cp_) % dp;
  c.dp_replicate = c.dp / dp_shard_;
  c.dp_shard = c.dp % dp_shard_;
  c.ep = (c.dp * cp_ + c.cp) % ep_;
  c.edp = (c.dp * cp_ + c.cp) / ep_;
  c.node = rank / rpn_;
  c.local_rank = rank % rpn_;
  return c;
}

int DeviceMesh::rank_of(int pp_idx, int dp_idx, int cp_idx, int tp_idx) const {
  MT_CHECK(pp_idx >= 0 && pp_idx < pp_ && dp_idx >= 0 && dp_idx < dp() && cp_idx >= 0 && cp_idx < cp_ && tp_idx >= 0 &&
               tp_idx < tp_,
           "mesh.rank_of", "coordinates (pp ", pp_idx, ", dp ", dp_idx, ", cp ", cp_idx, ", tp ", tp_idx, ") outside (",
           pp_, ", ", dp(), ", ", cp_, ", ", tp_, ")");
  return ((pp_idx * dp() + dp_idx) * cp_ + cp_idx) * tp_ + tp_idx;
}

int DeviceMesh::rank_of_ep(int pp_idx, int edp_idx, int ep_idx, int tp_idx) const {
  MT_CHECK(edp_idx >= 0 && edp_idx < edp() && ep_idx >= 0 && ep_idx < ep_, "mesh.rank_of_ep", "coordinates (edp ",
           edp_idx, ", ep ", ep_idx, ") outside (", edp(), ", ", ep_, ")");
  const int dc = edp_idx * ep_ + ep_idx;  // the index over dp x cp
  return rank_of(pp_idx, dc / cp_, dc % cp_, tp_idx);
}

std::vector<int> DeviceMesh::group(MeshGroup g, int rank) const {
  const MeshCoord c = coord(rank);
  std::vector<int> out;
  switch (g) {
    case MeshGroup::Dp:
      for (int i = 0; i < dp(); ++i) out.push_back(rank_of(c.pp, i, c.cp, c.tp));
      break;
    case MeshGroup::DpShard:
      for (int i = 0; i < dp_shard_; ++i) out.push_back(rank_of(c.pp, c.dp_replicate * dp_shard_ + i, c.cp, c.tp));
      break;
    case MeshGroup::DpReplicate:
      for (int i = 0; i < dp_rep_; ++i) out.push_back(rank_of(c.pp, i * dp_shard_ + c.dp_shard, c.cp, c.tp));
      break;
    case MeshGroup::Ep:
      for (int i = 0; i < ep_; ++i) out.push_back(rank_of_ep(c.pp, c.edp, i, c.tp));
      break;
    case MeshGroup::Edp:
      for (int i = 0; i < edp(); ++i) out.push_back(rank_of_ep(c.pp, i, c.ep, c.tp));
      break;
    case MeshGroup::Pp:
      for (int i = 0; i < pp_; ++i) out.push_back(rank_of(i, c.dp, c.cp, c.tp));
      break;
    case MeshGroup::Cp:
      for (int i = 0; i < cp_; ++i) out.push_back(rank_of(c.pp, c.dp, i, c.tp));
      break;
    case MeshGroup::Tp:
      for (int i = 0; i < tp_; ++i) out.push_back(rank_of(c.pp, c.dp, c.cp, i));
      break;
    case MeshGroup::DpCp:
      for (int i = 0; i < dp() * cp_; ++i) out.push_back(rank_of(c.pp, i / cp_, i % cp_, c.tp));
      break;
  }
  return out;
}

std::string DeviceMesh::describe() const {
  std::ostringstream os;
  os << "world " << world_ << " = pp " << pp_ << " x dp_replicate " << dp_rep_ << " x dp_shard " << dp_shard_;
  if (cp_ > 1) os << " x cp " << cp_;
  if (tp_ > 1) os << " x tp " << tp_;
  os << "; ep " << ep_ << " x edp " << edp() << "; " << num_nodes() << " node(s) of " << rpn_ << " ranks"
     << (ep_within_node() ? " (EP groups inside a node)" : " (EP groups span nodes)");
  return os.str();
}

const Comm& MeshComms::get(MeshGroup g) const {
  switch (g) {
    case MeshGroup::Dp: return dp;
    case MeshGroup::DpShard: return dp_shard;
    case MeshGroup::DpReplicate: return dp_replicate;
    case MeshGroup::Ep: return ep;
    case MeshGroup::Edp: return edp;
    case MeshGroup::Pp: return pp;
    case MeshGroup::Cp: return cp;
    case MeshGroup::Tp: return tp;
    case MeshGroup::DpCp: return dp_cp;
  }
  return world;
}

MeshComms make_mesh_comms(const DeviceMesh& mesh, const Comm& world) {
  MT_CHECK(world.size() == mesh.world_size(), "mesh.comms", "communicator size ", world.size(),
           " != mesh world size ", mesh.world_size());
  const MeshCoord c = mesh.coord(world.rank());
  const int dp = mesh.dp(), ep = mesh.ep();
  MeshComms m;
  m.world = world;
  const int ct = mesh.cp() * mesh.tp(), ci = c.cp * mesh.tp() + c.tp;  // the (cp, tp) position, flattened
  // color: the coordinates held fixed, flattened; key: the group index.
  m.dp = world.split(c.pp * ct + ci, c.dp);
  m.dp_shard = world.split((c.pp * mesh.dp_replicate() + c.dp_replicate) * ct + ci, c.dp_shard);
  m.dp_replicate = world.split((c.pp * mesh.dp_shard() + c.dp_shard) * ct + ci, c.dp_replicate);
  // EP is carved out of dp x cp within one tp index (mesh.h).
  m.ep = world.split((c.pp * mesh.edp() + c.edp) * mesh.tp() + c.tp, c.ep);
  m.edp = world.split((c.pp * ep + c.ep) * mesh.tp() + c.tp, c.edp);
  m.pp = world.split(c.dp * ct + ci, c.pp);
  m.cp = world.split((c.pp * dp + c.dp) * mesh.tp() + c.tp, c.cp);
  m.tp = world.split((c.pp * dp + c.dp) * mesh.cp() + c.cp, c.tp);
  m.dp_cp = world.split(c.pp * mesh.tp() + c.tp, c.dp * mesh.cp() + c.cp);
  // Trace names (Comm::set_name): a group's kind; dispatcher and node / rail communicators split from ep are
  // then "ep.<k>", "ep.<k>.<j>".
  m.dp.set_name("dp"), m.dp_shard.set_name("dp_shard"), m.dp_replicate.set_name("dp_replicate");
  m.ep.set_name("ep"), m.edp.set_name("edp"), m.pp.set_name("pp");
  m.cp.set_name("cp"), m.tp.set_name("tp"), m.dp_cp.set_name("dp_cp");
  return m;
}

}  // namespace moetron
