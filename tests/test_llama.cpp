// Llama (nn/llama.hpp) against Hugging Face transformers: the tiny LlamaForCausalLM of
// tests/data/make_hf_llama_fixture.py (grouped-query attention 4:2, Llama 3.1 rotary scaling,
// SwiGLU, RMSNorm, untied) loaded from its safetensors file gives transformers' loss and
// every parameter's gradient, in fp64 (1e-10) and fp32 (1e-5), serially and through a
// Trainer on Mesh<DP<2>, PP<2>, CP<2>, TP<2>> with SP and ZeRO-1. And on meshes against its
// own serial run over three steps (losses, gradients, weights): TP 2, ring CP 2 and 4.

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "fived/comm/counting.hpp"
#include "fived/comm/host.hpp"
#include "fived/io/safetensors.hpp"
#include "fived/model/contract.hpp"
#include "fived/nn/llama.hpp"
#include "fived/plan/models.hpp"
#include "fived/plan/plan.hpp"
#include "fived/train/trainer.hpp"
#include "support/batches.hpp"
#include "support/compare.hpp"
#include "support/trainer_checks.hpp"

using namespace fived;

namespace {

struct tiny : llama_config {  // tests/data/hf_tiny_llama.safetensors
  static constexpr int layers = 2, d_model = 32, heads = 4, kv_heads = 2, ffn = 48, vocab = 61, max_seq = 32;
  static constexpr int vocab_multiple = 16;
  static constexpr double rope_theta = 10000.0, rope_factor = 8.0;
  static constexpr int rope_original_max_seq = 64;
};
// SwiGLU experts in the second block, padded to capacity: every size after routing is static,
// so the plan's activations and exchanges are exact.
struct padded_moe_tiny : tiny {
  static constexpr int experts = 4, top_k = 2, moe_every = 2;
  static constexpr double aux_loss_coef = 0.01, capacity_factor = 1.25;
  static constexpr bool pad_to_capacity = true;
};
// The same with a capacity, not padded: the experts' buffers are made for the most rows that
// can arrive (E·capacity, or EP·N·k when that is fewer), so their plan is exact too.
struct capped_moe_tiny : padded_moe_tiny {
  static constexpr bool pad_to_capacity = false;
};
// Mixtral (tests/data/hf_tiny_mixtral.safetensors): 4 SwiGLU experts, top-2, in every
// block; no balancing term in its loss; rotary θ 1e6, unscaled.
struct mixtral_tiny : tiny {
  static constexpr int experts = 4, top_k = 2, moe_every = 1;
  static constexpr double aux_loss_coef = 0;
  static constexpr double rope_theta = 1e6, rope_factor = 1.0;
};
constexpr int fixture_batch = 4, fixture_T = 16;

// A model file from transformers and its reference: a token batch, the loss and every
// gradient under the file's tensor names (tests/data/make_hf_*_fixture.py).
struct HfFixture {
  std::string model_file;
  io::SafetensorsFile ref;
  std::vector<int> ids(const char* name) const {
    const std::vector<std::int32_t> v = ref.read<std::int32_t>(name);
    return {v.begin(), v.end()};
  }
};
HfFixture read_fixture(const std::string& stem) {
  const std::string dir = FIVED_TEST_DATA_DIR;
  return {dir + "/hf_tiny_" + stem + ".safetensors", io::SafetensorsFile::read(dir + "/hf_tiny_" + stem + "_ref.safetensors")};
}
const HfFixture& llama_fixture() {
  static const HfFixture f = read_fixture("llama");
  return f;
}
const HfFixture& mixtral_fixture() {
  static const HfFixture f = read_fixture("mixtral");
  return f;
}

// Per tensor of the model's file, max |got - ref| / max |ref| against transformers' gradient
// (no vocabulary padding; each of Mixtral's experts apart). The worst one, and its name.
template <class Model, class T>
double worst_against_hf(const HfFixture& fx, const std::vector<T>& dense, const std::vector<T>& experts,
                        const std::string& precision, std::string& where) {
  double worst = 0;
  for (const FileTensor& t : file_tensors<typename Model::serial_layout, typename Model::serial_expert_layout>()) {
    const std::vector<double> ref = fx.ref.read<double>(precision + "." + t.name);
    REQUIRE(ref.size() == t.size);
    const std::vector<T>& grads = t.expert ? experts : dense;
    const std::vector<T> got(grads.begin() + static_cast<std::ptrdiff_t>(t.offset),
                             grads.begin() + static_cast<std::ptrdiff_t>(t.offset + t.size));
    if (const double e = test::max_rel_error(got, ref); e > worst) worst = e, where = t.name;
  }
  return worst;
}

template <class Cfg, class T>
void serial_equals_hf(const HfFixture& fx, const std::string& precision, const char* loss_name, double tolerance) {
  using Model = Llama<Cfg, Mesh<>, T>;
  Model m;
  m.load(fx.model_file);
  const std::vector<int> tok = fx.ids("tokens"), tgt = fx.ids("targets");
  const double loss = m.forward(tok.data(), tgt.data(), fixture_batch, fixture_T);
  m.backward();
  const double ref = fx.ref.read<double>(loss_name)[0];
  std::string where;
  std::vector<T> experts;
  if constexpr (Model::has_experts) experts = m.expert_grads_to_host();
  const double g = worst_against_hf<Model>(fx, m.grads_to_host(), experts, precision, where);
  MESSAGE(Model::describe() << ", " << precision << ": loss " << loss << " vs transformers' " << ref << " ("
                            << std::abs(loss - ref) / ref << " relative), every gradient within " << g << " (" << where
                            << ")");
  CHECK(std::abs(loss - ref) / ref <= tolerance);
  CHECK(g <= tolerance);
}

}  // namespace

using Serial = Llama<tiny>;
static_assert(check_model<Serial>::ok && ModelPart<Serial>, "Llama satisfies the model contract");
static_assert(Serial::layout::count == 1 + 2 * 9 + 2, "embed_tokens; 9 tensors a block; model.norm and lm_head");
static_assert(plan::from_model<Serial>().parameters() == static_cast<std::int64_t>(Serial::serial_layout::num_parameters),
              "the plan counts the model's parameters (as Hugging Face does: no padded vocabulary rows)");

// The planner's Llama-3-405B (plan/models.hpp, a description) is the model type's own.
constexpr plan::Transformer llama405 = plan::from_model<Llama<llama3_405b_config>>();
static_assert(llama405.parameters() == plan::llama3_405b.parameters() && llama405.kv_heads == 8 && llama405.gated &&
                  llama405.d_ff == plan::llama3_405b.d_ff && llama405.positions == 0 && !llama405.biases &&
                  llama405.norm == plan::Norm::rms_norm && llama405.padded_vocab == plan::llama3_405b.padded_vocab,
              "plan::llama3_405b describes fived's Llama<llama3_405b_config>");

TEST_CASE("Llama's tensors carry Hugging Face LlamaForCausalLM's names and shapes") {
  const io::SafetensorsFile f = io::SafetensorsFile::read(llama_fixture().model_file);
  CHECK(f.tensors().size() == static_cast<std::size_t>(Serial::layout::count));
  for (const ParamInfo& t : Serial::serial_layout::tensors) {
    CAPTURE(t.name());
    const io::TensorEntry* e = f.find(t.name());
    REQUIRE(e != nullptr);
    CHECK(e->shape == t.file_shape());
  }
}

TEST_CASE("Llama from the Hugging Face fixture: its loss and every gradient are transformers' (fp64 to 1e-10, "
          "fp32 to 1e-5)") {
  serial_equals_hf<tiny, double>(llama_fixture(), "grad64", "loss64", 1e-10);
  serial_equals_hf<tiny, float>(llama_fixture(), "grad32", "loss32", 1e-5);
}

namespace {

// A Trainer on mesh M (SP, ZeRO-1, 1F1B over two micro-batches of two sequences) from the
// fixture's file: its loss and gathered gradient, experts included, against transformers'.
template <class Cfg, class M, class T>
void trainer_equals_hf(const HfFixture& fx, const std::string& what, const std::string& precision, const char* loss_name,
                       double tolerance) {
  using Model = Llama<Cfg, M, T, Host, SequenceParallel>;
  using SerialModel = Llama<Cfg, Mesh<>, T>;
  const std::vector<int> tok = fx.ids("tokens"), tgt = fx.ids("targets");
  constexpr int micro = 2, b = fixture_batch / micro;  // one sequence of each micro-batch per DP rank
  std::vector<std::vector<T>> dense(M::size), experts(M::size);
  std::vector<double> loss(M::size);
  host::run(M::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(world);
    Trainer<Model, ZeRO<1>, pipeline::OneFOneB<M::pp, micro>> tr(ctx, {.adamw = {}, .lr = ConstantLr{1e-3}}, GptInit{5});
    tr.load_weights(fx.model_file);
    const auto r = static_cast<std::size_t>(ctx.rank());
    loss[r] = tr.reduce(1, tok, tgt, b, fixture_T);
    dense[r] = tr.serial_grads();
    if constexpr (Model::has_experts) experts[r] = tr.serial_expert_grads();
  });
  const double ref = fx.ref.read<double>(loss_name)[0];
  for (std::size_t r = 0; r < static_cast<std::size_t>(M::size); ++r) {
    CAPTURE(r);
    std::string where;
    const double g = worst_against_hf<SerialModel>(fx, dense[r], experts[r], precision, where);
    if (r == 0)
      MESSAGE(what << ", " << precision << ": loss " << std::abs(loss[0] - ref) / ref << " relative, every gradient within "
                   << g << " (" << where << ") of transformers'");
    CHECK(std::abs(loss[r] - ref) / ref <= tolerance);
    CHECK(g <= tolerance);
  }
}

}  // namespace

TEST_CASE("a Trainer on Mesh<DP<2>, PP<2>, CP<2>, TP<2>> (SP, ZeRO-1, 1F1B) starts from the Hugging Face Llama; its "
          "loss and gathered gradient are transformers' (fp64 to 1e-10, fp32 to 1e-5)") {
  using M = Mesh<DP<2>, PP<2>, CP<2>, TP<2>>;
  trainer_equals_hf<tiny, M, double>(llama_fixture(), "DP 2 x PP 2 x CP 2 x TP 2", "grad64", "loss64", 1e-10);
  trainer_equals_hf<tiny, M, float>(llama_fixture(), "DP 2 x PP 2 x CP 2 x TP 2", "grad32", "loss32", 1e-5);
}

namespace {

// `got` holds `want`'s tensors, name for name, shape and values (as floats).
void same_tensors(const std::filesystem::path& want, const std::filesystem::path& got) {
  const io::SafetensorsFile a = io::SafetensorsFile::read(want), b = io::SafetensorsFile::read(got);
  CHECK(b.tensors().size() == a.tensors().size());
  for (const io::TensorEntry& e : a.tensors()) {
    CAPTURE(e.name);
    REQUIRE(b.find(e.name) != nullptr);
    CHECK(b.find(e.name)->shape == e.shape);
    CHECK(b.read<float>(e.name) == a.read<float>(e.name));
  }
}

// The fixture's file loaded, saved and read again: the same tensors, bit for bit.
template <class Model>
void saves_the_file(const HfFixture& fx, const char* stem) {
  Model m;
  m.load(fx.model_file);
  const std::filesystem::path out = std::filesystem::temp_directory_path() / (std::string("fived_") + stem + "_roundtrip.safetensors");
  m.save(out);
  same_tensors(fx.model_file, out);
  std::filesystem::remove(out);
}

}  // namespace

TEST_CASE("Llama saves Hugging Face's file: the fixture loaded, saved and loaded again is the same, name for name; "
          "on TP 2, a file TP rank 0 cannot write is an error on both ranks, not a hang") {
  saves_the_file<Serial>(llama_fixture(), "llama");
  using M = Mesh<TP<2>>;
  const std::filesystem::path nowhere = std::filesystem::temp_directory_path() / "fived-no-such-folder" / "w.safetensors";
  std::vector<int> threw(M::size, 0);
  host::run(M::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(world);
    Llama<tiny, M, float, Host, SequenceParallel> m(ctx, GptInit{5});
    try {
      m.save(nowhere);
    } catch (const std::exception&) {
      threw[static_cast<std::size_t>(ctx.rank())] = 1;
    }
  });
  CHECK(std::count(threw.begin(), threw.end(), 1) == M::size);
}

// ---- Mixtral: Llama's blocks with a mixture of SwiGLU experts, from transformers' file -------

using Mixtral = Llama<mixtral_tiny>;
static_assert(Mixtral::has_experts && Mixtral::serial_expert_layout::count == 4,
              "each block's experts: gate_up_proj and down_proj, stacked");

TEST_CASE("Mixtral's file loads as it is: the router and each expert's w1, w3 and w2 under transformers' names and "
          "shapes, w1 and w3 the gate and up rows of the expert's gate_up_proj") {
  const io::SafetensorsFile f = io::SafetensorsFile::read(mixtral_fixture().model_file);
  const std::vector<FileTensor> want = file_tensors<Mixtral::serial_layout, Mixtral::serial_expert_layout>();
  CHECK(f.tensors().size() == want.size());
  for (const FileTensor& t : want) {
    CAPTURE(t.name);
    REQUIRE(f.find(t.name) != nullptr);
    CHECK(f.find(t.name)->shape == t.shape);
  }
  Mixtral m;
  m.load(mixtral_fixture().model_file);
  constexpr int C = mixtral_tiny::d_model, F = mixtral_tiny::ffn;
  const ParamInfo& gate_up = Mixtral::serial_expert_layout::tensors[static_cast<std::size_t>(
      *Mixtral::serial_expert_layout::find("model.layers.1.block_sparse_moe.experts.gate_up_proj"))];
  const std::vector<float> w3 = f.read<float>("model.layers.1.block_sparse_moe.experts.2.w3.weight");
  const float* up = m.expert_params().data() + gate_up.offset + static_cast<std::size_t>(2 * 2 * F + F) * C;
  CHECK(std::equal(w3.begin(), w3.end(), up));  // expert 2's up rows
  const std::vector<float> router = f.read<float>("model.layers.1.block_sparse_moe.gate.weight");
  const TensorView<float> r = m.param("model.layers.1.block_sparse_moe.gate.weight");
  CHECK(std::equal(router.begin(), router.end(), r.data.begin()));  // [experts, d_model], as torch.nn.Linear
}

TEST_CASE("Mixtral from the Hugging Face fixture: its loss and every gradient, the router's and each expert's, are "
          "transformers' (fp64 to 1e-10, fp32 to 1e-5)") {
  serial_equals_hf<mixtral_tiny, double>(mixtral_fixture(), "grad64", "loss64", 1e-10);
  serial_equals_hf<mixtral_tiny, float>(mixtral_fixture(), "grad32", "loss32", 1e-5);
}

TEST_CASE("a Trainer on Mesh<DP<2>, PP<2>, TP<2>, EP<2>> (SP, ZeRO-1, 1F1B; experts over EP and split over TP) "
          "starts from the Hugging Face Mixtral; its loss and gathered gradients are transformers' (fp64 to 1e-10, "
          "fp32 to 1e-5)") {
  using M = Mesh<DP<2>, PP<2>, TP<2>, EP<2>>;
  trainer_equals_hf<mixtral_tiny, M, double>(mixtral_fixture(), "DP 2 x PP 2 x TP 2 x EP 2", "grad64", "loss64", 1e-10);
  trainer_equals_hf<mixtral_tiny, M, float>(mixtral_fixture(), "DP 2 x PP 2 x TP 2 x EP 2", "grad32", "loss32", 1e-5);
}

namespace {

// A Trainer on mesh M under Policy loads the Mixtral fixture and saves it again
// (Trainer::save_weights): transformers' file, bit for bit. A path it cannot write throws on
// every rank.
template <class M, class Policy, class Sched>
void trainer_saves_the_file(const char* stem) {
  using Model = Llama<mixtral_tiny, M, float, Host, SequenceParallel>;
  const std::filesystem::path out = std::filesystem::temp_directory_path() / (std::string("fived_") + stem + ".safetensors");
  const std::filesystem::path nowhere = std::filesystem::temp_directory_path() / "fived-no-such-folder" / "w.safetensors";
  std::vector<int> threw(M::size, 0);
  host::run(M::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(world);
    Trainer<Model, Policy, Sched> tr(ctx, {.adamw = {}, .lr = ConstantLr{1e-3}}, GptInit{5});
    tr.load_weights(mixtral_fixture().model_file);
    tr.save_weights(out, {{"step", "0"}});
    try {
      tr.save_weights(nowhere);
    } catch (const std::exception&) {
      threw[static_cast<std::size_t>(ctx.rank())] = 1;
    }
  });
  CHECK(std::count(threw.begin(), threw.end(), 1) == M::size);
  same_tensors(mixtral_fixture().model_file, out);
  std::filesystem::remove(out);
}

}  // namespace

TEST_CASE("a Trainer on Mesh<DP<2>, PP<2>, TP<2>, EP<2>> saves the Mixtral it loaded as transformers' file, name for "
          "name and bit for bit (Trainer::save_weights); a file it cannot write is an error on every rank") {
  trainer_saves_the_file<Mesh<DP<2>, PP<2>, TP<2>, EP<2>>, ZeRO<1>, pipeline::OneFOneB<2, 2>>("mixtral_trainer");
}

TEST_CASE("under ZeRO-3 too: a Trainer on Mesh<DP<4>, TP<2>, EP<2>> (the dense weights sharded over 4 ranks, the "
          "experts over their 2-rank data group) saves the Mixtral it loaded, bit for bit") {
  trainer_saves_the_file<Mesh<DP<4>, TP<2>, EP<2>>, ZeRO<3>, Accumulate<1>>("mixtral_trainer_zero3");
}

TEST_CASE("Mixtral saves transformers' file (each expert's w1, w3 and w2 apart): loaded, saved and loaded again is "
          "the same, name for name") {
  saves_the_file<Mixtral>(mixtral_fixture(), "mixtral");
}

// ---- on meshes against its own serial run: three steps, losses, gradients, weights ---------

namespace {

constexpr int steps = 3, B = 4, T = 16;
const TrainerConfig hp{.adamw = {.beta2 = 0.95, .eps = 1e-4, .weight_decay = 0.1, .max_norm = 0.5},
                       .lr = ConstantLr{3e-3}};
const GptInit init{7, 0.1};

struct ring_tiny : tiny {
  using context_attention = RingContext;
};

template <class M, class Policy, class Sched, class Cfg = tiny>
void equals_serial(const std::string& what) {
  test::trainer_equals_serial<Llama<Cfg>, Llama<Cfg, M, float, Host, SequenceParallel>, Policy, Sched>(
      what, hp, init, steps, B, T, tiny::vocab);
}

}  // namespace

TEST_CASE("Llama on Mesh<TP<2>> with SP (the 2 key/value heads split like the 4 query heads): equals serial") {
  equals_serial<Mesh<TP<2>>, NoZeRO, Accumulate<1>>("TP 2");
}

TEST_CASE("grouped-query attention with TP above the key/value heads: 2 KV heads on Mesh<TP<4>> (each on 2 ranks, "
          "its gradient summed over them) and with DP 2 x TP 4, ZeRO-1: equals serial") {
  equals_serial<Mesh<TP<4>>, NoZeRO, Accumulate<1>>("TP 4 (KV heads on 2 ranks each)");
  equals_serial<Mesh<DP<2>, TP<4>>, ZeRO<1>, Accumulate<2>>("DP 2 x TP 4, ZeRO-1");
}

namespace {
struct moe_tiny : tiny {  // Mixtral-like: SwiGLU experts in every second block
  static constexpr int experts = 4, top_k = 2, moe_every = 2;
};
}  // namespace

TEST_CASE("a Mixtral-like Llama (4 SwiGLU experts, top-2, in every second block): its expert gradients are the loss's "
          "(fp64 central differences), and it equals serial on Mesh<CP<2>, TP<2>, EP<2>> (SP, ZeRO-1)") {
  using M64 = Llama<moe_tiny, Mesh<>, double>;
  static_assert(M64::has_experts && M64::expert_layout::count == 2, "gate_up_proj and down_proj, stacked");
  std::vector<int> tok, tgt;
  test::global_batch(1, 1, 2, 8, tiny::vocab, tok, tgt);
  M64 m(init);
  m.zero_grad();
  m.forward(tok.data(), tgt.data(), 2, 8);
  m.backward();
  const std::vector<double> g = m.expert_grads_to_host();
  double worst = 0;
  for (std::size_t i = 0; i < g.size(); i += 97) {  // a spread of elements of both tensors
    const double x = m.expert_params()[i], h = 1e-4;
    m.expert_params()[i] = x + h;
    const double up = m.forward(tok.data(), tgt.data(), 2, 8) + m.aux_loss();
    m.expert_params()[i] = x - h;
    const double down = m.forward(tok.data(), tgt.data(), 2, 8) + m.aux_loss();
    m.expert_params()[i] = x;
    worst = std::max(worst, std::abs((up - down) / (2 * h) - g[i]) / (std::abs(g[i]) + 1e-3));
  }
  MESSAGE("SwiGLU experts: gradients within " << worst << " of central differences");
  CHECK(worst <= 1e-6);
  // EP carved from CP: the balancing loss counts a replica's whole micro-batch, as serially
  // (over DP it would count each DP rank's share: tests/test_moe.cpp compares those runs).
  equals_serial<Mesh<CP<2>, TP<2>, EP<2>>, ZeRO<1>, Accumulate<1>, moe_tiny>("CP 2 x TP 2 x EP 2, ZeRO-1 (MoE)");
}

TEST_CASE("Llama under all-gather context parallelism (its default), CP 2 and CP 4 with zig-zag chunks (rotary "
          "positions per chunk): equals serial") {
  equals_serial<Mesh<CP<2>>, NoZeRO, Accumulate<1>>("CP 2 (all-gather)");
  equals_serial<Mesh<CP<4>>, NoZeRO, Accumulate<2>>("CP 4 (all-gather)");
}

TEST_CASE("Llama under ring context parallelism, CP 2 and CP 4: equals serial") {
  equals_serial<Mesh<CP<2>>, NoZeRO, Accumulate<1>, ring_tiny>("CP 2 (ring)");
  equals_serial<Mesh<CP<4>>, NoZeRO, Accumulate<2>, ring_tiny>("CP 4 (ring)");
}

// ---- the plan, from the model type: what a Trainer step sends and what the model holds -----

namespace {

template <class Cfg, class M, int Zero, class Sched>
struct run : plan::layout {
  using mesh = M;
  using schedule = Sched;
  static constexpr bool sequence_parallel = true;
  static constexpr int zero = Zero, element_bytes = 4, micro_batch = B / M::dp, sequence = T;
  static constexpr auto bounds = StageLayers<Llama<Cfg, M, float, Host, SequenceParallel>,
                                             Sched::table.shape.ranks * Sched::table.shape.chunks>::bounds;
};
template <class Cfg, class M, int Zero, class Sched>
using PlanOf = plan::Plan<plan::from_model<Llama<Cfg, M, float, Host, SequenceParallel>>(), run<Cfg, M, Zero, Sched>>;

// Bytes the model's buffers hold after one forward and backward on mesh M, against the plan.
template <class Cfg, class M>
void holds_the_planned_bytes(const std::string& what) {
  using P = PlanOf<Cfg, M, 0, Accumulate<1>>;
  std::vector<int> tok, tgt;
  test::global_batch(1, 1, B, T, tiny::vocab, tok, tgt);
  using Model = Llama<Cfg, M, float, Host, SequenceParallel>;
  const std::size_t held = test::bytes_held_after_step<Model>(init, tok, tgt, B, T);
  const plan::Memory& m = P::memory;
  const plan::Bytes planned = m.parameters + m.gradients + m.peak_activations + m.recompute + m.work;
  // What the plan leaves out: the experts' balance from step to step (nn/expert_balance.hpp),
  // the selection bias (floats) and the loads counted and last summed (stats) of each expert
  // of each MoE block; a dense model's one float of bias.
  constexpr std::size_t per_expert = static_cast<std::size_t>(Model::moe_blocks) * Cfg::experts;
  const std::size_t balance = sizeof(float) * std::max<std::size_t>(per_expert, 1) + 2 * sizeof(float) * per_expert;
  MESSAGE(what << ": " << held << " bytes a rank, planned " << planned << " + the experts' balance " << balance);
  CHECK(held == planned + balance);
}

}  // namespace

TEST_CASE("Llama's plan, from its type: its buffers after a forward and backward are the planned bytes on "
          "Mesh<TP<2>>, Mesh<TP<4>>, Mesh<CP<2>, TP<2>> (all-gather) and Mesh<CP<2>> (ring), with SP") {
  holds_the_planned_bytes<tiny, Mesh<TP<2>>>("TP 2");
  holds_the_planned_bytes<tiny, Mesh<TP<4>>>("TP 4 (2 KV heads on 2 ranks each)");
  holds_the_planned_bytes<tiny, Mesh<CP<2>, TP<2>>>("CP 2 (all-gather) x TP 2");
  holds_the_planned_bytes<ring_tiny, Mesh<CP<2>>>("CP 2 (ring)");
}

namespace {
// Serial steps of a Llama with experts: the losses, and the dense and expert weights and
// gradients after the last.
struct ExpertRun {
  std::vector<double> losses;
  std::vector<float> weights, grads, expert_weights, expert_grads;
};
template <class Cfg>
ExpertRun expert_steps() {
  Llama<Cfg> m(init);
  DataParallel<Llama<Cfg>> dp(m, hp.adamw);
  dp.optimizer().hp.lr = hp.lr(1);
  ExpertRun r;
  std::vector<int> tok, tgt;
  for (int s = 1; s <= steps; ++s) {
    test::global_batch(s, 1, B, T, tiny::vocab, tok, tgt);
    r.losses.push_back(dp.step(tok, tgt, B, T));
  }
  r.weights.assign(m.params().begin(), m.params().end());
  r.grads.assign(m.grads().begin(), m.grads().end());
  r.expert_weights.assign(m.expert_params().begin(), m.expert_params().end());
  r.expert_grads.assign(m.expert_grads().begin(), m.expert_grads().end());
  return r;
}
}  // namespace

// (On a mesh each rank's capacity counts its own tokens, so padded runs equal serial ones fed
// the same rows per rank: tests/test_moe.cpp, for GPT-2's experts, batched the same way.)
TEST_CASE("SwiGLU experts padded to capacity, their GEMMs one strided batch for all experts, take the capacity "
          "path's steps (a GEMM per expert) bit for bit") {
  const ExpertRun padded = expert_steps<padded_moe_tiny>(), capped = expert_steps<capped_moe_tiny>();
  CHECK(padded.losses == capped.losses);
  CHECK(padded.weights == capped.weights);
  CHECK(padded.grads == capped.grads);
  CHECK(padded.expert_weights == capped.expert_weights);
  CHECK(padded.expert_grads == capped.expert_grads);
  CHECK(padded.losses.back() < padded.losses.front());
}

TEST_CASE("experts padded to capacity: their buffers after a forward and backward are the planned bytes on "
          "Mesh<CP<2>, TP<2>, EP<2>> and Mesh<TP<2>>, with SP") {
  holds_the_planned_bytes<padded_moe_tiny, Mesh<CP<2>, TP<2>, EP<2>>>("CP 2 x TP 2 x EP 2, padded experts");
  holds_the_planned_bytes<padded_moe_tiny, Mesh<TP<2>>>("TP 2, padded experts");
}

namespace {

// A split backward (its input half, then its weight half) leaves a tape of snapshots on top of
// the buffers a whole backward leaves: the plan's deferred bytes.
template <class Cfg, class M>
void leaves_the_planned_tape(const std::string& what) {
  using P = PlanOf<Cfg, M, 0, Accumulate<1>>;
  using Model = Llama<Cfg, M, float, Host, SequenceParallel>;
  std::vector<int> tok, tgt;
  test::global_batch(1, 1, B, T, tiny::vocab, tok, tgt);
  const std::size_t whole = test::bytes_held_after_step<Model>(init, tok, tgt, B, T),
                    split = test::bytes_held_after_step<Model>(init, tok, tgt, B, T, /*split=*/true);
  MESSAGE(what << ": the tape holds " << split - whole << " bytes a rank, planned " << P::memory.deferred);
  CHECK(P::memory.deferred > 0);
  CHECK(split - whole == P::memory.deferred);
}

}  // namespace

TEST_CASE("a split backward's snapshots for W are the plan's deferred bytes: Llama on Mesh<TP<2>>, and with experts "
          "padded to capacity (EP x capacity rows at each local expert) on Mesh<CP<2>, TP<2>, EP<2>>") {
  leaves_the_planned_tape<tiny, Mesh<TP<2>>>("TP 2");
  leaves_the_planned_tape<padded_moe_tiny, Mesh<CP<2>, TP<2>, EP<2>>>("CP 2 x TP 2 x EP 2, padded experts");
}

TEST_CASE("experts with a capacity, not padded: their buffers are made once for the most rows that can arrive, the "
          "planned bytes (E x capacity on Mesh<CP<2>, TP<2>, EP<2>>, N x k on Mesh<TP<2>> where that is fewer)") {
  constexpr plan::Transformer m = plan::from_model<Llama<capped_moe_tiny, Mesh<CP<2>, TP<2>, EP<2>>, float, Host,
                                                         SequenceParallel>>();
  constexpr std::int64_t N = B * T / 2;  // a CP rank's tokens; both bounds are taken:
  static_assert(m.expert_rows(N, 2) == 4 * plan::expert_capacity(1.25, N, 2, 4) && m.expert_rows(N, 2) < 2 * N * 2);
  static_assert(m.expert_rows(B * T, 1) == B * T * 2 && m.expert_rows(B * T, 1) < 4 * plan::expert_capacity(1.25, B * T, 2, 4));
  holds_the_planned_bytes<capped_moe_tiny, Mesh<CP<2>, TP<2>, EP<2>>>("CP 2 x TP 2 x EP 2, experts with a capacity");
  holds_the_planned_bytes<capped_moe_tiny, Mesh<TP<2>>>("TP 2, experts with a capacity");
}

template <class M, class Sched, class Cfg = tiny>
void sends_the_planned_traffic() {
  std::vector<int> tok, tgt;
  test::global_batch(1, Sched::table.micro_batches, B, T, Cfg::vocab, tok, tgt);
  const test::StepTraffic got =
      test::step_traffic<Llama<Cfg, M, float, Host, SequenceParallel>, ZeRO<1>, Sched>(hp, init, tok, tgt, B, T);
  test::check_traffic<PlanOf<Cfg, M, 1, Sched>>(got);
  if constexpr (M::extent(Axis::cp) > 1 && Cfg::experts == 0)
    for (const plan::Traffic& x : got.by_rank) CHECK(x.cp.all_gather.calls > 0);  // the all-gather CP
  if constexpr (M::ep > 1) {  // no counts, E·capacity rows each way (a stage without MoE blocks: none)
    std::int64_t rows_exchanged = 0;
    for (const plan::Traffic& x : got.by_rank) {
      CHECK(x.ep.all_to_all.calls == 0);
      rows_exchanged += x.ep.all_to_all_v.calls;
    }
    CHECK(rows_exchanged > 0);
  }
}

TEST_CASE("Llama's plan: a Trainer step's collectives, group by group, on DP 2 x PP 2 x CP 2 x TP 2 (all-gather CP) "
          "and DP 2 x PP 2 x TP 4 (KV heads on 2 ranks each)") {
  sends_the_planned_traffic<Mesh<DP<2>, PP<2>, CP<2>, TP<2>>, pipeline::OneFOneB<2, 4>>();
  sends_the_planned_traffic<Mesh<DP<2>, PP<2>, TP<4>>, pipeline::OneFOneB<2, 4>>();
}

TEST_CASE("experts padded to capacity: a Trainer step's collectives, EP's included, are the plan's on DP 2 x CP 2 x "
          "EP 2 and DP 2 x PP 2 x TP 2 x EP 2") {
  sends_the_planned_traffic<Mesh<DP<2>, CP<2>, EP<2>>, Accumulate<2>, padded_moe_tiny>();
  sends_the_planned_traffic<Mesh<DP<2>, PP<2>, TP<2>, EP<2>>, pipeline::OneFOneB<2, 4>, padded_moe_tiny>();
}

namespace {
struct packed_tiny : tiny {
  static constexpr int end_of_document = 5;
};
}  // namespace

// Packed documents (context/documents.hpp) against each document alone: rotary attention
// scores depend on positions' differences only, so a document's rows give the same logits
// whether it sits inside a packed row or starts its own; and the packed row's gradient is
// the documents' gradients weighted by their share of the row's tokens. fp64.
TEST_CASE("packed documents: each document's logits equal the document's alone (rotary positions and all), and the "
          "row's gradient is the documents' gradients weighted by their tokens") {
  constexpr int T = 16, eod = packed_tiny::end_of_document;
  std::vector<int> tok, tgt;
  test::global_batch(3, 1, 1, T, tiny::vocab, tok, tgt);
  for (int& id : tok)
    if (id == eod) id = 6;
  for (int t : {2, 3, 9}) tok[static_cast<std::size_t>(t)] = eod;  // documents [0, 3), [3], [4, 10), [10, 16)
  const GptInit init{7, 0.1};
  Llama<packed_tiny, Mesh<>, double> packed(init);
  Llama<tiny, Mesh<>, double> alone(init);
  REQUIRE(std::equal(packed.params().begin(), packed.params().end(), alone.params().begin()));
  packed.forward(tok.data(), nullptr, 1, T);
  const std::vector<double> row(packed.logits().begin(), packed.logits().end());
  packed.zero_grad();
  packed.forward(tok.data(), tgt.data(), 1, T);
  packed.backward();
  std::vector<double> weighted(alone.grads().size(), 0.0);
  constexpr int Vp = padded_vocab<tiny>;
  for (const auto [begin, end] : std::vector<std::array<int, 2>>{{0, 3}, {3, 4}, {4, 10}, {10, 16}}) {
    CAPTURE(begin);
    const int n = end - begin;
    alone.forward(tok.data() + begin, nullptr, 1, n);
    for (int i = 0; i < n * Vp; ++i)
      CHECK(alone.logits()[static_cast<std::size_t>(i)] ==
            doctest::Approx(row[static_cast<std::size_t>(begin * Vp + i)]).epsilon(1e-12));
    alone.zero_grad();
    alone.forward(tok.data() + begin, tgt.data() + begin, 1, n);
    alone.backward();
    for (std::size_t i = 0; i < weighted.size(); ++i) weighted[i] += alone.grads()[i] * n / T;
  }
  const std::vector<double> got(packed.grads().begin(), packed.grads().end());
  CHECK(test::max_rel_error(got, weighted) <= 1e-10);
}
