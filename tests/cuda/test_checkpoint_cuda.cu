// Checkpoints on CUDA with NCCL, each rank a process (scripts/launch-local.sh 2), fp32:
//   - resume is bit for bit: 4 steps straight equal 2 steps, a save (and for the background
//     save, 2 more steps behind it), then a new trainer that loads and runs steps 3-4 —
//     losses and weights equal to the last bit; on Mesh<DP<2>> with ZeRO-1 and on Mesh<PP<2>>
//     with 1F1B;
//   - a CUDA checkpoint loads on the host backend (the serial model: the same weights, to the
//     bit), and a host checkpoint of it resumes on CUDA as the CUDA one does.
// Exits 77 without a GPU.

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include <fived/comm/host.hpp>
#include <fived/comm/nccl.hpp>
#include <fived/nn/cuda/ops.hpp>  // before gpt.hpp: Ops<T, Cuda>
#include <fived/mesh/context.hpp>
#include <fived/nn/gpt.hpp>
#include <fived/train/trainer.hpp>

#include "nccl_test_main.hpp"
#include "../support/batches.hpp"

using namespace fived;
namespace fs = std::filesystem;

namespace {

struct cfg : gpt_config {
  static constexpr int layers = 2, d_model = 64, heads = 4, vocab = 101, max_seq = 32, vocab_multiple = 16;
  static constexpr bool tied = false;  // pipeline stages
};
constexpr int B = 4, T = 16;
const TrainerConfig hp{
    .adamw = {.lr = 0, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-6f, .weight_decay = 0.1f, .max_norm = 0.5f},
    .lr = WarmupCosine{.peak = 3e-3, .warmup = 1, .total = 6, .floor = 0.1}};

struct Run {
  std::vector<double> losses;
  std::vector<float> weights;  // serial layout, after the last step
};

// A folder both processes use, emptied by rank 0 first.
fs::path shared_folder(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("fived_test_checkpoint_cuda_" + name);
  if (test::world().rank() == 0) fs::remove_all(d);
  test::world().barrier();
  return d;
}

enum class Save { none, now, behind };

// Steps [first, last] on mesh M on CUDA; loads `from` first (if given); saves at `save_at`.
template <class M, class Policy, class Sched>
Run train(int first, int last, const fs::path& from = {}, int save_at = -1, const fs::path& to = {},
          Save how = Save::none, unsigned seed = 5) {
  auto ctx = make_mesh_context<M>(test::world().split(0, test::world().rank(), "world"));
  Trainer<GPT<cfg, M, float, Cuda>, Policy, Sched> t(ctx, hp, GptInit{seed, 0.05});
  if (!from.empty())
    if (const int loaded = t.load(from); loaded != first - 1)
      throw std::runtime_error("loaded step " + std::to_string(loaded) + ", expected " + std::to_string(first - 1));
  Run out;
  std::vector<int> tok, tgt;
  for (int s = first; s <= last; ++s) {
    test::global_batch(s, Sched::table.micro_batches, B, T, cfg::vocab, tok, tgt);
    out.losses.push_back(t.step(s, tok, tgt, B, T));
    if (s == save_at) how == Save::behind ? t.save_async(to, s) : t.save(to, s);
  }
  t.wait_for_save();
  out.weights = t.serial_params();
  return out;
}

template <class M, class Policy, class Sched>
void resume_is_bitwise(const std::string& name, Save how) {
  CAPTURE(name);
  const fs::path dir = shared_folder(name);
  const Run straight = train<M, Policy, Sched>(1, 4);
  const Run before = train<M, Policy, Sched>(1, how == Save::behind ? 4 : 2, {}, 2, dir, how);
  const Run after = train<M, Policy, Sched>(3, 4, dir, -1, {}, Save::none, /*another seed: the load must win*/ 99);
  CHECK(after.losses == std::vector<double>(straight.losses.begin() + 2, straight.losses.end()));
  CHECK(after.weights == straight.weights);
  CHECK(before.losses.front() == straight.losses.front());
}

}  // namespace

TEST_CASE("2 ranks: checkpoints on CUDA resume bit for bit: DP 2 with ZeRO-1 (saved now and in the background), "
          "PP 2 with 1F1B") {
  resume_is_bitwise<Mesh<DP<2>>, ZeRO<1>, Accumulate<1>>("dp2", Save::now);
  resume_is_bitwise<Mesh<DP<2>>, ZeRO<1>, Accumulate<1>>("dp2_behind", Save::behind);
  resume_is_bitwise<Mesh<PP<2>>, NoZeRO, pipeline::OneFOneB<2, 2>>("pp2", Save::now);
}

TEST_CASE("2 ranks: a CUDA checkpoint loads on the host backend, and the host's checkpoint of it resumes on CUDA") {
  using M = Mesh<DP<2>>;
  const fs::path cuda_dir = shared_folder("to_host"), host_dir = shared_folder("from_host");
  const Run straight = train<M, ZeRO<1>, Accumulate<1>>(1, 4);
  const Run saved = train<M, ZeRO<1>, Accumulate<1>>(1, 2, {}, 2, cuda_dir, Save::now);
  if (test::world().rank() == 0) {  // the serial host model loads it and saves it again
    std::vector<float> on_host;
    host::run(1, [&](host::Comm& world) {
      auto ctx = make_mesh_context<Mesh<>>(world);
      Trainer<GPT<cfg>, NoZeRO, Accumulate<1>> t(ctx, hp, GptInit{99, 0.05});
      CHECK(t.load(cuda_dir) == 2);
      on_host = t.serial_params();
      t.save(host_dir, 2);
    });
    CHECK(on_host == saved.weights);
  }
  test::world().barrier();
  const Run resumed = train<M, ZeRO<1>, Accumulate<1>>(3, 4, host_dir, -1, {}, Save::none, 99);
  CHECK(resumed.losses == std::vector<double>(straight.losses.begin() + 2, straight.losses.end()));
  CHECK(resumed.weights == straight.weights);
}

int main(int argc, char** argv) { return test::nccl_doctest_main(argc, argv, "test_checkpoint_cuda"); }
