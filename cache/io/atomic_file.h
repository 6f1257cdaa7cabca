// Writing outputs without ever leaving a half-written file or silently replacing a user's file.
//
// Every output goes to a temporary file in the destination directory (same file system, so the final rename is
// atomic) and is renamed into place only after it was completely written and flushed.
#pragma once

#include <functional>
#include <string>

namespace anchor {

// Throws anchor::Error when `path` exists and `overwrite` is false, or when its directory is not writable.
void check_output_path(const std::string& path, bool overwrite);

// Writes `bytes` to `path` atomically (temporary file + fsync + rename).
void write_file_atomic(const std::string& path, const std::string& bytes, bool overwrite = true);

// Calls `writer(tmp_path)` to produce the file at a temporary path in the same directory, then renames it to
// `path`. On any exception the temporary file is removed and the exception propagates.
void write_via_temp(const std::string& path, const std::function<void(const std::string& tmp_path)>& writer,
                    bool overwrite = true);

// Temporary paths currently being written; a SIGINT handler removes them (see install_interrupt_cleanup).
void install_interrupt_cleanup();

} // namespace anchor
