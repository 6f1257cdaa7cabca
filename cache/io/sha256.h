// SHA-256 (FIPS 180-4) for integrity checks of reference data and assets (manifest.json, *_sha256 fields).
#pragma once

#include <string>

namespace anchor {

// Lower-case hex digest of a file's bytes; throws anchor::Error when it cannot be read.
std::string sha256_file(const std::string& path);
std::string sha256_hex(const std::string& bytes);

namespace detail {
// The SHA-NI block function (x86 SHA extensions), used when the CPU has them; the portable rounds otherwise. For the
// tests that compare the two: whether it exists, and switching it (returns the previous setting).
bool sha256_fast_path_available();
bool use_sha256_fast_path(bool on);
} // namespace detail

} // namespace anchor
