// comm.h: Comm, the one narrow communication interface of moetron: rank/size, all_reduce (sum),
// reduce_scatter, all_gather, all_to_all_v, a capped exchange, send/recv (blocking and non-blocking),
// barrier and split. Two backends: MPI (src/comm/comm_mpi.cpp, when built with MOETRON_WITH_MPI) and
// single-process (size 1, collectives are copies). Every call is timed and its bytes counted per op kind
// (stats()), and can be reported to a trace hook. Not a tensor library and not a scheduler: raw pointers,
// sizes, blocking calls plus non-blocking point-to-point (isend / irecv / wait).
//
// Reduction order (all_reduce, reduce_scatter, all_reduce_ordered); this is what parallel-equivalence
// tests can rely on:
//   every reduced element is the left fold  ((x_0 + x_1) + x_2) + ... + x_{p-1}  over the ranks in rank
//   order 0..p-1 (x_r = that element on rank r), computed once, by one rank, and copied to the others.
//   So the result is bitwise identical on every rank, bitwise reproducible run to run, and does not depend
//   on how the vector is chunked between ranks; it does depend on p (a different association).
//   Implementation: fixed chunks of at most kCommReduceSegment elements; inside a segment, rank r owns the
//   elements [r*m/p, (r+1)*m/p); all_to_all_v delivers every rank's copy of its chunk, the owner folds them
//   in rank order, all_gather_v returns the chunks. MPI_Allreduce is not used (its order is unspecified).
//   Integer sums are exact (two's complement wrap on overflow).
//   all_reduce_ordered(parts, m): each rank holds m_r >= 0 vectors; the result is the left fold over ALL
//   vectors in global order (rank 0's parts, then rank 1's, ...), so it equals the single-process
//   sequential sum of the same list whatever the split between ranks (p = 1 with all parts included).
//
// Bytes. Each op records `bytes` (the payload of the call seen from this rank: all_reduce n*elem;
// reduce_scatter its input; all_gather / all_to_all_v / exchange what this rank contributes; send what is
// sent; recv what is received) and `wire_bytes` (what this rank itself sends to OTHER ranks for the
// algorithm used: e.g. all_to_all_v excludes the self block; all_reduce counts both phases).
//
// Non-blocking point-to-point (isend / irecv, completed by wait / wait_all). Accounting matches send/recv:
// an isend counts as one Send call with its bytes (and wire bytes unless sent to itself), an irecv as one Recv
// call, both when posted; the op's seconds add the time spent posting and the time spent in the wait that
// completes it (a wait_all's time is shared equally among its requests), not the time the message was in
// flight while the caller did other work. The trace hook sees one event per request when it completes, from
// its posting to the end of its wait. Matching follows MPI: between one sender and one receiver, messages
// with the same tag are received in the order they were sent. The single-process backend loops back to
// itself: an isend is buffered at once (complete when posted); an irecv completes at once if a message is
// waiting, else at the next send/isend with its tag; waiting for an irecv nothing can satisfy is refused.
//
// Tags: user send/recv tags must be in [0, kCommMaxUserTag]; larger tags are reserved.
// Thread safety: a Comm is used by one thread at a time (MPI is initialized with MPI_THREAD_FUNNELED).
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace moetron {

enum class CommOp : uint8_t { AllReduce, ReduceScatter, AllGather, AllToAllV, Exchange, Send, Recv, Barrier, Split };
inline constexpr int kNumCommOps = 9;
std::string_view comm_op_name(CommOp op);

enum class ReduceType : uint8_t { F32, F64, I32, I64 };
size_t reduce_type_size(ReduceType t);

inline constexpr int kCommMaxUserTag = 29999;
inline constexpr int64_t kCommReduceSegment = int64_t(1) << 22;  // elements per all_reduce segment

struct CommOpStats {
  int64_t calls = 0;
  int64_t bytes = 0;
  int64_t wire_bytes = 0;
  double seconds = 0;
};

struct CommStats {
  std::array<CommOpStats, kNumCommOps> op{};
  const CommOpStats& operator[](CommOp o) const { return op[size_t(o)]; }
  CommOpStats total() const;
  std::string summary() const;  // one line per op kind that was called
};

// Who a communicator is, for traces: its name (see Comm::set_name) and its members' ranks in MPI_COMM_WORLD,
// in the communicator's rank order (single process: {0}).
struct CommInfo {
  std::string name;
  std::vector<int> world_ranks;
};

// One call, for traces. Times are seconds on std::chrono::steady_clock since its epoch. Pointers are valid
// during the hook call only.
struct CommEvent {
  CommOp op;
  int64_t bytes = 0, wire_bytes = 0;
  double t_begin = 0, t_end = 0;
  int comm_size = 1;
  // What this rank put in and got out: all_reduce n*elem both; reduce_scatter its p*n*elem input, n*elem out;
  // all_gather its part, p parts; all_to_all_v / exchange the sums of its send / receive counts (exchange:
  // receive sizes are not known to the call: 0); send its bytes out; recv its bytes in.
  int64_t bytes_in = 0, bytes_out = 0;
  // Collectives (every op but send / recv): the communicator's sequence number of this collective, counted from
  // 0 since the communicator was made; every member numbers the same collective alike. -1 for send / recv.
  int64_t seq = -1;
  // send / recv: the peer's rank in the communicator, the tag, and the message's index among this
  // communicator's messages from the sender to the receiver with that tag (both ends count alike, in posting
  // order, so the k-th send pairs with the k-th receive: MPI's non-overtaking order). -1 otherwise.
  int peer = -1, tag = -1;
  int64_t msg = -1;
  // all_to_all_v: bytes to / from each member [comm_size]; exchange: send_counts only. Null otherwise.
  const int64_t* send_counts = nullptr;
  const int64_t* recv_counts = nullptr;
  // Non-blocking requests (isend / irecv), reported when completed: t_begin is the posting, t_post_end the end
  // of the posting call, t_wait_begin the start of the wait that completed it (t_end its end); the request is
  // wait_index of the wait_count requests that wait completed.
  bool nonblocking = false;
  double t_post_end = 0, t_wait_begin = 0;
  int wait_index = 0, wait_count = 0;
  const CommInfo* comm = nullptr;  // the communicator (always set)
  // The flight recorder's sink (set_comm_flight_sink) also sees calls before they finish: Scheduled when a
  // non-blocking request is posted, Started when a blocking call (or the wait of a request) begins (t_end = 0),
  // Completed at the end. The trace hooks see Completed events only.
  enum class State : uint8_t { Scheduled, Started, Completed };
  State state = State::Completed;
};
using CommTraceHook = std::function<void(const CommEvent&)>;
// "<name>@<first member's MPI_COMM_WORLD rank>": how flight-recorder dumps name a communicator.
std::string comm_group_id(const CommInfo& info);
// A hook every communicator reports to (besides its own set_trace_hook), e.g. the profiler's; empty = none.
// Set it while no communication runs on any thread.
void set_comm_trace_sink(CommTraceHook hook);
// The flight recorder's sink (src/comm/flight_recorder.cpp): every call's Scheduled / Started / Completed
// events with the same sequence numbers the traces use. Set it while no communication runs; empty = none.
// Called from whichever thread communicates: it must be thread-safe.
void set_comm_flight_sink(CommTraceHook hook);

namespace detail {
class CommBackend;
struct CommState;
}  // namespace detail

// A posted non-blocking send or receive (Comm::isend / Comm::irecv). Move-only. Complete it exactly once with
// wait() or wait_all() on the Comm that posted it; until then the buffer must stay valid (and an isend's
// buffer unchanged). A request dropped while pending stays counted in Comm::pending_requests().
class CommRequest {
 public:
  CommRequest() = default;
  CommRequest(CommRequest&& o) noexcept : owner_(o.owner_), id_(o.id_) { o.id_ = -1; }
  CommRequest& operator=(CommRequest&& o) noexcept {
    owner_ = o.owner_;
    id_ = o.id_;
    o.id_ = -1;
    return *this;
  }
  CommRequest(const CommRequest&) = delete;
  CommRequest& operator=(const CommRequest&) = delete;
  bool pending() const { return id_ >= 0; }  // posted and not yet waited for

 private:
  friend class Comm;
  friend struct detail::CommState;
  const void* owner_ = nullptr;
  int64_t id_ = -1;
};

// Memory every member of a communicator can load from and store to directly: one segment per member, all of
// them on one node (an MPI shared-memory window; the single-process communicator's is plain memory). What a
// transport that writes rows straight into a peer's buffer builds on (the EP dispatchers' ep_transport = "shm").
// Made by Comm::share_memory (collective); destroying it is collective too, except while an exception unwinds
// (then the window is left to MPI_Finalize). Ordering between members: stores made before a publish() of a
// flag are visible to a member once it has seen that flag's value with seen().
class SharedMemory {
 public:
  virtual ~SharedMemory() = default;
  virtual char* segment(int rank) const = 0;  // member `rank`'s segment: bytes() long, 64-byte aligned
  virtual int64_t bytes() const = 0;
  // Waits until ready() holds, the way communication waits ([comm] mpi_wait, mpi_max_nap_us): it tests at once,
  // then naps between tests, running the thread's CommIdleWork. Single process: ready() must already hold.
  virtual void wait_until(const std::function<bool()>& ready) const = 0;
  static void publish(int64_t* flag, int64_t v);  // release store
  static int64_t seen(const int64_t* flag);       // acquire load
};

// A handle (like a shared_ptr: the methods are const, the communicator and its stats are shared by copies).
// A default-constructed Comm is the single-process communicator (size 1).
class Comm {
 public:
  Comm();
  explicit Comm(std::shared_ptr<detail::CommBackend> backend);

  int rank() const;
  int size() const;
  std::string_view backend_name() const;  // "local" or "mpi"

  // In-place sum; the order above. n >= 0 elements.
  void all_reduce(float* x /* [n] */, int64_t n) const;
  void all_reduce(double* x /* [n] */, int64_t n) const;
  void all_reduce(int32_t* x /* [n] */, int64_t n) const;
  void all_reduce(int64_t* x /* [n] */, int64_t n) const;
  void all_reduce(void* x /* [n] */, int64_t n, ReduceType t) const;

  // out = the sum over ranks of block `rank()` of in (blocks of n elements), same order as all_reduce.
  void reduce_scatter(float* out /* [n] */, const float* in /* [size*n] */, int64_t n) const;
  void reduce_scatter(double* out /* [n] */, const double* in /* [size*n] */, int64_t n) const;
  void reduce_scatter(int32_t* out /* [n] */, const int32_t* in /* [size*n] */, int64_t n) const;
  void reduce_scatter(int64_t* out /* [n] */, const int64_t* in /* [size*n] */, int64_t n) const;
  void reduce_scatter(void* out /* [n] */, const void* in /* [size*n] */, int64_t n, ReduceType t) const;

  // Sum in global order over every rank's parts (see above). out may not alias parts.
  void all_reduce_ordered(float* out /* [n] */, const float* parts /* [m_local, n] */, int64_t m_local, int64_t n) const;
  void all_reduce_ordered(double* out /* [n] */, const double* parts /* [m_local, n] */, int64_t m_local,
                          int64_t n) const;

  // out[r*bytes .. (r+1)*bytes) = rank r's `in`. out may not alias in.
  void all_gather(void* out /* [size*bytes] */, const void* in /* [bytes] */, int64_t bytes) const;
  // Variable sizes: rank r contributes counts[r] bytes, placed at out + displs[r] (every rank passes the
  // same counts/displs); in has counts[rank()] bytes.
  void all_gather_v(void* out, const int64_t* counts /* [size] */, const int64_t* displs /* [size] */,
                    const void* in) const;

  // Byte counts and displacements per peer (any dtype as bytes). send_counts[p] on rank r must equal
  // recv_counts[r] on rank p. Buffers may not overlap.
  void all_to_all_v(void* recv, const int64_t* recv_counts /* [size] */, const int64_t* recv_displs /* [size] */,
                    const void* send, const int64_t* send_counts /* [size] */,
                    const int64_t* send_displs /* [size] */) const;
  // Equal blocks: bytes_per_peer to and from every rank.
  void all_to_all(void* recv /* [size*b] */, const void* send /* [size*b] */, int64_t bytes_per_peer) const;

  // One exchange without a count round: the message for peer p (send_counts[p] <= capacity bytes) lands at
  // recv + q*capacity on p, where q is the sender. Receivers do not learn the sizes from this call: the
  // payload must say them (e.g. a header). Only send_counts[p] bytes cross the wire.
  void exchange(void* recv /* [size*capacity] */, int64_t capacity, const void* send,
                const int64_t* send_counts /* [size] */, const int64_t* send_displs /* [size] */) const;

  void send(const void* buf, int64_t bytes, int dst, int tag = 0) const;
  void recv(void* buf, int64_t bytes, int src, int tag = 0) const;  // exactly `bytes` must arrive
  // Non-blocking forms (see above). An irecv checks at completion that exactly `bytes` arrived.
  CommRequest isend(const void* buf, int64_t bytes, int dst, int tag = 0) const;
  CommRequest irecv(void* buf, int64_t bytes, int src, int tag = 0) const;
  // Completes the request(s) and leaves them empty. Refuses an empty request (never posted, or already
  // completed) and one posted on another communicator, naming its position in the list.
  void wait(CommRequest& r) const;
  void wait_all(CommRequest* reqs, size_t n) const;
  int64_t pending_requests() const;  // posted, not yet completed
  void barrier() const;

  // One segment of `bytes` (rounded up to 64) per member that every member can address (SharedMemory above).
  // Collective. Null on every member when they do not all share one node.
  std::unique_ptr<SharedMemory> share_memory(int64_t bytes) const;
  // m.wait_until(ready), recorded as a barrier of this communicator (statistics, traces, the flight recorder and
  // its watchdog): every member must make the same sequence of these waits, as of any collective.
  void wait_shared(const SharedMemory& m, const std::function<bool()>& ready) const;

  // Ranks with the same color (>= 0) form a communicator, ordered by (key, rank). Collective.
  Comm split(int color, int key) const;

  CommStats stats() const;
  void reset_stats() const;
  void set_trace_hook(CommTraceHook hook) const;
  // The name traces use for this communicator. comm_world() is "world", comm_local() and Comm() "local"; a
  // communicator made by split() is "<parent name>.<k>" for the parent's k-th split (k counts from 0 and is
  // the same on every member, split being collective) until it is named otherwise.
  void set_name(std::string name) const;
  const CommInfo& info() const;  // name and MPI_COMM_WORLD ranks of the members (computed on first use)

 private:
  std::shared_ptr<detail::CommState> s_;
};

Comm comm_local();
// MPI_COMM_WORLD when built with MPI and either MPI is already initialized or the process was started by
// an MPI launcher (OMPI_COMM_WORLD_SIZE / PMI_SIZE / PMIX_RANK set): initializes MPI on first use.
// Otherwise the single-process communicator.
Comm comm_world();
bool comm_mpi_built();
// Finalizes MPI if comm_world() initialized it (idempotent; also registered with atexit).
void comm_finalize();
// MPI runs with MPI_THREAD_MULTIPLE: two threads may use two different communicators at once (the
// pipeline's EP overlap needs it). comm_world() initialises MPI with it, unless comm_request_mpi_thread(false)
// asked for MPI_THREAD_FUNNELED before ([comm] mpi_thread = "funneled"; docs/benchmarks.md compares the two).
bool comm_thread_multiple();
// The thread level comm_world() asks MPI_Init for: true MPI_THREAD_MULTIPLE (the default), false
// MPI_THREAD_FUNNELED. MPI starts once per process, so the level is chosen once: returns false, changing nothing,
// when MPI has already started at another level (started by comm_world() asking for the other one, or started
// outside moetron at MULTIPLE when FUNNELED is asked), true otherwise. Without MPI: true, nothing to do. The
// trainer calls it with [comm] mpi_thread before its first comm_world().
bool comm_request_mpi_thread(bool multiple);
// How the MPI transport waits for its requests ([comm] mpi_wait, mpi_max_nap_us): poll = true tests them and,
// after 50 us, sleeps between tests (20 us, doubling up to max_nap_us, in [20, 5000]); false waits inside
// MPI_Waitall. Process-wide, for the waits that start after the call; poll and 200 us until a call (the trainer
// calls it with its config at start-up). Without MPI: nothing to do.
void comm_set_mpi_wait(bool poll, int max_nap_us);

// Work a thread may do while it waits inside a Comm call: the MPI backend, polling its pending requests
// ([comm] mpi_wait = "poll", the default), calls fn(ctx) between tests; fn returns true if it did some work (the wait
// tests again at once) and false if it had none (the wait naps as before). The EP overlap uses it to run deferred
// weight gradients while both lanes wait (docs/pipeline.md). Per thread; nests: the destructor restores the hook
// that was set before. With mpi_wait = "spin" (one blocking MPI wait) no hook runs.
class CommIdleWork {
 public:
  CommIdleWork(bool (*fn)(void*), void* ctx);
  ~CommIdleWork();
  CommIdleWork(const CommIdleWork&) = delete;
  CommIdleWork& operator=(const CommIdleWork&) = delete;
  static bool run();  // the calling thread's hook, once; false when none is set

 private:
  bool (*prev_fn_)(void*);
  void* prev_ctx_;
};

}  // namespace moetron
