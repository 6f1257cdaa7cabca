// Per-call wall time of the fast kernels (linear layers, convolutions, Winograd convolutions, attention) with their
// shapes and MACs, for a per-shape profile of one step: which layer shapes reach what share of the machine's GEMM
// rate. LibTorch's --profile trace names the kernels but not their shapes or MAC counts. Off unless started; a kernel
// then pays one relaxed atomic load per call. Only the outermost timed call of a nest records (a Winograd convolution
// times its batched GEMM as part of itself).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace anchor::kernels {

struct OpTime {
    std::string kind;  // "linear", "conv3x3", "winograd3x3", "attention", ...
    std::string shape; // the call's shape, e.g. "2048x320 @ 320x2560" or "2x640x16x16 -> 640"
    double macs = 0;   // multiply-adds of the call
    double ms = 0;     // its wall time
};

// Clears the record and starts recording on every thread.
void op_timing_start();
// Stops recording; the calls in the order they ended.
std::vector<OpTime> op_timing_stop();
bool op_timing_on();

// Times the scope it lives in when recording is on and it is not nested in another timed call; `describe` is called
// only then, so a kernel builds no shape string when recording is off.
class ScopedOpTime {
public:
    template <class Describe> ScopedOpTime(const char* kind, Describe describe) : on_(op_timing_on() && enter()) {
        if (!on_) return;
        rec_.kind = kind;
        describe(rec_.shape, rec_.macs);
        t0_ = std::chrono::steady_clock::now();
    }
    ~ScopedOpTime();
    ScopedOpTime(const ScopedOpTime&) = delete;
    ScopedOpTime& operator=(const ScopedOpTime&) = delete;

private:
    static bool enter(); // false when a timed call is already open on this thread
    bool on_;
    OpTime rec_;
    std::chrono::steady_clock::time_point t0_;
};

// "2x640x16x16 * 640x640x3x3" (input * weight; " /2" for stride 2): the shape text of a convolution call.
std::string conv_shape_text(const std::vector<int64_t>& input, const std::vector<int64_t>& weight, int64_t stride);

// Calls grouped by (kind, shape), or by kind alone (shape left empty), the most time first.
struct OpTimeGroup {
    std::string kind, shape;
    int calls = 0;
    double ms = 0, macs = 0;
};
std::vector<OpTimeGroup> group_op_times(const std::vector<OpTime>& calls, bool by_shape = true);

} // namespace anchor::kernels
