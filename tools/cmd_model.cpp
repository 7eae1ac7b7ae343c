// cmd_model.cpp: `moetron model info CONFIG [--json] [--section.key=value ...]` prints what the
// accounting says about a config: total and active parameters, FLOPs per token, and per layer the
// parameter bytes and the saved-activation bytes of one micro-batch. Not a planner: no parallelism,
// optimizer state or hardware here.
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli.h"
#include "moetron/accounting.h"
#include "moetron/config.h"

namespace {
using namespace moetron;

std::string count(double x) {
  char b[32];
  if (x >= 1e12) std::snprintf(b, sizeof b, "%.3fT", x / 1e12);
  else if (x >= 1e9) std::snprintf(b, sizeof b, "%.2fB", x / 1e9);
  else if (x >= 1e6) std::snprintf(b, sizeof b, "%.2fM", x / 1e6);
  else if (x >= 1e3) std::snprintf(b, sizeof b, "%.1fK", x / 1e3);
  else std::snprintf(b, sizeof b, "%.0f", x);
  return b;
}
std::string mib(double bytes) {
  char b[32];
  if (bytes >= 1024.0 * 1024 * 1024) std::snprintf(b, sizeof b, "%.2f GiB", bytes / (1024.0 * 1024 * 1024));
  else std::snprintf(b, sizeof b, "%.2f MiB", bytes / (1024.0 * 1024));
  return b;
}
std::string flops(double f) {
  char b[32];
  if (f >= 1e12) std::snprintf(b, sizeof b, "%.3f TFLOP", f / 1e12);
  else if (f >= 1e9) std::snprintf(b, sizeof b, "%.3f GFLOP", f / 1e9);
  else std::snprintf(b, sizeof b, "%.3f MFLOP", f / 1e6);
  return b;
}

nlohmann::ordered_json info_json(const JobConfig& c, const std::string& path) {
  const auto& s = c.model;
  ParamCounts pc = count_params(s);
  FlopsPerToken f = flops_per_token(s, c.training.seq_len, true, c.activation_checkpoint);
  ActivationBytes act = activation_bytes(c);
  nlohmann::ordered_json j;
  j["name"] = c.job.name;
  j["config"] = path;
  j["total_params"] = pc.total;
  j["active_params"] = pc.active;
  j["active_params_no_embed"] = pc.active_no_embed;
  j["embedding_params"] = pc.embedding;
  j["head_params"] = pc.head;
  j["routed_expert_params"] = pc.routed_experts;
  j["dense_part_params"] = pc.dense_part;
  j["seq_len"] = c.training.seq_len;
  j["micro_batch_size"] = c.training.micro_batch_size;
  j["compute_dtype"] = std::string(to_string(c.training.compute_dtype));
  j["activation_checkpoint"] = std::string(to_string(c.activation_checkpoint.mode));
  j["flops_per_token"] = f.train;
  j["flops_per_token_fwd"] = f.fwd();
  j["flops_per_token_fwd_matmul"] = f.fwd_matmul;
  j["flops_per_token_fwd_attention"] = f.fwd_attention;
  j["flops_per_token_hw"] = f.hw_train;
  j["param_bytes_fp32"] = pc.total * 4;
  j["activation_bytes"] = act.total;
  j["recompute_transient_bytes"] = act.recompute_transient;
  nlohmann::ordered_json layers = nlohmann::ordered_json::array();
  for (int64_t l = 0; l < s.n_layers; ++l) {
    const auto& p = pc.layers[l];
    nlohmann::ordered_json terms = nlohmann::ordered_json::object();
    for (const auto& t : act.layers[l].terms) terms[t.name] = t.bytes;
    layers.push_back({{"layer", l},
                      {"kind", p.moe ? "moe" : "dense"},
                      {"params",
                       {{"attention", p.attention},
                        {"norms", p.norms},
                        {"dense_mlp", p.dense_mlp},
                        {"router", p.router},
                        {"routed_experts", p.routed_experts},
                        {"shared_experts", p.shared_experts},
                        {"total", p.total()},
                        {"active", p.active()}}},
                      {"param_bytes_fp32", p.total() * 4},
                      {"flops_fwd_per_token", f.layer_fwd[l]},
                      {"activation_bytes", act.layers[l].total()},
                      {"activation_terms", terms}});
  }
  j["layers"] = layers;
  nlohmann::ordered_json outside = nlohmann::ordered_json::object();
  for (const auto& t : act.outside.terms) outside[t.name] = t.bytes;
  j["activation_terms_outside_layers"] = outside;
  return j;
}

void print_info(const JobConfig& c, const std::string& path) {
  const auto& s = c.model;
  const auto& a = s.attn;
  const auto& m = s.moe;
  ParamCounts pc = count_params(s);
  FlopsPerToken f = flops_per_token(s, c.training.seq_len, true, c.activation_checkpoint);
  ActivationBytes act = activation_bytes(c);

  std::printf("model %s (%s)\n", c.job.name.c_str(), path.c_str());
  std::printf("  %lld layers (%lld dense, %lld MoE), d_model %lld, vocab %lld, %s embeddings\n", (long long)s.n_layers,
              (long long)s.n_dense_layers(), (long long)s.n_moe_layers(), (long long)s.d_model,
              (long long)s.vocab_size, s.tie_embeddings ? "tied" : "untied");
  if (a.type == AttnType::MLA)
    std::printf("  attention mla: %lld heads, q_lora %lld, kv_lora %lld, qk %lld+%lld, v %lld\n", (long long)a.n_heads,
                (long long)a.q_lora_rank, (long long)a.kv_lora_rank, (long long)a.qk_nope_head_dim,
                (long long)a.qk_rope_head_dim, (long long)a.v_head_dim);
  else
    std::printf("  attention %s: %lld heads, %lld kv heads, head_dim %lld%s\n", std::string(to_string(a.type)).c_str(),
                (long long)a.n_heads, (long long)a.n_kv_heads, (long long)a.head_dim, a.qk_norm ? ", qk_norm" : "");
  if (s.is_moe())
    std::printf("  moe: %lld routed experts top-%lld (%s) + %lld shared, expert ffn %lld; dense ffn %lld\n",
                (long long)m.n_routed_experts, (long long)m.topk, std::string(to_string(m.score_func)).c_str(),
                (long long)m.n_shared_experts, (long long)m.moe_inter_size, (long long)s.inter_size);

  std::printf("\nparameters\n");
  std::printf("  total                 %12s  (%lld)\n", count(pc.total).c_str(), (long long)pc.total);
  std::printf("  active per token      %12s  (incl. input embedding; %s without)\n", count(pc.active).c_str(),
              count(pc.active_no_embed).c_str());
  std::printf("  embedding / head      %12s / %s\n", count(pc.embedding).c_str(), count(pc.head).c_str());
  std::printf("  routed experts        %12s  (dense part %s)\n", count(pc.routed_experts).c_str(),
              count(pc.dense_part).c_str());

  std::printf("\nFLOPs per token (seq_len %lld, causal)\n", (long long)c.training.seq_len);
  std::printf("  forward               %12s  (matmul %s, attention %s)\n", flops(f.fwd()).c_str(),
              flops(f.fwd_matmul).c_str(), flops(f.fwd_attention).c_str());
  std::printf("  train = 3 x forward   %12s  (6 x active_no_embed = %s)\n", flops(f.train).c_str(),
              flops(6.0 * pc.active_no_embed).c_str());
  std::printf("  with recompute        %12s  (activation_checkpoint %s)\n", flops(f.hw_train).c_str(),
              std::string(to_string(c.activation_checkpoint.mode)).c_str());

  std::printf("\nper layer: fp32 parameter bytes; activations saved for one micro-batch (%lld x %lld tokens, %s)\n",
              (long long)c.training.micro_batch_size, (long long)c.training.seq_len,
              std::string(to_string(c.training.compute_dtype)).c_str());
  std::printf("  %-12s %-6s %10s %10s %10s %10s %12s %12s\n", "layers", "kind", "attention", "mlp/exp", "router",
              "params", "param bytes", "act bytes");
  int64_t l = 0;
  while (l < s.n_layers) {
    int64_t e = l + 1;
    const auto& p = pc.layers[l];
    while (e < s.n_layers && pc.layers[e].total() == p.total() && pc.layers[e].moe == p.moe &&
           act.layers[e].total() == act.layers[l].total())
      ++e;
    std::string range = e - l == 1 ? std::to_string(l)
                                   : std::to_string(l) + "-" + std::to_string(e - 1) + " x" + std::to_string(e - l);
    std::printf("  %-12s %-6s %10s %10s %10s %10s %12s %12s\n", range.c_str(), p.moe ? "moe" : "dense",
                count(p.attention).c_str(), count(p.dense_mlp + p.routed_experts + p.shared_experts).c_str(),
                count(p.router).c_str(), count(p.total()).c_str(), mib(p.total() * 4.0).c_str(),
                mib(act.layers[l].total()).c_str());
    l = e;
  }
  std::printf("  %-12s %-6s %10s %10s %10s %10s %12s %12s\n", "outside", "", "", "", "",
              count(pc.embedding + pc.head + pc.final_norm).c_str(),
              mib((pc.embedding + pc.head + pc.final_norm) * 4.0).c_str(), mib(act.outside.total()).c_str());
  std::printf("  %-12s %-6s %10s %10s %10s %10s %12s %12s\n", "total", "", "", "", "", count(pc.total).c_str(),
              mib(pc.total * 4.0).c_str(), mib(act.total).c_str());
  if (act.recompute_transient > 0)
    std::printf("  + %s re-materialized while recomputing one fully checkpointed layer\n",
                mib(act.recompute_transient).c_str());
}

}  // namespace

MT_REGISTER_COMMAND([](CLI::App& root) {
  auto* model = root.add_subcommand("model", "Model facts from a config: parameters, FLOPs, activations");
  model->require_subcommand(1);
  auto* info = model->add_subcommand(
      "info", "Total/active parameters, FLOPs per token, per-layer parameter and activation bytes. "
              "Extra --section.key=value arguments override the config.");
  auto path = std::make_shared<std::string>();
  auto json = std::make_shared<bool>(false);
  info->add_option("config", *path, "TOML config (e.g. configs/ds_mini.toml)")->required();
  info->add_flag("--json", *json, "Print one JSON object");
  info->allow_extras();
  info->callback([info, path, json] {
    JobConfig c = load_config(*path, info->remaining());
    if (*json) std::printf("%s\n", info_json(c, *path).dump(2).c_str());
    else print_info(c, *path);
  });
});
