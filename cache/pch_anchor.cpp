// Anchor translation unit for the shared precompiled header (see cache/pch.h).
namespace anchor {
int pch_anchor_unused = 0;
}
