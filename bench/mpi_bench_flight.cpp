// mpi_bench_flight.cpp: what the flight recorder (include/moetron/flight_recorder.h) adds to one Comm call: a
// small all_reduce on a split communicator, timed with the recorder off and on in alternating rounds in the
// same run (best round of each). Its own main, run under mpirun. Not a test; not the watchdog (it never fires
// here). docs/reliability.md quotes its output.
//
//   mpirun --oversubscribe --bind-to none -np 2 build/bench/mpi_bench_flight [--calls 20000] [--rounds 6] [--n 16]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "moetron/comm.h"
#include "moetron/flight_recorder.h"

using namespace moetron;

namespace {
double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
}  // namespace

int main(int argc, char** argv) {
  int calls = 20000, rounds = 6, n = 16;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const int v = std::atoi(argv[i + 1]);
    if (a == "--calls") calls = v;
    else if (a == "--rounds") rounds = v;
    else if (a == "--n") n = v;
    else {
      std::fprintf(stderr, "unknown option %s (--calls, --rounds, --n)\n", a.c_str());
      return 2;
    }
  }
  Comm w = comm_world();
  Comm dp = w.split(0, w.rank());
  dp.set_name("dp");
  std::vector<float> x(static_cast<size_t>(n), 0.0f);
  double best[2] = {1e30, 1e30};
  for (int round = 0; round < rounds; ++round)
    for (int on = 0; on < 2; ++on) {
      if (on) flight_recorder_start();
      else flight_recorder_stop();
      dp.barrier();
      const double t0 = now();
      for (int i = 0; i < calls; ++i) dp.all_reduce(x.data(), n);
      double t = (now() - t0) / calls;
      w.all_reduce(&t, 1);  // the mean over ranks
      best[on] = std::min(best[on], t / w.size());
    }
  flight_recorder_stop();
  if (w.rank() == 0)
    std::printf("all_reduce of %d floats on %d ranks, %d calls x %d rounds: %.2f us per call without the flight "
                "recorder, %.2f us with (+%.2f us)\n",
                n, w.size(), calls, rounds, best[0] * 1e6, best[1] * 1e6, (best[1] - best[0]) * 1e6);
  comm_finalize();
  return 0;
}
