// comm_mpi.cpp: the MPI transport behind Comm (compiled only with MOETRON_WITH_MPI). Bytes only: byte
// counts are sent as contiguous units of 2^j bytes (the largest power of two <= 4096 dividing every count
// and displacement of the call) so that int-typed MPI counts reach past 2 GiB. Errors come back as
// moetron::Error naming the op and the MPI error string (MPI_ERRORS_RETURN on every communicator).
// Not a reduction: Comm folds in a fixed order itself; MPI_Allreduce is never used. Non-blocking sends and
// receives (isend / irecv) keep their MPI_Request in a table of reusable slots until wait_all completes them.
// Waiting: every call but the barrier is non-blocking underneath and completes in wait_requests(), which tests
// the requests and, once a wait has lasted a little, sleeps between tests ([comm] mpi_wait = "poll", the default)
// instead of spinning inside MPI ("spin"; comm_set_mpi_wait). A rank that waits then leaves its core to the ranks
// and threads that compute, which matters whenever ranks share cores (oversubscribed runs, the EP overlap's second
// lane). MPI_Init asks for the thread level comm_request_mpi_thread chose ([comm] mpi_thread; MULTIPLE by default).
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm_backend.h"
#include "moetron/env.h"
#include "moetron/check.h"
#include "moetron/comm.h"
#include "moetron/memory.h"

namespace moetron::detail {
namespace {

bool g_we_initialized = false;
// The level MPI_Init is asked for (comm_request_mpi_thread), and the one it was asked for when it ran here.
std::atomic<int> g_want_level{MPI_THREAD_MULTIPLE};
int g_asked_level = -1;
// How waits wait (comm_set_mpi_wait): polling with naps up to g_max_nap_us, or one blocking MPI_Waitall.
std::atomic<bool> g_poll{true};
std::atomic<int> g_max_nap_us{200};

void mpi_ok(int rc, const char* op) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  MT_FAIL(op, "MPI error ", rc, ": ", std::string(msg, size_t(len)));
}

// Contiguous byte units 1, 2, 4, ..., 4096, created on first use.
MPI_Datatype unit_type(int log2u) {
  static MPI_Datatype types[13];
  static bool made[13] = {};
  if (!made[log2u]) {
    if (log2u == 0) {
      types[0] = MPI_BYTE;
    } else {
      mpi_ok(MPI_Type_contiguous(1 << log2u, MPI_BYTE, &types[log2u]), "comm.mpi");
      mpi_ok(MPI_Type_commit(&types[log2u]), "comm.mpi");
    }
    made[log2u] = true;
  }
  return types[log2u];
}

// Largest log2(unit) such that every value is a multiple of the unit.
int common_unit(std::initializer_list<std::pair<const int64_t*, int>> arrays, int64_t extra = 0) {
  uint64_t acc = uint64_t(extra);
  for (auto [a, n] : arrays)
    for (int i = 0; i < n; ++i) acc |= uint64_t(a[i]);
  int j = 0;
  while (j < 12 && acc != 0 && (acc & (uint64_t(1) << j)) == 0) ++j;
  if (acc == 0) j = 12;
  return j;
}

// How a rank waits for its requests: sleeping between tests (default) or spinning inside MPI_Waitall.
bool wait_by_polling() { return g_poll.load(std::memory_order_relaxed); }

// The longest sleep between two tests of a long wait: [comm] mpi_max_nap_us (20 to 5000, default 200).
std::chrono::microseconds max_nap() { return std::chrono::microseconds(g_max_nap_us.load(std::memory_order_relaxed)); }

// Tests done() until it holds, running the thread's own work between tests (CommIdleWork, comm.h: then it tests
// again at once). With naps: back to back for the first 50 us (short messages finish at MPI's own latency), then
// sleeping between tests, 20 us at first and doubling up to max_nap() (200 us), so a long wait costs its core
// almost nothing while each test still moves the transfers on (TCP's socket buffers hold far more than 200 us of
// any link here). Without: back to back throughout, yielding the core between tests.
template <class Done>
void poll_until(Done done, bool naps) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  const auto top = max_nap();
  auto nap = std::chrono::microseconds(20);
  while (!done()) {
    if (CommIdleWork::run()) continue;
    if (!naps) {
      std::this_thread::yield();
      continue;
    }
    if (clock::now() - start < std::chrono::microseconds(50)) continue;
    std::this_thread::sleep_for(nap);
    nap = std::min(nap * 2, top);
  }
}

// Completes n requests; returns MPI's code (MPI_ERR_IN_STATUS with per-request errors in st, as MPI_Waitall).
// Polling ([comm] mpi_wait = "poll") with naps, else one MPI_Waitall.
int wait_requests(int n, MPI_Request* reqs, MPI_Status* st) {
  if (!wait_by_polling()) return MPI_Waitall(n, reqs, st);
  int rc = MPI_SUCCESS;
  poll_until(
      [&] {
        int done = 0;
        rc = MPI_Testall(n, reqs, &done, st);
        return rc != MPI_SUCCESS || done;
      },
      true);
  return rc;
}

// A shared-memory window over a communicator whose members all share a node (MpiBackend::share_memory). Each
// member charges its own segment to the Comm memory category.
class MpiShared final : public SharedMemory {
 public:
  MpiShared(MPI_Comm node, int64_t bytes) : node_(node), bytes_((bytes + 63) / 64 * 64) {
    MPI_Info info;
    MPI_Info_create(&info);
    MPI_Info_set(info, "alloc_shared_noncontig", "true");  // each segment on its owner's memory, page aligned
    char* base = nullptr;
    // 64 bytes more, to align each segment (the mappings are page aligned, so every process aligns alike)
    const int rc = MPI_Win_allocate_shared(MPI_Aint(bytes_ + 64), 1, info, node_, &base, &win_);
    MPI_Info_free(&info);
    mpi_ok(rc, "comm.share_memory");
    int n = 0;
    MPI_Comm_size(node_, &n);
    seg_.assign(size_t(n), nullptr);
    for (int r = 0; r < n; ++r) {
      MPI_Aint sz = 0;
      int du = 0;
      void* p = nullptr;
      mpi_ok(MPI_Win_shared_query(win_, r, &sz, &du, &p), "comm.share_memory");
      seg_[size_t(r)] = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
    }
    mpi_ok(MPI_Win_lock_all(MPI_MODE_NOCHECK, win_), "comm.share_memory");
    MemoryTracker::global().on_alloc(MemCategory::Comm, bytes_);
  }
  ~MpiShared() override {
    MemoryTracker::global().on_free(MemCategory::Comm, bytes_);
    int fin = 0;
    MPI_Finalized(&fin);
    if (fin || std::uncaught_exceptions() > 0) return;  // collective calls are not safe while unwinding
    MPI_Win_unlock_all(win_);
    MPI_Win_free(&win_);
    MPI_Comm_free(&node_);
  }
  char* segment(int rank) const override { return static_cast<char*>(seg_.at(size_t(rank))); }
  int64_t bytes() const override { return bytes_; }
  // As a request wait: naps under mpi_wait = "poll"; under "spin" (where requests wait inside MPI) it spins.
  void wait_until(const std::function<bool()>& ready) const override { poll_until(ready, wait_by_polling()); }

 private:
  MPI_Comm node_;
  MPI_Win win_ = MPI_WIN_NULL;
  int64_t bytes_;
  std::vector<void*> seg_;
};

void wait_ok(int n, MPI_Request* reqs, const char* op) { mpi_ok(wait_requests(n, reqs, MPI_STATUSES_IGNORE), op); }

int to_int(int64_t v, int log2u, const char* op) {
  int64_t u = v >> log2u;
  MT_CHECK(u <= INT_MAX, op, "size ", v, " bytes is too large for one MPI call (", INT_MAX, " units of ",
           (1 << log2u), " bytes)");
  return int(u);
}

class MpiBackend final : public CommBackend {
 public:
  MpiBackend(MPI_Comm c, bool owned) : comm_(c), owned_(owned) {
    mpi_ok(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "comm.mpi");
    mpi_ok(MPI_Comm_rank(comm_, &rank_), "comm.mpi");
    mpi_ok(MPI_Comm_size(comm_, &size_), "comm.mpi");
    ic_.resize(size_t(size_) * 4);
  }
  ~MpiBackend() override {
    int fin = 0;
    MPI_Finalized(&fin);
    if (owned_ && !fin) MPI_Comm_free(&comm_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view name() const override { return "mpi"; }

  void all_to_all_v(void* recv, const int64_t* rc, const int64_t* rd, const void* send, const int64_t* sc,
                    const int64_t* sd) override {
    const char* op = "comm.all_to_all_v";
    const int p = size_;
    const int j = common_unit({{rc, p}, {rd, p}, {sc, p}, {sd, p}});
    int *irc = ic_.data(), *ird = irc + p, *isc = ird + p, *isd = isc + p;
    for (int q = 0; q < p; ++q) {
      irc[q] = to_int(rc[q], j, op);
      ird[q] = to_int(rd[q], j, op);
      isc[q] = to_int(sc[q], j, op);
      isd[q] = to_int(sd[q], j, op);
    }
    MPI_Datatype t = unit_type(j);
    // MPI wants valid pointers even when nothing moves.
    static char dummy[64];
    MPI_Request r;
    mpi_ok(MPI_Ialltoallv(send ? send : dummy, isc, isd, t, recv ? recv : dummy, irc, ird, t, comm_, &r), op);
    wait_ok(1, &r, op);
  }

  void all_gather_v(void* out, const int64_t* counts, const int64_t* displs, const void* in) override {
    const char* op = "comm.all_gather_v";
    const int p = size_;
    const int j = common_unit({{counts, p}, {displs, p}});
    int *ic = ic_.data(), *id = ic + p;
    for (int q = 0; q < p; ++q) {
      ic[q] = to_int(counts[q], j, op);
      id[q] = to_int(displs[q], j, op);
    }
    MPI_Datatype t = unit_type(j);
    static char dummy[64];
    MPI_Request r;
    mpi_ok(MPI_Iallgatherv(in ? in : dummy, ic[rank_], t, out, ic, id, t, comm_, &r), op);
    wait_ok(1, &r, op);
  }

  void exchange(void* recv, int64_t capacity, const void* send, const int64_t* sc, const int64_t* sd) override {
    const char* op = "comm.exchange";
    const int p = size_;
    const int j = common_unit({{sc, p}, {sd, p}}, capacity);
    MPI_Datatype t = unit_type(j);
    const int icap = to_int(capacity, j, op);
    reqs_.assign(size_t(2 * p), MPI_REQUEST_NULL);
    char* rb = static_cast<char*>(recv);
    const char* sb = static_cast<const char*>(send);
    for (int q = 0; q < p; ++q)
      if (q != rank_) mpi_ok(MPI_Irecv(rb + q * capacity, icap, t, q, kExchangeTag, comm_, &reqs_[size_t(q)]), op);
    for (int q = 0; q < p; ++q)
      if (q != rank_)
        mpi_ok(MPI_Isend(sb + sd[q], to_int(sc[q], j, op), t, q, kExchangeTag, comm_, &reqs_[size_t(p + q)]), op);
    if (sc[rank_] > 0) std::memmove(rb + rank_ * capacity, sb + sd[rank_], size_t(sc[rank_]));
    wait_ok(2 * p, reqs_.data(), op);
  }

  void send(const void* buf, int64_t bytes, int dst, int tag) override {
    const int j = common_unit({}, bytes);
    static char dummy[64];
    MPI_Request r;
    mpi_ok(MPI_Isend(buf ? buf : dummy, to_int(bytes, j, "comm.send"), unit_type(j), dst, tag, comm_, &r), "comm.send");
    wait_ok(1, &r, "comm.send");
  }

  void recv(void* buf, int64_t bytes, int src, int tag) override {
    const char* op = "comm.recv";
    MPI_Status st;
    static char dummy[64];
    // Received as bytes so that the size check below is exact.
    MT_CHECK(bytes <= INT_MAX, op, "recv of ", bytes, " bytes is too large for one MPI call");
    MPI_Request r;
    mpi_ok(MPI_Irecv(buf ? buf : dummy, int(bytes), MPI_BYTE, src, tag, comm_, &r), op);
    mpi_ok(wait_requests(1, &r, &st), op);
    int got = 0;
    MPI_Get_count(&st, MPI_BYTE, &got);
    MT_CHECK(got == bytes, op, "message of ", got, " bytes from rank ", src, ", expected ", bytes, " (tag ", tag, ")");
  }

  int64_t isend(const void* buf, int64_t bytes, int dst, int tag) override {
    const char* op = "comm.isend";
    const int j = common_unit({}, bytes);
    static char dummy[64];
    const int count = to_int(bytes, j, op);
    const int64_t id = new_req({MPI_REQUEST_NULL, bytes, dst, tag, false});
    mpi_ok(MPI_Isend(buf ? buf : dummy, count, unit_type(j), dst, tag, comm_, &preq_[size_t(id)].req), op);
    return id;
  }

  int64_t irecv(void* buf, int64_t bytes, int src, int tag) override {
    const char* op = "comm.irecv";
    static char dummy[64];
    // Received as bytes so that the size check at completion is exact.
    MT_CHECK(bytes <= INT_MAX, op, "irecv of ", bytes, " bytes is too large for one MPI call");
    const int64_t id = new_req({MPI_REQUEST_NULL, bytes, src, tag, true});
    mpi_ok(MPI_Irecv(buf ? buf : dummy, int(bytes), MPI_BYTE, src, tag, comm_, &preq_[size_t(id)].req), op);
    return id;
  }

  std::string wait_all(const int64_t* ids, int n) override {
    reqs_.resize(size_t(n));
    stats_.resize(size_t(n));
    for (int k = 0; k < n; ++k) reqs_[size_t(k)] = preq_[size_t(ids[k])].req;
    const int rc = wait_requests(n, reqs_.data(), stats_.data());
    for (int k = 0; k < n; ++k) free_.push_back(ids[k]);
    auto describe = [&](const Req& r) {
      return std::string(r.is_recv ? "irecv of " : "isend of ") + std::to_string(r.bytes) + " bytes " +
             (r.is_recv ? "from" : "to") + " rank " + std::to_string(r.peer) + " (tag " + std::to_string(r.tag) + ")";
    };
    auto mpi_text = [](int code) {
      char msg[MPI_MAX_ERROR_STRING];
      int len = 0;
      MPI_Error_string(code, msg, &len);
      return "MPI error " + std::to_string(code) + ": " + std::string(msg, size_t(len));
    };
    if (rc != MPI_SUCCESS) {
      for (int k = 0; k < n; ++k) {
        const int e = stats_[size_t(k)].MPI_ERROR;
        if (rc == MPI_ERR_IN_STATUS && e != MPI_SUCCESS && e != MPI_ERR_PENDING)
          return describe(preq_[size_t(ids[k])]) + ": " + mpi_text(e);
      }
      return mpi_text(rc);
    }
    for (int k = 0; k < n; ++k) {
      const Req& r = preq_[size_t(ids[k])];
      if (!r.is_recv) continue;
      int got = 0;
      MPI_Get_count(&stats_[size_t(k)], MPI_BYTE, &got);
      if (got != r.bytes)
        return "message of " + std::to_string(got) + " bytes from rank " + std::to_string(r.peer) + ", expected " +
               std::to_string(r.bytes) + " (tag " + std::to_string(r.tag) + ", posted by irecv)";
    }
    return {};
  }

  // Blocking: barriers are rare (start-up, folders shared between ranks), and a barrier must never pair with
  // another rank's non-blocking collective (libnbc numbers its operations per communicator, so an Ibarrier
  // facing a mismatched Ialltoallv could match its messages instead of hanging where the watchdog sees it).
  void barrier() override { mpi_ok(MPI_Barrier(comm_), "comm.barrier"); }

  std::shared_ptr<CommBackend> split(int color, int key) override {
    MPI_Comm c;
    mpi_ok(MPI_Comm_split(comm_, color, key, &c), "comm.split");
    return std::make_shared<MpiBackend>(c, true);
  }

  std::unique_ptr<SharedMemory> share_memory(int64_t bytes) override {
    MPI_Comm node;
    mpi_ok(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node), "comm.share_memory");
    int n = 0;
    MPI_Comm_size(node, &n);
    // one node for all: every member's node communicator has all of them (gathered, so every member decides alike)
    std::vector<int> sizes(static_cast<size_t>(size_));
    mpi_ok(MPI_Allgather(&n, 1, MPI_INT, sizes.data(), 1, MPI_INT, comm_), "comm.share_memory");
    if (*std::min_element(sizes.begin(), sizes.end()) != size_) {
      MPI_Comm_free(&node);
      return nullptr;
    }
    return std::make_unique<MpiShared>(node, bytes);  // node ranks = ranks here (split key = rank)
  }

  std::vector<int> world_ranks() const override {  // local calls only: no communication
    MPI_Group mine, world;
    mpi_ok(MPI_Comm_group(comm_, &mine), "comm.world_ranks");
    mpi_ok(MPI_Comm_group(MPI_COMM_WORLD, &world), "comm.world_ranks");
    std::vector<int> in(static_cast<size_t>(size_)), out(static_cast<size_t>(size_));
    for (int r = 0; r < size_; ++r) in[size_t(r)] = r;
    mpi_ok(MPI_Group_translate_ranks(mine, size_, in.data(), world, out.data()), "comm.world_ranks");
    MPI_Group_free(&mine);
    MPI_Group_free(&world);
    return out;
  }

 private:
  MPI_Comm comm_;
  bool owned_;
  int rank_ = 0, size_ = 1;
  std::vector<int> ic_;
  std::vector<MPI_Request> reqs_;
  std::vector<MPI_Status> stats_;
  // Non-blocking requests by id (slots reused once completed).
  struct Req {
    MPI_Request req = MPI_REQUEST_NULL;
    int64_t bytes = 0;
    int peer = 0, tag = 0;
    bool is_recv = false;
  };
  std::vector<Req> preq_;
  std::vector<int64_t> free_;
  int64_t new_req(const Req& r) { return put_request(preq_, free_, r); }
};

}  // namespace

bool mpi_launched() {
  int init = 0;
  MPI_Initialized(&init);
  if (init) return true;
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"})
    if (std::getenv(v)) return true;
  return false;
}

std::shared_ptr<CommBackend> mpi_world_backend() {
  static std::once_flag once;
  std::call_once(once, [] {
    int init = 0;
    MPI_Initialized(&init);
    if (!init) {
      int provided = 0;
      // MULTIPLE: the pipeline's EP overlap runs two micro-batches' halves on two threads, each with its own
      // communicators (Model lanes). Everything else calls MPI from the main thread only.
      // [comm] mpi_thread = "funneled" asks for the lower level (for comparisons; ep_overlap is then refused).
      refuse_retired_env();  // MOETRON_MPI_THREAD and the rest: errors naming their config keys (env.h)
      const int want = g_want_level.load();
      mpi_ok(MPI_Init_thread(nullptr, nullptr, want, &provided), "comm.init");
      g_we_initialized = true;
      g_asked_level = want;
      std::atexit([] { mpi_finalize_if_owned(); });
    }
  });
  int fin = 0;
  MPI_Finalized(&fin);
  MT_CHECK(!fin, "comm.init", "MPI was already finalized");
  return std::make_shared<MpiBackend>(MPI_COMM_WORLD, false);
}

bool mpi_thread_multiple() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (!init || fin) return false;
  int level = 0;
  MPI_Query_thread(&level);
  return level == MPI_THREAD_MULTIPLE;
}

bool mpi_request_thread(bool multiple) {
  const int want = multiple ? MPI_THREAD_MULTIPLE : MPI_THREAD_FUNNELED;
  int init = 0;
  MPI_Initialized(&init);
  if (!init) {
    g_want_level.store(want);
    return true;
  }
  if (g_we_initialized) return g_asked_level == want;
  int level = 0;  // started outside moetron: FUNNELED cannot be had from a MULTIPLE MPI
  MPI_Query_thread(&level);
  return multiple || level != MPI_THREAD_MULTIPLE;
}

void mpi_set_wait(bool poll, int max_nap_us) {
  MT_CHECK(max_nap_us >= 20 && max_nap_us <= 5000, "comm", "comm.mpi_max_nap_us = ", max_nap_us,
           " must be in [20, 5000] microseconds");
  g_poll.store(poll);
  g_max_nap_us.store(max_nap_us);
}

void mpi_finalize_if_owned() {
  int fin = 0;
  MPI_Finalized(&fin);
  if (g_we_initialized && !fin) MPI_Finalize();
}

}  // namespace moetron::detail
