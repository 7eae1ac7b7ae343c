// fuzz_schedule_csv: feeds the pipeline schedule CSV reader (from_csv and parse_action, src/schedule/action.cpp)
// and the validator that runs on any schedule a user supplies (validate, src/schedule/validate.cpp). Input: CSV
// text, one pipeline rank per line, actions like "0F3" or "1SEND_F2". A finding is anything but a clean
// moetron::Error, or a parsed schedule whose to_csv() text does not read back to the same CSV.
#include "fuzz_common.h"
#include "moetron/check.h"
#include "moetron/schedule.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moetron;
  sched::Schedule s;
  try {
    s = sched::from_csv(fuzz::as_text(data, size));
  } catch (const Error&) {
    return 0;
  }
  const std::string csv = sched::to_csv(s);
  try {
    if (sched::to_csv(sched::from_csv(csv)) != csv) fuzz::invariant_broken("to_csv(from_csv(to_csv(s))) != to_csv(s)");
  } catch (const Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    fuzz::invariant_broken("to_csv output does not read back");
  }
  try {
    (void)sched::validate(s);
  } catch (const Error&) {
  }
  return 0;
}
