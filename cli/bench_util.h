// Transitional: the helpers moved to cache/util/bench.h (anchor::util); the text programs still use this name.
#pragma once

#include "cache/util/bench.h"

namespace anchor::cli::bench {
using namespace anchor::util;
} // namespace anchor::cli::bench
