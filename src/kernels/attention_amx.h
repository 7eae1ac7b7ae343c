// attention_amx.h: the AMX-BF16 tile product of the bf16 flash attention (attention_bf16_avx512.cpp): the
// same contract as that file's gemm16 / tri16, C[M,N] (+)= op(A)[M,K] B[K,N] on bf16 pairs with fp32 output,
// computed on Intel's AMX tiles. Not the grouped GEMM's tile kernel (grouped_gemm_amx.cpp) and not a general GEMM.
#pragma once
#include <cstdint>

namespace moetron::attn_amx {

// Whether this build compiled the tile kernel (the compiler knows -mamx-tile -mamx-bf16); the caller also
// needs amx_active() (CPU, OS permission, MOETRON_ISA).
bool built();

// The causal trims of attention_impl.h's Tri, in its order (None, NUpTo, NFrom, KUpTo, KFrom), applied per
// block of 16 rows with the block's last row setting the bound (the tile's granularity; the vector kernel
// trims per 6 rows the same way): what is computed beyond a row's own bound is either overwritten by the
// caller (the scores' masked entries) or multiplies operands that are 0 there (P and dS past the diagonal).
enum : int { kNone = 0, kNUpTo = 1, kNFrom = 2, kKUpTo = 3, kKFrom = 4 };

// C[M,N] (+)= op(A)[M,K] B[K,N] over ceil(K/2) pair steps: op(A)(m, pair p) = trans_a ? A[p*lda + m] :
// A[m*lda + p], B(p, n) = B[p*ldb + n] (32-bit words holding bf16 pairs, lda / ldb in words), C fp32 with
// ldc in floats. Operand pairs past K hold 0 (the caller's layouts guarantee it). Each output element is C
// (when accumulating) plus the K chunks of 16 pairs in order, one tile instruction each.
void gemm(int tri, bool acc, bool trans_a, int64_t M, int64_t N, int64_t K, const uint32_t* A, int64_t lda,
          const uint32_t* B, int64_t ldb, float* C, int64_t ldc);

// Keeps this thread's tile configuration across gemm calls (one per thread, inside the parallel region, with
// no other tile kernel running until it ends): loading a configuration and releasing the tiles cost about as
// much as a 64 x 64 x 64 product. Without one, each gemm call configures and releases the tiles itself.
class Session {
 public:
  explicit Session(bool on);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

 private:
  bool on_;
};

}  // namespace moetron::attn_amx
