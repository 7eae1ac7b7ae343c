// cmd_dump.cpp: `moetron debug dump-init CONFIG OUT.safetensors [--section.key=value ...]` (hidden).
// Builds the Model with the config's micro-batch shape (training.micro_batch_size x training.seq_len),
// runs init_params(training.seed) and writes, for an external reference implementation
// (tools/torch_ref/moetron_ref.py):
//   param.<name>          every parameter, fp32, with the engine's name and shape
//   expert_bias.<i>       [E] per MoE layer: a deterministic nonzero bias when load_balance = aux_free
//                         (N(0, bias_std) by Philox, stream "ref.expert_bias.<i>"), zeros otherwise
//   tokens, targets       [B*T] int32: Philox tokens (stream "ref.tokens"), targets = the next token
//   metadata              config_toml (the resolved config, every key), B, T, seed
// Not a checkpoint (no optimizer state, no data position) and not part of the user-facing CLI.
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "cli.h"
#include "moetron/config.h"
#include "moetron/model.h"
#include "moetron/rng.h"
#include "moetron/runtime.h"
#include "moetron/safetensors.h"

namespace {

using namespace moetron;

void dump_init(const std::string& config, const std::string& out, const std::vector<std::string>& overrides,
               double bias_std) {
  init_threads();
  JobConfig cfg = load_config(config, overrides);
  const int64_t B = cfg.training.micro_batch_size, T = cfg.training.seq_len, V = cfg.model.vocab_size;
  const uint64_t seed = uint64_t(cfg.training.seed);
  Model model(cfg.model, B, T);
  model.init_params(seed);

  // Tokens: a Philox stream over the vocabulary; each row's targets are its inputs shifted by one.
  const uint64_t key = rng_key(seed, "ref.tokens");
  std::vector<int32_t> tokens(size_t(B * T)), targets(size_t(B * T));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t <= T; ++t) {
      int32_t v = int32_t(philox4x32(key, uint64_t(b * (T + 1) + t))[0] % uint64_t(V));
      if (t < T) tokens[size_t(b * T + t)] = v;
      if (t > 0) targets[size_t(b * T + t - 1)] = v;
    }

  const int64_t E = cfg.model.moe.n_routed_experts;
  const bool aux_free = cfg.model.moe.load_balance == LoadBalance::AuxFree;
  std::vector<std::vector<float>> bias(size_t(model.n_moe_layers()), std::vector<float>(size_t(E), 0.0f));
  for (int i = 0; i < model.n_moe_layers(); ++i) {
    if (aux_free && bias_std > 0)
      fill_normal(bias[size_t(i)].data(), E, rng_key(seed, "ref.expert_bias." + std::to_string(i)), 0, 0.0f,
                  float(bias_std));
    std::copy(bias[size_t(i)].begin(), bias[size_t(i)].end(), model.expert_bias(i));
  }

  std::vector<SafetensorsEntry> ents;
  for (auto& p : model.params())
    ents.push_back({"param." + p.name, DType::F32, p.shape, model.param_data() + p.offset, size_t(p.numel) * 4});
  for (int i = 0; i < model.n_moe_layers(); ++i)
    ents.push_back({"expert_bias." + std::to_string(i), DType::F32, {E}, bias[size_t(i)].data(), size_t(E) * 4});
  ents.push_back({"tokens", DType::I32, {B * T}, tokens.data(), tokens.size() * 4});
  ents.push_back({"targets", DType::I32, {B * T}, targets.data(), targets.size() * 4});
  std::map<std::string, std::string> meta{{"config_toml", to_toml(cfg)},
                                          {"B", std::to_string(B)},
                                          {"T", std::to_string(T)},
                                          {"seed", std::to_string(seed)},
                                          {"generator", "moetron debug dump-init"}};
  auto r = write_safetensors(out, ents, meta);
  std::printf("wrote %s: %lld parameters in %zu tensors, %lld tokens, %llu bytes\n", out.c_str(),
              (long long)model.num_params(), model.params().size(), (long long)(B * T),
              (unsigned long long)r.file_bytes);
}

}  // namespace

MT_REGISTER_COMMAND([](CLI::App& root) {
  auto* dbg = root.add_subcommand("debug", "Developer tools (reference dumps)");
  dbg->group("");  // hidden from --help
  dbg->require_subcommand(1);
  auto* dump = dbg->add_subcommand("dump-init", "Write the initial parameters and a deterministic batch "
                                                "(safetensors) for tools/torch_ref/moetron_ref.py");
  static std::string config;
  static std::string out;
  static double bias_std = 0.02;
  dump->add_option("config", config, "TOML config")->required();
  dump->add_option("out", out, "output .safetensors")->required();
  dump->add_option("--bias-std", bias_std, "std of the expert bias written when load_balance = aux_free");
  dump->allow_extras();
  dump->callback([dump] { dump_init(config, out, dump->remaining(), bias_std); });
});
