// cmd_info.cpp: `moetron version` prints the build and runtime facts (ISA chosen, threads, oneDNN).
#include <cstdio>

#include "cli.h"
#include "moetron/runtime.h"

MT_REGISTER_COMMAND([](CLI::App& root) {
  auto* c = root.add_subcommand("version", "Print the runtime facts: ISA chosen, threads, oneDNN version");
  c->callback([] {
    moetron::init_threads();
    std::printf("moetron 0.1 %s\n", moetron::runtime_summary().c_str());
  });
});
