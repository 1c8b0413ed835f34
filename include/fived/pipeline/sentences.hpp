#pragma once
// The sentences a schedule is rejected with: by a static_assert in Proven<>
// (proven.hpp) or a generator type, and by describe() and the generators'
// exceptions at run time. Macros, because a C++20 static_assert message must be
// a string literal, and the compile-time and run-time rejections must say the
// same thing.

// Properties of a table, in the order verify() checks them (the first that fails is reported).
#define FIVED_PIPELINE_SAYS_SHAPE                                                                                 \
  "fived::pipeline: the table's shape is not valid: it needs P >= 1 ranks, M >= 1 micro-batches, V >= 1 chunks " \
  "(exactly 2 for a vee table) and one program per rank"
#define FIVED_PIPELINE_SAYS_WELL_FORMED                                                                         \
  "fived::pipeline: every action must name a micro-batch in [0, M) and a chunk in [0, V), every send and "      \
  "receive a peer rank in [0, P) other than its own, and only a comm action that follows another comm action " \
  "may join its group"
#define FIVED_PIPELINE_SAYS_ONE_FORWARD_EACH \
  "fived::pipeline: every stage (rank, chunk) must run exactly one forward F per micro-batch"
#define FIVED_PIPELINE_SAYS_ONE_BACKWARD_EACH                                                                    \
  "fived::pipeline: every stage (rank, chunk) must run exactly one backward per micro-batch: one B, or one I " \
  "and one W (never both forms)"
#define FIVED_PIPELINE_SAYS_FORWARD_BEFORE_BACKWARD \
  "fived::pipeline: a stage must run a micro-batch's forward before its backward (B or I)"
#define FIVED_PIPELINE_SAYS_INPUT_GRAD_BEFORE_WEIGHT_GRAD \
  "fived::pipeline: a stage must run a micro-batch's I (input gradient) before its W (weight gradient)"
#define FIVED_PIPELINE_SAYS_PEERS_ARE_NEIGHBOURS                                                                 \
  "fived::pipeline: a send or receive must name the rank of the neighbouring virtual stage: activations go to " \
  "the next stage's rank and come from the previous one's, gradients the other way; a stage whose neighbour "   \
  "is on its own rank, or that has none, exchanges nothing on that side"
#define FIVED_PIPELINE_SAYS_ONE_SEND_EACH                                                                        \
  "fived::pipeline: every stage must send each micro-batch's output activations to the next virtual stage's " \
  "rank, and its input gradient to the previous one's, exactly once"
#define FIVED_PIPELINE_SAYS_ONE_RECEIVE_EACH                                                                     \
  "fived::pipeline: every send needs its receive: each stage must receive each micro-batch's activations from " \
  "the previous virtual stage's rank, and its output gradient from the next one's, exactly once"
#define FIVED_PIPELINE_SAYS_SENDS_AFTER_COMPUTE                                                                  \
  "fived::pipeline: a stage must not send what it has not computed yet: activations go after the micro-batch's " \
  "F, the input gradient after its B or I"
#define FIVED_PIPELINE_SAYS_FORWARD_AFTER_INPUT                                                                    \
  "fived::pipeline: a stage must receive a micro-batch's activations from the previous virtual stage before its " \
  "forward (or, when that stage is on the same rank, run after that stage's forward)"
#define FIVED_PIPELINE_SAYS_BACKWARD_AFTER_GRADIENT                                                              \
  "fived::pipeline: a stage must receive a micro-batch's output gradient from the next virtual stage before "   \
  "its B or I (or, when that stage is on the same rank, run after that stage's B or I)"
#define FIVED_PIPELINE_SAYS_SENDS_MATCH_RECEIVES                                                                  \
  "fived::pipeline: sends and receives between two ranks must pair up in the same order on both sides: NCCL "   \
  "matches the k-th send from a rank with the k-th receive posted for it, so any other order hands a message " \
  "to another one's buffer"
#define FIVED_PIPELINE_SAYS_NO_CROSSED_SENDS                                                                      \
  "fived::pipeline: deadlock: two ranks each send to the other first, in separate comm steps; blocking "        \
  "point-to-point waits for the receive on both sides, so neither gets to it. Issue the crossing send and "     \
  "receive as one group (.with_previous())"
#define FIVED_PIPELINE_SAYS_PROGRESSES                                                                          \
  "fived::pipeline: deadlock: a dry run of all ranks stops progressing: some comm group waits for an operation " \
  "its peer never reaches"

// Where the first failure is (Proven<> instantiates FirstFailure<rank, position, micro_batch, chunk>).
#define FIVED_PIPELINE_SAYS_WHERE                                                                               \
  "fived::pipeline: the template arguments of FirstFailure<rank, position, micro_batch, chunk> in the lines "  \
  "above say where the property first fails (position -1: an action is missing from that rank's program)"

// Constraints of the generators.
#define FIVED_PIPELINE_SAYS_AT_LEAST_ONE \
  "fived::pipeline: a schedule needs at least one rank (P >= 1) and one micro-batch (M >= 1)"
#define FIVED_PIPELINE_SAYS_1F1B_NEEDS_M_GE_P                                                                      \
  "fived::pipeline: 1F1B (and ZB-H1) needs at least as many micro-batches as pipeline ranks (M >= P): with "     \
  "fewer, the pipeline never reaches its one-forward-one-backward steady state"
#define FIVED_PIPELINE_SAYS_INTERLEAVED_NEEDS_ROUNDS                                                             \
  "fived::pipeline: interleaved 1F1B runs micro-batches in rounds of P per model chunk (Megatron): M must be " \
  "a multiple of P"
#define FIVED_PIPELINE_SAYS_INTERLEAVED_NEEDS_CHUNKS \
  "fived::pipeline: interleaved 1F1B needs at least two model chunks per rank (V >= 2); V = 1 is plain 1F1B"
#define FIVED_PIPELINE_SAYS_V_NEEDS_M_GE_2P                                                                      \
  "fived::pipeline: the V schedule needs M >= 2P micro-batches: its warm-up keeps rank 0 busy with 2P chunk " \
  "forwards before the first backward comes back"
