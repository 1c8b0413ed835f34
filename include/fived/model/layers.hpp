#pragma once
// Which of a model's layers one model object holds: a pipeline stage (or model chunk) holds
// Layers<first, count>, blocks [first, first + count) of the model, with whatever comes
// before the first block (the embedding) when first == 0 and whatever comes after the last
// (final norm, head, loss) when the part ends the model. AllLayers is the whole model (the
// serial and the TP/CP/DP models). A model type takes its part as a template argument and
// names the same model with another part as `Model::part<P>` (model/contract.hpp).

namespace fived {

template <int First, int Count>
struct Layers {
  static constexpr int first = First, count = Count;
};
struct AllLayers {};

}  // namespace fived
