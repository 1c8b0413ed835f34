#pragma once
// Token ids drawn as text repeats them, for the benchmarks whose speed depends on how often an
// id comes (the embedding's backward sums each id's rows): Zipf, P(id k) ~ 1 / (k + 1), by the
// inverse of its continuous CDF, k = (V + 1)^u - 1 for u uniform in [0, 1). The most frequent
// id is then ~6% of a batch; GPT-2's tokenizer on English gives ",", " the" and "." 3-4% each.
// (bench/train_step_pytorch.py --ids text draws the same way.)

#include <algorithm>
#include <cmath>

namespace bench {

inline int text_like_id(double u, int V) { return std::min(V - 1, static_cast<int>(std::pow(V + 1.0, u)) - 1); }

}  // namespace bench
