// cmd_train.cpp: `moetron train CONFIG [--section.key=value ...]`.
#include <cstdio>

#include "cli.h"
#include "moetron/config.h"
#include "moetron/trainer.h"

MT_REGISTER_COMMAND([](CLI::App& root) {
  auto* c = root.add_subcommand("train", "Train a model from a TOML config; overrides as --section.key=value");
  static std::string path;
  static std::vector<std::string> overrides;
  static bool quiet = false, profile = false;
  static std::string trace_path;
  c->add_option("config", path, "TOML config (e.g. configs/ds_mini.toml)")->required();
  c->add_flag("--quiet", quiet, "No progress output");
  c->add_flag("--profile", profile, "Print a per-op time breakdown at the end");
  c->add_option("--trace", trace_path, "Write a Chrome trace JSON of the profiled steps to this file");
  c->allow_extras();
  c->callback([c] {
    overrides = c->remaining();
    moetron::JobConfig cfg = moetron::load_config(path, overrides);
    moetron::TrainOptions o;
    o.quiet = quiet;
    o.profile = profile;
    o.trace_path = trace_path;
    moetron::train(cfg, o);
  });
});
