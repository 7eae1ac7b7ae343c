// ep_wire.h: what every EP dispatcher (src/ep/dispatch_*.cpp) uses below its layout: the bf16 row conversions
// of the wire formats, the fp8 block and padding constants, the tracked buffer that only grows (or, frozen,
// refuses to), and the clock that times one public call and its communication.
// Not a dispatcher and not a layout: the record headers are with their layouts (WireMeta in dispatch_flat.h,
// RecMeta in dispatch_hier.cpp), the payload codecs and the shared state in dispatcher.h.
#pragma once
#include <chrono>
#include <cstddef>
#include <cstdint>

#include "moetron/check.h"
#include "moetron/dtype.h"
#include "moetron/ep_dispatch.h"
#include "moetron/gemm.h"
#include "moetron/memory.h"

namespace moetron::ep {

constexpr int64_t kFp8Block = 128;  // e4m3 payload: one fp32 scale per 1 x 128 block of a token row
// Loops over fewer elements than this stay serial: a parallel region costs more than it saves, and much
// more when ranks oversubscribe the cores.
constexpr int64_t kParMin = int64_t(1) << 16;

inline int64_t round_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

// Wire conversions: serial (the callers parallelize over rows), AVX-512 when active, else the scalar codecs
// of dtype.h; both are bitwise to_bf16 / from_bf16.
inline void to_wire_bf16(bf16* out, const float* in, int64_t n) { f32_to_bf16_serial(out, in, n); }
inline void from_wire_bf16(float* out, const bf16* in, int64_t n) { bf16_to_f32_serial(out, in, n); }
// Row-parallel versions for [rows, D] blocks.
void to_wire_bf16_rows(bf16* out, const float* in, int64_t rows, int64_t D);
void from_wire_bf16_rows(float* out, const bf16* in, int64_t rows, int64_t D);

inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// One public call's traffic: body(tr) fills it, the wall time is added, and it becomes the "last" record and
// is added to the running total.
template <class Body>
void record_call(EpTraffic& last, EpTraffic& total, Body&& body) {
  const double t0 = now_s();
  EpTraffic tr;
  tr.calls = 1;
  body(tr);
  tr.seconds = now_s() - t0;
  last = tr;
  total.add(tr);
}

// One communication call, its time added to tr.seconds_comm (the caller counts the rounds).
template <class Call>
void timed_comm(EpTraffic& tr, Call&& call) {
  const double c0 = now_s();
  call();
  tr.seconds_comm += now_s() - c0;
}

// A tracked buffer that only grows (or, when frozen, refuses to grow).
struct Buf {
  const char* name = "";
  char* p = nullptr;
  size_t bytes = 0;
  bool frozen = false;
  explicit Buf(const char* n) : name(n) {}
  ~Buf() { mt_free(p, bytes, MemCategory::Comm); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  template <class T = char>
  T* get(int64_t count) {
    const size_t need = size_t(count) * sizeof(T);
    if (need > bytes) {
      MT_CHECK(!frozen, "ep_dispatch", "buffer '", name, "' needs ", need, " bytes but sync_free allocated ", bytes,
               " at construction");
      mt_free(p, bytes, MemCategory::Comm);
      p = nullptr;
      p = static_cast<char*>(mt_alloc(need, MemCategory::Comm));
      bytes = need;
    }
    return reinterpret_cast<T*>(p);
  }
  template <class T = char>
  T* data() const {
    return reinterpret_cast<T*>(p);
  }
};

}  // namespace moetron::ep
