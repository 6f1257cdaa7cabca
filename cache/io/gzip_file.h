// Whole-file reads through zlib: gzip files are inflated, plain files are read as they are (gzopen is transparent).
#pragma once

#include <string>

namespace anchor {

// Throws anchor::Error naming `what` (e.g. "BPE vocabulary") and the path on open/read/inflate errors.
std::string read_gzip_or_plain(const std::string& path, const std::string& what = "file");

} // namespace anchor
