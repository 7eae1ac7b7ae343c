// checkpoint_writer.h: the background writer behind `[checkpoint] async = true`. The trainer gathers and copies
// the state at a step boundary (collective, on the main thread), then hands rank 0's copy here; one thread
// writes it through save_checkpoint (atomic as always: the checkpoint counts only once its state.json is in
// place) while the next steps run. At most one write is in flight: the next save, and the end of the run, wait
// for the previous one and rethrow its error there, so a failed write is never silent.
// Not a checkpoint format and not collective: the store is include/moetron/checkpoint.h.
#pragma once
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <thread>

namespace moetron {

class CheckpointWriter {
 public:
  CheckpointWriter() = default;
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;
  ~CheckpointWriter();  // waits; an error nobody collected is printed on stderr (the run is unwinding anyway)

  // Waits for the write in flight (rethrowing its error), then starts `write` on the writer thread.
  void submit(std::function<void()> write);
  // Waits for the write in flight, if any, and rethrows its error.
  void wait();
  bool busy() const { return thread_.joinable(); }

 private:
  std::thread thread_;
  std::exception_ptr error_;
};

}  // namespace moetron
