// router_avx2.cpp: AVX2 + FMA row kernels for the router (chosen by router.cpp when active_isa() is Avx2): score
// rows (softmax or sigmoid over E experts), the group-limited top-k of a row, and the logsumexp / z-loss
// gradient rows. Not the loop over tokens, the validation or the losses (router.cpp). Same contract as the
// AVX-512 rows (router_avx512.cpp), not bitwise them nor the portable rows: the exp is exp_avx2.h's exp_ps
// (within 2 ulp of the correctly rounded expf; inputs above 89 give +inf where the AVX-512 router's clamp at
// 88.7 gives 3.3e38, so a sigmoid of a logit below -89 is 0 here and 3e-39 there, inside the harness's 1e-37
// absolute slack), and the E-term sums run in 8 lanes. The selection itself is exact (q = s + bias rounds once,
// as in the portable path), so the top-k of given scores is the portable top-k.
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "exp_avx2.h"
#include "router_topk.h"

namespace moetron {

namespace {

inline __m256 load_or(const float* p, int64_t rem, float fill) {
  if (rem >= 8) return _mm256_loadu_ps(p);
  const __m256i m = avx2_tail_mask(rem);
  return _mm256_blendv_ps(_mm256_set1_ps(fill), _mm256_maskload_ps(p, m), _mm256_castsi256_ps(m));
}

inline float row_max(const float* l, int E) {
  __m256 vm = _mm256_set1_ps(-INFINITY);
  for (int e = 0; e < E; e += 8) vm = _mm256_max_ps(vm, load_or(l + e, E - e, -INFINITY));
  return avx2_hmax(vm);
}

// sum_e exp(l_e - m) in 8 lanes (padding lanes contribute exactly 0); with s, the exps are stored there.
inline float exp_sum(float* s, const float* l, int E, __m256 m) {
  __m256 vz = _mm256_setzero_ps();
  for (int e = 0; e < E; e += 8) {
    const __m256i k = avx2_tail_mask(E - e);
    __m256 v = exp_ps(_mm256_sub_ps(load_or(l + e, E - e, 0.0f), m));
    v = _mm256_and_ps(v, _mm256_castsi256_ps(k));
    if (s) _mm256_maskstore_ps(s + e, k, v);
    vz = _mm256_add_ps(vz, v);
  }
  return avx2_hsum(vz);
}

void softmax_row(float* s, const float* l, int E) {
  const __m256 m = _mm256_set1_ps(row_max(l, E));
  const __m256 z = _mm256_set1_ps(exp_sum(s, l, E, m));
  for (int e = 0; e < E; e += 8) {
    const __m256i k = avx2_tail_mask(E - e);
    _mm256_maskstore_ps(s + e, k, _mm256_div_ps(_mm256_maskload_ps(s + e, k), z));
  }
}

void sigmoid_row(float* s, const float* l, int E) {
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int e = 0; e < E; e += 8) {
    const __m256i k = avx2_tail_mask(E - e);
    const __m256 x = _mm256_maskload_ps(l + e, k);
    const __m256 v = _mm256_div_ps(one, _mm256_add_ps(one, exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), x))));
    _mm256_maskstore_ps(s + e, k, v);
  }
}

constexpr int kSelMaxE = 1024;  // q lives on the stack
constexpr int kSelMaxGroups = 256;

// Keeps only the topk_group best groups of q (the others set to -inf), as the portable selection does.
void mask_groups(float* q, int E, int n_group, int topk_group, bool top2sum) {
  const int G = E / n_group;
  float t1[kSelMaxGroups], t2[kSelMaxGroups], gval[kSelMaxGroups];
  int gidx[kSelMaxGroups];
  for (int g = 0; g < n_group; ++g) t1[g] = t2[g] = -INFINITY;
  // The two largest values of each group (with multiplicity), branch-free, groups interleaved.
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

}  // namespace

void router_scores_row_avx2(float* s, const float* l, int E, bool softmax) {
  if (softmax) softmax_row(s, l, E);
  else sigmoid_row(s, l, E);
}

// Group-limited top-k of one token: k passes of a vector arg-max (the first lane holding the maximum, i.e. the
// lowest index among equal values), each removing its winner. Returns false (nothing written) when E or the
// group count is too large for the stack buffers.
bool router_select_row_avx2(int32_t* idx, float* val, const float* s, const float* bias, int E, int k, int n_group,
                            int topk_group, bool top2sum) {
  if (E > kSelMaxE || n_group > kSelMaxGroups) return false;
  alignas(32) float q[kSelMaxE];
  for (int e = 0; e < E; e += 8) {
    const __m256 x = _mm256_add_ps(load_or(s + e, E - e, -INFINITY),
                                   bias ? load_or(bias + e, E - e, 0.0f) : _mm256_setzero_ps());
    _mm256_store_ps(q + e, x);  // padding lanes: -inf + 0
  }
  const int nv = (E + 7) / 8;
  if (n_group > 1) mask_groups(q, E, n_group, topk_group, top2sum);
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int j = 0; j < k; ++j) {
    __m256 vm = _mm256_load_ps(q);
    for (int v = 1; v < nv; ++v) vm = _mm256_max_ps(vm, _mm256_load_ps(q + 8 * v));
    const float m = avx2_hmax(vm);
    const __m256 mv = _mm256_set1_ps(m);
    int e = 0;  // first lane equal to the maximum, four vectors (32 experts) per step
    for (int v = 0; v < nv; v += 4) {
      uint32_t hit = 0;
      for (int u = 0; u < 4 && v + u < nv; ++u)
        hit |= uint32_t(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_load_ps(q + 8 * (v + u)), mv, _CMP_EQ_OQ))) << (8 * u);
      if (hit) {
        e = 8 * v + __builtin_ctz(hit);
        break;
      }
    }
    idx[j] = e;
    val[j] = m;
    float* qv = q + (e & ~7);  // knock the winner out with a vector blend
    const __m256 sel = _mm256_castsi256_ps(_mm256_cmpeq_epi32(lane, _mm256_set1_epi32(e & 7)));
    _mm256_store_ps(qv, _mm256_blendv_ps(_mm256_load_ps(qv), ninf, sel));
  }
  return true;
}

// logsumexp of one row in fp32 (vector exp; the log of the sum through libm).
float router_lse_row_avx2(const float* l, int E) {
  const float m = row_max(l, E);
  return m + __builtin_logf(exp_sum(nullptr, l, E, _mm256_set1_ps(m)));
}

// dl += coef * lse(l) * softmax(l): the z-loss gradient of one row (coef = 2 z_coef / N).
void router_zgrad_row_avx2(float* dl, const float* l, int E, float coef) {
  const float m = row_max(l, E);
  const __m256 mv = _mm256_set1_ps(m);
  const float z = exp_sum(nullptr, l, E, mv);
  const __m256 f = _mm256_set1_ps(coef * (m + __builtin_logf(z)) / z);
  for (int e = 0; e < E; e += 8) {
    const __m256i k = avx2_tail_mask(E - e);
    const __m256 p = exp_ps(_mm256_sub_ps(_mm256_maskload_ps(l + e, k), mv));
    _mm256_maskstore_ps(dl + e, k, _mm256_fmadd_ps(f, p, _mm256_maskload_ps(dl + e, k)));
  }
}

}  // namespace moetron
