// The rules a reuse cache applies under an ancestral sampler's injected noise (cache/ancestral_reuse.h), on values
// worked out by hand.
#include "cache/ancestral_reuse.h"
#include "cache/io/error.h"

#include <catch2/catch.hpp>

#include <cmath>
#include <limits>

using namespace anchor;
using namespace anchor::cache;

TEST_CASE("ancestral reuse: the Wiener share of fresh noise on a 1x1 map", "[cache][ancestral]") {
    // On a 1x1 map the orthonormal DCT is the identity (a_0 = sqrt(1/1)): G = d^2 / (d^2 + sigma^2).
    const auto d = torch::full({1, 1, 1, 1}, 2.0f);
    CHECK(wiener_noise_gain(d, 1.0).item<float>() == Approx(0.8));       // 4 / (4 + 1)
    CHECK(wiener_noise_gain(d, 2.0).item<float>() == Approx(0.5));       // 4 / (4 + 4)
    CHECK(wiener_noise_gain(d * 0, 0.5).item<float>() == Approx(0.0));   // no image energy: all noise removed
    CHECK(wiener_noise_gain(d, 0.0).item<float>() == Approx(1.0));       // sigma 0: nothing left to remove
    const auto n = torch::full({1, 1, 1, 1}, 0.5f);
    CHECK(noise_into_denoised(n, d, 1.0).item<float>() == Approx(0.4)); // 0.8 * 0.5
    CHECK(noise_into_denoised(n, d, 2.0).item<float>() == Approx(0.25));
    CHECK_THROWS_AS(wiener_noise_gain(d, std::nan("")), UsageError);
    CHECK_THROWS_AS(wiener_noise_gain(d, std::numeric_limits<double>::infinity()), UsageError);
}

TEST_CASE("ancestral reuse: the Wiener share per DCT coefficient of a 2x2 map", "[cache][ancestral]") {
    // C = [[1, 1], [1, -1]] / sqrt(2). A constant estimate of 1 has X = C D C^T = [[2, 0], [0, 0]]; at sigma = 1 the
    // gain is [[4 / 5, 0], [0, 0]]: its mean passes at 0.8, every other coefficient is removed.
    const auto D = torch::ones({1, 1, 2, 2});
    const auto G = wiener_noise_gain(D, 1.0);
    CHECK(G[0][0][0][0].item<float>() == Approx(0.8));
    CHECK(G[0][0][0][1].item<float>() == Approx(0.0).margin(1e-7));
    CHECK(G[0][0][1][0].item<float>() == Approx(0.0).margin(1e-7));
    CHECK(G[0][0][1][1].item<float>() == Approx(0.0).margin(1e-7));
    // Noise 1 in one pixel: dct2 = C e00 C^T = 1/2 everywhere; times G: 0.4 at (0, 0); back: C^T [[0.4, 0], [0, 0]] C
    // = 0.4 / 2 = 0.2 in every pixel (the pixel's share of the mean, kept at 0.8).
    const auto e00 = torch::zeros({1, 1, 2, 2});
    e00[0][0][0][0] = 1.0f;
    const auto kept = noise_into_denoised(e00, D, 1.0);
    for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 2; ++j) CHECK(kept[0][0][i][j].item<float>() == Approx(0.2));
    // A checkerboard [[1, -1], [-1, 1]] = v v^T with C v = [0, sqrt(2)]: X = [[0, 0], [0, 2]], the one coefficient the
    // estimate has no energy in: removed entirely.
    auto checker = torch::tensor({1.0f, -1.0f, -1.0f, 1.0f}).reshape({1, 1, 2, 2});
    CHECK(noise_into_denoised(checker, D, 1.0).abs().max().item<float>() == Approx(0.0).margin(1e-6));
    // A constant noise 1 is the mean only (X = [[2, 0], [0, 0]]): 0.8 of it passes, 0.8 in every pixel.
    const auto c = noise_into_denoised(torch::ones({1, 1, 2, 2}), D, 1.0);
    CHECK(c.min().item<float>() == Approx(0.8));
    CHECK(c.max().item<float>() == Approx(0.8));
    // Each row and channel has its own gain: a second channel with estimate 0 removes everything.
    auto D2 = torch::cat({D, torch::zeros({1, 1, 2, 2})}, 1);
    const auto c2 = noise_into_denoised(torch::ones({1, 2, 2, 2}), D2, 1.0);
    CHECK(c2[0][0].min().item<float>() == Approx(0.8));
    CHECK(c2[0][1].abs().max().item<float>() == Approx(0.0).margin(1e-7));
}
