#include "cache/divergence_guard.h"

#include "cache/io/error.h"

#include <cmath>
#include <sstream>

namespace anchor::cache {

DivergenceGuard::DivergenceGuard(double budget) : budget_(budget) {
    if (!(budget >= 0) || !std::isfinite(budget)) {
        std::ostringstream os;
        os << "divergence guard: budget must be a finite number >= 0, got " << budget;
        throw UsageError(os.str());
    }
}

bool DivergenceGuard::must_compute(double residual) {
    if (budget_ <= 0) return false;
    if (tripped_) return true;
    if (std::isnan(residual)) return false;
    // The step that would pass the budget is computed rather than spent: its residual adds no error.
    if (spent_ + residual > budget_) {
        tripped_ = true;
        return true;
    }
    spent_ += residual;
    return false;
}

void DivergenceGuard::reset() {
    spent_ = 0.0;
    tripped_ = false;
}

} // namespace anchor::cache
