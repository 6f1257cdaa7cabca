// libpng's reading of a PNG (tests/test_png_libpng_reader.cpp), kept out of the tests' own translation units:
// <png.h> declares names (png_text, ...) that clash with ours.
#pragma once

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

namespace anchor::test {

struct LibpngImage {
    int width = 0, height = 0;
    std::vector<uint8_t> rgb;
    std::vector<std::tuple<std::string, std::string, std::string>> text; // keyword, text, "tEXt" / "zTXt" / "iTXt"
    std::string error;                                                   // libpng's error or warning, "" when none
};

// Fills `out` from `path` through libpng; out.error is set on any libpng error or warning (libpng drops an ancillary
// chunk with a bad CRC with only a warning).
void read_with_libpng(const std::string& path, LibpngImage& out);

} // namespace anchor::test
