// env.h: the engine's environment knobs (MOETRON_EP_BATON, MOETRON_MPI_WAIT, ...) read one way: a value from a
// fixed set or an integer in a range, the default when the variable is unset or empty, and any other value
// refused with an Error that names the variable, the value and what it may be. Not a config loader: job settings
// live in the TOML config (config.h); these knobs are for measurements and comparisons.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <string>

namespace moetron {

// One of `choices`, or `fallback` when unset. Refused: "NAME must be 'a' or 'b', not 'x'" (op names the reader).
std::string env_choice(const char* name, const char* fallback, std::initializer_list<const char*> choices,
                       const char* op);
// An integer in [lo, hi], or `fallback` when unset. Refused: "NAME must be an integer in [lo, hi], not 'x'".
int64_t env_int_in(const char* name, int64_t fallback, int64_t lo, int64_t hi, const char* op);

}  // namespace moetron
