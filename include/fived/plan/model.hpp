#pragma once
// The planner's view of a model: plan::Transformer and plan::from_model
// (model/plan_shape.hpp, part of the model contract), and fived's GPT as one,
// plan::from_gpt (nn/gpt_shape.hpp).

#include "fived/model/plan_shape.hpp"
#include "fived/nn/gpt_shape.hpp"
