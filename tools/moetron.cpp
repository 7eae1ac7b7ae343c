// moetron.cpp: entry point of the `moetron` command line. Subcommands live in tools/cmd_*.cpp.
// Errors go to stderr with a non-zero exit code.
#include <cstdio>
#include <exception>

#include "cli.h"
#include "moetron/check.h"
#include "moetron/env.h"

namespace moetron::cli {
static std::vector<Registrar>& registry() {
  static std::vector<Registrar> r;
  return r;
}
int register_command(Registrar r) {
  registry().push_back(std::move(r));
  return 0;
}
}  // namespace moetron::cli

int main(int argc, char** argv) {
  CLI::App app{"moetron: pre-training Mixture-of-Experts models on CPUs, and planning them on GPU clusters"};
  app.require_subcommand(1);
  for (auto& r : moetron::cli::registry()) r(app);
  try {
    moetron::refuse_retired_env();  // a variable that once chose behaviour names its config key (env.h)
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moetron: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
