// The independent PNG reader of tests/test_png_meta.cpp: libpng, with its error and warning callbacks recording
// into LibpngImage::error.
#include "tests/libpng_reader.h"

#if ANCHOR_HAVE_LIBPNG
#include <png.h>

#include <csetjmp>
#include <cstdio>

namespace anchor::test {

namespace {

void on_png_error(png_structp png, png_const_charp msg) {
    static_cast<LibpngImage*>(png_get_error_ptr(png))->error = msg;
    png_longjmp(png, 1);
}
void on_png_warning(png_structp png, png_const_charp msg) {
    static_cast<LibpngImage*>(png_get_error_ptr(png))->error = msg;
}

} // namespace

// No object with a destructor is created between setjmp and a png_longjmp back to it.
void read_with_libpng(const std::string& path, LibpngImage& out) {
    FILE* f = std::fopen(path.c_str(), "rb");
    if (!f) {
        out.error = "cannot open";
        return;
    }
    png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &out, on_png_error, on_png_warning);
    png_infop info = png_create_info_struct(png);
    if (setjmp(png_jmpbuf(png))) {
        png_destroy_read_struct(&png, &info, nullptr);
        std::fclose(f);
        return;
    }
    png_init_io(png, f);
    png_read_png(png, info, PNG_TRANSFORM_IDENTITY, nullptr);
    out.width = int(png_get_image_width(png, info));
    out.height = int(png_get_image_height(png, info));
    png_bytepp rows = png_get_rows(png, info);
    for (int y = 0; y < out.height; ++y) out.rgb.insert(out.rgb.end(), rows[y], rows[y] + 3 * out.width);
    png_textp text = nullptr;
    const int n = png_get_text(png, info, &text, nullptr);
    for (int i = 0; i < n; ++i) {
        const int c = text[i].compression;
        const char* kind = c == PNG_TEXT_COMPRESSION_NONE ? "tEXt" : c == PNG_TEXT_COMPRESSION_zTXt ? "zTXt" : "iTXt";
        const size_t len = c == PNG_TEXT_COMPRESSION_NONE || c == PNG_TEXT_COMPRESSION_zTXt ? text[i].text_length
                                                                                            : text[i].itxt_length;
        out.text.emplace_back(text[i].key, std::string(text[i].text, len), kind);
    }
    png_destroy_read_struct(&png, &info, nullptr);
    std::fclose(f);
}

} // namespace anchor::test

#else

namespace anchor::test {
void read_with_libpng(const std::string&, LibpngImage& out) {
    out.error = "built without libpng";
}
} // namespace anchor::test

#endif
