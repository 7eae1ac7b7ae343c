// router_topk.h: the top-k insertion shared by the router's portable, AVX-512 and AVX2 paths (router.cpp,
// router_avx512.cpp, router_avx2.cpp). Scalar code in an anonymous namespace, so each ISA file keeps its own copy.
#pragma once
#include <cstdint>

namespace moetron {
namespace {

// Insert (v, i) into the sorted list (val, idx) of length cnt <= cap, keeping "larger value, then lower
// index" first. Candidates arrive in increasing index, so an equal value goes after the ones already there.
inline void topk_insert(float* val, int32_t* idx, int& cnt, int cap, float v, int32_t i) {
  int pos;
  if (cnt < cap) pos = cnt++;
  else if (v > val[cap - 1]) pos = cap - 1;
  else return;
  while (pos > 0 && val[pos - 1] < v) {
    val[pos] = val[pos - 1];
    idx[pos] = idx[pos - 1];
    --pos;
  }
  val[pos] = v;
  idx[pos] = i;
}

}  // namespace
}  // namespace moetron
