// router_avx512.cpp: AVX-512 row kernels for the router: score rows (softmax or sigmoid over E experts),
// the group-limited top-k of a row, capacity routing's pick for one token, and the logsumexp / z-loss gradient
// rows. Not the loop over tokens,
// the validation or the losses (router.cpp). The exp (exp_avx512.h) is a degree-7 polynomial after a
// Cody-Waite reduction, within 2 ulp of the correctly rounded expf on the router's input range, so the scores
// differ from router_scores_ref<float> by a few ulp (the tolerance rationale is in docs/kernels/moe.md).
// GCC 12 warns falsely about _mm512_undefined_* inside its own intrinsic headers.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>

#include "exp_avx512.h"
#include "router_topk.h"

namespace moetron {

namespace {

// exp_avx512.h's variant clamped to [-104, 88.7] with the 9-bit ln2 split (this file's historic exp).
inline __m512 exp512(__m512 x) { return exp_ps<true>(x, 88.7f, kLn2Cephes); }

inline __mmask16 tail_mask(int rem) { return rem >= 16 ? __mmask16(0xffff) : __mmask16((1u << rem) - 1); }

void softmax_row(float* s, const float* l, int E) {
  __m512 vm = _mm512_set1_ps(-INFINITY);
  for (int e = 0; e < E; e += 16)
    vm = _mm512_max_ps(vm, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail_mask(E - e), l + e));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vm));
  __m512 vz = _mm512_setzero_ps();
  for (int e = 0; e < E; e += 16) {
    __mmask16 k = tail_mask(E - e);
    __m512 v = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, l + e), m));
    v = _mm512_maskz_mov_ps(k, v);
    _mm512_mask_storeu_ps(s + e, k, v);
    vz = _mm512_add_ps(vz, v);
  }
  const __m512 z = _mm512_set1_ps(_mm512_reduce_add_ps(vz));
  for (int e = 0; e < E; e += 16) {
    __mmask16 k = tail_mask(E - e);
    _mm512_mask_storeu_ps(s + e, k, _mm512_div_ps(_mm512_maskz_loadu_ps(k, s + e), z));
  }
}

void sigmoid_row(float* s, const float* l, int E) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int e = 0; e < E; e += 16) {
    __mmask16 k = tail_mask(E - e);
    __m512 x = _mm512_maskz_loadu_ps(k, l + e);
    __m512 v = _mm512_div_ps(one, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), x))));
    _mm512_mask_storeu_ps(s + e, k, v);
  }
}

// Selection values q = s + bias for a row (padding lanes -inf), into q [16 * ceil(E/16)].
inline void selection_values(float* q, const float* s, const float* bias, int E) {
  for (int e = 0; e < E; e += 16) {
    __mmask16 m = tail_mask(E - e);
    __m512 x = _mm512_maskz_loadu_ps(m, s + e);
    x = _mm512_add_ps(x, bias ? _mm512_maskz_loadu_ps(m, bias + e) : _mm512_setzero_ps());
    _mm512_store_ps(q + e, _mm512_mask_blend_ps(m, _mm512_set1_ps(-INFINITY), x));
  }
}

constexpr int kSelMaxE = 1024;  // q lives on the stack
constexpr int kSelMaxGroups = 256;

}  // namespace

void router_scores_row_avx512(float* s, const float* l, int E, bool softmax) {
  if (softmax) softmax_row(s, l, E);
  else sigmoid_row(s, l, E);
}

// Group-limited top-k of one token: k passes of a vector arg-max (the first lane holding the maximum, i.e.
// the lowest index among equal values), each removing its winner. Experts of groups that are not kept are
// set to -inf first. Returns false (nothing written) when E is too large for the stack buffer.
bool router_select_row_avx512(int32_t* idx, float* val, const float* s, const float* bias, int E, int k,
                              int n_group, int topk_group, bool top2sum) {
  if (E > kSelMaxE || n_group > kSelMaxGroups) return false;
  alignas(64) float q[kSelMaxE];
  selection_values(q, s, bias, E);
  const int nv = (E + 15) / 16;
  if (n_group > 1) {
    const int G = E / n_group;
    float t1[kSelMaxGroups], t2[kSelMaxGroups], gval[kSelMaxGroups];
    int gidx[kSelMaxGroups];
    for (int g = 0; g < n_group; ++g) t1[g] = t2[g] = -INFINITY;
    // The two largest values of each group (with multiplicity), branch-free; groups interleaved so that the
    // max/min chains of different groups overlap.
    for (int j = 0; j < G; ++j)
      for (int g = 0; g < n_group; ++g) {
        const float v = q[g * G + j], lo = v < t1[g] ? v : t1[g];
        t2[g] = lo > t2[g] ? lo : t2[g];
        t1[g] = v > t1[g] ? v : t1[g];
      }
    int gcnt = 0;
    for (int g = 0; g < n_group; ++g)
      topk_insert(gval, gidx, gcnt, topk_group, top2sum && G >= 2 ? t1[g] + t2[g] : t1[g], g);
    bool chosen[kSelMaxGroups] = {};
    for (int r = 0; r < gcnt; ++r) chosen[gidx[r]] = true;
    for (int g = 0; g < n_group; ++g)
      if (!chosen[g])
        for (int e = g * G; e < (g + 1) * G; ++e) q[e] = -INFINITY;
  }
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  for (int j = 0; j < k; ++j) {
    __m512 vm = _mm512_load_ps(q);
    for (int v = 1; v < nv; ++v) vm = _mm512_max_ps(vm, _mm512_load_ps(q + 16 * v));
    const float m = _mm512_reduce_max_ps(vm);
    const __m512 mv = _mm512_set1_ps(m);
    // First lane equal to the maximum, four vectors (64 experts) per step.
    int e = 0;
    for (int v = 0; v < nv; v += 4) {
      uint64_t hit = 0;
      for (int u = 0; u < 4 && v + u < nv; ++u)
        hit |= uint64_t(_mm512_cmp_ps_mask(_mm512_load_ps(q + 16 * (v + u)), mv, _CMP_EQ_OQ)) << (16 * u);
      if (hit) {
        e = 16 * v + __builtin_ctzll(hit);
        break;
      }
    }
    idx[j] = e;
    val[j] = m;
    // Knock the winner out with a vector blend (a scalar store followed by vector loads would stall).
    float* qv = q + (e & ~15);
    _mm512_store_ps(qv, _mm512_mask_blend_ps(__mmask16(1u << (e & 15)), _mm512_load_ps(qv), ninf));
  }
  return true;
}

// logsumexp of one row in fp32 (vector exp; the log of the sum through libm).
float router_lse_row_avx512(const float* l, int E) {
  __m512 vm = _mm512_set1_ps(-INFINITY);
  for (int e = 0; e < E; e += 16)
    vm = _mm512_max_ps(vm, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail_mask(E - e), l + e));
  const float m = _mm512_reduce_max_ps(vm);
  const __m512 mv = _mm512_set1_ps(m);
  __m512 vz = _mm512_setzero_ps();
  for (int e = 0; e < E; e += 16) {
    __mmask16 k = tail_mask(E - e);
    vz = _mm512_add_ps(vz, _mm512_maskz_mov_ps(k, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, l + e), mv))));
  }
  return m + __builtin_logf(_mm512_reduce_add_ps(vz));
}

// dl += coef * lse(l) * softmax(l): the z-loss gradient of one row (coef = 2 z_coef / N).
void router_zgrad_row_avx512(float* dl, const float* l, int E, float coef) {
  __m512 vm = _mm512_set1_ps(-INFINITY);
  for (int e = 0; e < E; e += 16)
    vm = _mm512_max_ps(vm, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail_mask(E - e), l + e));
  const float m = _mm512_reduce_max_ps(vm);
  const __m512 mv = _mm512_set1_ps(m);
  __m512 vz = _mm512_setzero_ps();
  for (int e = 0; e < E; e += 16) {
    __mmask16 k = tail_mask(E - e);
    vz = _mm512_add_ps(vz, _mm512_maskz_mov_ps(k, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, l + e), mv))));
  }
  const float z = _mm512_reduce_add_ps(vz);
  const __m512 f = _mm512_set1_ps(coef * (m + __builtin_logf(z)) / z);
  for (int e = 0; e < E; e += 16) {
    __mmask16 k = tail_mask(E - e);
    __m512 p = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, l + e), mv));
    _mm512_mask_storeu_ps(dl + e, k, _mm512_fmadd_ps(f, p, _mm512_maskz_loadu_ps(k, dl + e)));
  }
}

// Capacity routing's choice for one token (router.cpp capacity_route): k times the largest q among the experts
// not yet taken with counts below C, ties to the lower index; with none left below C, the largest not yet taken.
// Each pick increments counts. The same choices as the scalar loop; returns false, writing nothing, when a q is
// NaN (the scalar loop decides those) or E > 1024.
bool router_capacity_pick_avx512(int32_t* idx, const float* q, int32_t* counts, int64_t C, int E, int k) {
  const int nv = (E + 15) / 16;
  if (nv > 64) return false;
  __m512 x[64];
  __mmask16 valid[64], used[64];
  for (int v = 0; v < nv; ++v) {
    const int n = E - 16 * v;
    valid[v] = n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1u);
    used[v] = 0;
    x[v] = _mm512_maskz_loadu_ps(valid[v], q + 16 * v);
    if (_mm512_mask_cmp_ps_mask(valid[v], x[v], x[v], _CMP_UNORD_Q)) return false;
  }
  const __m512i vc = _mm512_set1_epi32(int32_t(std::min<int64_t>(C, INT32_MAX)));
  __mmask16 avail[64];
  for (int j = 0; j < k; ++j) {
    bool any = false;
    for (int v = 0; v < nv; ++v) {
      const __mmask16 room = _mm512_mask_cmplt_epi32_mask(valid[v], _mm512_maskz_loadu_epi32(valid[v], counts + 16 * v), vc);
      avail[v] = room & __mmask16(~used[v]);
      any |= avail[v] != 0;
    }
    if (!any)
      for (int v = 0; v < nv; ++v) avail[v] = valid[v] & __mmask16(~used[v]);
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int v = 0; v < nv; ++v) vmax = _mm512_mask_max_ps(vmax, avail[v], vmax, x[v]);
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    int best = -1;
    for (int v = 0; v < nv && best < 0; ++v) {
      const __mmask16 hit = _mm512_mask_cmp_ps_mask(avail[v], x[v], mx, _CMP_EQ_OQ);
      if (hit) best = 16 * v + __builtin_ctz(unsigned(hit));
    }
    if (best < 0) return false;  // unreachable: k <= E leaves an expert not yet taken
    idx[j] = best;
    used[best / 16] |= __mmask16(1u << (best % 16));
    ++counts[best];
  }
  return true;
}

}  // namespace moetron
