#include "cache/util/threads.h"

#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <thread>

TEST_CASE("threads option sets LibTorch intra-op threads, 0 means all cores", "[cli][threads]") {
    CHECK(anchor::util::configure_threads(1) == 1);
    CHECK(at::get_num_threads() == 1);
    const int cores = static_cast<int>(std::thread::hardware_concurrency());
    CHECK(anchor::util::configure_threads(0) == cores);
    CHECK(anchor::util::blas_in_use().find("OpenBLAS") != std::string::npos);
}
