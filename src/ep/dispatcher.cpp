// dispatcher.cpp: the part of EpDispatch::Impl every dispatcher shares: the configuration checks, the input
// checks of a dispatch, the weights copy, the token payload encode, the combine row encode and the combine's
// reduction (moe_unpermute / moe_permute_backward over wire rows).
// Not a layout and not an exchange: the dispatchers (dispatch_flat.cpp, dispatch_alltoall.cpp,
// dispatch_sync_free.cpp, dispatch_hier.cpp) move the rows.
#include "ep/dispatcher.h"

#include <limits>

#include <omp.h>

#include "moetron/check.h"
#include "moetron/permute.h"
#include "moetron/runtime.h"

namespace moetron {

using ep::kParMin;

EpDispatch::Impl::Impl(const Comm& ep_comm, const EpDispatchConfig& config) : comm(ep_comm), cfg(config) {
  const char* op = "ep_dispatch";
  P = ep_comm.size();
  me = ep_comm.rank();
  MT_CHECK(cfg.n_experts >= 1, op, "n_experts=", cfg.n_experts, " must be >= 1");
  MT_CHECK(cfg.n_experts % P == 0, op, "EP size ", P, " must divide n_experts=", cfg.n_experts);
  MT_CHECK(cfg.topk >= 1 && cfg.topk <= cfg.n_experts, op, "topk=", cfg.topk, " outside [1, n_experts=",
           cfg.n_experts, "]");
  MT_CHECK(cfg.hidden >= 1, op, "hidden=", cfg.hidden, " must be >= 1");
  MT_CHECK(cfg.max_tokens >= 0, op, "max_tokens=", cfg.max_tokens, " must be >= 0");
  MT_CHECK(cfg.ranks_per_node >= 0, op, "ranks_per_node=", cfg.ranks_per_node, " must be >= 0");
  MT_CHECK(cfg.combine_payload != EpPayload::E4M3, op, "combine payload must be f32 or bf16 (got e4m3)");
  E = cfg.n_experts;
  El = cfg.n_experts / P;
  MT_CHECK(El <= 32767 && cfg.topk <= 32767, op, "too many local experts (", El, ") or topk (", cfg.topk, ")");
  k = cfg.topk;
  D = cfg.hidden;
  L = (cfg.ranks_per_node == 0 || cfg.ranks_per_node >= P) ? P : cfg.ranks_per_node;
  MT_CHECK(P % L == 0, op, "ranks_per_node=", cfg.ranks_per_node, " must divide the EP size ", P);
  Nn = P / L;
  node = me / L;
  li = me % L;
  nb = (D + ep::kFp8Block - 1) / ep::kFp8Block;
  switch (cfg.dispatch_payload) {
    case EpPayload::F32: pb = D * 4; break;
    case EpPayload::BF16: pb = D * 2; break;
    case EpPayload::E4M3: pb = nb * 4 + D; break;
  }
  cb = cfg.combine_payload == EpPayload::BF16 ? D * 2 : D * 4;
  MT_CHECK(!cfg.land_rows || cfg.dispatch_payload != EpPayload::E4M3, op,
           "land_rows needs an f32 or bf16 dispatch payload (e4m3 rows are decoded to fp32, not landed)");
  MT_CHECK(cfg.transport == EpTransport::Mpi || cfg.kind != EpDispatcher::Hierarchical, op,
           "ep_transport = shm moves the flat dispatchers' rows (alltoall, sync_free); hierarchical crosses nodes: "
           "use ep_transport = mpi with it");
  counts.assign(size_t(El), 0);
  offsets.assign(size_t(El) + 1, 0);
}

void EpDispatch::Impl::validate(const float* x, const int32_t* idx, int64_t n) const {
  const char* op = "ep_dispatch";
  MT_CHECK(n >= 0, op, "negative token count N=", n);
  check_token_bound(n);
  MT_CHECK(n <= std::numeric_limits<int32_t>::max() / std::max(k, 1), op, "N=", n, " too large");
  if (n == 0) return;
  MT_CHECK(x && idx, op, "null x or topk_idx with N=", n);
  for (int64_t t = 0; t < n; ++t)
    for (int s = 0; s < k; ++s) {
      const int32_t e = idx[t * k + s];
      MT_CHECK(e >= -1 && e < E, op, "topk_idx[", t, ",", s, "]=", e, " outside [0, E=", E, ") and not -1 (dropped)");
      if (e < 0) continue;
      for (int s2 = 0; s2 < s; ++s2)
        MT_CHECK(idx[t * k + s2] != e, op, "token ", t, " routes to expert ", e, " twice (slots ", s2, " and ", s,
                 ")");
    }
}

void EpDispatch::Impl::copy_weights(const float* w, int64_t n) {
  float* wc = wcopy.get<float>(std::max<int64_t>(n * k, 1));
  for (int64_t i = 0; i < n * k; ++i) wc[i] = w ? w[i] : 1.0f;
}

void EpDispatch::Impl::encode_tokens(const float* x, int64_t n) {
  if (n == 0) return;
  if (cfg.dispatch_payload == EpPayload::BF16) {
    ep::to_wire_bf16_rows(hbuf.get<bf16>(n * D), x, n, D);
  } else if (cfg.dispatch_payload == EpPayload::E4M3) {
    fp8_quantize(qbuf.get<uint8_t>(n * D), sbuf.get<float>(n * nb), x, n, D, Fp8Format::E4M3, Fp8Scaling::Block, 1,
                 ep::kFp8Block);
  }
}

char* EpDispatch::Impl::open_rows(int64_t rows) {
  landed_in_caller = false;
  if (land) {
    void* at = (*land)(rows);
    if (at) {
      landed_in_caller = true;
      return static_cast<char*>(at);
    }
  }
  return out_x.get(std::max<int64_t>(rows, 1) * row_out());
}

void EpDispatch::Impl::encode_rows(char* dst, const float* src, int64_t n) const {
  if (n == 0) return;
  if (cfg.combine_payload == EpPayload::BF16) ep::to_wire_bf16_rows(reinterpret_cast<bf16*>(dst), src, n, D);
  else std::memcpy(dst, src, size_t(n * D * 4));
}

void EpDispatch::Impl::reduce_rows(float* y, ep::Buf& tmp, const char* in, const int32_t* ro, const float* w,
                                   int64_t n, int64_t S) {
  if (n == 0) return;
  if (cfg.combine_payload == EpPayload::F32) {
    const float* rows = reinterpret_cast<const float*>(in);
    if (w) moe_unpermute(y, rows, ro, w, n, k, S, D);
    else moe_permute_backward(y, rows, ro, n, k, S, D);
    return;
  }
  const bf16* rows = reinterpret_cast<const bf16*>(in);
  reduce_fetched(y, tmp, ro, w, n,
                 [&](int64_t i, float* dst) { ep::from_wire_bf16(dst, rows + int64_t(ro[i]) * D, D); });
}

}  // namespace moetron
