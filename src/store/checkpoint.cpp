// checkpoint.cpp: the checkpoint store: atomic save (tmp dir + fsync + rename + fsync parent), keep-last-K
// pruning, discovery of the newest complete checkpoint, and fully verified loading. See docs/checkpoint.md.
// Not a trainer: it stores what the caller gives (tensors + a JSON state) and never interprets tensors.
#include "moetron/checkpoint.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>

#include "moetron/check.h"

namespace fs = std::filesystem;

namespace moetron {

namespace {

constexpr const char* kOp = "checkpoint";
constexpr const char* kModelFile = "model.safetensors";
constexpr const char* kOptimizerFile = "optimizer.safetensors";
constexpr const char* kStateFile = "state.json";
constexpr const char* kFormat = "moetron-checkpoint";
constexpr const char* kReservedKeys[] = {"format", "format_version", "step", "moetron_version", "files"};

std::function<void(std::string_view)>& fault_hook() {
  static std::function<void(std::string_view)> h;
  return h;
}
void hook(std::string_view stage) {
  if (fault_hook()) fault_hook()(stage);
}

std::string errno_str(int e) { return std::string(std::strerror(e)); }

// Parses "step-<digits>" exactly; false otherwise.
bool parse_step_dir(const std::string& name, int64_t* step) {
  if (name.size() <= 5 || name.compare(0, 5, "step-") != 0) return false;
  const char* b = name.data() + 5;
  const char* e = name.data() + name.size();
  if (!std::all_of(b, e, [](char c) { return c >= '0' && c <= '9'; })) return false;
  auto r = std::from_chars(b, e, *step);
  return r.ec == std::errc() && r.ptr == e;
}

// Parses "step-...tmp-<pid>"; false otherwise.
bool parse_tmp_dir(const std::string& name, long* pid) {
  if (name.compare(0, 5, "step-") != 0) return false;
  size_t pos = name.rfind(".tmp-");
  if (pos == std::string::npos) return false;
  const char* b = name.data() + pos + 5;
  const char* e = name.data() + name.size();
  if (b == e || !std::all_of(b, e, [](char c) { return c >= '0' && c <= '9'; })) return false;
  auto r = std::from_chars(b, e, *pid);
  return r.ec == std::errc() && r.ptr == e;
}

bool process_alive(long pid) {
  if (pid <= 0 || pid > 0x7fffffffL) return false;
  return ::kill(pid_t(pid), 0) == 0 || errno == EPERM;
}

void fsync_path(const std::string& path, bool dir) {
  int fd = ::open(path.c_str(), (dir ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  MT_CHECK(fd >= 0, kOp, path, ": cannot open for fsync: ", errno_str(errno));
  int rc = ::fsync(fd);
  int e = errno;
  ::close(fd);
  MT_CHECK(rc == 0, kOp, path, ": fsync failed: ", errno_str(e));
}

void write_text_file_fsync(const std::string& path, const std::string& text) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  MT_CHECK(fd >= 0, kOp, path, ": cannot create file: ", errno_str(errno));
  const char* p = text.data();
  size_t n = text.size();
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) {
      int e = errno;
      ::close(fd);
      MT_FAIL(kOp, path, ": write failed: ", errno_str(e));
    }
    p += w;
    n -= size_t(w);
  }
  int rc = ::fsync(fd);
  int e = errno;
  MT_CHECK(rc == 0, kOp, path, ": fsync failed: ", errno_str(e));
  MT_CHECK(::close(fd) == 0, kOp, path, ": close failed: ", errno_str(errno));
}

// Size and CRC32C of a file, read in chunks.
void file_size_crc(const std::string& path, uint64_t* size, uint32_t* crc) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  MT_CHECK(fd >= 0, kOp, path, ": cannot open: ", errno_str(errno), " (incomplete checkpoint)");
  std::vector<uint8_t> buf(size_t(4) << 20);
  uint64_t total = 0;
  uint32_t c = 0;
  for (;;) {
    ssize_t r = ::read(fd, buf.data(), buf.size());
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      int e = errno;
      ::close(fd);
      MT_FAIL(kOp, path, ": read failed: ", errno_str(e));
    }
    if (r == 0) break;
    c = crc32c_update(c, buf.data(), size_t(r));
    total += uint64_t(r);
  }
  ::close(fd);
  *size = total;
  *crc = c;
}

std::string crc_hex(uint32_t c) {
  char s[16];
  std::snprintf(s, sizeof s, "%08x", c);
  return s;
}

std::vector<SafetensorsEntry> to_entries(const std::vector<CheckpointTensor>& ts, const std::string& path) {
  std::vector<SafetensorsEntry> out;
  out.reserve(ts.size());
  for (const auto& t : ts) {
    int64_t n = 1;
    for (int64_t d : t.shape) {
      MT_CHECK(d >= 0, kOp, path, ": tensor '", t.name, "' has negative dimension in shape ", shape_str(t.shape));
      n *= d;
    }
    out.push_back({t.name, t.dtype, t.shape, t.data, size_t(n) * dtype_size(t.dtype)});
  }
  return out;
}

// Cheap completeness test used for pruning: state.json parses, names the right step, and every file it
// lists exists with the recorded size (no CRC: pruning must not read every checkpoint).
bool looks_complete(const fs::path& dir, int64_t step) {
  try {
    std::error_code ec;
    fs::path sp = dir / kStateFile;
    if (!fs::is_regular_file(sp, ec)) return false;
    std::FILE* f = std::fopen(sp.c_str(), "rb");
    if (!f) return false;
    std::string text;
    char buf[65536];
    size_t r;
    while ((r = std::fread(buf, 1, sizeof buf, f)) > 0) text.append(buf, r);
    std::fclose(f);
    auto j = nlohmann::json::parse(text);
    if (!j.is_object() || j.value("step", int64_t(-1)) != step || !j.contains("files")) return false;
    for (const char* name : {kModelFile, kOptimizerFile}) {
      const auto& e = j["files"].at(name);
      if (fs::file_size(dir / name) != e.at("bytes").get<uint64_t>()) return false;
    }
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

void warn(const std::string& msg) { std::fprintf(stderr, "moetron: warning: %s\n", msg.c_str()); }

void prune(const fs::path& folder, int keep_latest_k) {
  std::error_code ec;
  // Stale temporary directories: ours (left by an earlier failed attempt) or of dead processes.
  std::vector<fs::path> stale;
  for (const auto& e : fs::directory_iterator(folder, ec)) {
    long pid = 0;
    if (!parse_tmp_dir(e.path().filename().string(), &pid) || !e.is_directory(ec)) continue;
    if (pid != long(::getpid()) && process_alive(pid)) continue;  // another live writer
    stale.push_back(e.path());
  }
  for (const auto& p : stale) {
    std::error_code rm;
    fs::remove_all(p, rm);
    if (rm) warn("cannot remove stale temporary directory " + p.string() + ": " + rm.message());
  }
  if (keep_latest_k <= 0) return;
  auto dirs = list_checkpoint_dirs(folder.string());
  int kept = 0;
  for (auto it = dirs.rbegin(); it != dirs.rend(); ++it) {
    if (!looks_complete(it->second, it->first)) continue;  // never count or delete incomplete ones
    if (kept < keep_latest_k) {
      ++kept;
      continue;
    }
    std::error_code rm;
    fs::remove_all(it->second, rm);
    if (rm) warn("cannot remove old checkpoint " + it->second + ": " + rm.message());
  }
}

}  // namespace

void set_checkpoint_fault_hook(std::function<void(std::string_view stage)> h) { fault_hook() = std::move(h); }

std::vector<std::pair<int64_t, std::string>> list_checkpoint_dirs(const std::string& folder) {
  std::vector<std::pair<int64_t, std::string>> out;
  std::error_code ec;
  if (!fs::is_directory(folder, ec)) return out;
  for (const auto& e : fs::directory_iterator(folder, ec)) {
    int64_t step = 0;
    if (parse_step_dir(e.path().filename().string(), &step) && e.is_directory(ec))
      out.emplace_back(step, e.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string step_dir_name(int64_t step) { return "step-" + std::to_string(step); }

std::string checkpoint_path(const std::string& folder, int64_t step) {
  return (fs::path(folder) / step_dir_name(step)).string();
}

std::string save_checkpoint(const std::string& folder, const CheckpointWriteRequest& req, int keep_latest_k) {
  MT_CHECK(req.step >= 0, kOp, folder, ": negative step ", req.step);
  MT_CHECK(req.state.is_object(), kOp, folder, ": state must be a JSON object, got ", req.state.type_name());
  for (const char* k : kReservedKeys)
    MT_CHECK(!req.state.contains(k), kOp, folder, ": state key '", k, "' is reserved for the checkpoint store");

  const fs::path root(folder);
  std::error_code ec;
  if (!fs::is_directory(root, ec)) {
    fs::create_directories(root, ec);
    MT_CHECK(!ec, kOp, folder, ": cannot create checkpoint folder: ", ec.message());
    fs::path parent = fs::absolute(root).parent_path();
    fsync_path(parent.string(), true);
  }
  const fs::path final_dir = root / step_dir_name(req.step);
  const fs::path tmp_dir = root / (step_dir_name(req.step) + ".tmp-" + std::to_string(::getpid()));

  fs::remove_all(tmp_dir, ec);  // a leftover of an earlier failed attempt of this process
  fs::create_directory(tmp_dir, ec);
  MT_CHECK(!ec, kOp, tmp_dir.string(), ": cannot create temporary directory: ", ec.message());

  try {
    hook("tmp_created");
    nlohmann::ordered_json files = nlohmann::ordered_json::object();
    auto write_st = [&](const char* name, const char* kind, const std::vector<CheckpointTensor>& ts) {
      const std::string path = (tmp_dir / name).string();
      std::map<std::string, std::string> meta{{"moetron.kind", kind}, {"moetron.step", std::to_string(req.step)}};
      SafetensorsWriteResult r = write_safetensors(path, to_entries(ts, path), meta, {.fsync = true});
      files[name] = {{"bytes", r.file_bytes}, {"crc32c", crc_hex(r.crc32c)}};
    };
    write_st(kModelFile, "model", req.model);
    hook("model_written");
    write_st(kOptimizerFile, "optimizer", req.optimizer);
    hook("optimizer_written");

    nlohmann::ordered_json st = nlohmann::ordered_json::object();
    st["format"] = kFormat;
    st["format_version"] = kCheckpointFormatVersion;
    st["step"] = req.step;
    st["moetron_version"] = kMoetronVersion;
    st["files"] = files;
    for (auto it = req.state.begin(); it != req.state.end(); ++it) st[it.key()] = it.value();
    std::string text;
    try {
      text = st.dump(2) + "\n";
    } catch (const nlohmann::json::exception& ex) {
      MT_FAIL(kOp, folder, ": cannot encode state.json: ", ex.what());
    }
    write_text_file_fsync((tmp_dir / kStateFile).string(), text);
    hook("state_written");
    fsync_path(tmp_dir.string(), true);
    hook("before_rename");

    if (fs::exists(final_dir, ec)) {
      // Replace an existing checkpoint of the same step atomically: exchange the two directories, then
      // delete the old one (now under the temporary name, so a crash leaves only a stale tmp dir).
      if (::renameat2(AT_FDCWD, tmp_dir.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) != 0) {
        MT_CHECK(errno == EINVAL || errno == ENOSYS, kOp, final_dir.string(), ": rename (exchange) failed: ",
                 errno_str(errno));
        // The file system cannot exchange: move the old one aside (to a stale-tmp name), then rename.
        fs::path aside = root / (step_dir_name(req.step) + ".replaced.tmp-" + std::to_string(::getpid()));
        fs::remove_all(aside, ec);
        MT_CHECK(::rename(final_dir.c_str(), aside.c_str()) == 0, kOp, final_dir.string(),
                 ": rename aside failed: ", errno_str(errno));
        MT_CHECK(::rename(tmp_dir.c_str(), final_dir.c_str()) == 0, kOp, final_dir.string(),
                 ": rename failed: ", errno_str(errno));
        fs::remove_all(aside, ec);
      }
    } else {
      MT_CHECK(::rename(tmp_dir.c_str(), final_dir.c_str()) == 0, kOp, final_dir.string(), ": rename failed: ",
               errno_str(errno));
    }
    hook("after_rename");
    fsync_path(root.string(), true);
    fs::remove_all(tmp_dir, ec);  // holds the replaced checkpoint after an exchange; absent otherwise
  } catch (...) {
    std::error_code rm;
    fs::remove_all(tmp_dir, rm);  // best effort; a crash instead leaves it for the next save to prune
    throw;
  }
  prune(root, keep_latest_k);
  return final_dir.string();
}

LoadedCheckpoint load_checkpoint(const std::string& dir) {
  const fs::path d(dir);
  const std::string sp = (d / kStateFile).string();
  std::error_code ec;
  MT_CHECK(fs::is_directory(d, ec), kOp, dir, ": not a directory");
  MT_CHECK(fs::is_regular_file(sp, ec), kOp, sp, ": missing (incomplete checkpoint)");

  LoadedCheckpoint out;
  out.dir = dir;
  {
    std::FILE* f = std::fopen(sp.c_str(), "rb");
    MT_CHECK(f != nullptr, kOp, sp, ": cannot open: ", errno_str(errno));
    std::string text;
    char buf[65536];
    size_t r;
    while ((r = std::fread(buf, 1, sizeof buf, f)) > 0) text.append(buf, r);
    std::fclose(f);
    try {
      out.state = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& ex) {
      MT_FAIL(kOp, sp, ": not valid JSON: ", ex.what());
    }
  }
  const auto& s = out.state;
  MT_CHECK(s.is_object(), kOp, sp, ": not a JSON object");
  MT_CHECK(s.value("format", std::string()) == kFormat, kOp, sp, ": field 'format' is not \"", kFormat, "\"");
  MT_CHECK(s.contains("format_version") && s["format_version"].is_number_integer(), kOp, sp,
           ": missing integer field 'format_version'");
  MT_CHECK(s["format_version"].get<int64_t>() == kCheckpointFormatVersion, kOp, sp, ": format_version ",
           s["format_version"].get<int64_t>(), " is not supported (this build reads ", kCheckpointFormatVersion, ")");
  MT_CHECK(s.contains("step") && s["step"].is_number_integer() && s["step"].get<int64_t>() >= 0, kOp, sp,
           ": missing non-negative integer field 'step'");
  out.step = s["step"].get<int64_t>();
  int64_t dir_step = 0;
  if (parse_step_dir(d.filename().string(), &dir_step))
    MT_CHECK(dir_step == out.step, kOp, sp, ": step ", out.step, " does not match the directory name");
  MT_CHECK(s.contains("files") && s["files"].is_object(), kOp, sp, ": missing object field 'files'");

  auto open_verified = [&](const char* name, const char* kind) {
    const std::string path = (d / name).string();
    MT_CHECK(s["files"].contains(name), kOp, sp, ": 'files' has no entry for ", name);
    const auto& e = s["files"][name];
    MT_CHECK(e.is_object() && e.contains("bytes") && e["bytes"].is_number_unsigned() && e.contains("crc32c") &&
                 e["crc32c"].is_string(),
             kOp, sp, ": 'files' entry for ", name, " needs 'bytes' and 'crc32c'");
    uint64_t size = 0;
    uint32_t crc = 0;
    file_size_crc(path, &size, &crc);
    MT_CHECK(size == e["bytes"].get<uint64_t>(), kOp, path, ": file is ", size, " bytes, state.json records ",
             e["bytes"].get<uint64_t>(), " (truncated or replaced)");
    MT_CHECK(crc_hex(crc) == e["crc32c"].get<std::string>(), kOp, path, ": CRC32C ", crc_hex(crc),
             " does not match ", e["crc32c"].get<std::string>(), " recorded in state.json (file corrupted)");
    SafetensorsFile f = SafetensorsFile::open(path);
    auto meta = f.metadata();
    MT_CHECK(meta["moetron.kind"] == kind && meta["moetron.step"] == std::to_string(out.step), kOp, path,
             ": metadata (kind '", meta["moetron.kind"], "', step '", meta["moetron.step"], "') does not match ",
             kind, " at step ", out.step);
    return f;
  };
  out.model = open_verified(kModelFile, "model");
  out.optimizer = open_verified(kOptimizerFile, "optimizer");
  return out;
}

std::optional<std::string> latest_complete_checkpoint(const std::string& folder) {
  auto dirs = list_checkpoint_dirs(folder);
  for (auto it = dirs.rbegin(); it != dirs.rend(); ++it) {
    try {
      load_checkpoint(it->second);
      return it->second;
    } catch (const std::exception& e) {
      warn("skipping checkpoint " + it->second + ": " + e.what());
    }
  }
  return std::nullopt;
}

}  // namespace moetron
