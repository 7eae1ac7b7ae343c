// cmd_train.cpp: `moetron train CONFIG [--section.key=value ...] [--profile] [--trace DIR]`.
#include <cstdio>
#include <filesystem>

#include "cli.h"
#include "moetron/config.h"
#include "moetron/trainer.h"

MT_REGISTER_COMMAND([](CLI::App& root) {
  auto* c = root.add_subcommand("train", "Train a model from a TOML config; overrides as --section.key=value");
  static std::string path;
  static std::vector<std::string> overrides;
  static bool quiet = false, profile = false;
  static std::string trace_dir;
  c->add_option("config", path, "TOML config (e.g. configs/ds_mini.toml)")->required();
  c->add_flag("--quiet", quiet, "No progress output");
  c->add_flag("--profile", profile,
              "Print a per-op time breakdown at the end (over [profiling] start_step..end_step; pipeline runs also "
              "write pipeline_record.json)");
  c->add_option("--trace", trace_dir,
                "Profile into this folder: every rank writes DIR/rank<r>.trace.json (the same as "
                "--profiling.enable=true --profiling.folder=DIR; docs/profiling.md)");
  c->allow_extras();
  c->callback([c] {
    overrides = c->remaining();
    if (!trace_dir.empty()) {  // relative to the working directory, not to job.dump_folder
      overrides.push_back("--profiling.enable=true");
      overrides.push_back("--profiling.folder=" + std::filesystem::absolute(trace_dir).string());
    }
    moetron::JobConfig cfg = moetron::load_config(path, overrides);
    moetron::TrainOptions o;
    o.quiet = quiet;
    o.profile = profile;
    moetron::train(cfg, o);
  });
});
