// html_text.h: escaping text for HTML and SVG pages (the run report, the trace analysis page, pp_vis), written
// once and header-only so that libraries which link nothing else can use it. Not a template engine.
#pragma once
#include <string>

namespace moetron {

// The text with &, <, > and " replaced by their entities: safe inside an element and a quoted attribute.
inline std::string html_escape(const std::string& s) {
  std::string o;
  o.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&': o += "&amp;"; break;
      case '<': o += "&lt;"; break;
      case '>': o += "&gt;"; break;
      case '"': o += "&quot;"; break;
      default: o += c;
    }
  }
  return o;
}

}  // namespace moetron
