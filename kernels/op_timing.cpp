#include "kernels/op_timing.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>

namespace anchor::kernels {
namespace {
std::atomic<bool> g_on{false};
std::mutex g_mu;
std::vector<OpTime> g_calls;
thread_local int t_depth = 0;
} // namespace

void op_timing_start() {
    std::lock_guard<std::mutex> lock(g_mu);
    g_calls.clear();
    g_on.store(true, std::memory_order_relaxed);
}

std::vector<OpTime> op_timing_stop() {
    g_on.store(false, std::memory_order_relaxed);
    std::lock_guard<std::mutex> lock(g_mu);
    return std::move(g_calls);
}

bool op_timing_on() {
    return g_on.load(std::memory_order_relaxed);
}

bool ScopedOpTime::enter() {
    if (t_depth > 0) return false;
    ++t_depth;
    return true;
}

ScopedOpTime::~ScopedOpTime() {
    if (!on_) return;
    rec_.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0_).count();
    --t_depth;
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_on.load(std::memory_order_relaxed)) g_calls.push_back(std::move(rec_));
}

std::string conv_shape_text(const std::vector<int64_t>& input, const std::vector<int64_t>& weight, int64_t stride) {
    auto dims = [](const std::vector<int64_t>& d) {
        std::string s;
        for (size_t i = 0; i < d.size(); ++i) s += (i ? "x" : "") + std::to_string(d[i]);
        return s;
    };
    return dims(input) + " * " + dims(weight) + (stride > 1 ? " /" + std::to_string(stride) : "");
}

std::vector<OpTimeGroup> group_op_times(const std::vector<OpTime>& calls, bool by_shape) {
    std::map<std::pair<std::string, std::string>, OpTimeGroup> by;
    for (const auto& c : calls) {
        const std::string shape = by_shape ? c.shape : std::string();
        auto& g = by[{c.kind, shape}];
        g.kind = c.kind;
        g.shape = shape;
        ++g.calls;
        g.ms += c.ms;
        g.macs += c.macs;
    }
    std::vector<OpTimeGroup> out;
    for (auto& [key, g] : by) out.push_back(std::move(g));
    std::stable_sort(out.begin(), out.end(), [](const OpTimeGroup& a, const OpTimeGroup& b) { return a.ms > b.ms; });
    return out;
}

} // namespace anchor::kernels
