// env.cpp: the readers of the environment variables that remain, and the refusal of the retired ones (env.h).
// Not a config loader.
#include "moetron/env.h"

#include <cerrno>
#include <cstdlib>

#include "moetron/check.h"

namespace moetron {

std::string env_choice(const char* name, const char* fallback, std::initializer_list<const char*> choices,
                       const char* op) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  std::string allowed;
  size_t k = 0;
  for (const char* c : choices) {
    if (std::string(c) == v) return v;
    allowed += std::string(k == 0 ? "" : k + 1 == choices.size() ? " or " : ", ") + "'" + c + "'";
    ++k;
  }
  MT_FAIL(op, name, " must be ", allowed, ", not '", v, "'");
}

int64_t env_int_in(const char* name, int64_t fallback, int64_t lo, int64_t hi, const char* op) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(v, &end, 10);
  MT_CHECK(end != v && *end == '\0' && errno == 0 && x >= lo && x <= hi, op, name, " must be an integer in [", lo,
           ", ", hi, "], not '", v, "'");
  return int64_t(x);
}

const std::vector<RetiredEnv>& retired_env() {
  static const std::vector<RetiredEnv> list = {
      {"MOETRON_EP_PAIR_BACKWARD", "parallelism.ep_pair_backward", "\"auto\" | \"b\" | \"iw\" | \"iwfill\" | \"iwcarry\""},
      {"MOETRON_EP_BATON", "parallelism.ep_baton", "\"free\" | \"turn\""},
      {"MOETRON_EP_LINK", "parallelism.ep_link", "\"shared\" | \"paced\""},
      {"MOETRON_MPI_WAIT", "comm.mpi_wait", "\"poll\" | \"spin\""},
      {"MOETRON_MPI_MAX_NAP_US", "comm.mpi_max_nap_us", "20 to 5000"},
      {"MOETRON_MPI_THREAD", "comm.mpi_thread", "\"multiple\" | \"funneled\""},
      {"MOETRON_NUM_THREADS", "training.threads", "a thread count; programs without a config read OMP_NUM_THREADS"},
  };
  return list;
}

void refuse_retired_env() {
  for (const RetiredEnv& r : retired_env()) {
    const char* v = std::getenv(r.name);
    if (!v || !*v) continue;
    throw Error(std::string("environment variable ") + r.name + "=" + v + " was retired: set the config key " + r.key +
                " instead (" + r.how + "; on the command line --" + r.key + "=...) and unset " + r.name +
                " (docs/architecture.md, Environment variables)");
  }
}

}  // namespace moetron
