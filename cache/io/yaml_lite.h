// The block-style YAML subset of model config files (CompVis/LDM and Stability SGM `*.yaml`, read by A1111 and
// diffusers' single-file loaders for checkpoints that ship one): nested mappings by indentation, block sequences
// (`- item`, including `- key: value` mappings), plain, quoted and flow-list (`[a, b]`) scalars, `#` comments.
// Anchors, tags, multi-line scalars and flow mappings are not part of it and are refused with the line named.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

namespace anchor {

// Parses `text` into JSON (integers, floats, booleans, null, strings). `source` names the file in errors.
nlohmann::json parse_yaml_lite(const std::string& text, const std::string& source);
nlohmann::json load_yaml_lite(const std::string& path);

} // namespace anchor
