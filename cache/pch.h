// Precompiled header: LibTorch's headers dominate compile time, so every target reuses this one PCH.
#pragma once
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>
