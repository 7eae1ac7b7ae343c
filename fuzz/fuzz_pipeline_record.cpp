// fuzz_pipeline_record: feeds the measured pipeline record reader (record_from_json, src/schedule/record.cpp),
// the JSON file `train --pp-record` writes and `viz pipeline` reads, whose "lowered" field is a schedule CSV,
// then what those readers compute from it (measured_result, compare_bubbles).
// Input: JSON text. A finding is anything but a clean moetron::Error (a crash, a sanitizer report, a hang, an
// nlohmann exception leaking out).
#include "fuzz_common.h"
#include "moetron/check.h"
#include "moetron/pipeline_record.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moetron;
  try {
    sched::PipelineRecord r = sched::record_from_json(std::string(fuzz::as_text(data, size)), "fuzz record");
    (void)sched::record_to_json(r);
    // What `viz pipeline` and `schedule compare` do next with a record they read.
    if (!r.steps.empty()) (void)sched::measured_result(r, 0);
    (void)sched::compare_bubbles(r);
  } catch (const Error&) {
  }
  return 0;
}
