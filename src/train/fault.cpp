// fault.cpp: the MOETRON_FAULT grammar and the fault kinds that act alone (kill, delay); see fault.h. The
// trainer's own reactions (nan, mismatch) live at its hook points in train_step.cpp.
#include "moetron/fault.h"

#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "moetron/check.h"

namespace moetron {

std::string_view to_string(FaultKind k) {
  switch (k) {
    case FaultKind::Kill: return "kill";
    case FaultKind::Delay: return "delay";
    case FaultKind::Nan: return "nan";
    case FaultKind::Mismatch: return "mismatch";
  }
  return "?";
}

std::string_view to_string(FaultPhase p) {
  switch (p) {
    case FaultPhase::Forward: return "forward";
    case FaultPhase::Backward: return "backward";
    case FaultPhase::Optimizer: return "optimizer";
    case FaultPhase::Checkpoint: return "checkpoint";
  }
  return "?";
}

namespace {

std::vector<std::string_view> split(std::string_view s, char sep) {
  std::vector<std::string_view> out;
  size_t a = 0;
  for (size_t i = 0; i <= s.size(); ++i)
    if (i == s.size() || s[i] == sep) out.push_back(s.substr(a, i - a)), a = i + 1;
  return out;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\n')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\n')) s.remove_suffix(1);
  return s;
}

[[noreturn]] void bad(std::string_view spec, const std::string& why) {
  throw Error("MOETRON_FAULT: \"" + std::string(spec) + "\": " + why +
              " (expected kind:rank=R:step=S:phase=P[:ms=M], kind one of kill, delay, nan, mismatch; "
              "phase one of forward, backward, optimizer, checkpoint; docs/reliability.md)");
}

int64_t number(std::string_view spec, std::string_view key, std::string_view v, int64_t lo, int64_t hi) {
  if (v.empty()) bad(spec, std::string(key) + " has no value");
  int64_t x = 0;
  for (char c : v) {
    if (c < '0' || c > '9') bad(spec, std::string(key) + "=" + std::string(v) + " is not a non-negative integer");
    if (x > (hi - (c - '0')) / 10) bad(spec, std::string(key) + "=" + std::string(v) + " is too large");
    x = x * 10 + (c - '0');
  }
  if (x < lo) bad(spec, std::string(key) + "=" + std::string(v) + " must be >= " + std::to_string(lo));
  return x;
}

FaultSpec parse_one(std::string_view spec) {
  const auto parts = split(spec, ':');
  FaultSpec f;
  f.text = std::string(spec);
  const std::string_view kind = parts[0];
  if (kind == "kill") f.kind = FaultKind::Kill;
  else if (kind == "delay") f.kind = FaultKind::Delay;
  else if (kind == "nan") f.kind = FaultKind::Nan;
  else if (kind == "mismatch") f.kind = FaultKind::Mismatch;
  else bad(spec, "unknown kind \"" + std::string(kind) + "\"");
  bool has_rank = false, has_step = false, has_phase = false, has_ms = false;
  for (size_t i = 1; i < parts.size(); ++i) {
    const std::string_view kv = parts[i];
    const size_t eq = kv.find('=');
    if (eq == std::string_view::npos) bad(spec, "\"" + std::string(kv) + "\" is not key=value");
    const std::string_view k = kv.substr(0, eq), v = kv.substr(eq + 1);
    bool* seen = k == "rank" ? &has_rank : k == "step" ? &has_step : k == "phase" ? &has_phase : k == "ms" ? &has_ms : nullptr;
    if (!seen) bad(spec, "unknown key \"" + std::string(k) + "\" (keys: rank, step, phase, ms)");
    if (*seen) bad(spec, "key \"" + std::string(k) + "\" given twice");
    *seen = true;
    if (k == "rank") f.rank = int(number(spec, k, v, 0, 1 << 24));
    else if (k == "step") f.step = number(spec, k, v, 1, int64_t(1) << 50);
    else if (k == "ms") f.ms = number(spec, k, v, 0, int64_t(1) << 40);
    else if (v == "forward") f.phase = FaultPhase::Forward;
    else if (v == "backward") f.phase = FaultPhase::Backward;
    else if (v == "optimizer") f.phase = FaultPhase::Optimizer;
    else if (v == "checkpoint") f.phase = FaultPhase::Checkpoint;
    else bad(spec, "unknown phase \"" + std::string(v) + "\"");
  }
  if (!has_rank) bad(spec, "rank=R is missing");
  if (!has_step) bad(spec, "step=S is missing");
  if (!has_phase) bad(spec, "phase=P is missing");
  if (f.kind == FaultKind::Delay && !has_ms) bad(spec, "a delay needs ms=M (milliseconds)");
  if (f.kind != FaultKind::Delay && has_ms) bad(spec, "ms applies to delay only");
  if (f.kind == FaultKind::Nan && f.phase == FaultPhase::Optimizer)
    bad(spec, "a nan fault poisons the loss (phase=forward), a gradient (phase=backward) or a parameter before a "
              "checkpoint (phase=checkpoint), not phase=optimizer");
  return f;
}

}  // namespace

std::vector<FaultSpec> parse_faults(std::string_view text) {
  std::vector<FaultSpec> out;
  for (std::string_view s : split(text, ';')) {
    s = trim(s);
    if (s.empty()) continue;
    out.push_back(parse_one(s));
  }
  return out;
}

FaultInjector::FaultInjector(std::vector<FaultSpec> all, int world_rank) : rank_(world_rank) {
  for (auto& f : all)
    if (f.rank == world_rank || f.kind == FaultKind::Mismatch) faults_.push_back(std::move(f));
}

FaultInjector FaultInjector::from_env(int world_rank) {
  const char* e = std::getenv("MOETRON_FAULT");
  return FaultInjector(parse_faults(e ? e : ""), world_rank);
}

std::vector<FaultSpec> FaultInjector::take(FaultPhase phase, int64_t step) {
  std::vector<FaultSpec> due;
  for (size_t i = 0; i < faults_.size();) {
    if (faults_[i].phase == phase && faults_[i].step == step) {
      due.push_back(std::move(faults_[i]));
      faults_.erase(faults_.begin() + int64_t(i));
    } else {
      ++i;
    }
  }
  return due;
}

void FaultInjector::act(const FaultSpec& f) {
  std::fprintf(stderr, "moetron: fault injection (MOETRON_FAULT): rank %d, step %lld, phase %s: %s\n", f.rank,
               (long long)f.step, std::string(to_string(f.phase)).c_str(), f.text.c_str());
  std::fflush(stderr);
  if (f.kind == FaultKind::Kill) {
    std::fflush(stdout);
    ::kill(::getpid(), SIGKILL);
    std::_Exit(137);  // not reached
  }
  if (f.kind == FaultKind::Delay) std::this_thread::sleep_for(std::chrono::milliseconds(f.ms));
}

}  // namespace moetron
