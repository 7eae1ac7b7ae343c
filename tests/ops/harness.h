// harness.h: the op harness. One registry of op cases; each case states its tolerances, its
// finite-difference step and its FLOPs or bytes, and implements three modes:
//   test  optimized kernel vs its naive *_ref twin (forward and backward), within (atol, rtol);
//   grad  the reference backward (instantiated in fp64) vs central finite differences;
//   perf  one call of the optimized kernel, timed by the harness (GFLOPS or GB/s).
// --device cuda runs the CUDA backend's cases instead (tests/ops/cuda/, built with -DMOETRON_CUDA=ON): the same
// three modes against the same twins, with fresh random inputs (a new seed per run, printed; --seed repeats one)
// and outputs poisoned with NaN before every call. Without a usable GPU it says why and exits kExitNoDevice.
// A new op brings a new case in tests/ops/<family>_cases.cpp. Not a benchmark suite: the
// side-by-side ratios against the machine's limits live in bench/.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "moetron/check.h"

namespace moetron::ops {

class Report {
 public:
  // Passes when every |got - want| <= atol + rtol * |want|. Records the worst element.
  void compare(std::string_view what, const float* got, const float* want, int64_t n, double atol, double rtol);
  void compare(std::string_view what, const double* got, const double* want, int64_t n, double atol, double rtol);
  void compare(std::string_view what, const int32_t* got, const int32_t* want, int64_t n);
  // Normwise: passes when every got[i] is finite where want[i] is (a NaN never passes) and
  // ||got - want||_2 <= tol * ||want||_2 (want == 0 everywhere: ||got||_2 <= tol). The CUDA cases' comparison.
  void compare_rel(std::string_view what, const float* got, const double* want, int64_t n, double tol);
  void check(bool ok, std::string_view what, const std::string& detail = {});
  // Passes when f() throws moetron::Error; the message is recorded with the check.
  template <class F>
  void expect_throw(std::string_view what, F&& f) {
    bool threw = false;
    std::string msg;
    try {
      f();
    } catch (const Error& e) {
      threw = true;
      msg = e.what();
    }
    check(threw, std::string("throws: ") + std::string(what), msg);
  }
  // Central finite differences of loss() with respect to x[i] for up to max_checks coordinates
  // (chosen deterministically, always including the largest |dx|), against analytic dx.
  // Passes when |num - ana| <= tol * max(|num|, |ana|) + tol * 1e-2 * max_i |dx_i|.
  // `skip(i)` may veto a coordinate (e.g. a top-k tie or a kink within eps).
  void fd_check(std::string_view what, double* x, int64_t n, const double* dx, const std::function<double()>& loss,
                double eps, double tol, int max_checks = 48, const std::function<bool(int64_t)>& skip = {});

  bool ok() const { return failures_ == 0; }
  int failures() const { return failures_; }
  int checks() const { return checks_; }
  const std::vector<std::string>& lines() const { return lines_; }

 private:
  void record(bool ok, std::string line);
  int failures_ = 0, checks_ = 0;
  std::vector<std::string> lines_;
};

struct OpCase {
  std::string name;        // "family/variant"
  double fd_eps = 1e-6;    // finite-difference step used in grad mode
  double grad_tol = 1e-5;  // relative tolerance for grad mode
  bool smooth = true;      // false: the op has kinks (top-k, clipping); grad mode avoids them
  double flops = 0;        // per perf() call (0 if the op is bandwidth-bound)
  double bytes = 0;        // bytes moved per perf() call
  std::string device = "cpu";  // "cuda": a case of the CUDA backend (op_harness --device cuda)
  // Test-mode tolerances are passed to Report::compare by each case and printed with it.

  virtual ~OpCase() = default;
  virtual void test(Report& r) = 0;
  virtual void grad(Report& r) = 0;
  virtual void perf() = 0;
  std::string family() const { return name.substr(0, name.find('/')); }
};

using CaseFactory = std::function<std::vector<std::unique_ptr<OpCase>>()>;
int register_cases(CaseFactory f);
std::vector<std::unique_ptr<OpCase>> all_cases();

// Exit code of `op_harness --device cuda` when no GPU can be used (no backend in the build, no driver, no device).
inline constexpr int kExitNoDevice = 4;
// The seed of this run's random inputs for the CUDA cases (fresh per run unless --seed is given).
uint64_t run_seed();

// Deterministic test data.
std::vector<float> randn(int64_t n, uint64_t seed, float scale = 1.0f);
std::vector<float> randu(int64_t n, uint64_t seed, float lo, float hi);
std::vector<double> to_f64(const std::vector<float>& v);
std::vector<float> to_f32(const std::vector<double>& v);
double dot(const double* a, const double* b, int64_t n);

// Runs f with the OpenMP thread count set to n, then restores the previous count (thread-independence
// checks).
void with_threads(int n, const std::function<void()>& f);

}  // namespace moetron::ops

#define MT_OPS_CAT2(a, b) a##b
#define MT_OPS_CAT(a, b) MT_OPS_CAT2(a, b)
// MT_REGISTER_OP_CASES(factory): factory returns std::vector<std::unique_ptr<OpCase>>.
#define MT_REGISTER_OP_CASES(factory) \
  static int MT_OPS_CAT(mt_op_cases_, __LINE__) = ::moetron::ops::register_cases(factory)
