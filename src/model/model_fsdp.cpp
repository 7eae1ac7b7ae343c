// model_fsdp.cpp: the model's side of FSDP / ZeRO-3 mode: which unit each parameter belongs to (0 =
// embedding, 1..n_layers = decoder layers, n_layers + 1 = final norm + head), the slots a gathered unit
// lives in (fp32 parameters, their bf16 copy, packed experts, gradients), and gathering / releasing a unit.
// Not the communication or the shards (src/parallel/fsdp.cpp, include/moetron/fsdp.h), and not when units
// are gathered (the layer loop and the embedding / head steps).
#include <cstring>

#include "model/model_impl.h"
#include "moetron/fsdp.h"
#include "moetron/trace.h"

namespace moetron {

void Model::Impl::fs_build() {
  const int nL = int(layers.size());
  fs_unit.resize(m.params_.size());
  for (size_t i = 0; i < m.params_.size(); ++i) {
    const ParamEntry& e = m.params_[i];
    fs_unit[i] = e.layer >= 0 ? e.layer + 1 : (int(i) == emb ? 0 : nL + 1);
  }
  m.fsdp_ = std::make_unique<Fsdp>(m.params_, fs_unit, nL + 2, *fs_opts);
  fs_on = true;
  fs_local.resize(m.params_.size());
  for (size_t i = 0; i < m.params_.size(); ++i) fs_local[i] = m.fsdp_->local_offset(int(i));
  fs_slot_of.assign(size_t(nL + 2), -1);
  // Blocking collectives: one unit is in use at a time, plus unit 0 for the whole pass when the head is
  // the embedding, or an MTP depth's unit with the head's (model_mtp.cpp).
  const int n_slots = head == emb || Dm > 0 ? 2 : 1;
  const int64_t n = m.fsdp_->max_slot_numel();
  fs_slots.resize(size_t(n_slots));
  for (auto& sl : fs_slots) {
    sl.p = Tensor::zeros({n}, DType::F32, MemCategory::Params, "fsdp.slot.params");
    if (!f32) sl.wc = Tensor::zeros({n}, DType::BF16, MemCategory::Params, "fsdp.slot.bf16");
    sl.g = Tensor::zeros({n}, DType::F32, MemCategory::Grads, "fsdp.slot.grads");
    if (E > 0) alloc_packed(sl.p13f, sl.p13d, sl.p2f, sl.p2d, "fsdp.slot.experts");
  }
}

void Model::Impl::fs_acquire(int u, bool params, bool grads) {
  if (!fs_on) return;
  MT_CHECK(fs_slot_of[size_t(u)] < 0, "Model(fsdp)", "unit ", u, " gathered twice");
  int k = -1;
  for (size_t j = 0; j < fs_slots.size() && k < 0; ++j)
    if (fs_slots[j].unit < 0) k = int(j);
  MT_CHECK(k >= 0, "Model(fsdp)", "no free slot for unit ", u);
  FsSlot& sl = fs_slots[size_t(k)];
  sl.unit = u, sl.grads = grads, fs_slot_of[size_t(u)] = k;
  const int64_t n = m.fsdp_->unit(u).slot_numel;
  if (params) {
    MT_TRACE("fsdp.all_gather");
    m.fsdp_->gather_unit(sl.p.data<float>(), u);
    if (!f32) f32_to_bf16(sl.wc.data<bf16>(), sl.p.data<float>(), n);
    if (u >= 1 && u <= int(layers.size()) && layers[size_t(u - 1)].moe) {
      pack_experts(layers[size_t(u - 1)], sl.p13f, sl.p13d, sl.p2f, sl.p2d);
    }
  }
  if (grads) std::memset(sl.g.raw(), 0, size_t(n) * 4);
}

void Model::Impl::fs_release(int u) {
  if (!fs_on) return;
  const int k = fs_slot_of[size_t(u)];
  MT_CHECK(k >= 0, "Model(fsdp)", "unit ", u, " released but not gathered");
  FsSlot& sl = fs_slots[size_t(k)];
  if (sl.grads) {
    MT_TRACE("fsdp.reduce_scatter");
    m.fsdp_->reduce_scatter_unit(sl.g.data<float>(), u);
  }
  sl.unit = -1, sl.grads = false, fs_slot_of[size_t(u)] = -1;
}

}  // namespace moetron
