// checkpoint_writer.cpp: the one-write-in-flight background checkpoint thread (see checkpoint_writer.h).
#include "train/checkpoint_writer.h"

#include <cstdio>

#include "moetron/check.h"

namespace moetron {

void CheckpointWriter::wait() {
  if (thread_.joinable()) thread_.join();
  if (error_) {
    std::exception_ptr e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
}

void CheckpointWriter::submit(std::function<void()> write) {
  wait();
  thread_ = std::thread([this, w = std::move(write)] {
    try {
      w();
    } catch (...) {
      error_ = std::current_exception();
    }
  });
}

CheckpointWriter::~CheckpointWriter() {
  try {
    wait();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moetron: error: background checkpoint write failed: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "moetron: error: background checkpoint write failed\n");
  }
}

}  // namespace moetron
