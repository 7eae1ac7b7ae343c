// pipeline_toy.h: the toy model of the pipeline runtime tests (tests/unit/test_pipeline_runtime.cpp and
// tests/mpi/test_mpi_pipeline.cpp): a chain of S fp32 stages, stage s computing y = tanh(x W_s^T + b_s) on R
// rows, with a squared-error loss per micro-batch after the last stage; stage 0 makes its own input from the
// micro-batch id. ToyStage implements PipelineStage (full B and split I / W), checks every call the runtime
// makes (slot free / holding that micro-batch, null pointers exactly at the ends), and accumulates weight
// gradients either as they come (Direct) or per micro-batch, summed in micro-batch order at the end of the
// step (PerMicrobatch). sequential_reference() runs the same stages one micro-batch at a time, F through all
// stages then B back, accumulating in micro-batch order: the single-process oracle the pipeline must equal
// bit for bit. toy_loss_f64() is an independent float64 twin of the forward for finite differences.
// Not a model of anything real.
#pragma once
#include <cmath>
#include <cstdint>
#include <vector>

#include "moetron/check.h"
#include "comm/pipeline_runtime.h"

namespace pp_toy {

using namespace moetron;

inline float unit(uint64_t a, uint64_t b, uint64_t c) {  // deterministic value in [-1, 1)
  uint64_t z = a * 0x9e3779b97f4a7c15ull ^ (b + 0x632be59bd9b4e019ull) * 0xbf58476d1ce4e5b9ull ^ (c + 1) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  z *= 0xd6e8feb86659fd93ull;
  z ^= z >> 32;
  return float(double(z >> 40) / double(uint64_t(1) << 24) * 2.0 - 1.0);
}

struct Dims {
  int S = 1;
  int rows = 3;
  std::vector<int> width;  // [S + 1]: width[0] the data, width[S] the target
  int64_t in(int s) const { return s == 0 ? 0 : int64_t(rows) * width[size_t(s)]; }
  int64_t out(int s) const { return s == S - 1 ? 0 : int64_t(rows) * width[size_t(s + 1)]; }
};
inline Dims make_dims(int S, int rows = 3, int base = 4) {
  Dims d;
  d.S = S;
  d.rows = rows;
  for (int i = 0; i <= S; ++i) d.width.push_back(base + (i * 3) % 5);
  return d;
}

inline float weight(int s, int o, int i, int win) { return unit(3 + uint64_t(s), uint64_t(o), uint64_t(i)) * 1.5f / std::sqrt(float(win)); }
inline float bias(int s, int o) { return 0.1f * unit(100 + uint64_t(s), uint64_t(o), 7); }
inline float data(int mb, int64_t j) { return unit(1, uint64_t(mb), uint64_t(j)); }
inline float target(int mb, int64_t j) { return 0.5f * unit(2, uint64_t(mb), uint64_t(j)); }

class ToyStage final : public pipeline::PipelineStage {
 public:
  enum class Accum { Direct, PerMicrobatch };
  ToyStage(const Dims& d, int stage, Accum acc = Accum::Direct) : d_(d), s_(stage), acc_(acc) {
    win_ = d.width[size_t(stage)];
    wout_ = d.width[size_t(stage + 1)];
    w_.resize(size_t(wout_) * size_t(win_));
    b_.resize(size_t(wout_));
    for (int o = 0; o < wout_; ++o) {
      b_[size_t(o)] = bias(s_, o);
      for (int i = 0; i < win_; ++i) w_[size_t(o * win_ + i)] = weight(s_, o, i, win_);
    }
  }
  // Test knobs: a wrong in_size, or no split backward.
  int64_t in_size_override = -1;
  bool split_supported = true;

  int64_t in_size() const override { return in_size_override >= 0 ? in_size_override : d_.in(s_); }
  int64_t out_size() const override { return d_.out(s_); }
  bool supports_split_backward() const override { return split_supported; }

  void setup(const pipeline::StageSetup& st) override {
    MT_CHECK(st.stage == s_, "toy", "setup for stage ", st.stage, " given to stage ", s_);
    setup_ = st;
    const size_t R = size_t(d_.rows);
    x_.assign(size_t(st.slots), std::vector<float>(R * size_t(win_)));
    y_.assign(size_t(st.slots), std::vector<float>(R * size_t(wout_)));
    dz_.assign(size_t(st.slots), std::vector<float>(R * size_t(wout_)));
    slot_mb_.assign(size_t(st.slots), -1);
    has_dz_.assign(size_t(st.slots), 0);
    loss_.assign(size_t(st.n_microbatches), NAN);
    parts_.assign(acc_ == Accum::PerMicrobatch ? size_t(st.n_microbatches) : 0, {});
    grads_done_.assign(size_t(st.n_microbatches), 0);
    zero_grads();
  }

  void forward(int mb, int slot, const float* in, float* out) override {
    check_slot(slot, -1, mb, "forward");
    MT_CHECK((in == nullptr) == (s_ == 0), "toy", "stage ", s_, " forward mb ", mb, ": in is ", in ? "set" : "null");
    MT_CHECK((out == nullptr) == (s_ == d_.S - 1), "toy", "stage ", s_, " forward mb ", mb, ": out is ",
             out ? "set" : "null");
    auto& x = x_[size_t(slot)];
    auto& y = y_[size_t(slot)];
    for (size_t j = 0; j < x.size(); ++j) x[j] = in ? in[j] : data(mb, int64_t(j));
    for (int r = 0; r < d_.rows; ++r)
      for (int o = 0; o < wout_; ++o) {
        float acc = b_[size_t(o)];
        for (int i = 0; i < win_; ++i) acc += x[size_t(r * win_ + i)] * w_[size_t(o * win_ + i)];
        y[size_t(r * wout_ + o)] = std::tanh(acc);
      }
    if (out)
      for (size_t j = 0; j < y.size(); ++j) out[j] = y[j];
    else {
      float l = 0;
      for (size_t j = 0; j < y.size(); ++j) {
        const float e = y[j] - target(mb, int64_t(j));
        l += 0.5f * e * e;
      }
      loss_[size_t(mb)] = l;
    }
    slot_mb_[size_t(slot)] = mb;
    has_dz_[size_t(slot)] = 0;
  }

  void backward_input(int mb, int slot, const float* dout, float* din) override {
    check_slot(slot, mb, mb, "backward_input");
    MT_CHECK(!has_dz_[size_t(slot)], "toy", "stage ", s_, " mb ", mb, ": second input-gradient pass");
    MT_CHECK((dout == nullptr) == (s_ == d_.S - 1), "toy", "stage ", s_, " backward mb ", mb, ": dout is ",
             dout ? "set" : "null");
    MT_CHECK((din == nullptr) == (s_ == 0), "toy", "stage ", s_, " backward mb ", mb, ": din is ", din ? "set" : "null");
    const auto& y = y_[size_t(slot)];
    auto& dz = dz_[size_t(slot)];
    for (size_t j = 0; j < y.size(); ++j) {
      const float dy = dout ? dout[j] : y[j] - target(mb, int64_t(j));
      dz[j] = dy * (1.0f - y[j] * y[j]);
    }
    if (din)
      for (int r = 0; r < d_.rows; ++r)
        for (int i = 0; i < win_; ++i) {
          float acc = 0;
          for (int o = 0; o < wout_; ++o) acc += dz[size_t(r * wout_ + o)] * w_[size_t(o * win_ + i)];
          din[size_t(r * win_ + i)] = acc;
        }
    has_dz_[size_t(slot)] = 1;
  }

  void backward_weight(int mb, int slot) override {
    check_slot(slot, mb, mb, "backward_weight");
    MT_CHECK(has_dz_[size_t(slot)], "toy", "stage ", s_, " mb ", mb, ": W before I");
    MT_CHECK(!grads_done_[size_t(mb)], "toy", "stage ", s_, " mb ", mb, ": weight gradient twice");
    const auto& x = x_[size_t(slot)];
    const auto& dz = dz_[size_t(slot)];
    std::vector<float> c(w_.size() + b_.size());
    for (int o = 0; o < wout_; ++o) {
      for (int i = 0; i < win_; ++i) {
        float acc = 0;
        for (int r = 0; r < d_.rows; ++r) acc += dz[size_t(r * wout_ + o)] * x[size_t(r * win_ + i)];
        c[size_t(o * win_ + i)] = acc;
      }
      float acc = 0;
      for (int r = 0; r < d_.rows; ++r) acc += dz[size_t(r * wout_ + o)];
      c[w_.size() + size_t(o)] = acc;
    }
    if (acc_ == Accum::Direct)
      for (size_t j = 0; j < c.size(); ++j) g_[j] += c[j];
    else
      parts_[size_t(mb)] = std::move(c);
    grads_done_[size_t(mb)] = 1;
    slot_mb_[size_t(slot)] = -1;
  }

  void backward(int mb, int slot, const float* dout, float* din) override {
    backward_input(mb, slot, dout, din);
    backward_weight(mb, slot);
  }

  // End of step: every micro-batch has its weight gradient; per-micro-batch parts summed in mb order.
  void finish_step() {
    for (size_t m = 0; m < grads_done_.size(); ++m)
      MT_CHECK(grads_done_[m], "toy", "stage ", s_, ": no weight gradient for mb ", m);
    for (int v : slot_mb_) MT_CHECK(v == -1, "toy", "stage ", s_, ": a slot still holds mb ", v);
    if (acc_ == Accum::PerMicrobatch)
      for (const auto& p : parts_)
        for (size_t j = 0; j < p.size(); ++j) g_[j] += p[j];
  }
  void zero_grads() {
    g_.assign(w_.size() + b_.size(), 0.0f);
    for (auto& p : parts_) p.clear();
    std::fill(grads_done_.begin(), grads_done_.end(), 0);
  }

  const std::vector<float>& grads() const { return g_; }  // [dW (wout x win), db (wout)]
  const std::vector<float>& losses() const { return loss_; }
  const pipeline::StageSetup& setup_info() const { return setup_; }
  int stage() const { return s_; }

 private:
  void check_slot(int slot, int holds, int mb, const char* what) const {
    MT_CHECK(slot >= 0 && slot < int(slot_mb_.size()), "toy", "stage ", s_, " ", what, " mb ", mb, ": slot ", slot,
             " outside [0, ", slot_mb_.size(), ")");
    MT_CHECK(slot_mb_[size_t(slot)] == holds, "toy", "stage ", s_, " ", what, " mb ", mb, ": slot ", slot,
             " holds mb ", slot_mb_[size_t(slot)], ", expected ", holds);
  }
  Dims d_;
  int s_ = 0, win_ = 0, wout_ = 0;
  Accum acc_;
  pipeline::StageSetup setup_;
  std::vector<float> w_, b_, g_;
  std::vector<std::vector<float>> x_, y_, dz_, parts_;
  std::vector<int> slot_mb_;
  std::vector<char> has_dz_, grads_done_;
  std::vector<float> loss_;
};

struct Result {
  std::vector<float> losses;               // [M]
  std::vector<std::vector<float>> grads;  // [S][...]
};

// The single-process oracle: micro-batch by micro-batch, F through every stage, then B back.
inline Result sequential_reference(const Dims& d, int M) {
  std::vector<ToyStage> st;
  for (int s = 0; s < d.S; ++s) st.emplace_back(d, s);
  for (int s = 0; s < d.S; ++s) {
    pipeline::StageSetup su;
    su.stage = s;
    su.n_stages = d.S;
    su.n_microbatches = M;
    su.slots = 1;
    st[size_t(s)].setup(su);
  }
  std::vector<std::vector<float>> act(size_t(d.S)), grad(size_t(d.S));
  for (int s = 0; s < d.S; ++s) {
    act[size_t(s)].resize(size_t(d.out(s)));
    grad[size_t(s)].resize(size_t(d.out(s)));
  }
  for (int mb = 0; mb < M; ++mb) {
    for (int s = 0; s < d.S; ++s)
      st[size_t(s)].forward(mb, 0, s ? act[size_t(s - 1)].data() : nullptr, s < d.S - 1 ? act[size_t(s)].data() : nullptr);
    for (int s = d.S - 1; s >= 0; --s)
      st[size_t(s)].backward(mb, 0, s < d.S - 1 ? grad[size_t(s)].data() : nullptr, s ? grad[size_t(s - 1)].data() : nullptr);
  }
  Result r;
  r.losses = st.back().losses();
  for (auto& x : st) {
    x.finish_step();
    r.grads.push_back(x.grads());
  }
  return r;
}

// Independent float64 twin: the summed loss over micro-batches with stage `ps`'s parameter `pi` (index into
// [W, b]) moved by `delta`.
inline double toy_loss_f64(const Dims& d, int M, int ps, int64_t pi, double delta) {
  double total = 0;
  for (int mb = 0; mb < M; ++mb) {
    std::vector<double> x(size_t(d.rows) * size_t(d.width[0]));
    for (size_t j = 0; j < x.size(); ++j) x[j] = data(mb, int64_t(j));
    for (int s = 0; s < d.S; ++s) {
      const int win = d.width[size_t(s)], wout = d.width[size_t(s + 1)];
      std::vector<double> y(size_t(d.rows) * size_t(wout));
      for (int r = 0; r < d.rows; ++r)
        for (int o = 0; o < wout; ++o) {
          double acc = bias(s, o) + (s == ps && pi == int64_t(wout) * win + o ? delta : 0.0);
          for (int i = 0; i < win; ++i) {
            const double w = weight(s, o, i, win) + (s == ps && pi == int64_t(o) * win + i ? delta : 0.0);
            acc += x[size_t(r * win + i)] * w;
          }
          y[size_t(r * wout + o)] = std::tanh(acc);
        }
      x = std::move(y);
    }
    for (size_t j = 0; j < x.size(); ++j) {
      const double e = x[j] - target(mb, int64_t(j));
      total += 0.5 * e * e;
    }
  }
  return total;
}

}  // namespace pp_toy
