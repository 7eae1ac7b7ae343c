// cmd_export.cpp: `moetron export --hf CONFIG [--checkpoint DIR | --init] --out DIR [--dtype bf16|f32]
// [--list] [--section.key=value ...]` writes a Hugging Face model directory (model.safetensors +
// config.json) from a moetron checkpoint (default: the latest complete one in the config's dump folder)
// or from the seed initialisation. --list prints the tensor mapping instead. The work is in
// src/model/hf_weights.cpp (export_hf); this file only parses arguments and prints.
#include <cstdio>
#include <memory>
#include <string>

#include "cli.h"
#include "moetron/check.h"
#include "moetron/config.h"
#include "moetron/hf_weights.h"

namespace {
using namespace moetron;

void print_map(const ModelSpec& spec) {
  HfWeightMap m = hf_weight_map(spec);
  std::printf("HF model_type %s: %zu HF tensors from %zu moetron tensors\n", m.model_type.c_str(), m.hf.size(),
              m.moetron.size());
  for (const auto& t : m.hf) {
    std::string src;
    for (const auto& p : t.parts) {
      if (!src.empty()) src += " + ";
      src += p.src;
      if (p.expert >= 0) src += "[" + std::to_string(p.expert) + "]";
    }
    if (src.empty()) src = "(no moetron tensor)";
    std::printf("  %-56s %-16s <- %s  (%s)\n", t.hf_name.c_str(), shape_str(t.hf_shape).c_str(), src.c_str(),
                t.how.c_str());
  }
  for (const auto& n : m.not_in_hf) std::printf("  (not exported) %s\n", n.c_str());
}
struct ExportArgs {
  std::string config, checkpoint, out, dtype = "bf16";
  bool hf = false, init = false, list = false;
};
}  // namespace

MT_REGISTER_COMMAND([](CLI::App& root) {
  auto* c = root.add_subcommand("export", "Export a checkpoint to another format (--hf: Hugging Face safetensors + "
                                          "config.json). Extra --section.key=value arguments override the config.");
  auto a = std::make_shared<ExportArgs>();
  c->add_option("config", a->config, "TOML config the checkpoint was trained with")->required();
  c->add_flag("--hf", a->hf, "Hugging Face format (the only format for now; required)");
  c->add_option("--checkpoint", a->checkpoint,
                "Checkpoint directory (step-N); default: latest complete one in <dump_folder>/<checkpoint.folder>");
  c->add_flag("--init", a->init, "Export the seed initialisation (training.seed) instead of a checkpoint");
  c->add_option("--out", a->out, "Output directory (created)");
  c->add_option("--dtype", a->dtype, "Weight dtype in model.safetensors: bf16 (default) or f32")
      ->check(CLI::IsMember({"bf16", "f32"}));
  c->add_flag("--list", a->list, "Print the moetron -> HF tensor mapping and exit");
  c->allow_extras();
  c->callback([c, a] {
    MT_CHECK(a->hf, "export", "choose a format: --hf (Hugging Face) is the only one so far");
    JobConfig cfg = load_config(a->config, c->remaining());
    if (a->list) {
      print_map(cfg.model);
      return;
    }
    MT_CHECK(!a->out.empty(), "export", "--out DIR is required");
    HfExportRequest req;
    req.out_dir = a->out, req.checkpoint = a->checkpoint, req.init = a->init;
    req.opt.dtype = a->dtype == "f32" ? DType::F32 : DType::BF16;
    std::string source;
    HfExportResult r = export_hf(cfg, req, &source);
    std::printf("exported %s as HF %s: %lld tensors, %s, %.2f MiB\n", source.c_str(), r.model_type.c_str(),
                (long long)r.n_tensors, a->dtype.c_str(), double(r.file_bytes) / (1024.0 * 1024.0));
    std::printf("  %s\n  %s\n", r.safetensors_path.c_str(), r.config_path.c_str());
    for (const auto& n : r.notes) std::printf("note: %s\n", n.c_str());
  });
});
