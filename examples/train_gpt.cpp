// Train a small byte-level GPT (or Llama) on a mesh chosen on the command line.
//
//   train_gpt [text-file] [--model gpt|llama] [--mesh NAME] [--tokens ids.bin] [--data-order random|epochs]
//             [--steps N] [--batch B] [--seq T] [--lr LR] [--seed S] [--log-every N]
//             [--init in.safetensors] [--save out.safetensors] [--metrics FILE]
//             [--checkpoints DIR [--save-every N]
//             [--keep-last N] [--resume | --resume-from STEP]] [--serial] [--step-graph] [--list-meshes]
//
// A thin program over fived::Trainer (train/trainer.hpp): one model (2 layers, d_model 64, 4
// heads, byte vocabulary: GPT-2's blocks, or with --model llama Llama 3's, 2 key/value heads,
// rotary positions, SwiGLU), one optimizer policy (AdamW, ZeRO-1 wherever the mesh has data
// ranks), one schedule (1F1B over 2·PP micro-batches on a pipeline, else the whole batch at
// once), and the mesh picked from the compiled ones by --mesh (default dp2.tp2):
//
//   serial            one rank                  dp2              DP 2
//   dp2.tp2           DP 2 x TP 2 (SP)          tp4              TP 4 (SP)
//   pp2.dp2           PP 2 x DP 2, 1F1B         cp2.tp2          CP 2 x TP 2 (SP)
//   dp2.pp2.cp2.tp2   all four axes: 16 ranks
//
// On the host backend the ranks are threads of this process. Built by nvcc with fived::cuda
// (train_gpt_cuda, examples/train_gpt_cuda.cu includes this file) it trains on the GPU when
// there is one: one process per rank of the mesh, launched by scripts/launch-local.sh, torchrun,
// mpirun or srun (one process for --mesh serial), over NCCL. Without a GPU it says so and names
// train_gpt: the CUDA build holds no host trainers (they would double its compile time).
//
// Data: a text file's bytes, or --tokens: a file of little-endian uint16 token ids (< 256 for
// this model; nanoGPT's .bin, or llm.c's with its header), or a quoted pattern naming several
// ('shards/train_*.bin': one stream, in name order); without either, generated lines of
// additions ("07+45=052"), whose loss falls visibly within a minute on two CPU cores. The
// last 10% is held out. Every run with the same --seed draws the same batches and starts from
// the same weights on every mesh, so the meshes' losses agree to the printed digits. A training window starts at a random place
// (--data-order random, the default), or the training part is cut into windows drawn each once
// an epoch in a shuffled order (--data-order epochs: BatchSampler's SampleOrder::epochs); both
// are functions of the seed and the step, so a resumed run goes on with the batches it would
// have drawn.
//
// Prints a progress line every --log-every steps (loss, learning rate, gradient norm,
// tokens/s, tokens/s per GPU, MFU against the device's own peak on CUDA, memory), the held-out
// loss every fifth line (Trainer::evaluate: on the mesh, forwards only; fit's eval_every),
// then a sample and, on
// the generated corpus, 40 sums that training never showed completed greedily and "correct:
// K/40". The trained weights are gathered into the serial model for that and for --save
// (Hugging Face GPT-2 or LlamaForCausalLM names).
// Exit status 0 when the held-out loss fell (a run from scratch; a resumed or --init run
// exits 0 once it trained). SIGTERM, SIGINT or SIGUSR1 (a scheduler's notice before it
// preempts the job, Ctrl-C; a second one ends the process at once) ends the run after the
// step it is in, a checkpoint saved there with --checkpoints, and exits with status 3:
// --resume goes on from it. --metrics FILE writes every step and every held-out loss as a JSON
// line (train/progress.hpp: loss, lr, grad_norm, seconds, tokens/s, mfu, memory), for a
// program to read or plot; a resumed run adds to the file (its first steps may be there
// already, from the run that went past its checkpoint: the later line is this run's), any
// other run starts it afresh.
//
// --init FILE starts from the weights of a file in the model's format (what --save writes:
// Hugging Face GPT-2 or Llama names and shapes, the model's sizes), saved on any mesh, with
// fresh optimizer state and learning-rate schedule: fine-tuning. A file that lacks one of the
// model's tensors, or holds one it does not have or of another shape, is an error that names
// it, before any step.
//
// --checkpoints DIR saves a sharded checkpoint (train/checkpoint.hpp: each rank its share,
// optimizer state included) every --save-every steps and at the end, written in the
// background while the next steps run (Trainer::save_async); --resume goes on from
// the newest one in DIR that verifies (every file of its recorded size and hash; newer ones
// that do not are named and passed over), saved on this mesh or any other (it is resharded
// as it loads); --resume-from STEP from that step, refused if it does not verify. --steps is
// the run's total: a checkpoint already past it trains nothing. The folders of --checkpoints
// and --save are checked for writing before the first step. What killed saves left in DIR
// (temporary files, steps without a manifest) is removed at the start and after each save;
// --keep-last N keeps only the newest N complete steps once the newest verifies.
//
// --step-graph: from the third step on, each step replays the second as a graph, its
// collectives and pipeline transfers included (a CUDA graph on the GPU: nn/step_graph.hpp);
// the losses are the same.

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <unistd.h>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <vector>

#if defined(FIVED_WITH_CUDA) && defined(__CUDACC__)
#define FIVED_TRAIN_GPT_CUDA 1
#include "fived/comm/nccl_bootstrap.hpp"
#include "fived/device/peak.hpp"
#include "fived/nn/cuda/ops.hpp"  // before gpt.hpp: Ops<T, Cuda>
#endif
#include "fived/comm/bootstrap.hpp"
#include "fived/comm/host.hpp"
#include "fived/mesh/context.hpp"
#include "fived/nn/gpt.hpp"
#include "fived/nn/llama.hpp"
#include "fived/train/stop_signal.hpp"
#include "fived/train/trainer.hpp"

namespace {

using namespace fived;

// 2 layers, d_model 64, 4 heads, byte vocabulary: small enough to take 1500 steps in half a
// minute on two cores, which is what learning two-digit addition takes. Untied, so that
// pipeline stages can hold the embedding and the head apart.
struct demo_config : gpt_config {
  static constexpr int layers = 2, d_model = 64, heads = 4, vocab = 256, max_seq = 128;
  static constexpr int vocab_multiple = 64;
  static constexpr bool tied = false;
};
// The same widths as Llama 3: grouped-query attention (4 query heads on 2 key/value heads;
// on tp4 each key/value head lives on two ranks), rotary positions, SwiGLU. Rotary θ 100
// instead of Llama's 10000: the lines are 10 characters, and at θ 10000 only 3 of a head's 8
// frequency pairs turn measurably over 10 positions. It learns the sums more often so (in 7
// of 10 runs over 5 seeds on serial and dp2.tp2, against 2 to 3 of 10 at 10000); a run is
// deterministic for a build, but which seeds learn changes with the rounding of any change.
struct demo_llama_config : llama_config {
  static constexpr int layers = 2, d_model = 64, heads = 4, kv_heads = 2, ffn = 192, vocab = 256, max_seq = 128;
  static constexpr int vocab_multiple = 64;
  static constexpr double rope_theta = 100.0, rope_factor = 1.0;  // no long-context scaling
};

// The two models --model picks, on any mesh and device.
struct GptModel {
  template <class M, class Device, class SP>
  using type = GPT<demo_config, M, float, Device, SP>;
};
struct LlamaModel {
  template <class M, class Device, class SP>
  using type = Llama<demo_llama_config, M, float, Device, SP>;
};
template <class F>
using serial_of = typename F::template type<Mesh<>, Host, NoSequenceParallel>;  // sampling, held-out loss, --save

struct Options {
  std::string file, tokens, init, save, metrics, mesh = "dp2.tp2", checkpoints, model = "gpt", data_order = "random";
  int steps = 1500, batch = 32, seq = 20, log_every = 0, save_every = 0, keep_last = 0;
  bool resume = false;               // from the newest checkpoint in `checkpoints` that verifies
  std::optional<int> resume_from;    // or from this step
  double lr = 4e-3;
  unsigned seed = 1337;
  bool step_graph = false;  // TrainerConfig::step_graph
};

[[noreturn]] void usage(const std::string& msg) {
  std::fprintf(stderr,
               "%s\nusage: train_gpt [text-file] [--model gpt|llama] [--mesh NAME] [--tokens ids.bin] "
               "[--data-order random|epochs] [--steps N] [--batch B] "
               "[--seq T (<= %d)] [--lr LR] [--seed S] [--log-every N] [--init in.safetensors] [--save out.safetensors] "
               "[--metrics FILE] "
               "[--checkpoints DIR "
               "[--save-every N] [--keep-last N] [--resume | --resume-from STEP]] [--serial] [--step-graph] [--list-meshes]\n",
               msg.c_str(), demo_config::max_seq);
  std::exit(2);
}

// The whole argument as a number, or a usage error that names the option ("5abc" is not 5).
template <class N>
N number(std::string_view option, const std::string& s) {
  N v{};
  const char* end = s.data() + s.size();
  const auto [p, ec] = std::from_chars(s.data(), end, v);
  if (ec != std::errc() || p != end || s.empty())
    usage("bad value '" + s + "' after " + std::string(option) + ": expected " +
          (std::is_unsigned_v<N> ? "a non-negative integer" : std::is_integral_v<N> ? "an integer" : "a number") +
          (ec == std::errc::result_out_of_range ? " in range" : "") + ", and nothing after it");
  return v;
}

// ---- the meshes this program is compiled for ----------------------------------------------------

template <class M>
using policy_for = std::conditional_t<(M::grad_group::size > 1), ZeRO<1>, NoZeRO>;
template <class M>
using schedule_for = std::conditional_t<(M::pp > 1), pipeline::OneFOneB<M::pp, 2 * M::pp>, Accumulate<1>>;
template <class M>
using sp_for = std::conditional_t<(M::tp > 1), SequenceParallel, NoSequenceParallel>;

struct Sum {  // a + b, a line of the generated corpus
  int a, b;
};

struct Corpus {
  TokenStream data;
  std::size_t split = 0;  // [0, split) trains, [split, size) is held out
  bool sums = false;      // the generated corpus of additions
  std::vector<Sum> held;  // ... and the sums it never shows
};

template <class F, class M>
int train_on(const Options& opt, const Corpus& corpus);

// What makes this run, recorded in each checkpoint's manifest: a resume compares it.
std::map<std::string, std::string> run_record(const Options& opt, const Corpus& corpus) {
  char lr[32];
  std::snprintf(lr, sizeof lr, "%g", opt.lr);
  return {{"model", opt.model}, {"seed", std::to_string(opt.seed)}, {"data", corpus.data.name()},
          {"data_tokens", std::to_string(corpus.data.size())}, {"batch", std::to_string(opt.batch)},
          {"seq", std::to_string(opt.seq)}, {"lr", lr}, {"steps", std::to_string(opt.steps)}, {"mesh", opt.mesh},
          {"data_order", opt.data_order}};
}

// A resume of another run (model, seed or data differ) is an error saying what differs; the
// rest (mesh: resharded; steps, batch, seq, lr, data order) is reported.
std::string compare_runs(const std::map<std::string, std::string>& saved, const std::map<std::string, std::string>& now,
                         bool prints) {
  std::string differs;
  for (const auto& [k, v] : now) {
    const auto it = saved.find(k);
    if (it == saved.end() || it->second == v) continue;
    if (k == "model" || k == "seed" || k == "data" || k == "data_tokens")
      differs += (differs.empty() ? "" : ", ") + k + " " + it->second + " (now " + v + ")";
    else if (prints) {
      std::printf("note: the checkpoint's run had %s %s, this one %s\n", k.c_str(), it->second.c_str(), v.c_str());
      if ((k == "batch" || k == "seq") && now.at("data_order") == "epochs")
        std::printf("note: under --data-order epochs another %s moves the run elsewhere in its epochs: in this one "
                    "some windows come twice and some not at all\n", k.c_str());
    }
  }
  return differs;
}

struct MeshChoice {
  const char* name;
  int ranks;
  int (*gpt)(const Options&, const Corpus&);
  int (*llama)(const Options&, const Corpus&);
};
#define FIVED_MESH(name, ...) \
  MeshChoice{name, __VA_ARGS__::size, &train_on<GptModel, __VA_ARGS__>, &train_on<LlamaModel, __VA_ARGS__>}
const MeshChoice meshes[] = {
    FIVED_MESH("serial", Mesh<>),
    FIVED_MESH("dp2", Mesh<DP<2>>),
    FIVED_MESH("dp2.tp2", Mesh<DP<2>, TP<2>>),
    FIVED_MESH("tp4", Mesh<TP<4>>),
    FIVED_MESH("pp2.dp2", Mesh<PP<2>, DP<2>>),
    FIVED_MESH("cp2.tp2", Mesh<CP<2>, TP<2>>),
    FIVED_MESH("dp2.pp2.cp2.tp2", Mesh<DP<2>, PP<2>, CP<2>, TP<2>>),
};
#undef FIVED_MESH

const MeshChoice& find_mesh(const std::string& name) {
  for (const MeshChoice& m : meshes)
    if (name == m.name) return m;
  std::string known;
  for (const MeshChoice& m : meshes) known += std::string(known.empty() ? "" : ", ") + m.name;
  usage("unknown mesh '" + name + "'; this program is compiled for: " + known);
}

// Why nothing can be written in `dir` (a probe file made and removed), or "" when it can.
std::string cannot_write(const std::filesystem::path& dir) {
  const std::filesystem::path probe = dir / (".fived-write-probe-" + std::to_string(::getpid()));
  std::FILE* f = std::fopen(probe.c_str(), "wb");
  if (!f) return std::strerror(errno);
  std::fclose(f);
  std::error_code ec;
  std::filesystem::remove(probe, ec);
  return "";
}

// A file the run writes (none when empty): one that cannot be written fails now, not after the run.
void check_output_file(const std::string& flag, const std::string& path) {
  if (path.empty()) return;
  const std::filesystem::path dir = std::filesystem::absolute(path).parent_path();
  if (!std::filesystem::is_directory(dir)) usage(flag + " " + path + ": the folder " + dir.string() + " does not exist");
  if (std::filesystem::is_directory(path)) usage(flag + " " + path + " is a folder; give a file name");
  if (const std::string why = cannot_write(dir); !why.empty())
    usage(flag + " " + path + ": cannot write in " + dir.string() + " (" + why + ")");
  if (std::filesystem::exists(path) && access(path.c_str(), W_OK) != 0)
    usage(flag + " " + path + ": cannot write that file (" + std::strerror(errno) + ")");
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage("missing value after " + std::string(a));
      return argv[++i];
    };
    if (a == "--steps") o.steps = number<int>(a, value());
    else if (a == "--batch") o.batch = number<int>(a, value());
    else if (a == "--seq") o.seq = number<int>(a, value());
    else if (a == "--lr") o.lr = number<double>(a, value());
    else if (a == "--seed") o.seed = number<unsigned>(a, value());
    else if (a == "--log-every") o.log_every = number<int>(a, value());
    else if (a == "--init") o.init = value();
    else if (a == "--save") o.save = value();
    else if (a == "--metrics") o.metrics = value();
    else if (a == "--checkpoints") o.checkpoints = value();
    else if (a == "--save-every") o.save_every = number<int>(a, value());
    else if (a == "--keep-last") o.keep_last = number<int>(a, value());
    else if (a == "--resume") o.resume = true;
    else if (a == "--resume-from") o.resume_from = number<int>(a, value()), o.resume = true;
    else if (a == "--tokens") o.tokens = value();
    else if (a == "--data-order") o.data_order = value();
    else if (a == "--mesh") o.mesh = value();
    else if (a == "--model") o.model = value();
    else if (a == "--serial") o.mesh = "serial";
    else if (a == "--step-graph") o.step_graph = true;
    else if (a == "--list-meshes") {
      for (const MeshChoice& m : meshes) std::printf("%-18s %2d ranks\n", m.name, m.ranks);
      std::exit(0);
    } else if (a == "-h" || a == "--help") usage("Trains a byte-level GPT on a mesh.");
    else if (!a.empty() && a[0] == '-') usage("unknown option " + std::string(a));
    else if (o.file.empty()) o.file = a;
    else usage("more than one text file given");
  }
  if (o.steps < 1 || o.batch < 1 || o.batch > 4096 || o.seq < 2 || o.seq > demo_config::max_seq ||
      !(o.lr > 0 && o.lr < 1) || o.log_every < 0)
    usage("need --steps >= 1, 1 <= --batch <= 4096, 2 <= --seq <= " + std::to_string(demo_config::max_seq) +
          ", 0 < --lr < 1, --log-every >= 0");
  if (!o.file.empty() && !o.tokens.empty()) usage("give a text file or --tokens, not both");
  if (o.model != "gpt" && o.model != "llama") usage("unknown --model '" + o.model + "': gpt or llama");
  if (o.data_order != "random" && o.data_order != "epochs")
    usage("unknown --data-order '" + o.data_order + "': random (windows anywhere) or epochs (each window once an epoch)");
  if (o.save_every < 0) usage("--save-every must be 0 (at the end only) or more");
  if (o.keep_last < 0) usage("--keep-last must be 0 (keep every step) or more");
  if (o.keep_last > 0 && o.checkpoints.empty()) usage("--keep-last needs --checkpoints DIR");
  if (!o.checkpoints.empty() && !o.resume && std::filesystem::is_directory(o.checkpoints)) {
    const std::vector<int> held = checkpoint::steps_with_manifest(o.checkpoints);
    if (!held.empty())
      usage("--checkpoints " + o.checkpoints + " holds steps " + std::to_string(held.back()) + ".." +
            std::to_string(held.front()) + " of another run: pass --resume to continue it, or choose another folder");
  }
  if (!o.init.empty() && o.resume)
    usage("--init and --resume or --resume-from: a checkpoint holds its own weights; give one of them");
  if (!o.init.empty() && !std::filesystem::is_regular_file(o.init))
    usage("--init " + o.init + ": no such file");
  if ((o.resume || o.save_every > 0) && o.checkpoints.empty())
    usage("--resume, --resume-from and --save-every need --checkpoints DIR");
  if (!o.checkpoints.empty()) {  // a folder that cannot be made or written fails now, not at the first save
    std::error_code ec;
    std::filesystem::create_directories(o.checkpoints, ec);
    if (ec || !std::filesystem::is_directory(o.checkpoints))
      usage("--checkpoints " + o.checkpoints + ": cannot make that folder (" + ec.message() + ")");
    if (const std::string why = cannot_write(o.checkpoints); !why.empty())
      usage("--checkpoints " + o.checkpoints + ": cannot write there (" + why + ")");
    checkpoint::remove_leftovers(o.checkpoints);  // of saves killed in earlier runs
  }
  if (o.log_every == 0) o.log_every = std::max(1, o.steps / 20);
  (void)find_mesh(o.mesh);  // an unknown mesh is an error before anything runs
  check_output_file("--save", o.save);
  check_output_file("--metrics", o.metrics);
  return o;
}

// ---- data, evaluation, sampling -----------------------------------------------------------------

// The generated corpus: lines "07+45=052\n", a + b with a, b in [0, 99], every number
// zero-padded to a fixed width, so each line is 10 bytes and a window that starts at a line
// (BatchSampler::align) holds whole sums at the same positions. The pairs of `held` never
// appear: the completions at the end ask for them.
constexpr int max_operand = 99;
std::string padded(int x, int width) {
  std::string s = std::to_string(x);
  return std::string(static_cast<std::size_t>(width) - s.size(), '0') + s;
}
std::string question(const Sum& q) { return padded(q.a, 2) + "+" + padded(q.b, 2) + "="; }
std::string answer(const Sum& q) { return padded(q.a + q.b, 3); }
std::string sum_line(const Sum& q) { return question(q) + answer(q) + "\n"; }
constexpr std::size_t line_length = 10;
// n different sums drawn from the seed: the ones the corpus leaves out.
std::vector<Sum> held_out_sums(unsigned seed, int n) {
  std::mt19937 rng(seed ^ 0x5eedu);
  std::uniform_int_distribution<int> d(0, max_operand);
  std::vector<Sum> h;
  while (static_cast<int>(h.size()) < n) {
    const Sum q{d(rng), d(rng)};
    if (std::none_of(h.begin(), h.end(), [&](const Sum& x) { return x.a == q.a && x.b == q.b; })) h.push_back(q);
  }
  return h;
}
std::string arithmetic_corpus(std::size_t bytes, unsigned seed, const std::vector<Sum>& held) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> d(0, max_operand);
  std::string s;
  while (s.size() < bytes) {
    const Sum q{d(rng), d(rng)};
    if (std::any_of(held.begin(), held.end(), [&](const Sum& x) { return x.a == q.a && x.b == q.b; })) continue;
    s += sum_line(q);
  }
  return s;
}

Corpus load(const Options& opt) {
  Corpus c;
  if (!opt.tokens.empty()) {
    c.data = TokenStream::map_glob(opt.tokens, 2, demo_config::vocab);  // a file, or shards in name order
  } else if (!opt.file.empty()) {
    if (std::filesystem::is_directory(opt.file)) usage(opt.file + " is a folder; give a text file");
    std::ifstream in(opt.file, std::ios::binary);
    if (!in) usage("cannot read " + opt.file);
    c.data = TokenStream::bytes_of(std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()),
                                   opt.file);
  } else {
    c.held = held_out_sums(opt.seed, 40);
    c.data = TokenStream::bytes_of(arithmetic_corpus(1 << 20, opt.seed, c.held), "generated corpus of additions");
    c.sums = true;
  }
  // Both parts need windows of seq + 1 tokens, the held-out part a few of them.
  const std::size_t need = static_cast<std::size_t>(opt.seq + 1) * 20;
  if (c.data.size() < need)
    usage(c.data.name() + " has " + std::to_string(c.data.size()) + " tokens; --seq " + std::to_string(opt.seq) +
          " needs at least " + std::to_string(need) + " (20 windows of seq + 1)");
  c.split = c.data.size() * 9 / 10;
  if (c.sums) c.split -= c.split % line_length;  // the held-out part starts with a whole line
  return c;
}

// The windows training draws from: [0, split), in the order --data-order names.
BatchSampler training_windows(const Options& opt, const Corpus& c) {
  BatchSampler train(c.data, 0, c.split, opt.seed);
  if (c.sums) train.align = line_length;
  if (opt.data_order == "epochs") train.order = SampleOrder::epochs;
  return train;
}

// The held-out windows: [split, size), at random (the same batches at every evaluation).
BatchSampler held_out_windows(const Options& opt, const Corpus& c) {
  BatchSampler held(c.data, c.split, c.data.size(), opt.seed + 1);
  if (c.sums) held.align = line_length;
  return held;
}

// Next token from the model given a context, greedy when temperature is 0. The model sees
// the context's last `window` tokens at most (the training length), starting at a multiple
// of `align` (the generated corpus's line: positions as in training).
template <class Serial>
int next_token(Serial& model, const std::vector<int>& ctx, float temperature, std::mt19937& rng, std::size_t window,
               std::size_t align) {
  std::size_t first = ctx.size() - std::min(ctx.size(), std::min<std::size_t>(window, Serial::max_seq));
  first = (first + align - 1) / align * align;
  const int T = static_cast<int>(ctx.size() - first);
  model.forward(ctx.data() + first, nullptr, 1, T);
  const auto logits = model.logits().subspan(static_cast<std::size_t>(T - 1) * Serial::Vp, Serial::V);
  if (temperature <= 0) return static_cast<int>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  const float mx = *std::max_element(logits.begin(), logits.end());
  std::vector<double> p(logits.size());
  for (std::size_t v = 0; v < p.size(); ++v) p[v] = std::exp((logits[v] - mx) / temperature);
  std::discrete_distribution<int> pick(p.begin(), p.end());
  return pick(rng);
}

std::string printable(const std::vector<int>& ids) {
  std::string o;
  for (int c : ids) o += (c == '\n' || c == '\t' || (c >= 0x20 && c < 0x7f)) ? static_cast<char>(c) : '?';
  return o;
}

// After training: save, sample, complete sums; the exit status says whether the held-out
// loss fell (the demo's promise, for a run from the start).
template <class Serial>
int finish(Serial& model, const Options& opt, const Corpus& c, double val_start, double val_end, bool must_fall) {
  if (!opt.save.empty()) {
    model.save(opt.save, {{"steps", std::to_string(opt.steps)}, {"mesh", opt.mesh}});
    std::printf("saved %s (Hugging Face names)\n", opt.save.c_str());
  }
  std::mt19937 rng(opt.seed + 2);
  std::vector<int> ctx;
  for (std::size_t i = c.split; i < std::min(c.data.size(), c.split + 16); ++i) ctx.push_back(c.data[i]);
  const std::vector<int> prompt = ctx;
  const std::size_t window = static_cast<std::size_t>(opt.seq), align = c.sums ? line_length : 1;
  for (int i = 0; i < (c.sums ? 44 : 200); ++i) ctx.push_back(next_token(model, ctx, 0.8f, rng, window, align));
  std::printf("\nsample (temperature 0.8) after the held-out prompt \"%s\":\n%s\n", printable(prompt).c_str(),
              printable(ctx).c_str());
  if (c.sums) {  // greedy completions of the sums training never showed
    // Before each question, as many held-out lines as a training window holds before its last.
    const std::size_t lines = std::max<std::size_t>(static_cast<std::size_t>(opt.seq) / line_length, 1) - 1;
    std::string context;
    for (std::size_t i = c.split; i < c.split + lines * line_length; ++i) context += static_cast<char>(c.data[i]);
    int right = 0;
    std::printf("\ngreedy completions of %zu sums never seen in training:\n", c.held.size());
    for (std::size_t q = 0; q < c.held.size(); ++q) {
      const Sum& x = c.held[q];
      const std::string p = context + question(x);
      std::vector<int> s(p.begin(), p.end()), ans;
      for (int i = 0; i < 4; ++i) {
        const int next = next_token(model, s, 0.0f, rng, window, align);
        if (next == '\n') break;
        s.push_back(next);
        ans.push_back(next);
      }
      const bool ok = printable(ans) == answer(x);
      right += ok;
      std::printf(" %s%-3s%s%s", question(x).c_str(), printable(ans).c_str(), ok ? " " : "x", (q + 1) % 8 == 0 ? "\n" : "");
    }
    std::printf("%scorrect: %d/%zu\n", c.held.size() % 8 == 0 ? "" : "\n", right, c.held.size());
  }
  if (must_fall && !(val_end < val_start)) {
    std::printf("held-out loss did not fall (%.4f -> %.4f)\n", val_start, val_end);
    return 1;
  }
  return 0;
}

// ---- one run on mesh M ------------------------------------------------------------------------

// SIGTERM, SIGINT and SIGUSR1 end the run after its step rather than in it (train/stop_signal.hpp).
const StopSignal& stop_signal() {
  static const StopSignal s;
  return s;
}

template <class F, class M, class Device, class Ctx>
int train_rank(Ctx& ctx, const Options& opt, const Corpus& corpus, const std::string& backend, double peak) {
  using Model = typename F::template type<M, Device, sp_for<M>>;
  using Serial = serial_of<F>;
  using Sched = schedule_for<M>;
  using T = Trainer<Model, policy_for<M>, Sched>;
  constexpr int micro = Sched::table.micro_batches;
  const bool prints = ctx.rank() == 0;
  const int B = opt.batch / micro;  // rows per micro-batch
  if (prints) {
    std::printf("train_gpt: %s, %zu tokens (%zu train, %zu held out)\n", corpus.data.name().c_str(), corpus.data.size(),
                corpus.split, corpus.data.size() - corpus.split);
    std::printf("model: %s; %zu parameters\n", Serial::config_name().c_str(), Serial::layout::num_parameters);
    std::printf("mesh: %s, %d rank%s (%s): %s%s%s\n", M::name().c_str(), M::size, M::size == 1 ? "" : "s", backend.c_str(),
                policy_for<M>::stage ? "ZeRO-1" : "no ZeRO", M::tp > 1 ? ", sequence parallel" : "",
                M::pp > 1 ? (", 1F1B over " + std::to_string(micro) + " micro-batches of " + std::to_string(B)).c_str() : "");
    std::printf("training: %d steps, batch %d x seq %d, AdamW lr %g (warmup, cosine)\n", opt.steps, opt.batch, opt.seq,
                opt.lr);
    const BatchSampler train = training_windows(opt, corpus);
    if (train.order == SampleOrder::epochs)
      std::printf("data: each of %zu windows once an epoch, in a shuffled order: an epoch is %.1f steps\n",
                  train.windows_per_epoch(opt.seq), static_cast<double>(train.windows_per_epoch(opt.seq)) / opt.batch);
  }
  const TrainerConfig hp{
      .adamw = {.lr = 0, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f, .max_norm = 1.0f},
      .lr = WarmupCosine{.peak = opt.lr, .warmup = std::max(1, opt.steps / 20), .total = opt.steps, .floor = 0.1},
      .step_graph = opt.step_graph};
  T trainer(ctx, hp, GptInit{opt.seed, 0.02});
  // The held-out loss on the mesh (Trainer::evaluate: forwards only, nothing gathered), before
  // and after training over the same 32 batches (fit's lines in between: 4); a collective,
  // every rank gets it.
  const BatchSampler held = held_out_windows(opt, corpus);
  const int held_batches = 32;
  auto held_out = [&] { return trainer.evaluate(held, held_batches, B, opt.seq); };
  const std::map<std::string, std::string> record = run_record(opt, corpus);
  int first = 1;
  if (!opt.init.empty()) {  // every rank reads the file and keeps its part
    trainer.load_weights(opt.init);
    if (prints) std::printf("weights from %s\n", opt.init.c_str());
  }
  if (opt.resume) {  // from any mesh's checkpoint: the state is resharded onto this one
    if (!opt.resume_from && !checkpoint::latest_step(opt.checkpoints)) {
      if (prints) std::printf("no checkpoint in %s yet: starting at step 1\n", opt.checkpoints.c_str());
    } else {
      std::vector<checkpoint::Refusal> refused;
      first = trainer.load(opt.checkpoints, opt.resume_from, &refused) + 1;
      for (const checkpoint::Refusal& r : refused)
        if (prints) std::printf("warning: step %d does not verify, passed over: %s\n", r.step, r.reason.c_str());
      const checkpoint::Manifest saved =
          checkpoint::read_manifest(checkpoint::step_folder(opt.checkpoints, first - 1), /*check_files=*/false);
      if (const std::string differs = compare_runs(saved.run, record, prints); !differs.empty())
        throw std::runtime_error("--resume: the checkpoint of step " + std::to_string(first - 1) + " in " +
                                 opt.checkpoints + " is of another run: " + differs +
                                 "; resume with its settings, or choose another folder");
      if (prints) std::printf("resumed from %s at step %d\n", opt.checkpoints.c_str(), first - 1);
    }
  }
  if (first > opt.steps) {  // --steps is the run's total
    if (prints)
      std::printf("the checkpoint is already at step %d, past --steps %d: nothing to train\n", first - 1, opt.steps);
    return 0;
  }
  // Checkpoints are written in the background (Trainer::save_async) while training goes on;
  // each is reported once it is committed.
  auto saved = [&](int step) {
    if (step > 0 && prints) std::printf("checkpoint of step %d in %s\n", step, opt.checkpoints.c_str());
  };
  const double val_start = held_out();
  if (prints)
    std::printf("held-out loss %.4f %s\n", val_start,
                first > 1 ? "at the checkpoint" : opt.init.empty() ? "before training" : "from --init");
  // World rank 0 writes the metrics: adding to a resumed run's, else afresh.
  const std::unique_ptr<std::FILE, int (*)(std::FILE*)> metrics(
      prints && !opt.metrics.empty() ? std::fopen(opt.metrics.c_str(), first > 1 ? "a" : "w") : nullptr, &std::fclose);
  if (prints && !opt.metrics.empty() && !metrics)
    throw std::runtime_error("--metrics " + opt.metrics + ": cannot open it for writing (" + std::strerror(errno) + ")");
  const BatchSampler train = training_windows(opt, corpus);
  int stopped_after = 0;  // a step before the last, where a signal ended the run
  const double seconds = trainer.fit(
      train, first, opt.steps, B, opt.seq,
      {.log_every = opt.log_every, .peak_flops = peak, .out = stdout, .metrics = metrics.get(), .held_out = &held,
       .eval_every = 5 * opt.log_every, .stop = [] { return stop_signal().requested(); }},
      [&](int s, double, bool last) {
        if (!opt.checkpoints.empty() && ((opt.save_every > 0 && s % opt.save_every == 0) || last)) {
          saved(trainer.wait_for_save());
          trainer.save_async(opt.checkpoints, s, {.keep_last = opt.keep_last, .run = record});
        }
        if (last && s < opt.steps) stopped_after = s;
      });
  saved(trainer.wait_for_save());  // the last checkpoint committed before the run reports
  if (stopped_after > 0) {
    if (prints)
      std::printf("stopped after step %d on %s: %s\n", stopped_after,
                  stop_signal().requested() ? stop_signal().name().c_str() : "another process's signal",
                  opt.checkpoints.empty() ? "nothing saved (no --checkpoints)"
                                          : ("its checkpoint is in " + opt.checkpoints + "; --resume goes on from it").c_str());
    return 3;
  }
  const double val_end = held_out();
  const std::vector<float> w = trainer.serial_params();  // a collective: every rank gathers
  if (!prints) return 0;
  std::printf("trained %d steps in %.1f s\n", opt.steps - first + 1, seconds);
  std::printf("held-out loss %.4f over %d batches\n", val_end, held_batches);
  Serial eval;  // the trained weights whole, on the host: samples and completions, --save
  std::copy(w.begin(), w.end(), eval.params().begin());
  return finish(eval, opt, corpus, val_start, val_end, /*must_fall=*/first == 1 && opt.init.empty());
}

template <class F, class M>
int train_on(const Options& opt, const Corpus& corpus) {
  constexpr int micro = schedule_for<M>::table.micro_batches;
  if (opt.batch % (micro * M::dp) != 0 || (opt.seq * opt.batch / micro / M::dp) % (2 * M::cp * M::tp) != 0 ||
      opt.seq % (2 * M::cp) != 0)
    usage("on " + M::name() + " --batch must be a multiple of " + std::to_string(micro * M::dp) + " (" +
          std::to_string(micro) + " micro-batches x DP " + std::to_string(M::dp) + ") and --seq of " +
          std::to_string(2 * M::cp * M::tp) + " (2 x CP x TP: zig-zag chunks, sequence parallelism)");
#if defined(FIVED_TRAIN_GPT_CUDA)
  if (fived::cuda::device_count() == 0)
    usage("train_gpt_cuda trains on a GPU and there is no CUDA device: build/examples/train_gpt is the same program on "
          "the host backend (the mesh's ranks as threads of one process)");
  const LaunchEnv env = launch_env();
  if (env.world_size != M::size)
    usage("--mesh " + opt.mesh + " needs " + std::to_string(M::size) + " processes, one per rank, but this launch has " +
          std::to_string(env.world_size) + ": scripts/launch-local.sh " + std::to_string(M::size) +
          " build/examples/train_gpt_cuda --mesh " + opt.mesh + " (or torchrun, mpirun, srun)");
  cudaDeviceProp prop{};
  FIVED_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  auto ctx = make_mesh_context<M>(nccl::init_world());
  return train_rank<F, M, Cuda>(ctx, opt, corpus, std::string("CUDA, ") + prop.name + ", fp32, NCCL",
                                fived::cuda::peak_bf16_flops(0));
#else
  int status = 0;
  host::run(M::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<M>(world);
    const int s = train_rank<F, M, Host>(ctx, opt, corpus, std::string("host backend, ") + host::ranks_are(), 0.0);
    if (ctx.rank() == 0) status = s;
  });
  return status;
#endif
}

}  // namespace

int main(int argc, char** argv) {
  (void)stop_signal();  // caught from here on
  const Options opt = parse(argc, argv);
  try {
    const Corpus corpus = load(opt);
    const MeshChoice& m = find_mesh(opt.mesh);
    return (opt.model == "llama" ? m.llama : m.gpt)(opt, corpus);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_gpt: %s\n", e.what());
    return 1;
  }
}
