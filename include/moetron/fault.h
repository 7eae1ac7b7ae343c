// fault.h: deterministic fault injection for reliability tests (docs/reliability.md, "Faults"). The
// MOETRON_FAULT environment variable lists faults, separated by ';', each `kind:key=value:...`:
//   kill:rank=2:step=7:phase=backward            the rank raises SIGKILL on itself
//   delay:rank=1:step=3:phase=forward:ms=2000    the rank sleeps ms milliseconds
//   nan:rank=1:step=3:phase=backward             the rank poisons its first gradient element (backward), its
//                                                loss sum (forward) or its first parameter element before a
//                                                checkpoint save (checkpoint) with a quiet NaN
//   mismatch:rank=1:step=2:phase=optimizer       the rank enters a barrier on the world communicator where the
//                                                others enter an all_reduce: a collective that never matches
// rank is the MPI_COMM_WORLD rank, step the 1-based optimizer step, phase one of forward (start of the step's
// forward / backward), backward (backward done, before the gradient reduction), optimizer (before the
// update), checkpoint (before a checkpoint save). A fault fires once, when its rank reaches that point of that
// step. This header parses and matches; the trainer (src/train/train_step.cpp) acts on the matches. Not a
// chaos monkey: nothing is random.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace moetron {

enum class FaultKind : uint8_t { Kill, Delay, Nan, Mismatch };
enum class FaultPhase : uint8_t { Forward, Backward, Optimizer, Checkpoint };
std::string_view to_string(FaultKind k);
std::string_view to_string(FaultPhase p);

struct FaultSpec {
  FaultKind kind = FaultKind::Kill;
  int rank = 0;
  int64_t step = 0;
  FaultPhase phase = FaultPhase::Forward;
  int64_t ms = 0;  // delay only
  std::string text;  // the spec as written, for messages
};

// Parses a MOETRON_FAULT value ("" = no faults). Throws moetron::Error naming the spec and the problem
// (unknown kind or key, missing rank / step / phase, a value that is not a number, ms without delay, a nan
// fault at the optimizer phase).
std::vector<FaultSpec> parse_faults(std::string_view text);

// The faults of one rank, consumed as they fire: those naming it, plus every mismatch fault (the ranks a
// mismatch does not name run the other side of the unmatched collective).
class FaultInjector {
 public:
  FaultInjector() = default;
  FaultInjector(std::vector<FaultSpec> all, int world_rank);
  // From MOETRON_FAULT (unset or empty: none).
  static FaultInjector from_env(int world_rank);
  bool empty() const { return faults_.empty(); }
  // The faults of this rank due at (phase, step), removed from the list (each fires once).
  std::vector<FaultSpec> take(FaultPhase phase, int64_t step);
  // Acts on the kinds that need no trainer state: kill (never returns), delay (sleeps). Prints one line to
  // stderr naming the fault first.
  static void act(const FaultSpec& f);

 private:
  std::vector<FaultSpec> faults_;
  int rank_ = 0;
};

}  // namespace moetron
