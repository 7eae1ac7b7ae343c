// model_tp.cpp: the model's tensor- and context-parallel plumbing. TP: the sequence-parallel regions' row all-gather
// (before a column-parallel block) and reduce-scatter (after a row-parallel one), and the sums over the TP group
// of the partial terms a rank computes for the heads or FFN columns it holds. Which block calls which is in
// model_layer.cpp, model_attention.cpp, model_moe.cpp and model_embed_head.cpp; docs/parallel.md ("Tensor
// parallelism") lists them per layer. The traces see them as Comm events of the "tp" group (no kernel scope of
// their own: they run inside the blocks' scopes). CP: this rank's rows of the micro-batch's tokens and targets (the
// ring attention itself is cp_attention.h, called by model_attention.cpp). Not the parameter slicing
// (src/params/param_layout.cpp).
#include "model/model_impl.h"
#include "moetron/cp_attention.h"

namespace moetron {

void Model::Impl::tp_gather_rows(void* full, const void* local, int64_t row_bytes) {
  tp_comm.all_gather(full, local, Nr * row_bytes);
}

void Model::Impl::tp_scatter_sum(float* local, const float* full) { tp_comm.reduce_scatter(local, full, Nr * d); }

void Model::Impl::tp_sum(float* x, int64_t n) {
  if (tp == 1) return;
  tp_comm.all_reduce(x, n);
}

const int32_t* Model::Impl::cp_rows(std::vector<int32_t>& dst, const int32_t* full) {
  if (cp == 1) return full;
  dst.resize(size_t(N));
  cp_take_rows(dst.data(), full, m.B_, m.seq_len_, 4, cp, cp_rank);
  return dst.data();
}

}  // namespace moetron
