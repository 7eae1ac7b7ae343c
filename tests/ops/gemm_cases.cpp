// gemm_cases.cpp: op-harness cases for the dense GEMM against gemm_ref: gemm_f32 (moetron's batch-invariant
// kernel), gemm_f32_onednn (dnnl_sgemm) and gemm_bf16 (oneDNN, or gemm_f32 on widened operands where oneDNN
// has no bf16 matmul): all four transpose combinations, alpha / beta, odd sizes (1, 7, 63, 65, 130), padded
// leading dimensions, several K blocks / column blocks / K phases, M = 0 / N = 0 / K = 0, bad leading
// dimensions throw. For gemm_f32 also:
//   - the exact formula: every element bitwise equal to a naive loop of the documented arithmetic (fp32
//     fused multiply-adds from 0 over k in order, then alpha * acc or fma(beta, C, alpha * acc); plain
//     multiply-then-add at the scalar ISA level, whose kernel has no FMA);
//   - batch invariance: rows of C computed for M rows, for a subset of the rows, for M split three ways, one
//     row at a time, and with 1 and 3 threads, are bitwise identical; the same for columns against N.
// Grad mode checks the matmul backward (dA = dC·B^T, dB = A^T·dC, written with gemm_ref<double> for every
// transpose combination) against finite differences. Not a benchmark.
//
// Tolerance: inputs are rounded to bf16 once for the bf16 path and the reference (double) sees the same values,
// so the only error is fp32 accumulation and the final alpha / beta update:
//   |C - C_ref| <= |alpha| * gamma_K * sum_k |a_ik||b_kj| + 2^-22 * (|alpha * acc| + |beta * C0|),
// gamma_K = K*2^-24 / (1 - K*2^-24); checked element by element (docs/kernels/gemm.md).
#include <omp.h>

#include <cmath>
#include <cstring>
#include <sstream>

#include "harness.h"
#include "moetron/check.h"
#include "moetron/gemm.h"
#include "moetron/runtime.h"

namespace moetron::ops {
namespace {

double gamma32(int64_t n) {
  const double u = std::ldexp(1.0, -24);
  return n * u / (1 - n * u);
}

const char* tname(Trans t) { return t == Trans::N ? "N" : "T"; }

enum class Impl { F32, F32Onednn, BF16 };
const char* impl_name(Impl i) { return i == Impl::F32 ? "f32" : i == Impl::F32Onednn ? "f32onednn" : "bf16"; }

void run_f32(Impl impl, Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
             const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (impl == Impl::F32Onednn)
    gemm_f32_onednn(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  else
    gemm_f32(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

struct GemmCase : OpCase {
  Trans ta, tb;
  int64_t M, N, K, pad;  // pad: extra elements per row of every operand (leading dimension > minimum)
  float alpha, beta;
  Impl impl;
  bool bf;

  GemmCase(Impl impl_, Trans ta_, Trans tb_, int64_t m, int64_t n, int64_t k, float al, float be, int64_t pad_ = 0)
      : ta(ta_), tb(tb_), M(m), N(n), K(k), pad(pad_), alpha(al), beta(be), impl(impl_), bf(impl_ == Impl::BF16) {
    std::ostringstream os;
    os << "gemm/" << impl_name(impl) << "_" << tname(ta) << tname(tb) << "_" << M << "x" << N << "x" << K;
    if (alpha != 1.0f || beta != 0.0f) os << "_a" << alpha << "_b" << beta;
    if (pad) os << "_ld+" << pad;
    name = os.str();
    fd_eps = 1e-3;
    grad_tol = 1e-7;
    flops = 2.0 * double(M) * double(N) * double(K);
  }
  // Stored shapes: A is [M,K] (N) or [K,M] (T); B is [K,N] (N) or [N,K] (T).
  int64_t a_rows() const { return ta == Trans::N ? M : K; }
  int64_t a_cols() const { return ta == Trans::N ? K : M; }
  int64_t b_rows() const { return tb == Trans::N ? K : N; }
  int64_t b_cols() const { return tb == Trans::N ? N : K; }
  int64_t lda() const { return std::max<int64_t>(1, a_cols() + pad); }  // BLAS: ld >= max(1, width)
  int64_t ldb() const { return std::max<int64_t>(1, b_cols() + pad); }
  int64_t ldc() const { return std::max<int64_t>(1, N + pad); }
  int64_t a_size() const { return std::max<int64_t>(1, a_rows() * lda()); }
  int64_t b_size() const { return std::max<int64_t>(1, b_rows() * ldb()); }
  int64_t c_size() const { return std::max<int64_t>(1, M * ldc()); }

  void test(Report& r) override {
    auto A = randn(a_size(), 1), B = randn(b_size(), 2), C0 = randn(c_size(), 3);
    if (bf)
      for (auto* v : {&A, &B})
        for (float& x : *v) x = round_bf16(x);
    if (beta == 0.0f)  // beta = 0: C is write-only (BLAS convention), so NaN there must not leak through
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < N; ++j) C0[i * ldc() + j] = NAN;
    std::vector<float> C = C0;
    if (bf) {
      std::vector<bf16> Ab(A.size()), Bb(B.size());
      f32_to_bf16(Ab.data(), A.data(), int64_t(A.size()));
      f32_to_bf16(Bb.data(), B.data(), int64_t(B.size()));
      gemm_bf16(ta, tb, M, N, K, alpha, Ab.data(), lda(), Bb.data(), ldb(), beta, C.data(), ldc());
    } else {
      run_f32(impl, ta, tb, M, N, K, alpha, A.data(), lda(), B.data(), ldb(), beta, C.data(), ldc());
    }
    if (impl == Impl::F32) check_formula(r, A, B, C0, C);
    auto Ad = to_f64(A), Bd = to_f64(B), Cref = to_f64(C0), S(Cref);
    gemm_ref<double>(ta, tb, M, N, K, alpha, Ad.data(), lda(), Bd.data(), ldb(), beta, Cref.data(), ldc());
    for (auto& x : Ad) x = std::fabs(x);
    for (auto& x : Bd) x = std::fabs(x);
    gemm_ref<double>(ta, tb, M, N, K, 1.0, Ad.data(), lda(), Bd.data(), ldb(), 0.0, S.data(), ldc());
    // Element-wise bound; the padding columns of C must be untouched.
    double worst = 0;
    int64_t bad = 0, wi = -1, pad_touched = 0;
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < ldc(); ++j) {
        const int64_t x = i * ldc() + j;
        if (j >= N) {
          pad_touched += !(C[x] == C0[x] || (std::isnan(C[x]) && std::isnan(C0[x])));
          continue;
        }
        const double c0 = beta == 0.0f ? 0.0 : double(C0[x]);
        const double bound = std::fabs(alpha) * gamma32(K) * S[x] +
                             std::ldexp(1.0, -22) * (std::fabs(Cref[x] - beta * c0) + std::fabs(beta * c0)) + 1e-30;
        const double err = std::fabs(double(C[x]) - Cref[x]);
        const double ratio = err == 0 ? 0 : err / bound;
        if (!(ratio <= 1)) ++bad;
        if (wi < 0 || !(ratio <= worst)) worst = ratio, wi = x;
      }
    std::ostringstream os;
    os << "n=" << M * N;
    if (wi >= 0)
      os << " worst " << worst << "x of bound at " << wi << " (got " << C[wi] << ", want " << Cref[wi] << ")";
    if (bad) os << " violations=" << bad;
    r.check(bad == 0, "C vs gemm_ref<double> (gamma_K bound)", os.str());
    r.check(pad_touched == 0, "padding columns of C untouched", std::to_string(pad_touched) + " changed");
  }

  // gemm_f32's documented arithmetic, element by element, in a naive loop: bitwise equality.
  void check_formula(Report& r, const std::vector<float>& A, const std::vector<float>& B, const std::vector<float>& C0,
                     const std::vector<float>& C) const {
    const bool fused = active_isa() != Isa::Scalar;
    int64_t bad = 0, first = -1;
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        float acc = 0.0f;
        for (int64_t k = 0; k < K; ++k) {
          const float a = ta == Trans::N ? A[i * lda() + k] : A[k * lda() + i];
          const float b = tb == Trans::N ? B[k * ldb() + j] : B[j * ldb() + k];
          if (fused) {
            acc = std::fma(a, b, acc);
          } else {
            const float p = a * b;
            acc = acc + p;
          }
        }
        const float c0 = C0[i * ldc() + j];
        const float want = K == 0 ? (beta == 0.0f ? 0.0f : beta * c0)
                                  : (beta == 0.0f ? alpha * acc : std::fma(beta, c0, alpha * acc));
        const float got = C[i * ldc() + j];
        if (std::memcmp(&got, &want, 4) != 0) {
          if (first < 0) first = i * ldc() + j;
          ++bad;
        }
      }
    r.check(bad == 0, std::string("bitwise the documented sum order (") + (fused ? "fused" : "unfused") + ")",
            bad ? std::to_string(bad) + " differ, first at " + std::to_string(first) : std::string());
  }

  // L = <G, op(A) op(B)>;  dop(A) = G op(B)^T [M,K], dop(B) = op(A)^T G [K,N], stored back in A's / B's layout.
  void grad(Report& r) override {
    if (M * N * K > 300000) {  // the reference backward does not depend on the size; keep grad mode fast
      r.check(true, "gradient: checked on the smaller cases of the family");
      return;
    }
    auto A = to_f64(randn(a_size(), 4)), B = to_f64(randn(b_size(), 5)), G = to_f64(randn(c_size(), 6));
    std::vector<double> C(c_size());
    auto loss = [&] {
      gemm_ref<double>(ta, tb, M, N, K, 1.0, A.data(), lda(), B.data(), ldb(), 0.0, C.data(), ldc());
      double s = 0;
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < N; ++j) s += G[i * ldc() + j] * C[i * ldc() + j];
      return s;
    };
    std::vector<double> dA(a_size(), 0.0), dB(b_size(), 0.0);
    // dA: ta = N -> dA[M,K] = G · op(B)^T;  ta = T -> dA[K,M] = op(B) · G^T.
    const Trans tbt = tb == Trans::N ? Trans::T : Trans::N;  // op(B)^T expressed on B's storage
    if (ta == Trans::N)
      gemm_ref<double>(Trans::N, tbt, M, K, N, 1.0, G.data(), ldc(), B.data(), ldb(), 0.0, dA.data(), lda());
    else
      gemm_ref<double>(tb, Trans::T, K, M, N, 1.0, B.data(), ldb(), G.data(), ldc(), 0.0, dA.data(), lda());
    // dB: tb = N -> dB[K,N] = op(A)^T · G;  tb = T -> dB[N,K] = G^T · op(A).
    const Trans tat = ta == Trans::N ? Trans::T : Trans::N;
    if (tb == Trans::N)
      gemm_ref<double>(tat, Trans::N, K, N, M, 1.0, A.data(), lda(), G.data(), ldc(), 0.0, dB.data(), ldb());
    else
      gemm_ref<double>(Trans::T, ta, N, K, M, 1.0, G.data(), ldc(), A.data(), lda(), 0.0, dB.data(), ldb());
    r.fd_check("dA", A.data(), int64_t(A.size()), dA.data(), loss, fd_eps, grad_tol);
    r.fd_check("dB", B.data(), int64_t(B.size()), dB.data(), loss, fd_eps, grad_tol);
  }

  void perf() override {
    if (pa.empty()) {
      pa = randn(a_size(), 7), pb = randn(b_size(), 8);
      pc.assign(c_size(), 0.0f);
      pab.resize(pa.size()), pbb.resize(pb.size());
      f32_to_bf16(pab.data(), pa.data(), int64_t(pa.size()));
      f32_to_bf16(pbb.data(), pb.data(), int64_t(pb.size()));
    }
    if (bf)
      gemm_bf16(ta, tb, M, N, K, alpha, pab.data(), lda(), pbb.data(), ldb(), beta, pc.data(), ldc());
    else
      run_f32(impl, ta, tb, M, N, K, alpha, pa.data(), lda(), pb.data(), ldb(), beta, pc.data(), ldc());
  }
  std::vector<float> pa, pb, pc;
  std::vector<bf16> pab, pbb;
};

// Bad leading dimensions and sizes throw, for both entry points.
struct GemmBadInput : OpCase {
  GemmBadInput() { name = "gemm/bad_input"; }
  void test(Report& r) override {
    std::vector<float> a(64 * 64), b(64 * 64), c(64 * 64);
    std::vector<bf16> ab(64 * 64), bb(64 * 64);
    const int64_t M = 5, N = 6, K = 7;
    for (Impl impl : {Impl::F32, Impl::F32Onednn, Impl::BF16}) {
      const bool bf = impl == Impl::BF16;
      auto call = [&](Trans ta, Trans tb, int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc) {
        if (bf)
          gemm_bf16(ta, tb, m, n, k, 1.0f, ab.data(), lda, bb.data(), ldb, 0.0f, c.data(), ldc);
        else
          run_f32(impl, ta, tb, m, n, k, 1.0f, a.data(), lda, b.data(), ldb, 0.0f, c.data(), ldc);
      };
      const std::string p = std::string(impl_name(impl)) + " ";
      r.expect_throw(p + "lda < K (A not transposed)", [&] { call(Trans::N, Trans::N, M, N, K, K - 1, N, N); });
      r.expect_throw(p + "lda < M (A transposed)", [&] { call(Trans::T, Trans::N, M, N, K, M - 1, N, N); });
      r.expect_throw(p + "ldb < N (B not transposed)", [&] { call(Trans::N, Trans::N, M, N, K, K, N - 1, N); });
      r.expect_throw(p + "ldb < K (B transposed)", [&] { call(Trans::N, Trans::T, M, N, K, K, K - 1, N); });
      r.expect_throw(p + "ldc < N", [&] { call(Trans::N, Trans::N, M, N, K, K, N, N - 1); });
      r.expect_throw(p + "negative M", [&] { call(Trans::N, Trans::N, -1, N, K, K, N, N); });
      r.expect_throw(p + "zero leading dimension", [&] { call(Trans::N, Trans::N, M, 0, 0, 0, 0, 0); });
      r.expect_throw(p + "null A", [&] {
        if (bf)
          gemm_bf16(Trans::N, Trans::N, M, N, K, 1.0f, nullptr, K, bb.data(), N, 0.0f, c.data(), N);
        else
          run_f32(impl, Trans::N, Trans::N, M, N, K, 1.0f, nullptr, K, b.data(), N, 0.0f, c.data(), N);
      });
    }
  }
  void grad(Report& r) override { r.check(true, "no gradient (input validation only)"); }
  void perf() override {}
};

// Batch invariance of gemm_f32: row i of C is bitwise the same whatever M is and whatever rows surround it
// (sub-ranges of the rows, M split three ways, single rows), whatever the thread count (1, 3, default), and
// column j whatever N is (sub-ranges of the columns). Leading dimensions are padded.
struct GemmInvariance : OpCase {
  Trans ta, tb;
  int64_t M, N, K;
  float alpha, beta;
  GemmInvariance(Trans ta_, Trans tb_, int64_t m, int64_t n, int64_t k, float al, float be)
      : ta(ta_), tb(tb_), M(m), N(n), K(k), alpha(al), beta(be) {
    std::ostringstream os;
    os << "gemm/f32_invariance_" << tname(ta) << tname(tb) << "_" << M << "x" << N << "x" << K << "_a" << alpha
       << "_b" << beta;
    name = os.str();
    flops = 2.0 * double(M) * double(N) * double(K);
  }
  int64_t lda() const { return (ta == Trans::N ? K : M) + 1; }
  int64_t ldb() const { return (tb == Trans::N ? N : K) + 2; }
  int64_t ldc() const { return N + 3; }

  void test(Report& r) override {
    const auto A = randn((ta == Trans::N ? M : K) * lda(), 41), B = randn((tb == Trans::N ? K : N) * ldb(), 42);
    const auto C0 = randn(M * ldc(), 43);
    // op(A) rows [i0, i0 + m) and op(B) columns [j0, j0 + n) into the same place of a fresh copy of C0.
    auto run = [&](std::vector<float>& C, int64_t i0, int64_t m, int64_t j0, int64_t n) {
      const float* a = ta == Trans::N ? A.data() + i0 * lda() : A.data() + i0;
      const float* b = tb == Trans::N ? B.data() + j0 : B.data() + j0 * ldb();
      gemm_f32(ta, tb, m, n, K, alpha, a, lda(), b, ldb(), beta, C.data() + i0 * ldc() + j0, ldc());
    };
    auto same = [&](const std::vector<float>& C, const std::vector<float>& ref, int64_t i0, int64_t m, int64_t j0,
                    int64_t n) {
      for (int64_t i = i0; i < i0 + m; ++i)
        if (std::memcmp(C.data() + i * ldc() + j0, ref.data() + i * ldc() + j0, size_t(n) * sizeof(float)) != 0)
          return false;
      return true;
    };
    std::vector<float> ref = C0;
    run(ref, 0, M, 0, N);
    bool ok = true;
    for (int64_t x = 0; x < M * ldc(); ++x) ok = ok && (x % ldc() >= N || std::isfinite(ref[x]));
    r.check(ok, "full product is finite");

    const int64_t h = M / 2, t1 = M / 3 + 1, t2 = (2 * M) / 3 + 2;
    std::vector<float> C = C0;
    run(C, 0, h, 0, N);
    r.check(same(C, ref, 0, h, 0, N), "rows [0, M/2) alone == the same rows of the full product");
    C = C0;
    run(C, h, M - h, 0, N);
    r.check(same(C, ref, h, M - h, 0, N), "rows [M/2, M) alone == the same rows of the full product");
    C = C0;
    run(C, 0, t1, 0, N), run(C, t1, t2 - t1, 0, N), run(C, t2, M - t2, 0, N);
    r.check(same(C, ref, 0, M, 0, N), "M split three ways (uneven) == the full product");
    C = C0;
    bool rows_ok = true;
    for (int64_t i : {int64_t(0), h, M - 1}) {
      run(C, i, 1, 0, N);
      rows_ok = rows_ok && same(C, ref, i, 1, 0, N);
    }
    r.check(rows_ok, "single rows (0, M/2, M-1) == the same rows of the full product");
    C = C0;
    const int64_t jh = N / 2 + 1;
    run(C, 0, M, 0, jh), run(C, 0, M, jh, N - jh);
    r.check(same(C, ref, 0, M, 0, N), "N split in two (uneven) == the full product");
    C = C0;
    run(C, 0, M, N - 1, 1);
    r.check(same(C, ref, 0, M, N - 1, 1), "last column alone == the same column of the full product");
    const int nt0 = omp_get_max_threads();
    bool threads_ok = true;
    for (int nt : {1, 3}) {
      omp_set_num_threads(nt);
      C = C0;
      run(C, 0, M, 0, N);
      threads_ok = threads_ok && same(C, ref, 0, M, 0, N);
      C = C0;
      run(C, h, M - h, 0, N);
      threads_ok = threads_ok && same(C, ref, h, M - h, 0, N);
    }
    omp_set_num_threads(nt0);
    r.check(threads_ok, "1 and 3 threads (full, and rows [M/2, M)) == " + std::to_string(nt0) + " threads");
  }
  void grad(Report& r) override { r.check(true, "no gradient (invariance only)"); }
  void perf() override {}
};

std::vector<std::unique_ptr<OpCase>> make_cases() {
  std::vector<std::unique_ptr<OpCase>> v;
  const Trans Ns = Trans::N, Ts = Trans::T;
  for (Impl impl : {Impl::F32, Impl::F32Onednn, Impl::BF16}) {
    auto add = [&](Trans ta, Trans tb, int64_t m, int64_t n, int64_t k, float al, float be, int64_t pad = 0) {
      v.push_back(std::make_unique<GemmCase>(impl, ta, tb, m, n, k, al, be, pad));
    };
    for (Trans ta : {Ns, Ts})
      for (Trans tb : {Ns, Ts}) {
        add(ta, tb, 7, 33, 130, 1.0f, 0.0f);
        add(ta, tb, 33, 7, 1, 0.5f, 1.0f, 3);
        add(ta, tb, 130, 65, 33, -1.25f, -0.75f);
        if (impl != Impl::F32) continue;
        // Odd sizes around the 6-row / 16- and 64-column blocks; several K blocks, column blocks and K phases
        // (1100 columns > one 1024-column block; K = 700: three K blocks, each a phase, beta != 0 scratch).
        add(ta, tb, 63, 65, 130, 1.0f, 0.5f, 2);
        add(ta, tb, 65, 130, 63, -1.5f, 0.0f);
        add(ta, tb, 130, 7, 65, 1.0f, 1.0f, 1);
        add(ta, tb, 1, 63, 7, 0.5f, 0.0f);
        add(ta, tb, 200, 130, 65, 1.0f, 0.0f);
        add(ta, tb, 40, 1100, 700, 0.75f, -0.5f, 1);
      }
    add(Ns, Ns, 1, 1, 1, 1.0f, 0.0f);
    add(Ns, Ns, 1, 130, 7, 2.0f, 0.5f, 5);
    if (impl == Impl::F32) add(Ts, Ns, 4100, 7, 5, 1.0f, 0.5f);  // op(A) = A^T: two row chunks of gemm_f32
    add(Ts, Ns, 64, 48, 300, 1.0f, 1.0f);  // wgrad-like: A^T B, +=
    // Empty problems: M = 0 and N = 0 do nothing; K = 0 gives C = beta * C.
    add(Ns, Ns, 0, 5, 7, 1.0f, 0.0f);
    add(Ns, Ns, 5, 0, 7, 1.0f, 0.0f);
    add(Ns, Ns, 5, 6, 0, 1.0f, 0.0f);
    add(Ns, Ts, 5, 6, 0, 1.0f, 0.5f, 2);
  }
  for (Trans ta : {Ns, Ts})
    for (Trans tb : {Ns, Ts}) v.push_back(std::make_unique<GemmInvariance>(ta, tb, 130, 200, 700, 0.75f, -0.5f));
  v.push_back(std::make_unique<GemmInvariance>(Ns, Ns, 300, 1100, 300, 1.0f, 0.0f));
  v.push_back(std::make_unique<GemmInvariance>(Ts, Ns, 65, 63, 7, -2.0f, 1.0f));
  v.push_back(std::make_unique<GemmInvariance>(Ns, Ts, 7, 1, 65, 1.0f, 0.0f));
  v.push_back(std::make_unique<GemmInvariance>(Ts, Ts, 4103, 9, 33, 1.0f, 0.0f));  // two row chunks
  v.push_back(std::make_unique<GemmBadInput>());
  return v;
}

}  // namespace
}  // namespace moetron::ops

MT_REGISTER_OP_CASES(moetron::ops::make_cases);
