// mpi_gtest_main.cpp: main() of the MPI gtest binaries. Every rank runs every test; ranks other than 0
// print only their failures (prefixed with the rank); the exit code is agreed by all ranks.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>

#include "moetron/comm.h"

using namespace moetron;

namespace {
// On ranks other than 0: print failures only, prefixed with the rank.
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed())
      std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_, r.file_name() ? r.file_name() : "?",
                   r.line_number(), r.summary());
  }

 private:
  int rank_;
};
}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  int rc = 0;
  {
    Comm c = comm_world();
    if (c.rank() != 0) {
      auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
      delete listeners.Release(listeners.default_result_printer());
      listeners.Append(new RankFailurePrinter(c.rank()));
    }
    rc = RUN_ALL_TESTS();
    int32_t failed = rc != 0;
    c.all_reduce(&failed, 1);  // every rank agrees on the outcome
    rc = failed ? 1 : 0;
  }
  comm_finalize();
  return rc;
}
