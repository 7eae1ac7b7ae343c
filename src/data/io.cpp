// io.cpp: atomic file writes with POSIX calls (open/write/fsync/rename), and whole-file reads.
#include "io.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "moetron/check.h"

namespace moetron::data::io {

namespace fs = std::filesystem;

void write_file_atomic(const std::string& path, const std::vector<std::string_view>& parts) {
  fs::path p(path);
  if (p.has_parent_path()) fs::create_directories(p.parent_path());
  std::string tmp = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  MT_CHECK(fd >= 0, "io", "cannot create ", tmp, ": ", std::strerror(errno));
  auto fail = [&](const char* what) {
    int e = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    MT_FAIL("io", what, " ", tmp, ": ", std::strerror(e));
  };
  for (std::string_view part : parts) {
    const char* d = part.data();
    size_t left = part.size();
    while (left > 0) {
      ssize_t w = ::write(fd, d, left);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) fail("write failed on");
      d += w;
      left -= size_t(w);
    }
  }
  if (::fsync(fd) != 0) fail("fsync failed on");
  if (::close(fd) != 0) {
    int e = errno;
    ::unlink(tmp.c_str());
    MT_FAIL("io", "close failed on ", tmp, ": ", std::strerror(e));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int e = errno;
    ::unlink(tmp.c_str());
    MT_FAIL("io", "cannot rename ", tmp, " to ", path, ": ", std::strerror(e));
  }
  // Make the rename itself durable.
  std::string dir = p.has_parent_path() ? p.parent_path().string() : std::string(".");
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  MT_CHECK(f.good(), "io", "cannot open ", path, ": ", std::strerror(errno));
  std::ostringstream ss;
  ss << f.rdbuf();
  MT_CHECK(!f.bad(), "io", "read failed on ", path);
  return ss.str();
}

}  // namespace moetron::data::io
