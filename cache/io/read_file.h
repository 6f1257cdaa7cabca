// The one whole-file read: a file's bytes as a string (text or binary, never transformed). Every loader that needs a
// whole file reads it here, so the errors read the same everywhere.
#pragma once

#include <string>

namespace anchor {

// Throws anchor::Error "cannot read <what> '<path>': <reason>" when the file cannot be opened (a folder, missing,
// no permission) or a read fails. `what` names the kind of file ("scheduler config", "token file"; "" for none).
std::string read_file(const std::string& path, const std::string& what = "");

} // namespace anchor
