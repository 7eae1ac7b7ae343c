// train_check.h: helpers shared by the MPI training tests (test_mpi_train.cpp, test_mpi_layouts.cpp): the
// world communicator, repository paths, run folders shared by all ranks, the TrainOptions that record what
// the equivalence checks compare, and the cross-rank bitwise check. Not a test by itself.
#pragma once
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "moetron/comm.h"
#include "moetron/trainer.h"

namespace mt_test {

inline moetron::Comm& world() {
  static moetron::Comm w = moetron::comm_world();
  return w;
}

inline std::string repo(const std::string& rel) { return std::string(MOETRON_SOURCE_DIR) + "/" + rel; }

// A folder under the temp directory; `prefix` keeps the test binaries apart.
inline std::string temp_dir(const std::string& prefix, const std::string& name) {
  return (std::filesystem::temp_directory_path() / (prefix + name)).string();
}

// Fresh folder shared by all ranks of one run (rank 0 clears it, everybody waits); named per world size.
inline std::string shared_dir(const std::string& prefix, const std::string& name) {
  std::string d = temp_dir(prefix, name + "_np" + std::to_string(world().size()));
  if (world().rank() == 0) std::filesystem::remove_all(d);
  world().barrier();
  return d;
}

// Quiet, and recording what the equivalence checks compare: the sequences trained, the parameter hash
// after every step, the final parameters and the first step's reduced gradient.
inline moetron::TrainOptions recorded(const moetron::Comm* c) {
  moetron::TrainOptions o;
  o.quiet = true;
  o.comm = c;
  o.record_data = true;
  o.record_param_hash = true;
  o.keep_params = true;
  o.keep_first_grads = true;
  return o;
}

// A fresh run folder `to` holding only the checkpoint `step` (e.g. "step-3") of the run in `from`: every rank
// writes its own copy when `per_rank`, else rank 0 writes the shared one; all ranks wait.
inline void copy_one_checkpoint(const std::string& from, const std::string& to, const std::string& step, bool per_rank) {
  namespace fs = std::filesystem;
  if (per_rank || world().rank() == 0) {
    fs::remove_all(to);
    fs::create_directories(fs::path(to) / "checkpoint");
    fs::copy(fs::path(from) / "checkpoint" / step, fs::path(to) / "checkpoint" / step, fs::copy_options::recursive);
  }
  world().barrier();
}

// All ranks' copies of `x` must be bitwise identical.
inline void expect_same_on_all_ranks(const void* x, int64_t bytes, const std::string& what) {
  const moetron::Comm& c = world();
  std::vector<char> all(size_t(bytes * c.size()));
  c.all_gather(all.data(), x, bytes);
  for (int q = 0; q < c.size(); ++q)
    EXPECT_EQ(0, std::memcmp(all.data() + q * bytes, x, size_t(bytes))) << what << ": rank " << q << " differs";
}

}  // namespace mt_test
