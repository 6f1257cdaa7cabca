// Lists of cache modes (--compare, bench and eval --modes, a server's `modes`), split the same way by anchor-sd and
// anchor-text: ';' always separates modes; a ',' separates them too, except that an item "key=value" with a plain key
// and no ':' belongs to the mode before it ("off,deepcache:3,branch=1,freq" is three modes,
// "off,dual:decoded=reuse,masked=reuse" two, "freq,max=2" one: freq:max=2). A repeatable option gives one list per
// occurrence.
#pragma once

#include <string>
#include <vector>

namespace anchor::cache::modes {

// The modes of `list`, in order. ParamError(field) on an empty list or an empty item ("off,,freq", "a;;b").
std::vector<std::string> split_mode_list(const std::string& list, const std::string& field = "compare");
// The modes of every list, in order (a repeatable option's values).
std::vector<std::string> split_mode_lists(const std::vector<std::string>& lists, const std::string& field = "compare");

} // namespace anchor::cache::modes
