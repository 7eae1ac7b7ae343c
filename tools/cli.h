// cli.h: subcommand registry for the `moetron` command line. Each tools/cmd_*.cpp registers one
// subcommand with MT_REGISTER_COMMAND; moetron.cpp builds the CLI11 app from the registry.
#pragma once
#include <CLI/CLI.hpp>
#include <functional>
#include <vector>

namespace moetron::cli {
using Registrar = std::function<void(CLI::App& root)>;
int register_command(Registrar r);
}  // namespace moetron::cli

#define MT_CLI_CAT2(a, b) a##b
#define MT_CLI_CAT(a, b) MT_CLI_CAT2(a, b)
#define MT_REGISTER_COMMAND(...) static int MT_CLI_CAT(mt_cmd_, __LINE__) = ::moetron::cli::register_command(__VA_ARGS__)
