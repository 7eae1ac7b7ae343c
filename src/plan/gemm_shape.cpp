// gemm_shape.cpp: GemmShapeTable (plan/hardware.h), a measured GEMM efficiency by (m, n, k) on a full grid: its
// construction from [m, n, k, eff] points and its trilinear log-space interpolation. Not the TOML reading
// (hardware.cpp) and not the catalog's tables (gemm_shape_tables.cpp).
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "moetron/check.h"
#include "moetron/plan/hardware.h"

namespace moetron::plan {

namespace {

// The cell of ascending axis `a` holding x and x's weight towards its upper end, log-linear; x above the axis is
// clamped to its last value; below its first it is clamped there too (the caller scales for that).
struct Cell {
  size_t lo = 0, hi = 0;
  double w = 0;
};
Cell cell(const std::vector<double>& a, double x) {
  if (a.size() == 1 || !(x > a.front())) return {0, 0, 0};
  if (x >= a.back()) return {a.size() - 1, a.size() - 1, 0};
  size_t i = 1;
  while (a[i] < x) ++i;
  return {i - 1, i, (std::log(x) - std::log(a[i - 1])) / (std::log(a[i]) - std::log(a[i - 1]))};
}

[[noreturn]] void fail(const std::string& key, const std::string& what) { throw Error(key + ": " + what); }

std::string fmt(double v) {
  std::string s = std::to_string(v);
  s.erase(s.find_last_not_of('0') + 1);
  if (!s.empty() && s.back() == '.') s.pop_back();
  return s;
}

}  // namespace

double GemmShapeTable::at(double mm, double nn, double kk) const {
  if (empty()) return 1.0;
  const Cell cm = cell(m, mm), cn = cell(n, nn), ck = cell(k, kk);
  auto e = [&](size_t i, size_t j, size_t l) { return eff[(i * n.size() + j) * k.size() + l]; };
  double v = 0;
  for (int a = 0; a < 2; ++a)
    for (int b = 0; b < 2; ++b)
      for (int c = 0; c < 2; ++c) {
        const double w = (a ? cm.w : 1 - cm.w) * (b ? cn.w : 1 - cn.w) * (c ? ck.w : 1 - ck.w);
        if (w > 0) v += w * e(a ? cm.hi : cm.lo, b ? cn.hi : cn.lo, c ? ck.hi : ck.lo);
      }
  // Below an axis's first value the GEMM takes the time of the smallest measured one (its tiles are no fewer).
  for (const auto& [x, axis] : {std::pair{mm, &m}, std::pair{nn, &n}, std::pair{kk, &k}})
    if (x < axis->front()) v *= std::max(x, 0.0) / axis->front();
  return v;
}

GemmShapeTable GemmShapeTable::from_points(const std::vector<std::vector<double>>& pts, const std::string& key) {
  GemmShapeTable t;
  for (const auto& p : pts) {
    if (p.size() != 4) fail(key, "each point is [m, n, k, eff], got " + std::to_string(p.size()) + " numbers");
    for (int d = 0; d < 3; ++d)
      if (!(p[d] > 0 && std::isfinite(p[d])))
        fail(key, "[" + fmt(p[0]) + ", " + fmt(p[1]) + ", " + fmt(p[2]) + "]: every dimension must be > 0");
    t.m.push_back(p[0]), t.n.push_back(p[1]), t.k.push_back(p[2]);
  }
  for (auto* a : {&t.m, &t.n, &t.k}) {
    std::sort(a->begin(), a->end());
    a->erase(std::unique(a->begin(), a->end()), a->end());
  }
  const size_t cells = t.m.size() * t.n.size() * t.k.size();
  if (pts.size() != cells)
    fail(key, std::to_string(pts.size()) + " points do not fill the grid of " + std::to_string(t.m.size()) + " m x " +
                  std::to_string(t.n.size()) + " n x " + std::to_string(t.k.size()) + " k values (" +
                  std::to_string(cells) + " points, each once)");
  t.eff.assign(cells, -1.0);
  auto index = [](const std::vector<double>& a, double x) {
    return size_t(std::lower_bound(a.begin(), a.end(), x) - a.begin());
  };
  for (const auto& p : pts) {
    double& slot = t.eff[(index(t.m, p[0]) * t.n.size() + index(t.n, p[1])) * t.k.size() + index(t.k, p[2])];
    if (slot >= 0) fail(key, "the point [" + fmt(p[0]) + ", " + fmt(p[1]) + ", " + fmt(p[2]) + "] is given twice");
    slot = p[3];
  }
  return t;
}

}  // namespace moetron::plan
