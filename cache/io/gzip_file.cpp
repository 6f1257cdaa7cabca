#include "cache/io/gzip_file.h"

#include "cache/io/error.h"

#include <zlib.h>

namespace anchor {

std::string read_gzip_or_plain(const std::string& path, const std::string& what) {
    gzFile f = gzopen(path.c_str(), "rb"); // transparently reads uncompressed files too
    if (!f) throw Error("cannot open " + what + " '" + path + "'");
    std::string data;
    char buf[1 << 16];
    int n;
    while ((n = gzread(f, buf, sizeof(buf))) > 0) data.append(buf, size_t(n));
    int err = 0;
    const char* msg = gzerror(f, &err);
    const std::string emsg = (n < 0 && msg) ? msg : "";
    gzclose(f);
    if (n < 0) throw Error("cannot read " + what + " '" + path + "': " + emsg);
    return data;
}

} // namespace anchor
