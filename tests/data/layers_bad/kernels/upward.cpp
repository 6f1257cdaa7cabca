// A kernel that reaches into the cache core: the layering check must refuse it (CMakeLists.txt, tests).
#include "cache/dct.h"
#include "cache/io/error.h"
