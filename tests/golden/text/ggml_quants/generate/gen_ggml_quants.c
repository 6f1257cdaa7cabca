// Reference blocks of llama.cpp's q8_0 and q4_0 formats, made by ggml's own reference quantizers
// (quantize_row_q8_0_ref, quantize_row_q4_0_ref in ggml/src/ggml-quants.c), for golden_runner's ggml-quants checker.
//
// build.sh compiles this against a ggml source tree's ggml-base library. Output: one safetensors file with
//   x     F32 [rows, cols]          the inputs (cols a multiple of 32, as ggml requires)
//   q8_0  U8  [rows, cols/32 * 34]  each row's q8_0 blocks (float16 d, 32 int8)
//   q4_0  U8  [rows, cols/32 * 18]  each row's q4_0 blocks (float16 d, 16 bytes of 4-bit codes)
// and a JSON sidecar with the parameters. Rows: Gaussian rows of several scales, and rows made to hit the rules'
// edges (all zeros, a positive or a negative extreme, values on the half steps where rounding decides, tiny and huge
// magnitudes, one non-zero value).
#include "ggml.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// The block layouts as ggml-common.h declares them (its header is internal; the sizes are checked below).
typedef struct { uint16_t d; int8_t qs[32]; } blk_q8_0;
typedef struct { uint16_t d; uint8_t qs[16]; } blk_q4_0;
void quantize_row_q8_0_ref(const float* x, blk_q8_0* y, int64_t k);
void quantize_row_q4_0_ref(const float* x, blk_q4_0* y, int64_t k);

static uint64_t state = 0x9E3779B97F4A7C15ull;
static double uniform(void) {
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    return ((state >> 11) + 0.5) / 9007199254740992.0;
}
static float gauss(void) {
    return (float)(sqrt(-2.0 * log(uniform())) * cos(6.283185307179586 * uniform()));
}

int main(int argc, char** argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: gen_ggml_quants OUT.safetensors ROWS_RANDOM SEED\n");
        return 2;
    }
    if (ggml_type_size(GGML_TYPE_Q8_0) != sizeof(blk_q8_0) || ggml_type_size(GGML_TYPE_Q4_0) != sizeof(blk_q4_0)) {
        fprintf(stderr, "block sizes differ from ggml's\n");
        return 1;
    }
    const int random_rows = atoi(argv[2]);
    state ^= (uint64_t)strtoull(argv[3], NULL, 10) * 0x2545F4914F6CDD1Dull;
    const int cols = 96, edge_rows = 8, rows = random_rows + edge_rows, nb = cols / 32;
    float* x = calloc((size_t)rows * cols, sizeof(float));
    for (int r = 0; r < random_rows; ++r) {
        const float scale = (float)pow(10.0, (r % 7) - 3); // 1e-3 .. 1e3
        for (int c = 0; c < cols; ++c) x[r * cols + c] = gauss() * scale;
    }
    float* e = x + (size_t)random_rows * cols;
    // row 0: zeros. row 1: a positive extreme. row 2: a negative extreme.
    for (int c = 0; c < cols; ++c) e[1 * cols + c] = (float)((c % 17) - 8) * 0.25f;
    e[1 * cols + 5] = 3.f, e[1 * cols + 40] = 2.5f, e[1 * cols + 70] = 9.f;
    for (int c = 0; c < cols; ++c) e[2 * cols + c] = -e[1 * cols + c];
    // row 3: half steps of q4_0 (d = 1 with -8 the extreme): v = k + 0.5 for k in -8..7, so v / d + 8.5 is whole.
    for (int c = 0; c < cols; ++c) e[3 * cols + c] = (c % 32 == 0) ? -8.f : (float)((c % 16) - 8) + 0.5f;
    // row 4: half steps of q8_0 (amax 127 -> d = 1): v = k + 0.5.
    for (int c = 0; c < cols; ++c) e[4 * cols + c] = (c % 32 == 0) ? 127.f : (float)((c * 7) % 253 - 126) + 0.5f;
    // row 5: tiny (subnormal float16 scales) and row 6: huge magnitudes.
    for (int c = 0; c < cols; ++c) e[5 * cols + c] = gauss() * 1e-6f, e[6 * cols + c] = gauss() * 3e4f;
    // row 7: one non-zero value per block.
    for (int b = 0; b < nb; ++b) e[7 * cols + b * 32 + (b * 11) % 32] = (b % 2 ? -1.f : 1.f) * (float)(b + 1);

    const size_t n8 = (size_t)rows * nb * sizeof(blk_q8_0), n4 = (size_t)rows * nb * sizeof(blk_q4_0);
    blk_q8_0* q8 = malloc(n8);
    blk_q4_0* q4 = malloc(n4);
    for (int r = 0; r < rows; ++r) {
        quantize_row_q8_0_ref(x + (size_t)r * cols, q8 + (size_t)r * nb, cols);
        quantize_row_q4_0_ref(x + (size_t)r * cols, q4 + (size_t)r * nb, cols);
    }
    const size_t nx = (size_t)rows * cols * sizeof(float);
    char header[512];
    int len = snprintf(header, sizeof header,
                       "{\"x\":{\"dtype\":\"F32\",\"shape\":[%d,%d],\"data_offsets\":[0,%zu]},"
                       "\"q8_0\":{\"dtype\":\"U8\",\"shape\":[%d,%zu],\"data_offsets\":[%zu,%zu]},"
                       "\"q4_0\":{\"dtype\":\"U8\",\"shape\":[%d,%zu],\"data_offsets\":[%zu,%zu]}}",
                       rows, cols, nx, rows, nb * sizeof(blk_q8_0), nx, nx + n8, rows, nb * sizeof(blk_q4_0),
                       nx + n8, nx + n8 + n4);
    while (len % 8 != 0) header[len++] = ' ';
    FILE* f = fopen(argv[1], "wb");
    if (!f) {
        perror(argv[1]);
        return 1;
    }
    const uint64_t hl = (uint64_t)len; // little-endian hosts only (x86-64, aarch64)
    fwrite(&hl, 8, 1, f);
    fwrite(header, 1, (size_t)len, f);
    fwrite(x, 1, nx, f);
    fwrite(q8, 1, n8, f);
    fwrite(q4, 1, n4, f);
    fclose(f);
    printf("{\"rows\": %d, \"cols\": %d, \"random_rows\": %d, \"edge_rows\": %d, \"seed\": %s}\n", rows, cols,
           random_rows, edge_rows, argv[3]);
    return 0;
}
