// SHA-256 (FIPS 180-4) for integrity checks of reference data and assets (manifest.json, *_sha256 fields).
#pragma once

#include <string>

namespace anchor {

// Lower-case hex digest of a file's bytes; throws anchor::Error when it cannot be read.
std::string sha256_file(const std::string& path);
std::string sha256_hex(const std::string& bytes);

} // namespace anchor
