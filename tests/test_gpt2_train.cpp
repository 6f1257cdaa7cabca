// GPT-2 trainer on a miniature KJV: split, export through the normal loader (compact softmax expanded exactly),
// resume, and the CLI's argument errors.
#include "cache/io/error.h"
#include "tests/test_cli_util.h"
#include "tests/test_util.h"
#include "text/gpt2/gpt2_tokenizer.h"
#include "text/params.h"
#include "text/train/gpt2_train.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <set>

using namespace anchor;
using namespace anchor::text;

namespace {

std::string mini_kjv() {
    return "Holy Bible, a miniature for tests.\n"
           "Ge1:1 In the beginning God created the heaven and the earth.\n"
           "Ge1:2 And the earth was without form, and void; and darkness was upon the face of the deep.\n"
           "Ge1:3 And God said, Let there be light: and there was light.\n"
           "Ge1:4 And God saw the light, that it was good: and God divided the light from the darkness.\n"
           "Ge1:5 And God called the light Day, and the darkness he called Night.\n"
           "Ruth1:1 Now it came to pass in the days when the judges ruled, that there was a famine in the land.\n"
           "Ruth1:2 And the name of the man was Elimelech.\n"
           "Rev22:21 The grace of our Lord Jesus Christ be with you all. Amen.\n";
}

Gpt2TrainOptions tiny_options(const std::string& dir) {
    const auto kjv = dir + "/mini_kjv.txt";
    std::ofstream(kjv) << mini_kjv();
    Gpt2TrainOptions o;
    o.kjv_path = kjv;
    o.out_dir = dir + "/run";
    o.export_dir = dir + "/model";
    o.config.n_layer = 1;
    o.config.n_head = 2;
    o.config.n_embd = 16;
    o.config.n_positions = 32;
    o.holdout = HoldoutSpec::parse("books:Ruth");
    o.batch = 2;
    o.steps = 6;
    o.warmup = 2;
    o.lr = 1e-2;
    o.ema = 0.9;
    o.eval_every = 3;
    o.log_every = 2;
    o.checkpoint_every = 3;
    return o;
}

} // namespace

TEST_CASE("KJV split and documents", "[kjv][train]") {
    const auto verses = parse_kjv_verses(mini_kjv());
    auto s = split_kjv(verses, HoldoutSpec::parse("books:Ruth"));
    CHECK(s.val.size() == 2);
    CHECK(s.train.size() == 6);
    s = split_kjv(verses, HoldoutSpec::parse("tail:25"));
    CHECK(s.val.size() == 2);
    CHECK(s.val.back().book == "Rev");
    const auto docs = kjv_documents(verses);
    REQUIRE(docs.size() == 3);
    CHECK(docs[1] == "Now it came to pass in the days when the judges ruled, that there was a famine in the land.\n"
                     "And the name of the man was Elimelech.\n");
    CHECK(HoldoutSpec::parse("books:Ecclesiastes,Titus").str() == "books:Eccl,Titus");
    CHECK_THROWS_AS(HoldoutSpec::parse("books:Tobit"), ParamError);
    CHECK_THROWS_AS(HoldoutSpec::parse("tail:100"), ParamError);
    CHECK_THROWS_AS(HoldoutSpec::parse("chapters:3"), ParamError);
    CHECK_THROWS_AS(split_kjv(verses, HoldoutSpec::parse("books:Mark")), ParamError);
}

TEST_CASE("GPT-2 trainer: exported model loads with load_gpt2 and matches the trained one", "[kjv][train][gpt2]") {
    const auto dir = test::scratch_dir("gpt2_train");
    auto o = tiny_options(dir);
    const auto r = train_gpt2(o);
    CHECK(r.end_step == 6);
    CHECK(r.metrics.size() == 4); // logged at 2, 4, 6 and evaluated at 3, 6
    CHECK(r.metrics.back().val_loss > 0);
    CHECK(r.metrics.back().train_loss < r.metrics.front().train_loss);
    REQUIRE(r.export_val_loss > 0);
    // The exported 50257-row fp16 model gives the compact-softmax loss up to fp16 rounding (unseen tokens: logit -30).
    CHECK(std::abs(r.export_val_loss - r.val_loss) < 2e-2);

    auto m = load_gpt2(o.export_dir);
    CHECK(m.config.vocab_size == 50257);
    CHECK(m.config.n_positions == 32);
    CHECK(m.model->lm_head_tied());
    const auto tok = Gpt2Tokenizer::load_default();
    auto ids = tok.encode("In the beginning God");
    auto logits = m.model->forward(torch::tensor(ids, torch::kLong)).logits[0][-1];
    // A token that never occurs in the text gets the fixed unseen logit in every context.
    const auto used_ids = tok.encode(mini_kjv());
    const std::set<int64_t> used(used_ids.begin(), used_ids.end());
    int64_t unseen = 0;
    while (used.count(unseen)) ++unseen;
    CHECK(logits[unseen].item<double>() == Approx(-30.0).margin(0.05));
    CHECK(used.count(logits.argmax().item<int64_t>()) == 1);
    CHECK(std::filesystem::exists(o.out_dir + "/heldout.txt"));

    // Exporting again without --overwrite is refused before any training.
    CHECK_THROWS_AS(train_gpt2(o), ParamError);

    // Resume: a longer schedule continues from step 6; the metrics file keeps the earlier rows.
    o.overwrite_export = true;
    o.steps = 8;
    const auto r2 = train_gpt2(o);
    CHECK(r2.start_step == 6);
    CHECK(r2.end_step == 8);
    const auto ms = read_train_metrics(o.out_dir + "/metrics.csv");
    REQUIRE(ms.size() == 5);
    CHECK(ms.back().step == 8);
    CHECK(ms.back().tokens == 8 * 2 * 32);
}

TEST_CASE("anchor-text gpt2 train/ppl: usage errors exit 2, ppl writes its table as JSON", "[kjv][train][cli]") {
    const auto dir = test::scratch_dir("cli_gpt2_train");
    auto r = test::run_program(test::text_bin(), {"gpt2", "train", "-o", dir + "/run", "--holdout", "books:Tobit"});
    INFO(r.output);
    CHECK(r.exit_code == 2);
    CHECK(r.output.find("unknown book 'Tobit'") != std::string::npos);
    r = test::run_program(test::text_bin(), {"gpt2", "train", "-o", dir + "/run", "--export-dtype", "f8"});
    CHECK(r.exit_code == 2);
    r = test::run_program(test::text_bin(), {"gpt2", "train", "-o", dir + "/run", "--heads", "5"});
    CHECK(r.exit_code == 2);

    const auto json = dir + "/ppl.json";
    const std::vector<std::string> args = {"--threads",    "1",
                                           "gpt2",         "ppl",
                                           "-m",           test::golden("text/gpt2_tiny"),
                                           "--file",       test::golden("text/eval/kjv_text.txt"),
                                           "--max-tokens", "80",
                                           "--compare",    "full,window:16,sink:4,12",
                                           "--json",       json};
    const auto ok = test::run_program(test::text_bin(), args);
    INFO(ok.output);
    REQUIRE(ok.exit_code == 0);
    std::ifstream in(json);
    const auto j = nlohmann::json::parse(in);
    REQUIRE(j["runs"].size() == 3);
    CHECK(j["runs"][1]["kv"] == "window:16");
    CHECK(j["runs"][2]["ppl"].get<double>() > 1.0);
    CHECK(j["tokens"] == 80);
    // The report is not replaced without --overwrite (a usage error: exit 2).
    r = test::run_program(test::text_bin(), args);
    CHECK(r.exit_code == 2);
}
