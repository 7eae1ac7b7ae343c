// comm_backend.h (internal): the raw transport a Comm wraps. A backend moves bytes and nothing else:
// no reductions (Comm folds in a fixed order itself), no timing, no statistics. Two implementations:
// the single-process backend (comm.cpp) and MPI (comm_mpi.cpp, only when MOETRON_WITH_MPI).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "moetron/comm.h"

namespace moetron::detail {

// Tags above kCommMaxUserTag (comm.h) that the backends use for their own point-to-point traffic.
inline constexpr int kExchangeTag = 30001;

// A request table with reused ids: stores `r` in a free slot (or a new one) of `table` and returns its id.
template <class R>
int64_t put_request(std::vector<R>& table, std::vector<int64_t>& free_ids, const R& r) {
  int64_t id;
  if (!free_ids.empty()) {
    id = free_ids.back();
    free_ids.pop_back();
  } else {
    id = int64_t(table.size());
    table.emplace_back();
  }
  table[size_t(id)] = r;
  return id;
}

class CommBackend {
 public:
  virtual ~CommBackend() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string_view name() const = 0;
  // Byte counts / displacements per peer, validated by Comm before the call.
  virtual void all_to_all_v(void* recv, const int64_t* recv_counts, const int64_t* recv_displs, const void* send,
                            const int64_t* send_counts, const int64_t* send_displs) = 0;
  virtual void all_gather_v(void* out, const int64_t* counts, const int64_t* displs, const void* in) = 0;
  virtual void exchange(void* recv, int64_t capacity, const void* send, const int64_t* send_counts,
                        const int64_t* send_displs) = 0;
  virtual void send(const void* buf, int64_t bytes, int dst, int tag) = 0;
  virtual void recv(void* buf, int64_t bytes, int src, int tag) = 0;
  // Non-blocking point-to-point: each returns a request id (>= 0) of this backend; wait_all completes the
  // given ids (each exactly once). It throws only when it completed none of them (they stay pending); once
  // they are complete it returns "" or the first problem (a receive that got another byte count, an MPI
  // error in a status), which Comm reports after releasing the requests. Arguments validated by Comm.
  virtual int64_t isend(const void* buf, int64_t bytes, int dst, int tag) = 0;
  virtual int64_t irecv(void* buf, int64_t bytes, int src, int tag) = 0;
  virtual std::string wait_all(const int64_t* ids, int n) = 0;
  virtual void barrier() = 0;
  virtual std::shared_ptr<CommBackend> split(int color, int key) = 0;
  // Comm::share_memory: null when the members do not all share a node (the same answer on every member).
  virtual std::unique_ptr<SharedMemory> share_memory(int64_t bytes) = 0;
  // The members' ranks in MPI_COMM_WORLD, in this communicator's order (single process: {0}). For traces.
  virtual std::vector<int> world_ranks() const = 0;
};

std::shared_ptr<CommBackend> make_local_backend();

#if MOETRON_WITH_MPI
bool mpi_launched();                                 // started by an MPI launcher, or MPI already initialized
std::shared_ptr<CommBackend> mpi_world_backend();    // initializes MPI on first use
void mpi_finalize_if_owned();
bool mpi_thread_multiple();  // MPI initialised with MPI_THREAD_MULTIPLE (and not finalized)
void mpi_set_wait(bool poll, int max_nap_us);  // comm_set_mpi_wait
bool mpi_request_thread(bool multiple);        // comm_request_mpi_thread
#endif

}  // namespace moetron::detail
