// A step captured once as a graph and replayed (nn/step_graph.hpp), on the host backend,
// whose Ops keep a captured step's calls and run them at launch as a CUDA graph would:
// - the Ops' bookkeeping: plain, captured, replayed; uploads reach the device at launch, from
//   the step's own copy; a changed call, a wait or an allocation inside a graph step refused,
//   and the Ops back to plain steps after;
// - DataParallel and the Trainer (GPT and Llama, float and double, accumulation 2, a new
//   batch and learning rate every step) give the plain steps' losses and weights bit for bit,
//   and capture again when the batch's shape or a hyperparameter changes;
// - on meshes (DP, with ZeRO-1; TP with SP; CP; PP, tied GPT-2's wte summed over the stages;
//   all of them) the Trainer's graph steps, whose collectives and point-to-point transfers
//   are captured with the kernels, equal its plain steps bit for bit, and each graph step
//   issues exactly the plain step's collectives (counted);
// - a checkpoint loaded between steps leaves the graph replaying the right steps;
// - the Trainer refuses the graph with several chunks per pipeline rank or ZeRO-2/3.

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include "fived/comm/counting.hpp"
#include "fived/comm/host.hpp"
#include "fived/nn/gpt.hpp"
#include "fived/nn/llama.hpp"
#include "fived/train/trainer.hpp"
#include "support/batches.hpp"

using namespace fived;

namespace {

struct small_gpt : gpt_config {
  static constexpr int layers = 2, d_model = 32, heads = 4, vocab = 53, max_seq = 16, vocab_multiple = 16;
};
struct four_layers : small_gpt {  // a part for each of 2 pipeline ranks x 2 chunks
  static constexpr int layers = 4;
};
// Experts padded to their capacity (a static routing: a step waits for no count), the
// balancing loss and the selection bias, which moves after each step's launch.
struct padded_moe : small_gpt {
  static constexpr int experts = 4, top_k = 2;
  static constexpr double aux_loss_coef = 0.05, capacity_factor = 1.25, bias_update_rate = 0.02;
  static constexpr bool pad_to_capacity = true;
  using balancing = AuxLossFreeBias;
};
struct dropless_moe : padded_moe {
  static constexpr double capacity_factor = 0;
  static constexpr bool pad_to_capacity = false;
};
struct small_llama : llama_config {
  static constexpr int layers = 2, d_model = 32, heads = 4, kv_heads = 2, ffn = 48, vocab = 61, max_seq = 16;
  static constexpr int vocab_multiple = 16;
};
struct padded_moe_llama : small_llama {  // SwiGLU experts in the second block
  static constexpr int experts = 4, top_k = 2, moe_every = 2;
  static constexpr double aux_loss_coef = 0.05, capacity_factor = 1.25;
  static constexpr bool pad_to_capacity = true;
};

constexpr int B = 2, T = 8, accum = 2, steps = 6;
const AdamWConfig adamw{.lr = 0, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-6, .weight_decay = 0.1, .max_norm = 0.5};
const WarmupCosine schedule{.peak = 3e-3, .warmup = 2, .total = steps, .floor = 0.1};

template <class T_>
bool same_bits(const std::vector<T_>& a, const std::vector<T_>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T_)) == 0;
}

}  // namespace

TEST_CASE("a graph step: plain, then captured, then replayed; uploads land at launch; a changed call is refused") {
  Ops<float, Host> ops;
  ops.use_step_graph = true;
  Buffer<float, Host> a(4), b(4);
  const float one[4] = {1, 2, 3, 4};
  auto step = [&](const float* values, std::size_t copied, StepMode expect) {
    GraphStep graph(ops, 7);
    CHECK(ops.step_mode() == expect);
    ops.upload(a.data(), values, 4);
    ops.copy(b.data(), a.data(), copied);
    if (expect != StepMode::plain) CHECK(b[0] != values[0]);  // queued, not run: the graph runs at launch
    graph.launch();
    CHECK(ops.step_mode() == StepMode::plain);
  };
  step(one, 4, StepMode::plain);  // the first step of its shape warms it
  CHECK(b[3] == 4.0f);
  const float two[4] = {5, 6, 7, 8}, three[4] = {9, 10, 11, 12};
  step(two, 4, StepMode::capturing);
  CHECK(b[3] == 8.0f);
  step(three, 4, StepMode::replaying);  // the new values, from the graph's own copy of them
  CHECK(b[0] == 9.0f);
  CHECK(b[3] == 12.0f);

  SUBCASE("a call with other arguments than the captured one is refused, and the next step is plain") {
    GraphStep graph(ops, 7);
    ops.upload(a.data(), one, 4);
    try {
      ops.copy(b.data(), a.data(), 3);
      FAIL("the changed copy was taken");
    } catch (const std::logic_error& e) {
      CHECK(std::string(e.what()).find("call 1 of the step (copy) has arguments other than the captured step's") !=
            std::string::npos);
    }
    CHECK(ops.step_mode() == StepMode::plain);
    CHECK(b[0] == 9.0f);  // nothing of the refused step ran
  }
  SUBCASE("a step that stops short of the captured one is refused at launch") {
    GraphStep graph(ops, 7);
    ops.upload(a.data(), one, 4);
    CHECK_THROWS_WITH_AS(graph.launch(), doctest::Contains("comes before the rest of the captured step's work"),
                         std::logic_error);
    CHECK(b[0] == 9.0f);
  }
  SUBCASE("a wait or an allocation inside a graph step is refused") {
    GraphStep graph(ops, 7);
    CHECK_THROWS_WITH_AS((void)ops.to_host(a.span()), doctest::Contains("to_host inside a step captured as a graph"),
                         std::logic_error);
    CHECK_THROWS_AS((void)ops.loss_sum(), std::logic_error);
    CHECK_THROWS_AS((void)ops.make_buffer<float>(3), std::logic_error);
  }
  SUBCASE("a new shape starts over with a plain step") {
    GraphStep graph(ops, 8);
    CHECK(ops.step_mode() == StepMode::plain);
    graph.launch();
  }
  SUBCASE("turned off, steps are plain") {
    ops.use_step_graph = false;
    step(two, 4, StepMode::plain);
    CHECK(b[0] == 5.0f);
  }
}

TEST_CASE("an upload more than the plain step before the capture made is refused") {
  Ops<double, Host> ops;
  ops.use_step_graph = true;
  Buffer<double, Host> a(8);
  const std::vector<double> v(8, 1.0);
  {
    GraphStep g(ops, 1);
    ops.upload(a.data(), v.data(), 4);
    g.launch();
  }
  GraphStep g(ops, 1);
  CHECK(ops.step_mode() == StepMode::capturing);
  ops.upload(a.data(), v.data(), 4);
  CHECK_THROWS_WITH_AS(ops.upload(a.data() + 4, v.data(), 4),
                       doctest::Contains("uploads more than the plain step before the capture did"), std::logic_error);
}

TEST_CASE_TEMPLATE("DataParallel: steps replayed as a graph equal plain steps bit for bit (GPT, Llama; float, double)",
                   Model, GPT<small_gpt, Mesh<>, float>, GPT<small_gpt, Mesh<>, double>, Llama<small_llama, Mesh<>, float>) {
  constexpr int vocab = Model::config::vocab;
  Model plain_model(typename Model::init_type{3, 0.05}), graph_model(typename Model::init_type{3, 0.05});
  DataParallel<Model> plain(plain_model, adamw, accum), graphed(graph_model, adamw, accum);
  graphed.set_step_graph(true);
  std::vector<int> tok, tgt;
  auto both = [&](int s, int b) {
    test::global_batch(s, accum, b, T, vocab, tok, tgt);
    plain.optimizer().hp.lr = graphed.optimizer().hp.lr = schedule(s);
    const double lp = plain.step(tok, tgt, b, T), lg = graphed.step(tok, tgt, b, T);
    CHECK(lp == lg);
  };
  for (int s = 1; s <= steps; ++s) {
    CAPTURE(s);
    both(s, B);
    CHECK(graph_model.ops().step_graph_captured() == (s >= 2));
  }
  CHECK(same_bits(plain_model.params_to_host(), graph_model.params_to_host()));
  CHECK(plain.optimizer().step_count() == graphed.optimizer().step_count());
  // A new batch size: plain, then captured again; a new beta2 likewise.
  both(steps + 1, 2 * B);
  CHECK_FALSE(graph_model.ops().step_graph_captured());
  both(steps + 2, 2 * B);
  both(steps + 3, 2 * B);
  CHECK(graph_model.ops().step_graph_captured());
  plain.optimizer().hp.beta2 = graphed.optimizer().hp.beta2 = 0.99;
  both(steps + 4, 2 * B);
  CHECK_FALSE(graph_model.ops().step_graph_captured());
  both(steps + 5, 2 * B);
  both(steps + 6, 2 * B);
  CHECK(same_bits(plain_model.params_to_host(), graph_model.params_to_host()));
  // The graph holds the trainer's work: a trainer that goes takes it along.
  CHECK(graph_model.ops().step_graph_captured());
  { DataParallel<Model> other(graph_model, adamw, accum); }
  CHECK_FALSE(graph_model.ops().step_graph_captured());
}

// Two trainers of the same model on every rank of the mesh, one plain and one replaying a
// graph, stepped in turn: their losses and serial weights, bit for bit. After step 3 (the
// first replayed) each evaluates a held-out batch at the steps' shape, which keeps the graph.
template <class Model, class Policy, class Schedule = Accumulate<accum>>
void trainer_graph_equals_plain() {
  using M = typename Model::mesh;
  const TrainerConfig plain_cfg{.adamw = adamw, .lr = schedule};
  TrainerConfig graph_cfg = plain_cfg;
  graph_cfg.step_graph = true;
  using V = typename Model::value_type;
  std::vector<double> losses[2];
  std::vector<V> weights[2];
  bool captured = false, kept = false;
  host::run(M::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(world);
    Trainer<Model, Policy, Schedule> plain(ctx, plain_cfg, GptInit{4, 0.05}),
        graphed(ctx, graph_cfg, GptInit{4, 0.05});
    std::vector<int> tok, tgt;
    std::vector<double> lp, lg;
    for (int s = 1; s <= steps; ++s) {
      test::global_batch(s, accum, B, T, Model::config::vocab, tok, tgt);
      lp.push_back(plain.step(s, tok, tgt, B, T));
      lg.push_back(graphed.step(s, tok, tgt, B, T));
      if (s == 3) {
        test::global_batch(100, accum, B, T, Model::config::vocab, tok, tgt);
        lp.push_back(plain.evaluate(tok, tgt, B, T));
        lg.push_back(graphed.evaluate(tok, tgt, B, T));
        if (world.rank() == 0) kept = graphed.step_graph_captured();
      }
    }
    std::vector<V> wp = plain.serial_params(), wg = graphed.serial_params();
    if (world.rank() == 0) {
      losses[0] = lp, losses[1] = lg, weights[0] = wp, weights[1] = wg;
      captured = graphed.step_graph_captured();
    }
  });
  CHECK(kept);
  CHECK(captured);
  CHECK(losses[0].size() == steps + 1);
  CHECK(losses[0] == losses[1]);
  CHECK(same_bits(weights[0], weights[1]));
}

TEST_CASE("the Trainer: steps replayed as a graph equal plain ones bit for bit, on one rank and on meshes") {
  SUBCASE("one rank") { trainer_graph_equals_plain<GPT<small_gpt, Mesh<>, float>, NoZeRO>(); }
  // The collectives are part of the graph: the gradients' over DP (the reductions overlapped
  // with backward in a plain step, on the communication thread), TP's and SP's, the ring's
  // over CP.
  SUBCASE("DP 2") { trainer_graph_equals_plain<GPT<small_gpt, Mesh<DP<2>>, float>, NoZeRO>(); }
  SUBCASE("DP 2, ZeRO-1") { trainer_graph_equals_plain<Llama<small_llama, Mesh<DP<2>>, double>, ZeRO<1>>(); }
  SUBCASE("TP 2, sequence parallel") {
    trainer_graph_equals_plain<GPT<small_gpt, Mesh<TP<2>>, float, Host, SequenceParallel>, NoZeRO>();
  }
  SUBCASE("CP 2, ring attention") { trainer_graph_equals_plain<GPT<small_gpt, Mesh<CP<2>>, float>, NoZeRO>(); }
  SUBCASE("CP 2, all-gather attention") { trainer_graph_equals_plain<Llama<small_llama, Mesh<CP<2>>, float>, NoZeRO>(); }
  SUBCASE("DP 2 x CP 2 x TP 2, ZeRO-1") {
    trainer_graph_equals_plain<GPT<small_gpt, Mesh<DP<2>, CP<2>, TP<2>>, float, Host, SequenceParallel>, ZeRO<1>>();
  }
  // The activations and gradients between stages, the tied wte's gradient swapped between the
  // first and last stage and summed, the norm over PP: all in the graph.
  SUBCASE("PP 2, 1F1B, tied GPT-2") {
    trainer_graph_equals_plain<GPT<small_gpt, Mesh<PP<2>>, float>, NoZeRO, pipeline::OneFOneB<2, accum>>();
  }
  SUBCASE("PP 2, ZB-H1 (a split backward), Llama, double") {
    trainer_graph_equals_plain<Llama<small_llama, Mesh<PP<2>>, double>, NoZeRO, pipeline::ZBH1<2, accum>>();
  }
  SUBCASE("DP 2 x PP 2 x TP 2, ZeRO-1, SP, tied GPT-2") {
    trainer_graph_equals_plain<GPT<small_gpt, Mesh<DP<2>, PP<2>, TP<2>>, float, Host, SequenceParallel>, ZeRO<1>,
                               pipeline::OneFOneB<2, accum>>();
  }
  // Experts padded to capacity: the all-to-alls over EP, the balancing loss's sum over CP,
  // the loads added up and summed over DP x CP and the selection bias moved, all in the graph
  // (DataParallel::update: ExpertBalance::step).
  SUBCASE("DP 2 x EP 2, experts padded to capacity, ZeRO-1") {
    trainer_graph_equals_plain<GPT<padded_moe, Mesh<DP<2>, EP<2>>, float>, ZeRO<1>>();
  }
  SUBCASE("DP 2 x CP 2 x EP 2, padded experts, Llama, double") {
    trainer_graph_equals_plain<Llama<padded_moe_llama, Mesh<DP<2>, CP<2>, EP<2>>, double>, NoZeRO>();
  }
  SUBCASE("DP 2 x PP 2 x EP 2, padded experts, 1F1B") {
    trainer_graph_equals_plain<GPT<padded_moe, Mesh<DP<2>, PP<2>, EP<2>>, float>, NoZeRO, pipeline::OneFOneB<2, accum>>();
  }
}

TEST_CASE("on a mesh each graph step issues the plain step's collectives, no more (DP 2 x TP 2, SP, ZeRO-1)") {
  // A collective issued past the Ops in a graph step (not captured, or issued again when
  // replayed) would make its step's count larger than the plain step's.
  using M = Mesh<DP<2>, TP<2>>;
  using Model = GPT<small_gpt, M, float, Host, SequenceParallel>;
  host::run(M::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(Counting<host::Comm>(world));
    Model model(ctx, GptInit{4, 0.05});
    DataParallel<Model, ZeRO<1>> dp(model, ctx, adamw, accum);
    dp.set_step_graph(true);
    auto& tp = ctx.comm<Axis::tp>();
    auto& grad = ctx.comm<typename M::grad_group>();
    std::vector<CommCounts> per_step_tp, per_step_grad;
    std::vector<int> tok, tgt;
    for (int s = 1; s <= 5; ++s) {
      test::global_batch(s, accum, B, T, small_gpt::vocab, tok, tgt);
      const CommCounts tp0 = tp.counts(), grad0 = grad.counts();
      dp.step(tok, tgt, B, T);
      per_step_tp.push_back(tp.counts() - tp0);
      per_step_grad.push_back(grad.counts() - grad0);
    }
    CHECK(model.ops().step_graph_captured());
    CHECK(per_step_tp[0].total_calls() > 0);
    CHECK(per_step_grad[0].reduce_scatter.calls > 0);
    CHECK(per_step_grad[0].all_gather.calls > 0);
    for (std::size_t s = 1; s < per_step_tp.size(); ++s) {
      CAPTURE(s);
      CHECK(per_step_tp[s] == per_step_tp[0]);
      CHECK(per_step_grad[s] == per_step_grad[0]);
    }
  });
}

TEST_CASE("an evaluation at the steps' shape keeps the step graph; at another shape it gives it up, and the step "
          "after runs plain, the next captures again") {
  TrainerConfig cfg{.adamw = adamw, .lr = schedule};
  cfg.step_graph = true;
  host::run(1, [&](host::Comm& world) {
    auto ctx = make_mesh_context<Mesh<>>(world);
    Trainer<GPT<small_gpt, Mesh<>, float>, NoZeRO, Accumulate<accum>> t(ctx, cfg, GptInit{4, 0.05});
    std::vector<int> tok, tgt, held, held_tgt;
    auto step = [&](int s) {
      test::global_batch(s, accum, B, T, small_gpt::vocab, tok, tgt);
      t.step(s, tok, tgt, B, T);
      return t.step_graph_captured();
    };
    CHECK_FALSE(step(1));
    CHECK(step(2));
    test::global_batch(100, accum, B, T, small_gpt::vocab, held, held_tgt);
    t.evaluate(held, held_tgt, B, T);
    CHECK(t.step_graph_captured());
    CHECK(step(3));  // replayed
    test::global_batch(100, accum, B, T / 2, small_gpt::vocab, held, held_tgt);
    t.evaluate(held, held_tgt, B, T / 2);
    CHECK_FALSE(t.step_graph_captured());
    CHECK_FALSE(step(4));
    CHECK(step(5));
  });
}

TEST_CASE("on a pipeline each graph step issues the plain step's transfers and collectives, no more (DP 2 x PP 2, "
          "tied GPT-2, ZeRO-1)") {
  using M = Mesh<DP<2>, PP<2>>;
  using Model = GPT<small_gpt, M, float>;
  TrainerConfig cfg{.adamw = adamw, .lr = schedule};
  cfg.step_graph = true;
  host::run(M::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(Counting<host::Comm>(world));
    Trainer<Model, ZeRO<1>, pipeline::OneFOneB<2, accum>> t(ctx, cfg, GptInit{4, 0.05});
    auto& pp = ctx.comm<Axis::pp>();
    auto& grad = ctx.comm<typename M::grad_group>();
    std::vector<CommCounts> per_step_pp, per_step_grad;
    std::vector<int> tok, tgt;
    for (int s = 1; s <= 5; ++s) {
      test::global_batch(s, accum, B, T, small_gpt::vocab, tok, tgt);
      const CommCounts pp0 = pp.counts(), grad0 = grad.counts();
      t.step(s, tok, tgt, B, T);
      per_step_pp.push_back(pp.counts() - pp0);
      per_step_grad.push_back(grad.counts() - grad0);
    }
    CHECK(t.step_graph_captured());
    CHECK(per_step_pp[0].send_recv.calls > 0);  // activations, gradients, the tied gradient's swap
    CHECK(per_step_grad[0].reduce_scatter.calls > 0);
    for (std::size_t s = 1; s < per_step_pp.size(); ++s) {
      CAPTURE(s);
      CHECK(per_step_pp[s] == per_step_pp[0]);
      CHECK(per_step_grad[s] == per_step_grad[0]);
    }
  });
}

TEST_CASE("the Trainer refuses a graph step with two chunks per pipeline rank, ZeRO-2 or dropless experts, saying which") {
  TrainerConfig cfg{.adamw = adamw, .lr = schedule};
  cfg.step_graph = true;
  using PP2 = Mesh<PP<2>>;
  host::run(2, [&](host::Comm& world) {
    auto ctx = make_mesh_context<PP2>(world);
    CHECK_THROWS_WITH_AS(
        (Trainer<GPT<four_layers, PP2, float>, NoZeRO, pipeline::Interleaved1F1B<2, 2, 2>>(ctx, cfg, GptInit{4, 0.05})),
        doctest::Contains("with one model chunk per pipeline rank, without dropless experts or ZeRO-2/3; this schedule has 2 "
                          "chunks per rank"),
        std::invalid_argument);
  });
  using DP2 = Mesh<DP<2>>;
  host::run(2, [&](host::Comm& world) {
    auto ctx = make_mesh_context<DP2>(world);
    CHECK_THROWS_WITH_AS((Trainer<GPT<small_gpt, DP2, float>, ZeRO<2>>(ctx, cfg, GptInit{4, 0.05})),
                         doctest::Contains("this trainer has ZeRO<2>"), std::invalid_argument);
    CHECK_THROWS_WITH_AS((Trainer<GPT<dropless_moe, DP2, float>, NoZeRO>(ctx, cfg, GptInit{4, 0.05})),
                         doctest::Contains("this model's experts route dropless"), std::invalid_argument);
  });
}

TEST_CASE("a checkpoint loaded into a trainer that replays a graph: the same steps again, bit for bit") {
  // Steps 1-4 (captured at 2, replayed at 3 and 4), saved after step 2; then step 2's
  // checkpoint loaded into the same trainer (its buffers written between steps, the graph
  // kept) and steps 3 and 4 run again: the same losses and weights as the first time.
  using Model = GPT<small_gpt, Mesh<>, float>;
  TrainerConfig cfg{.adamw = adamw, .lr = schedule};
  cfg.step_graph = true;
  const auto dir = std::filesystem::temp_directory_path() / "fived_test_step_graph_checkpoint";
  std::filesystem::remove_all(dir);
  host::run(1, [&](host::Comm& world) {
    auto ctx = make_mesh_context<Mesh<>>(world);
    Trainer<Model, NoZeRO, Accumulate<accum>> t(ctx, cfg, GptInit{4, 0.05});
    std::vector<int> tok, tgt;
    std::vector<double> first, again;
    for (int s = 1; s <= 4; ++s) {
      test::global_batch(s, accum, B, T, small_gpt::vocab, tok, tgt);
      first.push_back(t.step(s, tok, tgt, B, T));
      if (s == 2) t.save(dir, s);
    }
    const std::vector<float> weights = t.serial_params();
    CHECK(t.load(dir, 2) == 2);
    for (int s = 3; s <= 4; ++s) {
      test::global_batch(s, accum, B, T, small_gpt::vocab, tok, tgt);
      again.push_back(t.step(s, tok, tgt, B, T));
    }
    CHECK(again == std::vector<double>(first.begin() + 2, first.end()));
    CHECK(same_bits(weights, t.serial_params()));
  });
  std::filesystem::remove_all(dir);
}
