// Sharded checkpoints (train/checkpoint.hpp, Trainer::save / load) on the host backend.
//
// Bitwise resume: 4 steps straight, or 2 steps, save, a new run (new ranks, new objects, a
// model initialised from another seed) that loads and trains steps 3 and 4: the losses of
// steps 3 and 4 and the final weights are bit for bit the same, for the serial mesh, DP with
// ZeRO-1 and ZeRO-3, TP with SP, and a 3D mesh with a pipeline.
// Resharding: a checkpoint saved on Mesh<DP<2>, TP<2>> (ZeRO-1) loads on Mesh<TP<4>>, on the
// serial mesh and on Mesh<PP<2>, DP<2>>, optimizer state included: the next step's loss is the
// one the original mesh computes (within 1e-5: another reduction order), and a checkpoint
// saved there loads back.
// Refusal: a missing manifest, a file that does not match it, another model.
// Loading reads a rank's share: the manifest's index and the entries that hold what it keeps.

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <random>
#include <thread>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "fived/comm/host.hpp"
#include "fived/nn/gpt.hpp"
#include "fived/train/saver.hpp"
#include "fived/train/trainer.hpp"
#include "support/batches.hpp"
#include "support/compare.hpp"

using namespace fived;
namespace fs = std::filesystem;

namespace {

struct cfg : gpt_config {
  static constexpr int layers = 2, d_model = 32, heads = 4, vocab = 53, max_seq = 32, vocab_multiple = 16;
  static constexpr bool tied = false;  // pipeline stages
};
struct other_cfg : cfg {
  static constexpr int layers = 3;
};
struct tied_cfg : cfg {  // GPT-2's tie: on a pipeline the last stage's head keeps a copy of wte
  static constexpr bool tied = true;
};

constexpr int B = 4, T = 16;
const TrainerConfig hp{
    .adamw = {.lr = 0, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-6f, .weight_decay = 0.1f, .max_norm = 0.5f},
    .lr = WarmupCosine{.peak = 3e-3, .warmup = 1, .total = 6, .floor = 0.1}};

struct Run {
  std::vector<double> losses;           // of the steps run, in order
  std::vector<float> weights, experts;  // the serial layouts, after the last
};

fs::path fresh(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("fived_test_checkpoint_" + name);
  fs::remove_all(d);
  return d;
}

// Steps [first, last] on mesh M; loads `from` first (if given), saves at `save_at` to `to`
// (with save_async: written while the next steps run).
template <class M, class Policy, class Sched, class C = cfg>
Run train(int first, int last, const fs::path& from = {}, int save_at = -1, const fs::path& to = {}, unsigned seed = 5,
          bool async = false) {
  using Model = GPT<C, M, float, Host, std::conditional_t<(M::tp > 1), SequenceParallel, NoSequenceParallel>>;
  constexpr int micro = Sched::table.micro_batches;
  Run out;
  host::run(M::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(world);
    Trainer<Model, Policy, Sched> t(ctx, hp, GptInit{seed, 0.05});
    if (!from.empty())
      if (const int loaded = t.load(from); loaded != first - 1)
        throw std::runtime_error("loaded step " + std::to_string(loaded) + ", expected " + std::to_string(first - 1));
    std::vector<int> tok, tgt;
    std::vector<double> losses;
    for (int s = first; s <= last; ++s) {
      test::global_batch(s, micro, B, T, C::vocab, tok, tgt);
      losses.push_back(t.step(s, tok, tgt, B, T));
      if (s == save_at) async ? t.save_async(to, s) : t.save(to, s);
    }
    std::vector<float> w = t.serial_params(), e;
    if constexpr (C::experts > 0) e = t.serial_expert_params();
    if (ctx.rank() == 0) out.losses = losses, out.weights = std::move(w), out.experts = std::move(e);
  });
  return out;
}

template <class M, class Policy, class Sched, class C = cfg>
void resume_is_bitwise(const std::string& name, bool async = false) {
  CAPTURE(name);
  const fs::path dir = fresh(name);
  const Run straight = train<M, Policy, Sched, C>(1, 4);
  const Run before = train<M, Policy, Sched, C>(1, async ? 4 : 2, {}, 2, dir, 5, async);
  REQUIRE(fs::exists(checkpoint::step_folder(dir, 2) / "manifest.json"));
  const Run after = train<M, Policy, Sched, C>(3, 4, dir, -1, {}, /*another seed: the load must replace it*/ 99);
  CHECK(before.losses == std::vector<double>(straight.losses.begin(), straight.losses.begin() + (async ? 4 : 2)));
  CHECK(after.losses == std::vector<double>(straight.losses.begin() + 2, straight.losses.end()));
  CHECK(after.weights == straight.weights);
  CHECK(after.experts == straight.experts);
  CHECK(after.weights != train<M, Policy, Sched, C>(3, 4, {}, -1, {}, 99).weights);  // the load mattered
  fs::remove_all(dir);
}

}  // namespace

TEST_CASE("resume is bitwise: serial, DP 2 with ZeRO-1 and ZeRO-3, TP 2 with SP, and DP 2 x PP 2 x TP 2 with 1F1B") {
  resume_is_bitwise<Mesh<>, NoZeRO, Accumulate<2>>("serial");
  resume_is_bitwise<Mesh<DP<2>>, ZeRO<1>, Accumulate<2>>("dp2_zero1");
  resume_is_bitwise<Mesh<DP<2>>, ZeRO<3>, Accumulate<1>>("dp2_zero3");
  resume_is_bitwise<Mesh<TP<2>>, NoZeRO, Accumulate<1>>("tp2");
  resume_is_bitwise<Mesh<DP<2>, PP<2>, TP<2>>, ZeRO<1>, pipeline::OneFOneB<2, 2>>("dp2_pp2_tp2");
}

TEST_CASE("a save written in the background (save_async) holds the state of its step while training goes on, and "
          "resumes bit for bit: serial, DP 2 with ZeRO-3, DP 2 x PP 2 x TP 2") {
  resume_is_bitwise<Mesh<>, NoZeRO, Accumulate<2>>("async_serial", true);
  resume_is_bitwise<Mesh<DP<2>>, ZeRO<3>, Accumulate<1>>("async_dp2_zero3", true);
  resume_is_bitwise<Mesh<DP<2>, PP<2>, TP<2>>, ZeRO<1>, pipeline::OneFOneB<2, 2>>("async_dp2_pp2_tp2", true);
}

TEST_CASE("a tied model on a pipeline (the head's copy of wte) resumes bit for bit, and reshards onto one rank") {
  resume_is_bitwise<Mesh<DP<2>, PP<2>, TP<2>>, ZeRO<1>, pipeline::OneFOneB<2, 2>, tied_cfg>("dp2_pp2_tp2_tied");
  const fs::path dir = fresh("tied_reshard");
  using PPMesh = Mesh<DP<2>, PP<2>, TP<2>>;
  using Sched = pipeline::OneFOneB<2, 2>;
  const Run straight = train<PPMesh, ZeRO<1>, Sched, tied_cfg>(1, 3);
  (void)train<PPMesh, ZeRO<1>, Sched, tied_cfg>(1, 2, {}, 2, dir);
  const Run serial = train<Mesh<>, NoZeRO, Accumulate<2>, tied_cfg>(3, 3, dir, -1, {}, 99);
  REQUIRE(serial.losses.size() == 1);
  MESSAGE("tied DP2xPP2xTP2 -> serial: step 3 loss " << serial.losses[0] << " vs " << straight.losses[2]);
  CHECK(std::abs(serial.losses[0] - straight.losses[2]) <= 1e-5 * straight.losses[2]);
  CHECK(test::max_rel_error(serial.weights, straight.weights) <= 1e-5);
  fs::remove_all(dir);
}

TEST_CASE("a checkpoint reshards: Mesh<DP<2>, TP<2>> -> Mesh<TP<4>> -> serial -> Mesh<PP<2>, DP<2>>, optimizer state included") {
  using From = Mesh<DP<2>, TP<2>>;
  const fs::path a = fresh("reshard_a"), b = fresh("reshard_b"), c = fresh("reshard_c");
  const Run original = train<From, ZeRO<1>, Accumulate<2>>(1, 5);
  (void)train<From, ZeRO<1>, Accumulate<2>>(1, 2, {}, 2, a);
  auto close = [](const std::vector<double>& got, const std::vector<double>& want) {
    REQUIRE(got.size() == want.size());
    for (std::size_t i = 0; i < got.size(); ++i) CHECK(std::abs(got[i] - want[i]) <= 1e-5 * want[i]);
  };
  // steps 3 and 4 on TP 4 (2 micro-batches accumulated, as the original); saved at 3
  const Run tp4 = train<Mesh<TP<4>>, NoZeRO, Accumulate<2>>(3, 3, a, 3, b);
  close(tp4.losses, {original.losses[2]});
  // step 4 on one rank, from TP 4's checkpoint; saved at 4
  const Run serial = train<Mesh<>, NoZeRO, Accumulate<2>>(4, 4, b, 4, c);
  close(serial.losses, {original.losses[3]});
  // step 5 on a pipeline with data parallelism, from the serial checkpoint
  const Run pp = train<Mesh<PP<2>, DP<2>>, ZeRO<1>, pipeline::OneFOneB<2, 2>>(5, 5, c);
  close(pp.losses, {original.losses[4]});
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < pp.weights.size(); ++i)
    diff = std::max(diff, double(std::abs(pp.weights[i] - original.weights[i]))), scale = std::max(scale, double(std::abs(original.weights[i])));
  CHECK(diff <= 1e-5 * scale);
  for (const fs::path& d : {a, b, c}) fs::remove_all(d);
}

TEST_CASE("a rank loads only its share: Mesh<DP<4>, TP<2>> -> Mesh<DP<2>, TP<2>> reads the manifest and the entries "
          "that hold what it keeps, not every file; a manifest without an index (format 2) still loads") {
  // (rank, DP coordinate) below: what each rank read, and its DP coordinate
  using From = Mesh<DP<4>, TP<2>>;
  using To = Mesh<DP<2>, TP<2>>;
  using Model = GPT<cfg, To, float, Host, SequenceParallel>;
  const fs::path dir = fresh("share");
  const Run original = train<From, ZeRO<1>, Accumulate<1>>(1, 3);
  (void)train<From, ZeRO<1>, Accumulate<1>>(1, 2, {}, 2, dir);
  const fs::path step = checkpoint::step_folder(dir, 2);
  std::uintmax_t files = 0;
  for (int r = 0; r < From::size; ++r) files += fs::file_size(step / checkpoint::rank_file(r));
  const std::uintmax_t index = fs::file_size(step / "manifest.json");
  // What a rank of To keeps: its TP half of the parameters (ZeRO-1: every DP rank all of
  // them) and the two AdamW moments of its DP piece of each bucket, all float: its share. The
  // files hold each DP rank's piece of each bucket as one entry per tensor and kind; a piece
  // of To that cuts a piece of From reads the entries it cuts whole (each is checked against
  // its hash), so a rank reads exactly: the index, its parameters, and for the moments the
  // entries of From that hold any element of its pieces.
  using Layout = Model::layout;
  using ToPlan = DataParallel<Model, ZeRO<1>>::plan;
  using FromPlan = DataParallel<GPT<cfg, From, float, Host, SequenceParallel>, ZeRO<1>>::plan;
  static_assert(ToPlan::count == FromPlan::count);
  auto moment_bytes = [&](int dp, bool whole_entries) {
    std::uintmax_t bytes = 0;
    for (std::size_t i = 0; i < ToPlan::count; ++i) {
      REQUIRE(ToPlan::bucket(i).range.begin == FromPlan::bucket(i).range.begin);
      const FlatRange mine = ToPlan::owned(i, dp);
      if (!whole_entries) bytes += mine.size();
      for (int saver = 0; whole_entries && saver < From::dp; ++saver)
        for (const ParamInfo& t : Layout::tensors) {
          const FlatRange saved = FromPlan::owned(i, saver);
          const std::size_t b = std::max(t.offset, saved.begin), e = std::min(t.end(), saved.end);
          if (b < e && b < mine.end && mine.begin < e) bytes += e - b;  // an entry that holds an element of mine
        }
    }
    return 2 * sizeof(float) * bytes;
  };
  auto load = [&](std::vector<std::uintmax_t>& read, std::vector<int>& dp) {
    double loss = 0;
    host::run(To::size, [&](host::Comm& world) {
      auto ctx = make_mesh_context<To>(world);
      Trainer<Model, ZeRO<1>, Accumulate<1>> t(ctx, hp, GptInit{99, 0.05});
      const std::uint64_t before = io::bytes_read_by_this_thread();
      CHECK(t.load(dir) == 2);
      read[static_cast<std::size_t>(ctx.rank())] = io::bytes_read_by_this_thread() - before;
      dp[static_cast<std::size_t>(ctx.rank())] = ctx.coord().dp;
      std::vector<int> tok, tgt;
      test::global_batch(3, 1, B, T, cfg::vocab, tok, tgt);
      const double l = t.step(3, tok, tgt, B, T);
      if (ctx.rank() == 0) loss = l;
    });
    return loss;
  };
  std::vector<std::uintmax_t> read(To::size);
  std::vector<int> dp(To::size);
  CHECK(std::abs(load(read, dp) - original.losses[2]) <= 1e-5 * original.losses[2]);
  for (int r = 0; r < To::size; ++r) {
    CAPTURE(r);
    const std::uintmax_t params = sizeof(float) * Layout::size, share = params + moment_bytes(dp[r], false),
                         expected = index + params + moment_bytes(dp[r], true);
    MESSAGE("rank " << r << " read " << read[r] << " bytes: the index " << index << ", its share " << share
                    << " and the rest of the entries it cuts " << expected - index - share << "; the step's files hold "
                    << files);
    CHECK(read[r] == expected);
    CHECK(read[r] < files / 2);
  }

  // Format 2, before the index: the files' headers say where the tensors are, and each file is
  // read whole for its hash.
  checkpoint::Manifest m = checkpoint::read_manifest(step);
  m.format = 2;
  for (checkpoint::FileEntry& f : m.files) f.metadata.clear(), f.tensors.clear();
  checkpoint::write_manifest(step, m);
  CHECK(checkpoint::read_manifest(step).format == 2);
  CHECK(std::abs(load(read, dp) - original.losses[2]) <= 1e-5 * original.losses[2]);
  fs::remove_all(dir);
}

TEST_CASE("piece_index inverts whole_index: every element of a tensor is found in the piece that holds it") {
  const TensorSpec specs[] = {
      matrix_spec("w", 0, 6, 24, TpSplit{1, 3}, 0, Init::normal, 1),             // columns in 3 groups
      matrix_spec("k", 0, 8, 6, TpSplit{0, 1, 2}, 0, Init::normal, 1),           // rows, at most 2 pieces
      vector_spec("b", 0, 12, TpSplit{}, 0, Init::zeros, 1),                      // replicated
      [] { auto s = matrix_spec("e", 0, 32, 4, TpSplit{0, 2}, 0, Init::normal, 1); s.experts = 4; return s; }()};  // experts
  for (const TensorSpec& s : specs)
    for (int tp : {1, 2, 4})
      for (int ep : {1, 2, 4}) {
        if (s.experts == 0 && ep > 1) continue;
        const std::int64_t piece = piece_extent(s, 0, tp, ep) * piece_extent(s, 1, tp, ep);
        for (int r = 0; r < tp; ++r)
          for (int e = 0; e < ep; ++e)
            for (std::int64_t local = 0; local < piece; ++local) {
              const PieceIndex at = piece_index(s, tp, ep, whole_index(s, tp, ep, r, e, local));
              INFO(s.name << " TP " << tp << " EP " << ep << ": rank " << r << ", " << e << " element " << local);
              CHECK((at.local == local && at.piece == (s.tp.dim < 0 ? 0 : r / s.tp.replicas(tp)) &&
                     at.ep_rank == (s.experts > 0 ? e : 0)));
            }
      }
}

TEST_CASE("what is not a checkpoint is refused with the reason: no manifest, a changed file, another model") {
  const fs::path dir = fresh("refuse");
  (void)train<Mesh<DP<2>>, ZeRO<1>, Accumulate<1>>(1, 1, {}, 1, dir);
  const fs::path step = checkpoint::step_folder(dir, 1);
  auto load_error = [&](auto run) {
    try {
      run();
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  // another model
  CHECK(load_error([&] { train<Mesh<>, NoZeRO, Accumulate<1>, other_cfg>(2, 2, dir); }).find("not of this model") !=
        std::string::npos);
  // a changed byte
  {
    std::fstream f(step / checkpoint::rank_file(1), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-1, std::ios::end);
    f.put('x');
  }
  CHECK(load_error([&] { train<Mesh<DP<2>>, ZeRO<1>, Accumulate<1>>(2, 2, dir); })
            .find("rank-00001.safetensors: its contents do not match the manifest's hash") != std::string::npos);
  // no manifest: the step is not a checkpoint, and the folder holds none
  fs::remove(step / "manifest.json");
  CHECK(load_error([&] { train<Mesh<DP<2>>, ZeRO<1>, Accumulate<1>>(2, 2, dir); }).find("holds no complete checkpoint") !=
        std::string::npos);
  fs::remove_all(dir);
}

TEST_CASE("resume falls back to the newest step that verifies, naming the ones it passes over; a step asked for is refused "
          "outright; an edited step field is refused") {
  const fs::path dir = fresh("fallback");
  (void)train<Mesh<DP<2>>, ZeRO<1>, Accumulate<1>>(1, 2, {}, 2, dir);  // step 2
  (void)train<Mesh<DP<2>>, ZeRO<1>, Accumulate<1>>(1, 3, {}, 3, dir);  // and step 3
  // load(dir, step) on DP 2: the step it holds and the refusals, or the error.
  auto load = [&](std::optional<int> step, std::vector<checkpoint::Refusal>* refused, std::string* error) {
    int held = -1;
    try {
      host::run(2, [&](host::Comm& world) {
        auto ctx = make_mesh_context<Mesh<DP<2>>>(world);
        Trainer<GPT<cfg, Mesh<DP<2>>>, ZeRO<1>, Accumulate<1>> t(ctx, hp, GptInit{99, 0.05});
        std::vector<checkpoint::Refusal> r;
        const int s = t.load(dir, step, &r);
        if (ctx.rank() == 0) held = s, *refused = r;
      });
    } catch (const std::exception& e) {
      *error = e.what();
    }
    return held;
  };
  std::vector<checkpoint::Refusal> refused;
  std::string error;
  CHECK(load(std::nullopt, &refused, &error) == 3);
  CHECK(refused.empty());

  // A junk step newer than all, and one flipped byte in step 3: resume from step 2, naming both.
  fs::create_directories(checkpoint::step_folder(dir, 99999999));
  std::ofstream(checkpoint::step_folder(dir, 99999999) / "manifest.json") << "{ not a manifest";
  {
    std::fstream f(checkpoint::step_folder(dir, 3) / checkpoint::rank_file(0), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-1, std::ios::end);
    f.put('x');
  }
  CHECK(load(std::nullopt, &refused, &error) == 2);
  REQUIRE(refused.size() == 2);
  CHECK(refused[0].step == 99999999);
  CHECK(refused[1].step == 3);
  CHECK(refused[1].reason.find("rank-00000.safetensors: its contents do not match the manifest's hash") != std::string::npos);
  CHECK(error.empty());

  // Step 3 asked for: refused outright, with the reason.
  refused.clear();
  CHECK(load(3, &refused, &error) == -1);
  CHECK(error.find("its contents do not match the manifest's hash") != std::string::npos);

  // Step 2's manifest edited to say step 7: refused by field; no step verifies, and the error lists all three.
  const fs::path manifest = checkpoint::step_folder(dir, 2) / "manifest.json";
  std::string text;
  {
    std::ifstream in(manifest);
    text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  const std::size_t at = text.find("\"step\": 2");
  REQUIRE(at != std::string::npos);
  text.replace(at, 9, "\"step\": 7");
  std::ofstream(manifest, std::ios::trunc) << text;
  error.clear();
  CHECK(load(std::nullopt, &refused, &error) == -1);
  CHECK(error.find("holds no complete checkpoint") != std::string::npos);
  CHECK(error.find("step 2 refused") != std::string::npos);
  CHECK(error.find("its \"step\" is 7 in the folder of step 2") != std::string::npos);
  CHECK(error.find("step 99999999 refused") != std::string::npos);
  fs::remove_all(dir);
}

TEST_CASE("a manifest carries its own hash: an edited field is refused; a manifest of format 1 (before the hash) still "
          "loads") {
  const fs::path dir = fresh("own_hash");
  (void)train<Mesh<DP<2>>, ZeRO<1>, Accumulate<1>>(1, 2, {}, 2, dir);
  const fs::path manifest = checkpoint::step_folder(dir, 2) / "manifest.json";
  std::string text;
  {
    std::ifstream in(manifest);
    text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  auto rewrite = [&](const std::string& from, const std::string& to) {
    std::string t = text;
    const std::size_t at = t.find(from);
    REQUIRE(at != std::string::npos);
    t.replace(at, from.size(), to);
    std::ofstream(manifest, std::ios::trunc) << t;
  };
  auto error = [&] {
    try {
      (void)checkpoint::read_manifest(checkpoint::step_folder(dir, 2));
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK(error() == "no error");
  rewrite("\"adam_step\": 2", "\"adam_step\": 3");
  CHECK(error().find("edited after it was written") != std::string::npos);
  rewrite("\"manifest_fnv1a64\"", "\"manifest_fnv1a64\": \"0000000000000000\", \"x\"");
  CHECK(error().find("unknown field \"x\"") != std::string::npos);
  // format 1: no run, no own hash
  const std::size_t run = text.find(",\n  \"run\"");
  REQUIRE(run != std::string::npos);
  std::string old = text.substr(0, run) + "\n}\n";
  old.replace(old.find("fived-checkpoint-3"), 18, "fived-checkpoint-1");
  std::ofstream(manifest, std::ios::trunc) << old;
  CHECK(error() == "no error");
  rewrite("fived-checkpoint-3", "fived-checkpoint-4");
  CHECK(error().find("unknown format") != std::string::npos);
  // A manifest whose own hash agrees but whose AdamW step cannot be: more steps than trained.
  const checkpoint::Manifest m = [&] {
    std::ofstream(manifest, std::ios::trunc) << text;
    return checkpoint::read_manifest(checkpoint::step_folder(dir, 2));
  }();
  checkpoint::Manifest bad = m;
  bad.adam_step = 3;
  checkpoint::write_manifest(checkpoint::step_folder(dir, 2), bad);
  CHECK(error().find("its \"adam_step\" 3 is more than its step 2") != std::string::npos);
  fs::remove_all(dir);
}

TEST_CASE("a save removes what killed saves left (temporaries, steps without a manifest) and keeps the last N steps; "
          "files fived did not write stay") {
  const fs::path dir = fresh("keep_last");
  // What a killed earlier run left: a temporary in a complete step, a partial step, and the user's own files.
  (void)train<Mesh<DP<2>>, ZeRO<1>, Accumulate<1>>(1, 1, {}, 1, dir);
  std::ofstream(checkpoint::step_folder(dir, 1) / "rank-00001.safetensors.tmp.4242.0") << "half a file";
  fs::create_directories(checkpoint::step_folder(dir, 9));
  std::ofstream(checkpoint::step_folder(dir, 9) / "rank-00000.safetensors") << "no manifest";
  std::ofstream(checkpoint::step_folder(dir, 9) / "manifest.json.tmp.4242.1") << "{";
  fs::create_directories(checkpoint::step_folder(dir, 8));
  std::ofstream(checkpoint::step_folder(dir, 8) / "rank-00000.safetensors") << "no manifest";
  std::ofstream(checkpoint::step_folder(dir, 8) / "notes.txt") << "the user's";
  std::ofstream(dir / "README") << "the user's";

  host::run(2, [&](host::Comm& world) {
    auto ctx = make_mesh_context<Mesh<DP<2>>>(world);
    Trainer<GPT<cfg, Mesh<DP<2>>>, ZeRO<1>, Accumulate<1>> t(ctx, hp, GptInit{5, 0.05});
    std::vector<int> tok, tgt;
    for (int s = 1; s <= 4; ++s) {
      test::global_batch(s, 1, B, T, cfg::vocab, tok, tgt);
      t.step(s, tok, tgt, B, T);
      t.save(dir, s, {.keep_last = 2});
    }
  });
  std::vector<std::string> left;
  for (const auto& e : fs::recursive_directory_iterator(dir)) left.push_back(fs::relative(e.path(), dir).string());
  std::sort(left.begin(), left.end());
  CHECK(left == std::vector<std::string>{"README", "step-00000003", "step-00000003/manifest.json",
                                         "step-00000003/rank-00000.safetensors", "step-00000003/rank-00001.safetensors",
                                         "step-00000004", "step-00000004/manifest.json",
                                         "step-00000004/rank-00000.safetensors", "step-00000004/rank-00001.safetensors",
                                         "step-00000008", "step-00000008/notes.txt"});
  // The newest does not verify: nothing older is removed.
  { std::ofstream(checkpoint::step_folder(dir, 4) / checkpoint::rank_file(0), std::ios::app) << "x"; }
  CHECK(checkpoint::keep_last(dir, 1).empty());
  CHECK(checkpoint::steps_with_manifest(dir) == std::vector<int>{4, 3});
  fs::remove_all(dir);
}

// A group communicator that notes the thread it was bound to and whether a collective came
// from another thread: an NCCL communicator's calls check the thread's current device, which
// a thread that did not create it must first set (bind_thread).
struct BindingComm final : GroupCommOf<host::Comm> {
  using GroupCommOf<host::Comm>::GroupCommOf;
  std::thread::id bound;
  bool unbound_call = false;
  void bind_thread() override { bound = std::this_thread::get_id(); }
  void all_reduce_host(std::span<double> values, ReduceOp op) override {
    unbound_call |= std::this_thread::get_id() != bound;
    GroupCommOf<host::Comm>::all_reduce_host(values, op);
  }
  void barrier() override {
    unbound_call |= std::this_thread::get_id() != bound;
    GroupCommOf<host::Comm>::barrier();
  }
};

TEST_CASE("a background save binds its thread to the communicator before its collectives") {
  const fs::path dir = fresh("bind_thread");
  host::run(2, [&](host::Comm& world) {
    BindingComm comm(world);
    checkpoint::Shard shard;
    shard.add("x", std::vector<float>{1.0f, 2.0f, float(world.rank())});
    checkpoint::Saver saver;
    checkpoint::SaveRecord record;
    record.dir = dir, record.step = 1;
    saver.start(std::move(shard), record, comm);
    CHECK(saver.wait() == 1);
    CHECK(comm.bound != std::thread::id{});
    CHECK(comm.bound != std::this_thread::get_id());  // the save's own thread
    CHECK_FALSE(comm.unbound_call);
  });
  CHECK(checkpoint::steps_with_manifest(dir) == std::vector<int>{1});
  fs::remove_all(dir);
}

// ---- a saving process killed at any moment ---------------------------------------------------

namespace {
constexpr int kill_steps = 40;
const char* const child_env = "FIVED_TEST_CHECKPOINT_CHILD";

// kill_steps steps of the serial run, `after(trainer, step)` after each.
template <class After>
void serial_steps(After&& after) {
  host::run(1, [&](host::Comm& world) {
    auto ctx = make_mesh_context<Mesh<>>(world);
    Trainer<GPT<cfg>, NoZeRO, Accumulate<1>> t(ctx, hp, GptInit{5, 0.05});
    std::vector<int> tok, tgt;
    for (int s = 1; s <= kill_steps; ++s) {
      test::global_batch(s, 1, B, T, cfg::vocab, tok, tgt);
      t.step(s, tok, tgt, B, T);
      after(t, s);
    }
  });
}
}  // namespace

// Run by the test below as a child process: trains and saves after every step, until killed
// (with FIVED_TEST_CHECKPOINT_ASYNC set, each save written behind the next step).
TEST_CASE("child: trains and saves every step" * doctest::skip(std::getenv(child_env) == nullptr)) {
  const fs::path dir = std::getenv(child_env);
  const bool async = std::getenv("FIVED_TEST_CHECKPOINT_ASYNC") != nullptr;
  serial_steps([&](auto& t, int s) { async ? t.save_async(dir, s) : t.save(dir, s); });
}

TEST_CASE("a saving process killed (SIGKILL) at any moment leaves its last complete checkpoint loadable, bit for bit") {
  std::vector<std::vector<float>> reference;  // the weights after each step
  serial_steps([&](auto& t, int) { reference.push_back(t.serial_params()); });
  std::mt19937 rng(7);
  int loaded = 0, mid_save = 0;
  for (int round = 0; round < 16; ++round) {  // rounds 12..15 save in the background
    const fs::path dir = fresh("kill_" + std::to_string(round));
    const std::string env = std::string(child_env) + "=" + dir.string();
    char async_env[] = "FIVED_TEST_CHECKPOINT_ASYNC=1";
    char* const envp[] = {const_cast<char*>(env.c_str()), round >= 12 ? async_env : nullptr, nullptr};
    char arg0[] = "test_checkpoint", arg1[] = "--test-case=child: trains and saves every step";
    char* const argv[] = {arg0, arg1, nullptr};
    posix_spawn_file_actions_t quiet;  // the child's doctest report is not this test's
    posix_spawn_file_actions_init(&quiet);
    posix_spawn_file_actions_addopen(&quiet, 1, "/dev/null", O_WRONLY, 0);
    pid_t pid = 0;
    REQUIRE(posix_spawn(&pid, "/proc/self/exe", &quiet, nullptr, argv, envp) == 0);
    posix_spawn_file_actions_destroy(&quiet);
    // The moment is chosen on the child's own clock, not the wall's (a slow machine, or one
    // under a sanitizer, reaches its first save late): once step `after` is committed, the
    // next save cycle is timed, and the kill lands at a random point of the one after it.
    using clock = std::chrono::steady_clock;
    const clock::time_point spawned = clock::now();
    bool exited = false;
    int status = 0;
    auto wait_for = [&](int step) {  // until `step` is committed; false if the child stops first
      while (checkpoint::latest_step(dir).value_or(0) < step) {
        exited = ::waitpid(pid, &status, WNOHANG) == pid;
        if (exited || clock::now() - spawned > std::chrono::minutes(2)) return false;
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
      return true;
    };
    const int after = 1 + static_cast<int>(rng() % (kill_steps / 2));
    bool progressed = wait_for(after);
    const clock::time_point at = clock::now();
    progressed = progressed && wait_for(after + 1);
    const clock::duration cycle = clock::now() - at;
    std::this_thread::sleep_for(cycle * std::uniform_real_distribution<double>(0.0, 1.0)(rng));
    if (!exited) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
    }
    CAPTURE(after);
    CHECK_MESSAGE(progressed, "the child did not commit steps " << after << " and " << after + 1
                                                                << " within two minutes, or exited first");
    const std::optional<int> last = checkpoint::latest_step(dir);
    // killed in the middle of saving the next step: its folder exists without a manifest
    mid_save += fs::exists(checkpoint::step_folder(dir, last.value_or(0) + 1)) ? 1 : 0;
    CAPTURE(round);
    CAPTURE(last.value_or(0));
    if (last) {  // the latest complete step loads, and holds exactly that step's weights
      std::vector<float> got;
      host::run(1, [&](host::Comm& world) {
        auto ctx = make_mesh_context<Mesh<>>(world);
        Trainer<GPT<cfg>, NoZeRO, Accumulate<1>> t(ctx, hp, GptInit{99, 0.05});
        CHECK(t.load(dir) == *last);
        got = t.serial_params();
      });
      CHECK(got == reference[static_cast<std::size_t>(*last - 1)]);
      ++loaded;
    }
    fs::remove_all(dir);
  }
  MESSAGE(loaded << " of 16 kills after a complete save, " << mid_save << " in the middle of one");
  CHECK(loaded == 16);  // every kill comes after a complete save
}

namespace {
// MoE in the second block, the selection bias (which a checkpoint carries) and a balancing loss.
struct moe_cfg : cfg {
  static constexpr int experts = 4, top_k = 2, moe_every = 2;
  using balancing = AuxLossFreeBias;
  static constexpr double bias_update_rate = 0.01;
};
}  // namespace

TEST_CASE("a mixture of experts resumes bit for bit (experts, their AdamW state, the selection bias) and reshards over EP") {
  resume_is_bitwise<Mesh<DP<2>, EP<2>>, ZeRO<1>, Accumulate<2>, moe_cfg>("moe_dp2_ep2");
  resume_is_bitwise<Mesh<DP<2>, PP<2>, EP<2>>, NoZeRO, pipeline::OneFOneB<2, 2>, moe_cfg>("moe_dp2_pp2_ep2");
  // EP 2 -> EP 1 on the same data ranks: the same balancing statistics, so the same next loss
  const fs::path dir = fresh("moe_reshard");
  const Run original = train<Mesh<DP<2>, EP<2>>, ZeRO<1>, Accumulate<2>, moe_cfg>(1, 3);
  (void)train<Mesh<DP<2>, EP<2>>, ZeRO<1>, Accumulate<2>, moe_cfg>(1, 2, {}, 2, dir);
  const Run resharded = train<Mesh<DP<2>>, ZeRO<1>, Accumulate<2>, moe_cfg>(3, 3, dir);
  REQUIRE(resharded.losses.size() == 1);
  CHECK(std::abs(resharded.losses[0] - original.losses[2]) <= 1e-5 * original.losses[2]);
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < original.experts.size(); ++i)
    diff = std::max(diff, double(std::abs(resharded.experts[i] - original.experts[i]))),
    scale = std::max(scale, double(std::abs(original.experts[i])));
  CHECK(diff <= 1e-5 * scale);
  fs::remove_all(dir);
}
