// env.h: the few environment variables the engine still reads, read one way: a value from a fixed set or an
// integer in a range, the default when the variable is unset or empty, and any other value refused with an Error
// that names the variable, the value and what it may be. Not a config loader: what a run computes and how it runs
// is chosen in the TOML config (config.h), where the planner, the checkpoint and the run report see it.
//
// The variables that remain, each for testing, debugging or finding files, never for choosing behaviour:
//   MOETRON_FAULT    fault injection (include/moetron/fault.h): makes a rank fail on purpose, to test recovery.
//   MOETRON_ISA      caps the hand-written kernels' ISA below the CPU's (scalar | avx2 | avx512), to test every
//                    kernel path on one machine: a capped run computes what a CPU without the higher ISA would
//                    (training.compute_dtype = "auto" included), never more.
//   MOETRON_WEB_DIR  where the run report's plotting library lives (a file location, like --web).
// Standard variables of the runtimes are theirs (OMP_NUM_THREADS when training.threads = 0; the MPI launcher's).
// docs/architecture.md (Environment variables) keeps the same list.
//
// Retired: the variables that chose behaviour are config keys now (retired_env below); setting one is an Error
// naming its key, so nobody's setting is silently ignored.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace moetron {

// One of `choices`, or `fallback` when unset. Refused: "NAME must be 'a' or 'b', not 'x'" (op names the reader).
std::string env_choice(const char* name, const char* fallback, std::initializer_list<const char*> choices,
                       const char* op);
// An integer in [lo, hi], or `fallback` when unset. Refused: "NAME must be an integer in [lo, hi], not 'x'".
int64_t env_int_in(const char* name, int64_t fallback, int64_t lo, int64_t hi, const char* op);

// A variable that once chose behaviour, and the config key that does now.
struct RetiredEnv {
  const char* name;  // e.g. "MOETRON_EP_BATON"
  const char* key;   // e.g. "parallelism.ep_baton"
  const char* how;   // the key's values, e.g. "\"free\" | \"turn\""
};
// Every retired variable: MOETRON_EP_PAIR_BACKWARD, MOETRON_EP_BATON, MOETRON_EP_LINK, MOETRON_MPI_WAIT,
// MOETRON_MPI_MAX_NAP_US, MOETRON_MPI_THREAD, MOETRON_NUM_THREADS.
const std::vector<RetiredEnv>& retired_env();
// Throws moetron::Error for the first retired variable set to a non-empty value: "environment variable NAME = v
// was retired: set the config key KEY = ... instead (...)". The trainer, the command line and MPI's start call it.
void refuse_retired_env();

}  // namespace moetron
