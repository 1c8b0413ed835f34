#pragma once
// Pipeline schedules as compile-time tables, with proofs. One include for all of it:
//
//   action.hpp      Action: F, B, I, W, send/recv of activations and gradients; NCCL groups
//   stages.hpp      Shape: P ranks, M micro-batches, V chunks; looped or V-shaped stages
//   table.hpp       Schedule (run-time sizes) and Table<P, M, V, Order> (compile time); step_end
//   scratch.hpp     Scratch<T>: the proofs' working arrays, sized once (they run inside the compiler)
//   verdict.hpp     Verdict: the first property that fails, and where
//   table_index.hpp one walk over a table: where each action is, each message's number, the actions'
//                   own checks, each rank's counts and peaks; how the proofs are written for the
//                   compilers' interpreters
//   dry_run.hpp     all ranks run together under blocking point-to-point, with or without time
//   verify.hpp      verify(): the properties, the first that fails and where
//   simulate.hpp    measure(): makespan, bubble, peak activations
//   lower.hpp       with_messages(): compute orders to a full table with sends and receives
//   generators.hpp  gpipe, one_f_one_b, interleaved_1f1b, zb_h1, zb_v, dualpipe_v as constexpr
//                   functions (and their compute orders, *_order)
//   proven.hpp      Proven<S> / proven<S>: the proofs as static_asserts, the numbers as constants
//   schedules.hpp   GPipe<P, M>, OneFOneB<P, M>, Interleaved1F1B<P, M, V>, ZBH1<P, M>, ZBV<P, M>, DualPipeV<P, M>

#include "fived/pipeline/action.hpp"
#include "fived/pipeline/dry_run.hpp"
#include "fived/pipeline/generators.hpp"
#include "fived/pipeline/lower.hpp"
#include "fived/pipeline/proven.hpp"
#include "fived/pipeline/schedules.hpp"
#include "fived/pipeline/simulate.hpp"
#include "fived/pipeline/stages.hpp"
#include "fived/pipeline/table.hpp"
#include "fived/pipeline/table_index.hpp"
#include "fived/pipeline/verdict.hpp"
#include "fived/pipeline/verify.hpp"
