// harness.cpp: the op harness registry, comparison and finite-difference helpers, and main().
//   op_harness --mode test|grad|perf [--device cpu|cuda] [--family F] [--case SUBSTR] [--seed N] [--require-cases]
//              [--list]
// Ends with "N passed, N failed" and exits 1 on any failure, 2 on bad usage, kExitNoDevice (4) when --device cuda
// finds no usable GPU (or the build has no CUDA backend).
#include "harness.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "moetron/check.h"
#include "moetron/cuda/runtime.h"
#include "moetron/rng.h"
#include "moetron/runtime.h"

namespace moetron::ops {

static std::vector<CaseFactory>& factories() {
  static std::vector<CaseFactory> f;
  return f;
}
int register_cases(CaseFactory f) {
  factories().push_back(std::move(f));
  return 0;
}
std::vector<std::unique_ptr<OpCase>> all_cases() {
  std::vector<std::unique_ptr<OpCase>> out;
  for (auto& f : factories())
    for (auto& c : f()) out.push_back(std::move(c));
  std::sort(out.begin(), out.end(), [](auto& a, auto& b) { return a->name < b->name; });
  return out;
}

void Report::record(bool ok, std::string line) {
  ++checks_;
  if (!ok) ++failures_;
  lines_.push_back((ok ? "    ok   " : "    FAIL ") + line);
}

template <class T>
static void compare_impl(Report& r, std::string_view what, const T* got, const T* want, int64_t n, double atol,
                         double rtol, const std::function<void(bool, std::string)>& rec) {
  double worst = 0, worst_abs = 0;
  int64_t worst_i = -1, bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    double g = double(got[i]), w = double(want[i]);
    double err = std::fabs(g - w);
    double lim = atol + rtol * std::fabs(w);
    double ratio = std::isnan(g) != std::isnan(w) || std::isinf(g) != std::isinf(w) ? INFINITY
                   : (std::isnan(g) && std::isnan(w)) || g == w                    ? 0.0
                                                                                   : err / lim;
    if (ratio > 1.0) ++bad;
    if (ratio > worst || worst_i < 0) {
      worst = ratio;
      worst_i = i;
      worst_abs = err;
    }
  }
  std::ostringstream os;
  os << what << ": n=" << n << " atol=" << atol << " rtol=" << rtol;
  if (worst_i >= 0)
    os << " worst |err|=" << worst_abs << " at " << worst_i << " (got " << double(got[worst_i]) << ", want "
       << double(want[worst_i]) << ", " << worst << "x of limit)";
  if (bad) os << " violations=" << bad;
  rec(bad == 0, os.str());
}

void Report::compare(std::string_view what, const float* got, const float* want, int64_t n, double atol,
                     double rtol) {
  compare_impl(*this, what, got, want, n, atol, rtol, [this](bool ok, std::string s) { record(ok, std::move(s)); });
}
void Report::compare(std::string_view what, const double* got, const double* want, int64_t n, double atol,
                     double rtol) {
  compare_impl(*this, what, got, want, n, atol, rtol, [this](bool ok, std::string s) { record(ok, std::move(s)); });
}
void Report::compare(std::string_view what, const int32_t* got, const int32_t* want, int64_t n) {
  int64_t bad = 0, first = -1;
  for (int64_t i = 0; i < n; ++i)
    if (got[i] != want[i]) {
      if (first < 0) first = i;
      ++bad;
    }
  std::ostringstream os;
  os << what << ": n=" << n << " exact";
  if (bad) os << " mismatches=" << bad << " first at " << first << " (got " << got[first] << ", want " << want[first] << ")";
  record(bad == 0, os.str());
}

void Report::compare_rel(std::string_view what, const float* got, const double* want, int64_t n, double tol) {
  double num = 0, den = 0, worst = 0;
  int64_t bad = 0, worst_i = -1;
  for (int64_t i = 0; i < n; ++i) {
    const double g = double(got[i]), w = want[i];
    if (std::isfinite(w) && !std::isfinite(g)) {
      if (bad++ == 0) worst_i = i;
      continue;
    }
    const double d = std::isfinite(w) ? g - w : 0.0;
    num += d * d;
    den += w * w;
    if (!bad && std::fabs(d) >= worst) worst = std::fabs(d), worst_i = i;
  }
  const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  std::ostringstream os;
  os << what << ": n=" << n << " rel=" << rel << " tol=" << tol;
  if (bad) os << " non-finite=" << bad << " first at " << worst_i << " (got " << double(got[worst_i]) << ")";
  else if (worst_i >= 0) os << " worst |err|=" << worst << " at " << worst_i;
  record(bad == 0 && rel <= tol && n >= 0, os.str());
}

static uint64_t g_run_seed = 0;
uint64_t run_seed() { return g_run_seed; }

void Report::check(bool ok, std::string_view what, const std::string& detail) {
  record(ok, std::string(what) + (detail.empty() ? "" : ": " + detail));
}

void Report::fd_check(std::string_view what, double* x, int64_t n, const double* dx,
                      const std::function<double()>& loss, double eps, double tol, int max_checks,
                      const std::function<bool(int64_t)>& skip) {
  if (n == 0) {
    record(true, std::string(what) + ": empty");
    return;
  }
  double gmax = 0;
  int64_t imax = 0;
  for (int64_t i = 0; i < n; ++i)
    if (std::fabs(dx[i]) > gmax) gmax = std::fabs(dx[i]), imax = i;
  std::vector<int64_t> idx;
  if (n <= max_checks) {
    for (int64_t i = 0; i < n; ++i) idx.push_back(i);
  } else {
    idx.push_back(imax);
    uint64_t key = rng_key(12345, what);
    for (int k = 1; k < max_checks; ++k) idx.push_back(int64_t(philox4x32(key, uint64_t(k))[0] % uint64_t(n)));
  }
  double worst = 0, worst_num = 0, worst_ana = 0;
  int64_t worst_i = -1, bad = 0, checked = 0;
  for (int64_t i : idx) {
    if (skip && skip(i)) continue;
    double x0 = x[i];
    x[i] = x0 + eps;
    double lp = loss();
    x[i] = x0 - eps;
    double lm = loss();
    x[i] = x0;
    double num = (lp - lm) / (2 * eps);
    double ana = dx[i];
    double lim = tol * std::max(std::fabs(num), std::fabs(ana)) + tol * 1e-2 * gmax;
    double err = std::fabs(num - ana);
    double ratio = lim > 0 ? err / lim : (err > 0 ? INFINITY : 0);
    if (!(ratio <= 1.0)) ++bad;
    if (worst_i < 0 || ratio > worst) worst = ratio, worst_i = i, worst_num = num, worst_ana = ana;
    ++checked;
  }
  std::ostringstream os;
  os << what << ": fd eps=" << eps << " tol=" << tol << " checked=" << checked << "/" << n;
  if (worst_i >= 0)
    os << " worst at " << worst_i << " (numeric " << worst_num << ", analytic " << worst_ana << ", " << worst
       << "x of limit)";
  if (bad) os << " violations=" << bad;
  record(bad == 0 && checked > 0, os.str());
}

std::vector<float> randn(int64_t n, uint64_t seed, float scale) {
  std::vector<float> v(static_cast<size_t>(n));
  fill_normal(v.data(), n, rng_key(seed, "ops"), 0, 0.0f, scale);
  return v;
}
std::vector<float> randu(int64_t n, uint64_t seed, float lo, float hi) {
  std::vector<float> v(static_cast<size_t>(n));
  fill_uniform(v.data(), n, rng_key(seed, "ops.u"), 0, lo, hi);
  return v;
}
std::vector<double> to_f64(const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); }
std::vector<float> to_f32(const std::vector<double>& v) {
  std::vector<float> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = float(v[i]);
  return o;
}
void with_threads(int n, const std::function<void()>& f) {
  int old = omp_get_max_threads();
  omp_set_num_threads(n);
  f();
  omp_set_num_threads(old);
}

double dot(const double* a, const double* b, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace moetron::ops

using namespace moetron::ops;

int main(int argc, char** argv) {
  std::string mode = "test", family, substr, device = "cpu";
  bool seed_given = false;
  bool require = false, list = false, verbose = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "op_harness: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--mode") mode = next();
    else if (a == "--family") family = next();
    else if (a == "--device") device = next();
    else if (a == "--seed") g_run_seed = std::stoull(next()), seed_given = true;
    else if (a == "--case") substr = next();
    else if (a == "--require-cases") require = true;
    else if (a == "--list") list = true;
    else if (a == "-v" || a == "--verbose") verbose = true;
    else if (a == "--help" || a == "-h") {
      std::printf("usage: op_harness [--mode test|grad|perf] [--device cpu|cuda] [--family F] [--case SUBSTR] [--seed N] "
                  "[--require-cases] [--list] [-v]\n");
      return 0;
    } else {
      std::fprintf(stderr, "op_harness: unknown argument '%s'\n", a.c_str());
      return 2;
    }
  }
  if (mode != "test" && mode != "grad" && mode != "perf") {
    std::fprintf(stderr, "op_harness: unknown mode '%s' (test, grad or perf)\n", mode.c_str());
    return 2;
  }
  if (device != "cpu" && device != "cuda") {
    std::fprintf(stderr, "op_harness: unknown device '%s' (cpu or cuda)\n", device.c_str());
    return 2;
  }
  moetron::init_threads();
  std::printf("op_harness mode=%s %s\n", mode.c_str(), moetron::runtime_summary().c_str());
  if (device == "cuda" && !list) {  // --list names the CUDA cases without a GPU
    std::string why;
    if (moetron::cuda::device_count(&why) == 0) {
      std::printf("op_harness: --device cuda: %s\n", why.c_str());
      return kExitNoDevice;
    }
    if (!seed_given) g_run_seed = std::chrono::steady_clock::now().time_since_epoch().count() ^ 0x9e3779b97f4a7c15ull;
    std::printf("op_harness device=cuda seed=%llu (fresh inputs; --seed repeats them)\n",
                static_cast<unsigned long long>(g_run_seed));
#ifdef MOETRON_WITH_CUDA
    moetron::cuda::select_device(0);
    std::printf("op_harness %s\n", moetron::cuda::describe(moetron::cuda::device_info(0)).c_str());
#endif
  }
  int passed = 0, failed = 0;
  for (auto& c : all_cases()) {
    if (c->device != device) continue;
    if (!family.empty() && c->family() != family) continue;
    if (!substr.empty() && c->name.find(substr) == std::string::npos) continue;
    if (list) {
      std::printf("%s\n", c->name.c_str());
      continue;
    }
    Report r;
    bool ok = true;
    std::string err;
    try {
      if (mode == "test") c->test(r);
      else if (mode == "grad") c->grad(r);
      else {
        c->perf();  // warm-up
        std::vector<double> ts;
        auto t_end = std::chrono::steady_clock::now() + std::chrono::milliseconds(400);
        do {
          auto t0 = std::chrono::steady_clock::now();
          c->perf();
          ts.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        } while (std::chrono::steady_clock::now() < t_end || ts.size() < 3);
        std::sort(ts.begin(), ts.end());
        double t = ts[ts.size() / 2];
        std::printf("PERF %-44s %10.3f ms", c->name.c_str(), t * 1e3);
        if (c->flops > 0) std::printf("  %8.1f GFLOPS", c->flops / t * 1e-9);
        if (c->bytes > 0) std::printf("  %8.2f GB/s", c->bytes / t * 1e-9);
        std::printf("\n");
        ++passed;
        continue;
      }
      ok = r.ok() && r.checks() > 0;
      if (r.checks() == 0) err = "case made no checks";
    } catch (const std::exception& e) {
      ok = false;
      err = e.what();
    }
    std::printf("%s %s (%d checks)\n", ok ? "PASS" : "FAIL", c->name.c_str(), r.checks());
    if (!ok || verbose)
      for (auto& l : r.lines()) std::printf("%s\n", l.c_str());
    if (!err.empty()) std::printf("    error: %s\n", err.c_str());
    (ok ? passed : failed)++;
  }
  if (list) return 0;
  if (require && passed + failed == 0) {
    std::printf("no cases matched family='%s' case='%s'\n", family.c_str(), substr.c_str());
    failed = 1;
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
