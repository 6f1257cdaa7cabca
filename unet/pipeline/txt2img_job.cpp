#include "unet/pipeline/txt2img_job.h"

#include "cache/io/atomic_file.h"
#include "cache/io/error.h"
#include "cache/io/safetensors.h"
#include "cache/util/batch_job.h"
#include "cache/util/bench.h"
#include "kernels/attention.h"
#include "unet/cache/freq_cache.h"
#include "unet/pipeline/hires.h"
#include "unet/pipeline/infotext.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>

namespace anchor::unet {

namespace fs = std::filesystem;

void Txt2ImgJob::validate() const {
    if (prompts.empty()) throw ParamError("prompts", "no prompt");
    if (batch_size < 1) throw ParamError("batch_size", "must be >= 1, got " + std::to_string(batch_size));
    if (batch_count < 1) throw ParamError("batch_count", "must be >= 1, got " + std::to_string(batch_count));
    if (write_files && output.empty()) throw ParamError("output", "no output file");
    if (shard_count < 1 || shard_rank < 0 || shard_rank >= shard_count)
        throw ParamError("shard_rank", "rank " + std::to_string(shard_rank) + " of " + std::to_string(shard_count) +
                                           " shards (needs 0 <= rank < shards)");
    // The init images, masks and strength before any model is loaded (the pipeline checks the rest): every batch's
    // share, so that a count that fits no batch fails before the first image.
    if (params.steps >= 1)
        for (const auto& b : plan_batches(prompts, batch_size, 1, params.seed))
            (void)init_of(b).validate(params.steps, b.images());
    // A1111 syntax errors (a weight that is not a number) before any model is loaded.
    check_prompt_syntax(params.prompt_syntax, {&prompts, &params.negative_prompts});
    // The sampler's eta and schedule (the model's use_karras_sigmas only matters when no schedule is given).
    (void)effective_eta(params.sampler, params.eta);
    SchedulerConfig sc;
    sc.schedule = params.schedule;
    (void)effective_schedule(params.sampler, sc);
}

std::string Txt2ImgJob::numbered(const std::string& base, int k) {
    return batch::numbered_output(base, k, ".png");
}

namespace {

// The rows of image i in a batch of n images: [uncond i; cond i] with guidance (2n rows), else row i.
torch::Tensor image_rows(const torch::Tensor& t, int i, int n) {
    if (t.size(0) == 2 * int64_t(n)) return torch::cat({t.narrow(0, i, 1), t.narrow(0, n + i, 1)}, 0);
    return t.narrow(0, i, 1);
}

void save_image_tensors(const std::string& path, const Txt2ImgResult& r, int i, int n, int64_t seed, bool overwrite) {
    save_safetensors(path,
                     {{"initial_noise", r.initial_noise.narrow(0, i, 1)},
                      {"initial_latents", r.initial_latents.narrow(0, i, 1)},
                      {"final_latents", r.final_latents.narrow(0, i, 1)},
                      {"prompt_embeds", image_rows(r.prompt_embeds, i, n)},
                      {"decoded", r.decoded.narrow(0, i, 1)},
                      {"image", r.image.narrow(0, i, 1)},
                      {"image_uint8", r.image_uint8.narrow(0, i, 1)}},
                     {{"program", "anchor-sd"}, {"seed", std::to_string(seed)}, {"index_in_batch", std::to_string(i)}},
                     overwrite);
}

} // namespace

nlohmann::json model_record(const Txt2ImgPipeline& pipe) {
    const SDModels& m = pipe.models();
    const PredictionDecision& d = m.prediction;
    nlohmann::json pred = {{"type", enum_name(prediction_type_table(), pipe.scheduler_config().prediction_type)},
                           {"source", enum_name(prediction_source_table(), d.source)}};
    // The v-prediction test's evidence (unet/model/checkpoint.h): mean(UNet(x, 999) - x), v below -1.
    pred["v_test_mean"] = d.test_mean ? nlohmann::json(*d.test_mean) : nlohmann::json(nullptr);
    return {{"version", ANCHOR_VERSION},
            {"model_layout", m.layout},
            {"model_family", enum_name(sd_family_table(), m.family)},
            {"attention", enum_name(kernels::attention_kernel_table(), m.attention)},
            {"gemm", enum_name(kernels::gemm_backend_table(), m.gemm)},
            {"loras", lora_records_json(m.loras)}, // merged at load: name, file, sha256, multiplier
            {"prediction", pred},
            {"vae", m.vae_file.empty() ? nlohmann::json(nullptr) : nlohmann::json(m.vae_file)},
            {"weights_dtype", enum_name(weights_dtype_table(), m.weights_dtype)}};
}

nlohmann::json image_record(const Txt2ImgParams& p, const Txt2ImgResult& r, int i, const DenoiseController* ctl) {
    nlohmann::json j;
    j["prompt"] = p.prompts.at(size_t(i / std::max(p.images_per_prompt, 1)));
    const auto negatives = Txt2ImgPipeline::negatives_of(p);
    j["negative_prompt"] = negatives.at(size_t(i / std::max(p.images_per_prompt, 1)));
    j["cfg_scale"] = p.guidance_scale;
    j["steps"] = p.steps;
    j["sampler"] = sampler_name(p.sampler);
    j["prompt_syntax"] = enum_name(prompt_syntax_table(), p.prompt_syntax);
    j["schedule"] = noise_schedule_name(r.schedule);
    if (p.timestep_spacing) j["timestep_spacing"] = enum_name(timestep_spacing_table(), *p.timestep_spacing);
    j["eta"] = r.eta ? nlohmann::json(*r.eta) : nlohmann::json(nullptr);
    j["seed"] = p.seed;
    j["batch_size"] = int(p.prompts.size()) * p.images_per_prompt;
    j["index_in_batch"] = i;
    j["width"] = p.width;
    j["height"] = p.height;
    j["mode"] = !p.init.enabled() ? "txt2img" : p.init.inpaint() ? "inpaint" : "img2img";
    if (p.vae_decoder == VaeDecoder::Taesd) j["vae_decoder"] = "taesd";
    if (r.time_ids.defined()) {
        // SDXL: the second encoder's prompts and the micro-conditioning the UNet rows of this image got (diffusers'
        // order: original height, width, crop top, left, target height, width; Txt2ImgPipeline::sdxl_time_ids).
        const auto per = size_t(i / std::max(p.images_per_prompt, 1));
        auto pick = [&](const std::vector<std::string>& v, const std::vector<std::string>& fallback) {
            return v.empty() ? fallback.at(per) : v.size() == 1 ? v[0] : v.at(per);
        };
        const int64_t n = int64_t(p.prompts.size()) * p.images_per_prompt;
        const bool cfg = r.time_ids.size(0) == 2 * n;
        auto row = [&](int64_t k) {
            auto t = r.time_ids[k].to(torch::kDouble).contiguous();
            return std::vector<double>(t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
        };
        j["sdxl"] = {{"prompt_2", pick(p.prompts_2, p.prompts)},
                     {"negative_prompt_2", pick(p.negative_prompts_2, negatives)},
                     {"time_ids", row(cfg ? n + i : i)},
                     {"negative_time_ids", cfg ? nlohmann::json(row(i)) : nlohmann::json(nullptr)}};
    }
    if (!p.control.empty()) j["controlnets"] = control_records_json(p.control); // unet/pipeline/control.h
    if (p.init.enabled()) {
        // What the image was made from: the init image (and mask) by content, the strength and the first loop step.
        // Image i of the batch starts from init image i mod N (Img2ImgParams' tiling).
        j["init_image"] = {{"file", init_image_file(p.init, i)}, {"sha256", init_image_sha256(p.init, i)}};
        j["strength"] = p.init.strength;
        j["first_step"] = r.init.begin;
        if (p.init.inpaint()) {
            j["mask"] = {{"file", mask_file(p.init, i)}, {"sha256", mask_sha256(p.init, i)}};
            j["inpaint_unet_channels"] = r.init.unet9 ? 9 : 4;
        }
    }
    if (p.hires.enabled && r.image_uint8.defined()) { // unet/pipeline/hires.h: the settings and the output size
        HiresPlan plan;
        plan.width = int(r.image_uint8.size(2)), plan.height = int(r.image_uint8.size(1));
        plan.steps = p.hires.steps > 0 ? p.hires.steps : p.steps;
        j["hires"] = hires_record(p.hires, plan);
    }
    // Tiling changes the image (each tile decoded alone, then blended): the record says how it was decoded.
    if (p.vae_tiling.enabled)
        j["vae_tiling"] = {{"tile_size", p.vae_tiling.tile_sample_size}, {"overlap", p.vae_tiling.overlap}};
    j["cache"] = nlohmann::json{{"kind", "none"}};
    if (auto* cc = dynamic_cast<const CacheController*>(ctl)) j["cache"] = cache_log_json(*cc);
    j["unet_full_steps"] = r.full_steps;
    j["unet_steps"] = r.total_steps;
    j["warnings"] = r.warnings;
    j["timings_s"] = {{"text_encoder", r.text_s},
                      {"denoise", r.denoise_s},
                      {"vae_decode", r.decode_s},
                      {"per_step", r.total_steps ? r.denoise_s / r.total_steps : 0.0}};
    return j;
}

Img2ImgParams Txt2ImgJob::init_of(const BatchJob& batch) const {
    Img2ImgParams in = params.init;
    const auto n = int64_t(prompts.size());
    if (n < 2) return in;
    // One per prompt: the batch's slice, [first_prompt, first_prompt + its prompts).
    auto slice_files = [&](std::vector<std::string>& v) {
        if (int64_t(v.size()) == n)
            v = std::vector<std::string>(v.begin() + batch.first_prompt,
                                         v.begin() + batch.first_prompt + long(batch.prompts.size()));
    };
    auto slice_px = [&](torch::Tensor& t, int64_t batch_dims) {
        if (t.defined() && t.dim() == batch_dims && t.size(0) == n)
            t = t.narrow(0, batch.first_prompt, int64_t(batch.prompts.size()));
    };
    slice_files(in.init_images);
    slice_files(in.masks);
    slice_px(in.init_pixels, 4);
    slice_px(in.mask_pixels, 3);
    return in;
}

int Txt2ImgJob::image_count() const {
    const auto batches = plan_batches(prompts, batch_size, batch_count, params.seed);
    return batches.back().first_image + batches.back().images();
}

std::string manifest_path(const Txt2ImgJob& job) {
    return batch::manifest_path(job.output);
}

nlohmann::json job_manifest(const Txt2ImgJob& job, double wait_s) {
    const int n = job.image_count();
    std::vector<std::string> pngs;
    for (int k = 0; k < n; ++k) pngs.push_back(Txt2ImgJob::numbered(job.output, k));
    return {{"images", batch::read_records(pngs, wait_s)}, {"image_count", n}, {"shards", job.shard_count}};
}

Txt2ImgJobResult run_txt2img_job(Txt2ImgPipeline& pipe, const Txt2ImgJob& job, const Txt2ImgJobCallbacks& cb) {
    job.validate();
    auto batches = plan_batches(job.prompts, job.batch_size, job.batch_count, job.params.seed);
    const int n_images = batches.back().first_image + batches.back().images();
    std::vector<std::string> pngs, latents;
    for (int k = 0; k < n_images && job.write_files; ++k) {
        pngs.push_back(Txt2ImgJob::numbered(job.output, k));
        if (!job.save_latents.empty()) latents.push_back(Txt2ImgJob::numbered(job.save_latents, k));
    }
    // This shard's batches; with skip_existing, those whose every file exists come back from their sidecars.
    Txt2ImgJobResult out;
    std::vector<BatchJob> mine;
    for (size_t b = 0; b < batches.size(); ++b) {
        if (int(b % size_t(job.shard_count)) != job.shard_rank) continue;
        const auto& bj = batches[b];
        bool done = job.write_files && job.skip_existing;
        for (int k = bj.first_image; done && k < bj.first_image + bj.images(); ++k)
            done = batch::output_done(pngs[size_t(k)]);
        if (!done) {
            mine.push_back(bj);
            continue;
        }
        for (int k = bj.first_image; k < bj.first_image + bj.images(); ++k) {
            std::ifstream in(pngs[size_t(k)] + ".json");
            out.images.push_back({pngs[size_t(k)], nlohmann::json::parse(in), ""});
        }
    }
    batches = mine;
    // Every output is checked before the first image: a job never stops half-way on an existing file.
    for (const auto& batch : batches)
        for (int k = batch.first_image; k < batch.first_image + batch.images() && job.write_files; ++k) {
            for (const auto& f : {pngs[size_t(k)], pngs[size_t(k)] + ".json"}) check_output_path(f, job.overwrite);
            if (!latents.empty()) check_output_path(latents[size_t(k)], job.overwrite);
        }
    if (batches.empty()) return out;
    Txt2ImgParams p = pipe.resolved(job.params);
    // The model file is hashed once per job, before the first image (A1111's "Model hash").
    if (pipe.models().unet) check_cache_config(job.cache, *pipe.models().unet); // the branch exists, before any work
    InfotextFacts info = job.infotext ? *job.infotext : infotext_facts(pipe.models(), job.cache.label);
    info.cache_mode = job.cache.label;
    const nlohmann::json model_facts = model_record(pipe);
    bool first = true;
    for (const auto& batch : batches) {
        p.prompts = batch.prompts;
        p.images_per_prompt = batch.images_per_prompt;
        p.seed = batch.seed;
        p.init = job.init_of(batch);
        p.free_params = job.params.free_params && &batch == &batches.back(); // the models' last use in this job
        auto ctl = make_cache_controller(job.cache);
        const int nb = batch.images(), k0 = batch.first_image;
        const std::string label = n_images == 1 ? ""
                                  : nb > 1 ? "images " + std::to_string(k0 + 1) + "-" + std::to_string(k0 + nb) + "/" +
                                                 std::to_string(n_images) + " "
                                           : "image " + std::to_string(k0 + 1) + "/" + std::to_string(n_images) + " ";
        auto r = pipe.run(p, ctl.get(),
                          cb.progress ? [&](const ProgressInfo& pi) { cb.progress(pi, label); }
                                      : Txt2ImgPipeline::ProgressFn{});
        if (first) out.warnings = r.warnings;
        info.ti_hashes = r.ti_hashes; // the embeddings this batch's prompts named
        std::vector<Txt2ImgJobImage> done;
        for (int i = 0; i < nb; ++i) {
            const int k = k0 + i;
            if (!latents.empty() && job.write_files)
                save_image_tensors(latents[size_t(k)], r, i, nb, p.seed, job.overwrite);
            auto rec = job.facts;
            rec.update(image_record(p, r, i, ctl.get()));
            rec.update(model_facts);
            rec["base_seed"] = job.params.seed;
            rec["batch_index"] = batch.repeat;
            rec["image_index"] = k;
            if (job.write_files) rec["output"] = pngs[size_t(k)];
            rec["cache_mode"] = job.cache.label;
            if (!r.ti_hashes.empty()) {
                rec["textual_inversion"] = nlohmann::json::array();
                for (const auto& [name, hash] : r.ti_hashes)
                    rec["textual_inversion"].push_back({{"name", name}, {"hash", hash}});
            }
            if (!info.model_hash.empty()) rec["model_hash"] = info.model_hash;
            // The PNG carries the A1111 infotext and the record itself; the sidecar stays for tools that read JSON.
            auto pixels = r.image_uint8[i];
            apply_post_upscale(job.upscale, pixels, rec);
            auto chunks = image_text_chunks(infotext_of(p, i, info), rec);
            add_postprocess_chunk(job.upscale, chunks);
            if (!job.write_files) {
                done.push_back({"", rec, encode_png(pixels, chunks, "image " + std::to_string(k))});
                continue;
            }
            write_png(pngs[size_t(k)], pixels, job.overwrite, chunks);
            write_file_atomic(pngs[size_t(k)] + ".json", rec.dump(2) + "\n", job.overwrite);
            done.push_back({pngs[size_t(k)], rec, ""});
        }
        const int64_t rss = util::rss_now_bytes();
        if (first) out.rss_first = rss;
        first = false;
        out.rss_max = std::max(out.rss_max, rss);
        if (cb.batch_done) cb.batch_done(done, r.denoise_s, r.decode_s, rss);
        out.images.insert(out.images.end(), done.begin(), done.end());
    }
    std::stable_sort(out.images.begin(), out.images.end(), [](const auto& a, const auto& b) {
        return a.record.value("image_index", 0) < b.record.value("image_index", 0);
    });
    return out;
}

} // namespace anchor::unet
