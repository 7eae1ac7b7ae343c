// bench_fp8_real.cpp: FP8 quantization error (SQNR, dB) per recipe on the real operands of a model step: the
// input activations X, weights W and output gradients dY of chosen dense linears (attention, dense MLP, shared
// experts), copied out of one fp32 forward + backward of the config's model on one batch of its data
// (Model::capture_linear). For each recipe and format the operands are quantized as the model's FP8 path
// quantizes them, and the forward, dgrad and wgrad GEMMs (fp8_gemm) are compared with the exact fp64 products of
// the unquantized operands. Weights are the initialisation's unless --checkpoint gives trained ones.
// Not a speed benchmark and not the synthetic study (bench_fp8_accum sqnr).
// Usage: bench_fp8_real [--config configs/ds_mini.toml] [--data data/brown] [--checkpoint DIR] [--override k=v]...
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "moetron/checkpoint.h"
#include "moetron/config.h"
#include "moetron/data/loader.h"
#include "moetron/fp8_gemm.h"
#include "moetron/gemm.h"
#include "moetron/model.h"
#include "moetron/safetensors.h"

using namespace moetron;
namespace fs = std::filesystem;

namespace {

double sqnr(const float* got, const double* exact, int64_t n) {
  double s = 0, e = 0;
  for (int64_t i = 0; i < n; ++i) s += exact[i] * exact[i], e += (got[i] - exact[i]) * (got[i] - exact[i]);
  return e > 0 ? 10 * std::log10(s / e) : INFINITY;
}
double sqnr_q(const Fp8Tensor& q, const float* x, bool transposed) {  // of the operand itself
  std::vector<float> d(q.q.size());
  fp8_dequantize_operand(d.data(), q);
  std::vector<double> e(d.size());
  for (int64_t r = 0; r < q.rows; ++r)
    for (int64_t c = 0; c < q.cols; ++c) e[size_t(r * q.cols + c)] = transposed ? x[c * q.rows + r] : x[r * q.cols + c];
  return sqnr(d.data(), e.data(), int64_t(d.size()));
}
// C[M, N] = op(A) op(B) in fp64 on fp32 inputs.
std::vector<double> exact(Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                          const float* B, int64_t ldb) {
  std::vector<double> a(size_t(M * K)), b(size_t(K * N)), c(size_t(M * N), 0.0);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t k = 0; k < K; ++k) a[size_t(i * K + k)] = ta == Trans::N ? A[i * lda + k] : A[k * lda + i];
  for (int64_t k = 0; k < K; ++k)
    for (int64_t j = 0; j < N; ++j) b[size_t(k * N + j)] = tb == Trans::N ? B[k * ldb + j] : B[j * ldb + k];
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < M; ++i)
    for (int64_t k = 0; k < K; ++k) {
      const double v = a[size_t(i * K + k)];
      for (int64_t j = 0; j < N; ++j) c[size_t(i * N + j)] += v * b[size_t(k * N + j)];
    }
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  std::string config = "configs/ds_mini.toml", data = "data/brown", ckpt;
  std::vector<std::string> ov = {"--training.compute_dtype=fp32"};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--config" && i + 1 < argc) config = argv[++i];
    else if (a == "--data" && i + 1 < argc) data = argv[++i];
    else if (a == "--checkpoint" && i + 1 < argc) ckpt = argv[++i];
    else if (a == "--override" && i + 1 < argc) ov.push_back(std::string("--") + argv[++i]);
    else {
      std::fprintf(stderr, "bench_fp8_real: unknown argument '%s' (usage: [--config F] [--data DIR] [--checkpoint DIR] "
                   "[--override section.key=value]...)\n", a.c_str());
      return 2;
    }
  }
  try {
    const JobConfig c = load_config(config, ov);
    const int64_t B = c.training.micro_batch_size, T = c.training.seq_len;
    Model m(c.model, B, T, {}, {}, ComputeDtype::FP32);
    m.init_params(uint64_t(c.training.seed));
    if (!ckpt.empty()) {
      LoadedCheckpoint ck = load_checkpoint(ckpt);
      for (const ParamEntry& p : m.params())
        load_into(ck.model, p.name, DType::F32, p.global_shape, m.param_data() + p.offset);
      m.sync_weights();
    }
    data::LoaderOptions lo;
    lo.seq_len = T, lo.micro_batch = B, lo.seed = uint64_t(c.training.seed);
    data::DataLoader loader({(fs::path(data) / "train_000.bin").string()}, lo);
    data::Batch batch;
    loader.next(batch);
    std::vector<int32_t> tok(size_t(B * T)), tgt(size_t(B * T));
    batch.split(tok.data(), tgt.data());

    std::vector<std::string> sites;
    const int64_t L = c.model.n_layers, k = c.model.first_k_dense;
    for (const char* w : {"attn.wqkv", "attn.wo"}) sites.push_back("layers." + std::to_string(L - 1) + "." + w);
    if (k > 0) sites.push_back("layers.0.mlp.w13"), sites.push_back("layers.0.mlp.w2");
    if (c.model.is_moe() && c.model.moe.n_shared_experts > 0 && L > k)
      sites.push_back("layers." + std::to_string(L - 1) + ".moe.shared.w2");
    std::printf("%s, batch %lld x %lld tokens of %s, weights: %s\n", config.c_str(), (long long)B, (long long)T,
                data.c_str(), ckpt.empty() ? "initialisation" : ckpt.c_str());
    std::printf("%-26s %-11s %-6s %7s %7s %7s | %8s %8s %8s\n", "linear", "recipe", "dY fmt", "q(X)", "q(W)", "q(dY)",
                "Y fwd", "dX dgrad", "dW wgrad");
    for (const std::string& name : sites) {
      m.capture_linear(name);
      m.zero_grads();
      m.forward_backward(tok.data(), tgt.data(), 1.0f / float(B * T), 1.0f);
      const Model::LinearOperands o = m.captured_linear();
      m.capture_linear("");
      const int64_t R = o.rows, in = o.in, out = o.out;
      const std::vector<double> Y = exact(Trans::N, Trans::N, R, out, in, o.x.data(), in, o.w.data(), out);
      const std::vector<double> dX = exact(Trans::N, Trans::T, R, in, out, o.dy.data(), out, o.w.data(), out);
      const std::vector<double> dW = exact(Trans::T, Trans::N, in, out, R, o.x.data(), in, o.dy.data(), out);
      for (Fp8Recipe r : {Fp8Recipe::Tensorwise, Fp8Recipe::Rowwise, Fp8Recipe::Blockwise, Fp8Recipe::MXFP8})
        for (Fp8Format gf : {Fp8Format::E4M3, Fp8Format::E5M2}) {
          const Fp8Format e4 = Fp8Format::E4M3;
          const Fp8Tensor x = fp8_quantize_operand(o.x.data(), R, in, e4, r, Fp8Role::Activation);
          const Fp8Tensor wt = fp8_quantize_operand_t(o.w.data(), in, out, e4, r, Fp8Role::Weight);
          const Fp8Tensor w = fp8_quantize_operand(o.w.data(), in, out, e4, r, Fp8Role::Weight);
          const Fp8Tensor g = fp8_quantize_operand(o.dy.data(), R, out, gf, r, Fp8Role::Activation);
          const Fp8Tensor xt = fp8_quantize_operand_t(o.x.data(), R, in, e4, r, Fp8Role::Activation);
          const Fp8Tensor gt = fp8_quantize_operand_t(o.dy.data(), R, out, gf, r, Fp8Role::Activation);
          std::vector<float> y(size_t(R * out)), dx(size_t(R * in)), dw(size_t(in * out));
          fp8_gemm(y.data(), out, x, wt);
          fp8_gemm(dx.data(), in, g, w);
          fp8_gemm(dw.data(), out, xt, gt);
          std::printf("%-26s %-11s %-6s %7.1f %7.1f %7.1f | %8.1f %8.1f %8.1f\n", name.c_str(),
                      std::string(to_string(r)).c_str(), fp8_format_name(gf), sqnr_q(x, o.x.data(), false),
                      sqnr_q(w, o.w.data(), false), sqnr_q(g, o.dy.data(), false), sqnr(y.data(), Y.data(), R * out),
                      sqnr(dx.data(), dX.data(), R * in), sqnr(dw.data(), dW.data(), in * out));
        }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_fp8_real: %s\n", e.what());
    return 1;
  }
  return 0;
}
