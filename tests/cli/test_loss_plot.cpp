// Tests of the programs' own modules (cli/): they link anchor_cli, which the library tests (anchor_tests) do not.
#include "cli/loss_plot.h"
#include "tests/test_util.h"

#include <catch2/catch.hpp>

#include <fstream>

using namespace anchor;

TEST_CASE("loss log reader takes plain 'step loss' lines and the trainers' progress lines", "[cli]") {
    const std::string dir = test::scratch_dir("loss_log");
    const std::string plain = dir + "/plain.txt", progress = dir + "/progress.txt", empty = dir + "/empty.txt";
    std::ofstream(plain) << "# step loss\n10 2.5\n20 2.0\n";
    std::ofstream(progress) << "corpus: KJV\nstep 20/1600 loss 8.6033 lr 6.67e-04 elapsed 42.8s\n"
                               "step 40/1600 loss 6.7237 lr 1.33e-03 elapsed 79.0s\ntrained steps 0..40\n";
    std::ofstream(empty) << "nothing here\n";
    auto a = cli::read_loss_log(plain, "a");
    CHECK(a.steps == std::vector<double>{10, 20});
    CHECK(a.losses == std::vector<double>{2.5, 2.0});
    auto b = cli::read_loss_log(progress, "b");
    CHECK(b.steps == std::vector<double>{20, 40});
    CHECK(b.losses == std::vector<double>{8.6033, 6.7237});
    CHECK_THROWS_WITH(cli::read_loss_log(empty, "c"), Catch::Contains("has no 'step loss'"));
}
