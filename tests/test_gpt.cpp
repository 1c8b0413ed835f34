// The reference GPT: compile-time layout (GPT-2 124M sizes), initialisation by element
// index (slices equal the whole), a gradient check of every parameter tensor in double
// against central finite differences, loss at init, safetensors round trip and the
// loader's errors, and a loss that drops under AdamW.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "fived/io/safetensors.hpp"
#include "fived/kernels/host.hpp"
#include "fived/nn/config.hpp"
#include "fived/model/contract.hpp"
#include "fived/nn/gpt.hpp"
#include "fived/nn/init.hpp"
#include "fived/train/data_parallel.hpp"

using namespace fived;

namespace {

// ---- the parameter table, at compile time ------------------------------------------------

template <class Cfg>
using Table = typename GPT<Cfg>::layout;
using gpt2 = Table<gpt_config>;
static_assert(gpt_dims<gpt_config>::padded_vocab == 50304);
static_assert(gpt2::num_parameters == 124'439'808, "GPT-2 124M as Hugging Face counts it (wte 50257 rows)");
static_assert(gpt2::size == 124'475'904, "the buffer holds wte padded to 50304 rows: +47 * 768");
static_assert(gpt2::count == 2 + 12 * 12 + 2);
static_assert(gpt2::tensors[0].offset == 0 && gpt2::tensors[0].rows == 50304 && gpt2::tensors[0].spec.file_rows == 50257);
static_assert(gpt2::tensors[1].offset == 50304u * 768);                      // wpe
static_assert(gpt2::tensors[2].offset == 50304u * 768 + 1024u * 768);        // h.0.ln_1.weight
static_assert(gpt2::unit_begin(2) - gpt2::unit_begin(1) == 7'087'872);       // one block
static_assert(gpt2::unit_begin(6) == gpt2::unit_begin(1) + 5 * 7'087'872);
static_assert(gpt2::unit_begin(13) == gpt2::tensors[2 + 12 * 12].offset);    // ln_f.weight
static_assert(gpt2::tensors[2 + 12 * 3 + 2].rows == 768 && gpt2::tensors[2 + 12 * 3 + 2].cols == 2304);  // h.3 c_attn
static_assert(gpt2::tensors[2 + 12 * 3 + 10].rows == 3072 && gpt2::tensors[2 + 12 * 3 + 10].cols == 768);  // h.3 mlp c_proj
static_assert(gpt2::units == 14);

// The table is contiguous, in order, with no gaps.
template <class Lay>
constexpr bool contiguous() {
  std::size_t off = 0;
  for (const ParamInfo& t : Lay::tensors) {
    if (t.offset != off) return false;
    off = t.end();
  }
  return off == Lay::size;
}
static_assert(contiguous<gpt2>());

struct untied : gpt_config {
  static constexpr bool tied = false;
  static constexpr int vocab_multiple = 1;
};
static_assert(Table<untied>::num_parameters == 124'439'808 + 50257u * 768);
static_assert(Table<untied>::size == Table<untied>::num_parameters, "vocab_multiple = 1: no padding");
static_assert(Table<untied>::tensors[Table<untied>::count - 1].end() == Table<untied>::size);  // lm_head last
static_assert(contiguous<Table<untied>>());

// A tensor of a table by Hugging Face name.
template <class Lay>
const ParamInfo& info(const std::string& name) {
  const auto i = Lay::find(name);
  REQUIRE(i.has_value());
  return Lay::tensors[static_cast<std::size_t>(*i)];
}
template <class Lay>
std::size_t offset(const std::string& name) {
  return info<Lay>(name).offset;
}

// The gradient-check model: 2 layers, C = 16, 2 heads, vocab 37 padded to 40.
struct tiny : gpt_config {
  static constexpr int layers = 2, d_model = 16, heads = 2, vocab = 37, max_seq = 8, vocab_multiple = 8;
};
struct tiny_untied : tiny {
  static constexpr bool tied = false;
};
struct tiny3 : tiny {
  static constexpr int layers = 3;
};
struct wide : gpt_config {
  static constexpr int layers = 8, d_model = 128, heads = 4, vocab = 1000, max_seq = 64;
};
struct small : gpt_config {
  static constexpr int layers = 2, d_model = 32, heads = 4, vocab = 50, max_seq = 16, vocab_multiple = 16;
};
static_assert(padded_vocab<tiny> == 40);
static_assert(contiguous<Table<tiny>>() && contiguous<Table<tiny_untied>>());

constexpr int B = 2, T = 5;

void batch(std::vector<int>& tok, std::vector<int>& tgt, int b, int t, int vocab, unsigned salt = 0) {
  tok.resize(static_cast<std::size_t>(b * t));
  tgt.resize(tok.size());
  for (std::size_t i = 0; i < tok.size(); ++i) {
    tok[i] = static_cast<int>((i * 7 + 3 + salt) % static_cast<unsigned>(vocab));
    tgt[i] = static_cast<int>((i * 11 + 5 + 3 * salt) % static_cast<unsigned>(vocab));
  }
}

}  // namespace

TEST_CASE("table: lookup by name, units, and the serial layout of every tensor") {
  using Lay = Table<tiny>;
  for (int i = 0; i < Lay::count; ++i) {
    const ParamInfo& t = Lay::tensors[static_cast<std::size_t>(i)];
    CAPTURE(t.name());
    CHECK(Lay::find(t.name()) == i);
    CHECK(t.spec.decays == (t.rank() == 2));  // the GPT-2 weight-decay rule
  }
  CHECK(Lay::tensors[5].name() == "h.0.attn.c_attn.bias");
  CHECK_FALSE(Lay::find("h.2.ln_1.weight"));  // only 2 layers
  CHECK_FALSE(Lay::find("lm_head.weight"));   // tied
  CHECK_FALSE(Lay::find("h.0.wte.weight"));
  CHECK_FALSE(Lay::find("ln_1.weight"));
  CHECK_FALSE(Lay::find("h.01.ln_1.weight"));
  CHECK(Table<tiny_untied>::find("lm_head.weight") == Table<tiny_untied>::count - 1);
  CHECK(Lay::units == tiny::layers + 2);
  CHECK(Lay::unit_begin(1) == offset<Lay>("h.0.ln_1.weight"));
  CHECK(Lay::unit_begin(Lay::units - 1) == offset<Lay>("ln_f.weight"));
  CHECK(Lay::unit_begin(Lay::units) == Lay::size);
}

TEST_CASE("init: by element index, so a tensor-parallel piece initialised alone equals the same piece of the whole") {
  using Lay = Table<tiny>;
  using Tp2 = ParamTable<GptSpecs<tiny>, 2>;
  GptInit how{7, 0.02};
  std::vector<float> whole(Lay::size), mine(Tp2::size), sliced(Tp2::size);
  init_params<Lay>(std::span<float>(whole), 0, how);
  for (int r = 0; r < 2; ++r) {
    init_params<Tp2>(std::span<float>(mine), r, how);
    Tp2::slice(std::span<const float>(whole), std::span<float>(sliced), r);
    CHECK(mine == sliced);
  }
  CHECK_THROWS_AS(init_value(Lay::tensors[0].spec, 2, how, Lay::tensors[0].size()), std::out_of_range);

  // Values do not depend on the number of layers or on tying: layer 0 of a 3-layer model
  // equals layer 0 of the 2-layer one.
  std::vector<float> w3(Table<tiny3>::size);
  init_params<Table<tiny3>>(std::span<float>(w3), 0, how);
  const auto& fc2 = info<Lay>("h.0.mlp.c_fc.weight");
  const auto& fc3 = info<Table<tiny3>>("h.0.mlp.c_fc.weight");
  CHECK(std::equal(whole.begin() + static_cast<std::ptrdiff_t>(fc2.offset),
                   whole.begin() + static_cast<std::ptrdiff_t>(fc2.end()), w3.begin() + static_cast<std::ptrdiff_t>(fc3.offset)));

  // Another seed gives other values.
  std::vector<float> other(Lay::size);
  init_params<Lay>(std::span<float>(other), 0, GptInit{8, 0.02});
  CHECK(other[5] != whole[5]);
}

TEST_CASE("init: the GPT-2 scheme, statistics plausible") {
  using Lay = Table<wide>;
  std::vector<double> w(Lay::size);
  init_params<Lay>(std::span<double>(w), 0, GptInit{1, 0.02});
  auto stats = [&](const ParamInfo& t, std::size_t n) {
    double s = 0, s2 = 0;
    for (std::size_t i = 0; i < n; ++i) {
      s += w[t.offset + i];
      s2 += w[t.offset + i] * w[t.offset + i];
    }
    const double mean = s / static_cast<double>(n);
    return std::pair(mean, std::sqrt(s2 / static_cast<double>(n) - mean * mean));
  };
  const ParamInfo& wte = info<Lay>("wte.weight");
  auto [m, sd] = stats(wte, wte.file_size());  // 128,000 values
  CHECK(std::abs(m) < 4 * 0.02 / std::sqrt(128000.0));
  auto near = [](double got, double want, double rel) { return std::abs(got - want) <= rel * want; };
  CHECK(near(sd, 0.02, 0.01));
  for (std::size_t i = wte.file_size(); i < wte.size(); ++i) REQUIRE(w[wte.offset + i] == 0.0);  // padded rows (1000 -> 1024)
  const ParamInfo& cp = info<Lay>("h." + std::to_string(3) + ".mlp.c_proj.weight");
  auto [m2, sd2] = stats(cp, cp.size());
  CHECK(std::abs(m2) < 4 * sd2 / std::sqrt(static_cast<double>(cp.size())));
  CHECK(near(sd2, 0.02 / std::sqrt(16.0), 0.01));  // residual projection: 0.02 / sqrt(2 * 8 layers)
  const ParamInfo& ap = info<Lay>("h." + std::to_string(7) + ".attn.c_proj.weight");
  CHECK(near(stats(ap, ap.size()).second, 0.02 / 4, 0.02));
  const ParamInfo& qkv = info<Lay>("h." + std::to_string(0) + ".attn.c_attn.weight");
  CHECK(near(stats(qkv, qkv.size()).second, 0.02, 0.01));
  // the fraction within one standard deviation is that of a normal (68.27%)
  std::size_t within = 0;
  for (std::size_t i = 0; i < qkv.size(); ++i) within += std::abs(w[qkv.offset + i]) < 0.02;
  CHECK(near(static_cast<double>(within) / static_cast<double>(qkv.size()), 0.6827, 0.01));
  for (int l = 0; l < wide::layers; ++l) {
    for (std::size_t i = 0; i < 128; ++i) {
      REQUIRE(w[offset<Lay>("h." + std::to_string(l) + ".ln_1.weight") + i] == 1.0);
      REQUIRE(w[offset<Lay>("h." + std::to_string(l) + ".ln_2.bias") + i] == 0.0);
      REQUIRE(w[offset<Lay>("h." + std::to_string(l) + ".attn.c_attn.bias") + i] == 0.0);
      REQUIRE(w[offset<Lay>("h." + std::to_string(l) + ".mlp.c_fc.bias") + i] == 0.0);
    }
  }
  CHECK(w[offset<Lay>("ln_f.weight")] == 1.0);
}

TEST_CASE("loss at init is about ln(vocab): padded columns do not count") {
  GPT<tiny, Mesh<>, double> model(GptInit{3, 0.02});
  std::vector<int> tok, tgt;
  batch(tok, tgt, B, T, tiny::vocab);
  const double loss = model.forward(tok.data(), tgt.data(), B, T);
  CHECK(loss == doctest::Approx(std::log(37.0)).epsilon(0.005));  // ln 40 would be 2% higher
  CHECK(model.loss() == doctest::Approx(loss).epsilon(1e-6));
  // no targets: no loss, logits readable, padded columns are exactly zero (zero wte rows)
  CHECK(model.forward(tok.data(), nullptr, B, T) == 0.0f);
  auto logits = model.logits();
  REQUIRE(logits.size() == static_cast<std::size_t>(B * T * 40));
  for (int i = 0; i < B * T; ++i)
    for (int v = 37; v < 40; ++v) CHECK(logits[static_cast<std::size_t>(i * 40 + v)] == 0.0);
  CHECK_THROWS_AS(model.backward(), std::logic_error);  // no targets, nothing to differentiate
  CHECK_THROWS_AS(model.forward(tok.data(), tgt.data(), B, 9), std::invalid_argument);  // > max_seq
  tok[3] = 37;
  CHECK_THROWS_AS(model.forward(tok.data(), tgt.data(), B, T), std::invalid_argument);  // token out of range
}

// Gradient check: every element of every parameter tensor, in double, against central
// differences (eps = 1e-5). Bound: |analytic - numeric| <= 1e-6 * (|analytic| + |numeric|) + 1e-9
// per element (truncation error ~ eps^2 and round-off ~ 1e-16 / eps are both far below), and
// the relative error of the whole tensor ||a - n|| / ||a + n|| <= 1e-7.
template <class Cfg>
void gradient_check() {
  using Model = GPT<Cfg, Mesh<>, double>;
  using Lay = typename Model::layout;
  Model model(GptInit{11, 0.3});  // larger weights than GPT-2's: a less linear point
  // move LayerNorm parameters and biases away from 1 / 0 so every path is exercised
  for (const ParamInfo& t : Lay::tensors)
    if (t.rank() == 1)
      for (std::size_t i = 0; i < t.size(); ++i) model.params()[t.offset + i] += 0.2 * standard_normal(99, t.spec.stream, i);
  std::vector<int> tok, tgt;
  batch(tok, tgt, B, T, Cfg::vocab);
  model.zero_grad();
  model.forward(tok.data(), tgt.data(), B, T);
  model.backward();
  std::vector<double> grad(model.grads().begin(), model.grads().end());

  const double eps = 1e-5;
  std::size_t checked = 0;
  double worst_all = 0;
  std::string worst_name;
  for (const ParamInfo& t : Lay::tensors) {
    CAPTURE(t.name());
    double diff2 = 0, sum2 = 0, worst = 0;
    for (std::size_t i = 0; i < t.size(); ++i) {
      double& p = model.params()[t.offset + i];
      const double p0 = p;
      p = p0 + eps;
      model.forward(tok.data(), tgt.data(), B, T);
      const double up = model.loss();
      p = p0 - eps;
      model.forward(tok.data(), tgt.data(), B, T);
      const double down = model.loss();
      p = p0;
      const double num = (up - down) / (2 * eps), ana = grad[t.offset + i];
      const double err = std::abs(ana - num);
      worst = std::max(worst, err / (std::abs(ana) + std::abs(num) + 1e-3));
      if (err > 1e-6 * (std::abs(ana) + std::abs(num)) + 1e-9) {
        CAPTURE(i);
        CAPTURE(ana);
        CAPTURE(num);
        CHECK(err <= 1e-6 * (std::abs(ana) + std::abs(num)) + 1e-9);  // fails here, with the values
      }
      if (static_cast<std::int64_t>(i) / t.cols >= t.spec.file_rows) REQUIRE(ana == 0.0);  // padded vocabulary rows
      diff2 += err * err;
      sum2 += (ana + num) * (ana + num);
      ++checked;
    }
    CHECK(std::sqrt(diff2) <= 1e-7 * std::sqrt(sum2));
    CHECK(sum2 > 0);  // every tensor gets a gradient
    if (worst > worst_all) worst_all = worst, worst_name = t.name();
  }
  CHECK(checked == Lay::size);
  MESSAGE(Lay::count << " tensors, " << checked << " elements; worst |a - n| / (|a| + |n| + 1e-3): " << worst_all
                     << " (" << worst_name << ")");
}

TEST_CASE("gradient check, every element of every parameter tensor, tied") { gradient_check<tiny>(); }
TEST_CASE("gradient check, every element of every parameter tensor, untied") { gradient_check<tiny_untied>(); }

TEST_CASE("gradients accumulate until zero_grad") {
  GPT<tiny, Mesh<>, double> model(GptInit{5, 0.1});
  std::vector<int> tok, tgt;
  batch(tok, tgt, B, T, tiny::vocab);
  model.zero_grad();
  model.forward(tok.data(), tgt.data(), B, T);
  model.backward();
  std::vector<double> once(model.grads().begin(), model.grads().end());
  CHECK_THROWS_AS(model.backward(), std::logic_error);  // one backward per forward
  model.forward(tok.data(), tgt.data(), B, T);
  model.backward();
  for (std::size_t i = 0; i < once.size(); ++i) REQUIRE(model.grads()[i] == doctest::Approx(2 * once[i]).epsilon(1e-12));
  model.zero_grad();
  for (double g : model.grads()) REQUIRE(g == 0.0);
  // a smaller batch after a larger one reuses the buffers and gives the same as a fresh model
  GPT<tiny, Mesh<>, double> fresh(GptInit{5, 0.1});
  const double a = model.forward(tok.data(), tgt.data(), 1, 4);
  const double b = fresh.forward(tok.data(), tgt.data(), 1, 4);
  CHECK(a == b);
}

TEST_CASE("float and bf16 models agree with the double model") {
  std::vector<int> tok, tgt;
  batch(tok, tgt, B, T, tiny::vocab);
  GPT<tiny, Mesh<>, double> d(GptInit{4, 0.2});
  GPT<tiny, Mesh<>, float> f(GptInit{4, 0.2});
  GPT<tiny, Mesh<>, bf16> h(GptInit{4, 0.2});
  const double ld = d.forward(tok.data(), tgt.data(), B, T);
  CHECK(f.forward(tok.data(), tgt.data(), B, T) == doctest::Approx(ld).epsilon(1e-5));
  CHECK(h.forward(tok.data(), tgt.data(), B, T) == doctest::Approx(ld).epsilon(2e-2));
  d.zero_grad(), f.zero_grad(), h.zero_grad();
  d.backward(), f.backward(), h.backward();
  double n2 = 0, ef = 0, eh = 0;
  for (std::size_t i = 0; i < d.grads().size(); ++i) {
    const double g = d.grads()[i];
    n2 += g * g;
    ef += (g - f.grads()[i]) * (g - f.grads()[i]);
    eh += (g - float(h.grads()[i])) * (g - float(h.grads()[i]));
  }
  CHECK(std::sqrt(ef / n2) < 1e-5);
  CHECK(std::sqrt(eh / n2) < 5e-2);
}

TEST_CASE("safetensors round trip is exact: HF names and shapes, unpadded vocabulary") {
  const auto path = std::filesystem::temp_directory_path() / "fived_test_gpt.safetensors";
  std::vector<int> tok, tgt;
  batch(tok, tgt, B, T, tiny::vocab);

  GPT<tiny> a(GptInit{21, 0.05});
  a.save(path, {{"step", "0"}});
  auto file = io::SafetensorsFile::read(path);
  CHECK(file.tensors().size() == Table<tiny>::count);
  CHECK(file.metadata().at("format") == "pt");
  CHECK(file.metadata().at("step") == "0");
  CHECK(file.at("wte.weight").shape == std::vector<std::int64_t>{37, 16});  // not 40
  CHECK(file.at("h.1.attn.c_attn.weight").shape == std::vector<std::int64_t>{16, 48});
  CHECK(file.at("h.1.mlp.c_proj.weight").shape == std::vector<std::int64_t>{64, 16});
  CHECK(file.at("ln_f.bias").shape == std::vector<std::int64_t>{16});
  CHECK(file.at("wpe.weight").dtype == io::Dtype::F32);
  CHECK(file.find("lm_head.weight") == nullptr);

  GPT<tiny> b(GptInit{22, 0.05});
  b.load(path);
  CHECK(std::memcmp(a.params().data(), b.params().data(), a.params().size_bytes()) == 0);
  CHECK(a.forward(tok.data(), tgt.data(), B, T) == b.forward(tok.data(), tgt.data(), B, T));

  // bf16 and untied models too
  GPT<tiny_untied, Mesh<>, bf16> c(GptInit{23, 0.05});
  c.save(path);
  CHECK(io::SafetensorsFile::read(path).at("lm_head.weight").dtype == io::Dtype::BF16);
  GPT<tiny_untied, Mesh<>, bf16> d(GptInit{24, 0.05});
  d.load(path);
  CHECK(std::memcmp(c.params().data(), d.params().data(), c.params().size_bytes()) == 0);
  // a float model reads the bf16 file by converting
  GPT<tiny_untied> e;
  e.load(path);
  for (std::size_t i = 0; i < e.params().size(); ++i) REQUIRE(e.params()[i] == float(c.params()[i]));
  std::filesystem::remove(path);
}

TEST_CASE("load: HF spellings are accepted, errors name the tensor, a failed load changes nothing") {
  using Lay = Table<tiny>;
  GPT<tiny> src(GptInit{31, 0.05});
  std::vector<float> mask(64, 1.0f), masked_bias(1, -1e4f);
  std::vector<std::vector<float>> keep;  // data the writers point to

  // "transformer." prefix, attention-mask buffers, a tied lm_head copy: all accepted.
  {
    io::SafetensorsWriter w;
    for (const ParamInfo& t : Lay::tensors) {
      w.add("transformer." + t.name(), t.file_shape(), src.params().subspan(t.offset, t.file_size()));
    }
    for (int l = 0; l < 2; ++l) {
      w.add("transformer.h." + std::to_string(l) + ".attn.bias", {1, 1, 8, 8}, std::span<const float>(mask));
      w.add("transformer.h." + std::to_string(l) + ".attn.masked_bias", {}, std::span<const float>(masked_bias));
    }
    w.add("lm_head.weight", {37, 16}, src.params().subspan(0, 37 * 16));
    GPT<tiny> m(GptInit{32, 0.05});
    m.load(io::SafetensorsFile::parse(w.serialize(), "hf.safetensors"));
    CHECK(std::memcmp(m.params().data(), src.params().data(), src.params().size_bytes()) == 0);
  }

  // A head that differs from wte: an untied checkpoint, refused by a tied model.
  {
    io::SafetensorsWriter w;
    for (const ParamInfo& t : Lay::tensors) w.add(t.name(), t.file_shape(), src.params().subspan(t.offset, t.file_size()));
    w.add("lm_head.weight", {37, 16}, src.params().subspan(1, 37 * 16));  // shifted by one element
    GPT<tiny> m(GptInit{32, 0.05});
    CHECK_THROWS_WITH_AS(m.load(io::SafetensorsFile::parse(w.serialize(), "untied.safetensors")),
                         "untied.safetensors: lm_head.weight differs from wte.weight, so this checkpoint has an "
                         "untied head; load it into a config with tied = false",
                         io::SafetensorsError);
  }

  // One tensor changed: wrong shape, missing, unknown, duplicated.
  auto file_with = [&](const std::string& victim, std::vector<std::int64_t> shape, bool drop,
                       const std::string& extra = "") {
    io::SafetensorsWriter w;
    for (const ParamInfo& t : Lay::tensors) {
      std::vector<std::int64_t> s = t.file_shape();
      if (t.name() == victim) {
        if (drop) continue;
        std::size_t n = 1;
        for (auto d : shape) n *= static_cast<std::size_t>(d);
        keep.emplace_back(n, 0.5f);
        w.add(t.name(), shape, std::span<const float>(keep.back()));
        continue;
      }
      w.add(t.name(), s, src.params().subspan(t.offset, t.file_size()));
    }
    if (!extra.empty()) {
      keep.emplace_back(16, 0.5f);
      w.add(extra, {16}, std::span<const float>(keep.back()));
    }
    return io::SafetensorsFile::parse(w.serialize(), "bad.safetensors");
  };
  GPT<tiny> m(GptInit{33, 0.05});
  std::vector<float> before(m.params().begin(), m.params().end());
  CHECK_THROWS_WITH_AS(m.load(file_with("h.1.mlp.c_fc.weight", {768, 3072}, false)),
                       "bad.safetensors: h.1.mlp.c_fc.weight has shape [768, 3072] in the file, the model expects [16, 64]",
                       io::SafetensorsError);
  CHECK_THROWS_WITH_AS(m.load(file_with("wte.weight", {40, 16}, false)),
                       "bad.safetensors: wte.weight has shape [40, 16] in the file, the model expects [37, 16]",
                       io::SafetensorsError);
  CHECK_THROWS_WITH_AS(m.load(file_with("h.0.ln_2.bias", {}, true)),
                       "bad.safetensors: tensor 'h.0.ln_2.bias' is missing (the model expects [16])", io::SafetensorsError);
  CHECK_THROWS_WITH_AS(m.load(file_with("", {}, false, "h.2.ln_1.weight")),
                       "bad.safetensors: tensor 'h.2.ln_1.weight' is not a parameter of this model (2 layers, d_model "
                       "16, 2 heads, vocab 37, max_seq 8, tied)",
                       io::SafetensorsError);
  CHECK_THROWS_WITH_AS(m.load(file_with("", {}, false, "transformer.ln_f.bias")),
                       doctest::Contains("'ln_f.bias' and 'transformer.ln_f.bias' are the same parameter"),
                       io::SafetensorsError);
  CHECK(std::equal(before.begin(), before.end(), m.params().begin()));  // unchanged by the failed loads
  CHECK_THROWS_WITH_AS(m.param("h.7.ln_1.weight"), doctest::Contains("no parameter named 'h.7.ln_1.weight'"),
                       std::invalid_argument);
  CHECK(m.param("h.1.attn.c_attn.weight").cols() == 48);
  CHECK(m.param("h.1.attn.c_attn.weight").data.data() ==
        m.params().data() + offset<Lay>("h." + std::to_string(1) + ".attn.c_attn.weight"));
}

TEST_CASE("the loss drops over 20 AdamW steps on a fixed batch") {
  GPT<small> model(GptInit{1, 0.02});
  const int b = 4, t = 16;
  std::vector<int> tok, tgt;
  batch(tok, tgt, b, t, small::vocab);
  DataParallel<GPT<small>> trainer(model, {.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f});  // no decay, no clipping
  float first = 0, last = 0;
  for (int step = 1; step <= 20; ++step) {
    const float loss = static_cast<float>(trainer.step(tok, tgt, b, t));
    if (step == 1) first = loss;
    last = loss;
  }
  MESSAGE("loss " << first << " -> " << last);
  CHECK(first == doctest::Approx(std::log(50.0)).epsilon(0.01));
  CHECK(last < 0.5f * first);
  // padded rows stayed zero (zero gradient, zero weight decay term)
  const ParamInfo& wte = info<Table<small>>("wte.weight");
  for (std::size_t i = wte.file_size(); i < wte.size(); ++i) REQUIRE(model.params()[wte.offset + i] == 0.0f);
}

TEST_CASE("loads a file written by Python's safetensors in Hugging Face's GPT-2 layout") {
  // tests/data/make_hf_fixture.py wrote it: "transformer." names, Conv1D [in, out]
  // weights, h.{i}.attn.bias mask buffers, a tied lm_head copy, {"format": "pt"}.
  const auto file = io::SafetensorsFile::read(std::string(FIVED_TEST_DATA_DIR) + "/hf_tiny_gpt2.safetensors");
  CHECK(file.metadata().at("format") == "pt");
  GPT<tiny> m(GptInit{1, 0.05});
  m.load(file);

  // the script's tensor order and value formula, repeated here
  std::vector<std::string> names = {"wte.weight", "wpe.weight"};
  for (int l = 0; l < 2; ++l)
    for (const char* k : {"ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
                          "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
                          "mlp.c_proj.weight", "mlp.c_proj.bias"})
      names.push_back("h." + std::to_string(l) + "." + k);
  names.push_back("ln_f.weight");
  names.push_back("ln_f.bias");
  REQUIRE(names.size() == static_cast<std::size_t>(Table<tiny>::count));
  for (std::size_t t = 0; t < names.size(); ++t) {
    const auto p = m.param(names[t]);
    const std::size_t n = static_cast<std::size_t>(p.info->file_size());
    std::size_t wrong = 0;
    for (std::size_t k = 0; k < n; ++k) {
      const double want = static_cast<double>(k % 97) * 0.01 - 0.48 + 0.001 * static_cast<double>(t);
      wrong += p[k] != static_cast<float>(want);
    }
    for (std::size_t k = n; k < p.size(); ++k) wrong += p[k] != 0.0f;  // padded vocabulary rows
    INFO(names[t]);
    CHECK(wrong == 0);
  }
  std::vector<int> tok = {1, 5, 9, 2}, tgt = {5, 9, 2, 7};
  CHECK(std::isfinite(m.forward(tok.data(), tgt.data(), 1, 4)));
}

// ---- the one model reproduces the serial model it replaced, bit for bit ----------------------

namespace {

// Recorded from the serial model (first before the one-model change, nn::GPT<Cfg, T> of
// commit ffb49ba; recorded again when issue 24 carried every scalar in double: AdamW's
// hyperparameters, bias corrections and clip factor, the 1/N of the loss, and double
// moments for the fp64 model, which moved the later steps by a float's rounding): the
// losses of 3 clipped AdamW steps (lr 1e-2, betas 0.9 / 0.95, weight decay 0.1, max_norm
// 0.5: every step clips), an FNV-1a hash of the bytes of the last step's gradients, and one
// of the weights after the third step. Batches are ids(B*T, 1 + step) and
// ids(B*T, 11 + step) with B = 2, T = 8, init seed 7. The first losses are unchanged; the
// hyperparameters are now given as doubles. bf16 recorded again when AdamW took the clip
// factor as it reads each gradient: the clipped gradient is no longer rounded to bf16 first
// (fp32 and fp64 unchanged: the same products). fp32 and fp64 recorded again when the host's
// GELU became 0.5 (1 + tanh u) = 1 / (1 + e^-2u): the fp32 losses moved by 7e-10 to 6e-8 of
// themselves, the fp64 losses kept every bit (only the hashes moved), bf16 all of them.
struct Recorded {
  const char* what;
  std::uint64_t loss_bits[3];
  std::uint64_t grads_hash, params_hash;
};
constexpr Recorded recorded[] = {
    {"fp32 tied", {0x40106907074e9be7ull, 0x4010a7ba05d701fcull, 0x401080c9868324d2ull}, 0x468bb3a2dfcb2ecaull,
     0xf2ec336c5e2966caull},
    {"fp32 untied", {0x40107ed264d040b9ull, 0x40102c65c2d865d1ull, 0x4010705c50e5bf85ull}, 0x13cd9402b53751b2ull,
     0xaae2f69d19528160ull},
    {"bf16 tied", {0x401068f84c0d1d2cull, 0x4010a57d55d8838full, 0x401085b242f418deull}, 0x442425982e7bdbe2ull,
     0x368d087048b26624ull},
    {"fp64 tied", {0x40106907071e9048ull, 0x4010a7ba01b0490dull, 0x401080c97caf9872ull}, 0x38dd6aa832d6e919ull,
     0x8f833fa1ec34021full},
};

struct rec_tiny : gpt_config {
  static constexpr int layers = 2, d_model = 32, heads = 4, vocab = 61, max_seq = 16, vocab_multiple = 8;
};
struct rec_tiny_untied : rec_tiny {
  static constexpr bool tied = false;
};

std::uint64_t fnv1a(const void* p, std::size_t n) {
  const unsigned char* b = static_cast<const unsigned char*>(p);
  std::uint64_t h = 1469598103934665603ull;
  for (std::size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}
std::vector<int> lcg_ids(int n, unsigned seed, int vocab) {
  std::vector<int> v(static_cast<std::size_t>(n));
  unsigned s = seed;
  for (int& e : v) e = static_cast<int>((s = s * 1103515245u + 12345u) >> 16) % vocab;
  return v;
}

template <class Cfg, class T>
void reproduces(const Recorded& r) {
  constexpr int b = 2, t = 8;
  GPT<Cfg, Mesh<>, T> m(GptInit{.seed = 7});
  DataParallel<GPT<Cfg, Mesh<>, T>> trainer(
      m, {.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1, .max_norm = 0.5});
  for (int step = 0; step < 3; ++step) {
    CAPTURE(r.what);
    CAPTURE(step);
    const auto tok = lcg_ids(b * t, 1 + static_cast<unsigned>(step), Cfg::vocab);
    const auto tgt = lcg_ids(b * t, 11 + static_cast<unsigned>(step), Cfg::vocab);
    m.zero_grad();
    m.forward(tok.data(), tgt.data(), b, t);
    const double loss = m.loss();
    m.backward();
    if (step == 2) CHECK(fnv1a(m.grads().data(), m.grads().size_bytes()) == r.grads_hash);
    CHECK(trainer.apply_gradients() < 1.0);  // clipped
    std::uint64_t bits = 0;
    std::memcpy(&bits, &loss, sizeof bits);
    CHECK(bits == r.loss_bits[step]);
  }
  CHECK(fnv1a(m.params().data(), m.params().size_bytes()) == r.params_hash);
}

}  // namespace

TEST_CASE("GPT<cfg, Mesh<>> reproduces the recorded serial model bit for bit: losses, gradients, weights") {
  reproduces<rec_tiny, float>(recorded[0]);
  reproduces<rec_tiny_untied, float>(recorded[1]);
  reproduces<rec_tiny, bf16>(recorded[2]);
  reproduces<rec_tiny, double>(recorded[3]);
}

// ---- parts: the layers of a pipeline stage ---------------------------------------------------

namespace {
struct four_untied : small {
  static constexpr int layers = 4;
  static constexpr bool tied = false;
};
template <class Part>
using PartOf = GPT<four_untied, Mesh<>, float, Host, NoSequenceParallel, Part>;
using Head0 = PartOf<Layers<0, 1>>;  // the embedding and block 0
using Mid = PartOf<Layers<1, 2>>;    // blocks 1 and 2
using Tail = PartOf<Layers<3, 1>>;   // block 3, ln_f and the head
static_assert(Head0::has_embedding && !Head0::has_head && Head0::layout::units == 2);
static_assert(!Mid::has_embedding && !Mid::has_head && Mid::layout::units == 2 && Mid::layout::count == 24);
static_assert(!Tail::has_embedding && Tail::has_head && Tail::layout::units == 2 && Tail::layout::count == 15);
static_assert(Head0::layout::size + Mid::layout::size + Tail::layout::size == GPT<four_untied>::layout::size);
// Every part satisfies the model contract (model/contract.hpp), and names the others.
static_assert(check_model<GPT<four_untied>>::ok && ModelPart<GPT<four_untied>>);
static_assert(ModelPart<Head0> && ModelPart<Mid> && ModelPart<Tail>);
static_assert(std::is_same_v<GPT<four_untied>::part<Layers<1, 2>>, Mid>);
static_assert(ModelType<GPT<four_untied, Mesh<PP<2>>>>, "the whole model on a PP mesh is a type to read facts from");
static_assert(std::is_same_v<GPT<four_untied, Mesh<>, float, Host, NoSequenceParallel, Layers<0, 4>>::layout,
                             ParamTable<GptSpecs<four_untied, Layers<0, 4>>, 1>> &&
              GPT<four_untied, Mesh<>, float, Host, NoSequenceParallel, Layers<0, 4>>::layout::size ==
                  GPT<four_untied>::layout::size);

// Every tensor of a part equals the whole model's tensor of the same name.
template <class PartModel, class Whole>
void same_tensors(PartModel& part, Whole& whole, bool grads) {
  for (const ParamInfo& t : PartModel::layout::tensors) {
    CAPTURE(t.name());
    const auto a = grads ? part.grad(t.name()) : part.param(t.name());
    const auto b = grads ? whole.grad(t.name()) : whole.param(t.name());
    REQUIRE(a.size() == b.size());
    CHECK(std::equal(a.data.begin(), a.data.end(), b.data.begin()));
  }
}
}  // namespace

TEST_CASE("parts chained by hand are the whole model, bit for bit: initial weights, loss, every gradient") {
  constexpr int b = 2, t = 16;
  std::vector<int> tok, tgt;
  batch(tok, tgt, b, t, four_untied::vocab);
  const GptInit init{3, 0.05};
  GPT<four_untied> whole(init);
  Head0 p0(init);
  Mid p1(init);
  Tail p2(init);
  same_tensors(p0, whole, false);
  same_tensors(p1, whole, false);
  same_tensors(p2, whole, false);

  const float loss = whole.forward(tok.data(), tgt.data(), b, t);
  whole.backward();

  const std::size_t n = Mid::boundary_size(b, t);
  auto hand_over = [n](const float* from, float* to) { std::copy_n(from, n, to); };
  p0.enqueue_forward(tok.data(), tgt.data(), b, t);
  hand_over(p0.output(0), p1.input(0, b, t));
  p1.enqueue_forward(tok.data(), tgt.data(), b, t);
  hand_over(p1.output(0), p2.input(0, b, t));
  const float part_loss = p2.forward(tok.data(), tgt.data(), b, t);
  CHECK(p0.loss() == 0.0);  // only the part with the head has a loss
  CHECK(part_loss == loss);

  p2.backward();
  hand_over(p2.input_grad(), p1.output_grad(b, t));
  p1.backward();
  hand_over(p1.input_grad(), p0.output_grad(b, t));
  p0.backward();
  same_tensors(p0, whole, true);
  same_tensors(p1, whole, true);
  same_tensors(p2, whole, true);
  CHECK_THROWS_WITH_AS(p1.backward(), "GPT::backward: call forward first (once per backward)", std::logic_error);
}

namespace {
struct packed_tiny : tiny {
  static constexpr int end_of_document = 4;
};
}  // namespace

// Packed documents (context/documents.hpp): a token attends only to its own document, so a
// document's logits cannot depend on the documents before it in the row; positions are the
// row's (the position embedding is not reset), as torchtitan's block-causal mask.
TEST_CASE("packed documents: a document's logits do not depend on the tokens before it in the row, bit for bit; "
          "without end_of_document they do") {
  constexpr int n = 8, Vp = padded_vocab<tiny>;
  const std::vector<int> a{1, 2, 3, 4, 9, 10, 11, 12}, b{7, 8, 4, 4, 9, 10, 11, 12};  // [0, 4) or [0, 3) [3], then [4, 8)
  auto logits = [&]<class Cfg>(const std::vector<int>& tok) {
    GPT<Cfg, Mesh<>, double> m(GptInit{3, 0.2});
    m.forward(tok.data(), nullptr, 1, n);
    return std::vector<double>(m.logits().begin(), m.logits().end());
  };
  const auto pa = logits.template operator()<packed_tiny>(a), pb = logits.template operator()<packed_tiny>(b);
  CHECK(std::equal(pa.begin() + 4 * Vp, pa.end(), pb.begin() + 4 * Vp));
  CHECK(!std::equal(pa.begin(), pa.begin() + 4 * Vp, pb.begin()));
  const auto ua = logits.template operator()<tiny>(a), ub = logits.template operator()<tiny>(b);
  CHECK(!std::equal(ua.begin() + 4 * Vp, ua.end(), ub.begin() + 4 * Vp));
}
