// `anchor-sd info IMAGE.png`: what an image says it was made with, as the image ecosystem reads it (A1111's
// `parameters` text) and as anchor-sd wrote it (the `anchorcache` JSON record), checked chunk by chunk on the way.
#include "cache/io/error.h"
#include "cli/sd_commands.h"
#include "unet/pipeline/infotext.h"

#include <CLI/CLI.hpp>

#include <cstdio>
#include <memory>

namespace anchor::cli {

namespace {

int run_info(const std::string& png) {
    const auto chunks = read_png_text_chunks(png); // anchor::Error (exit 1) naming the file and the chunk
    const auto* params = find_png_text(chunks, unet::kInfotextKeyword);
    const auto* record = find_png_text(chunks, unet::kRecordKeyword);
    if (params)
        std::printf("%s (%s):\n%s\n\n", unet::kInfotextKeyword, png_chunk_type(params->kind), params->text.c_str());
    else
        std::printf("no '%s' text chunk\n\n", unet::kInfotextKeyword);
    if (record) {
        const auto j = nlohmann::json::parse(record->text, nullptr, false);
        if (j.is_discarded()) throw Error("'" + png + "': the '" + unet::kRecordKeyword + "' chunk is not valid JSON");
        std::printf("%s (%s):\n%s\n", unet::kRecordKeyword, png_chunk_type(record->kind), j.dump(2).c_str());
    } else {
        std::printf("no '%s' text chunk\n", unet::kRecordKeyword);
    }
    std::string others;
    for (const auto& c : chunks)
        if (&c != params && &c != record) others += (others.empty() ? "" : ", ") + c.keyword;
    if (!others.empty()) std::printf("\nother text chunks: %s\n", others.c_str());
    return 0;
}

} // namespace

void add_sd_info_command(CLI::App& app, SdRunners& runners) {
    auto* cmd = app.add_subcommand(
        "info", "print a PNG's generation parameters: A1111's 'parameters' text and anchor-sd's JSON record");
    cmd->fallthrough();
    auto png = std::make_shared<std::string>();
    cmd->add_option("image", *png, "the PNG file")->required();
    runners.emplace_back(cmd, [png]() { return run_info(*png); });
}

} // namespace anchor::cli
