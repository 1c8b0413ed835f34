// Mutation fuzzing of the safetensors reader and the GPT loader, built with AddressSanitizer
// and UndefinedBehaviorSanitizer (tests/CMakeLists.txt): every mutated file must either load
// or be refused with io::SafetensorsError naming the file. Any other exception, a crash or a
// sanitizer report fails the test.
//
//   fuzz_safetensors [iterations (4000)] [seed (1)]
//
// Then as many mutants of a checkpoint's manifest (train/checkpoint.hpp), read with the file it
// names: each is read or refused with a SafetensorsError naming the manifest or the file.
//
// Seeds: files written by SafetensorsWriter (several dtypes, metadata, an empty tensor) and a
// small GPT's checkpoint (nn/checkpoint.hpp). Mutations: bit flips and random bytes in the
// header, truncation, a forged header length, bytes appended, and JSON-aware edits (a field
// repeated, a number replaced by a huge, negative or fractional one, a quote or brace
// removed). A mutant that still parses is read whole (every tensor into floats or its own
// dtype) and loaded into the GPT, whose own checks must refuse what does not fit.

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <filesystem>
#include <fstream>

#include "fived/io/safetensors.hpp"
#include "fived/nn/checkpoint.hpp"
#include "fived/nn/gpt.hpp"
#include "fived/train/checkpoint.hpp"

using namespace fived;

namespace {

struct tiny : gpt_config {
  static constexpr int layers = 1, d_model = 8, heads = 2, vocab = 11, max_seq = 4, vocab_multiple = 4;
};
using Layout = GPT<tiny>::serial_layout;

std::vector<std::byte> writer_seed() {
  std::vector<float> a = {1, 2, 3, 4, 5, 6};
  std::vector<double> b = {0.5, -0.25};
  std::vector<bf16> c = {bf16(1.0f), bf16(-2.0f), bf16(3.5f)};
  std::vector<std::int32_t> d = {7, 8, 9, 10};
  std::vector<float> empty;
  io::SafetensorsWriter w;
  w.add("a", {2, 3}, std::span<const float>(a));
  w.add("b", {2}, std::span<const double>(b));
  w.add("c", {3}, std::span<const bf16>(c));
  w.add("d", {2, 2}, std::span<const std::int32_t>(d));
  w.add("e", {0, 4}, std::span<const float>(empty));
  w.add_metadata("format", "pt");
  w.add_metadata("step", "12");
  return w.serialize();
}

std::vector<std::byte> gpt_seed() {
  std::vector<float> p(Layout::size, 0.25f);
  io::SafetensorsWriter w;
  for (const ParamInfo& t : Layout::tensors)
    w.add(t.name(), t.file_shape(), std::span<const float>(p).subspan(t.offset, t.file_size()));
  return w.serialize();
}

std::size_t header_end(const std::vector<std::byte>& f) {
  if (f.size() < 8) return f.size();
  std::uint64_t n = 0;
  std::memcpy(&n, f.data(), 8);
  return n > f.size() - 8 ? f.size() : static_cast<std::size_t>(8 + n);
}

std::vector<std::byte> mutate(std::vector<std::byte> f, std::mt19937_64& rng) {
  auto pick = [&](std::size_t n) { return n == 0 ? std::size_t{0} : static_cast<std::size_t>(rng() % n); };
  const int rounds = 1 + static_cast<int>(rng() % 3);
  for (int r = 0; r < rounds && !f.empty(); ++r) {
    const std::size_t he = header_end(f);
    switch (rng() % 9) {
      case 0: {  // a bit in the header
        const std::size_t i = pick(he);
        f[i] ^= static_cast<std::byte>(1u << (rng() % 8));
        break;
      }
      case 1:  // a random byte anywhere
        f[pick(f.size())] = static_cast<std::byte>(rng());
        break;
      case 2:  // truncated
        f.resize(pick(f.size()));
        break;
      case 3: {  // a forged header length
        const std::uint64_t forged[] = {0, 1, 7, he - 8 + 1, he - 8 - 1, f.size(), ~std::uint64_t{0}, rng() % 4096,
                                        std::uint64_t{1} << 40};
        const std::uint64_t n = forged[rng() % 9];
        if (f.size() >= 8) std::memcpy(f.data(), &n, 8);
        break;
      }
      case 4:  // bytes appended
        for (std::size_t k = 1 + pick(16); k-- > 0;) f.push_back(static_cast<std::byte>(rng()));
        break;
      default: {  // JSON-aware: edit the header text
        if (he <= 8) break;
        std::string h(reinterpret_cast<const char*>(f.data() + 8), he - 8);
        const std::size_t at = pick(h.size());
        switch (rng() % 5) {
          case 0: {  // a field repeated
            const char* fields[] = {"\"shape\":[1],", "\"dtype\":\"F32\",", "\"data_offsets\":[0,4],", "\"x\":{},"};
            const std::size_t brace = h.find('{', at == 0 ? 1 : at);
            if (brace != std::string::npos) h.insert(brace + 1, fields[rng() % 4]);
            break;
          }
          case 1: {  // a number replaced
            const std::size_t digit = h.find_first_of("0123456789", at);
            const char* numbers[] = {"18446744073709551615", "99999999999999999999999", "-1", "1.5", "1e3", "4294967296"};
            if (digit != std::string::npos) h.replace(digit, 1, numbers[rng() % 6]);
            break;
          }
          case 2: {  // a quote, bracket or brace removed
            const std::size_t c = h.find_first_of("\"[]{}:,", at);
            if (c != std::string::npos) h.erase(c, 1);
            break;
          }
          case 3:  // a dtype changed
            if (const std::size_t d = h.find("\"F32\"", at); d != std::string::npos) {
              const char* dtypes[] = {"\"F16\"", "\"BF16\"", "\"F64\"", "\"I64\"", "\"U8\"", "\"Q4\"", "\"\""};
              h.replace(d, 5, dtypes[rng() % 7]);
            }
            break;
          default:  // a control character or escape inside a string
            h.insert(at, rng() % 2 ? std::string("\\u0000") : std::string(1, static_cast<char>(rng() % 32)));
        }
        std::vector<std::byte> g(8 + h.size());
        const std::uint64_t n = h.size();
        std::memcpy(g.data(), &n, 8);
        std::memcpy(g.data() + 8, h.data(), h.size());
        g.insert(g.end(), f.begin() + static_cast<std::ptrdiff_t>(he), f.end());
        f = std::move(g);
      }
    }
  }
  return f;
}

// Everything a user could do with a file that parsed.
void use(const io::SafetensorsFile& f) {
  for (const io::TensorEntry& e : f.tensors()) {
    if (e.end < e.begin) std::abort();
    (void)f.bytes(e);
    if (io::is_floating(e.dtype)) {
      std::vector<float> v(e.numel());
      f.read_into(e, std::span<float>(v));
    }
  }
  std::vector<float> params(Layout::size);
  load_weights<Layout>(f, std::span<float>(params), std::span<float>(), "the fuzzing GPT");
}

}  // namespace

int main(int argc, char** argv) {
  const long iterations = argc > 1 ? std::strtol(argv[1], nullptr, 10) : 4000;
  std::mt19937_64 rng(argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 1);
  const std::vector<std::vector<std::byte>> seeds = {writer_seed(), gpt_seed()};
  use(io::SafetensorsFile::parse(seeds[1], "seed.safetensors"));  // the GPT's file loads
  try {  // the other is no GPT: refused by the loader, read whole by the reader before that
    use(io::SafetensorsFile::parse(seeds[0], "seed.safetensors"));
    return 1;
  } catch (const io::SafetensorsError& e) {
    if (std::string(e.what()).find("is not a parameter of this model") == std::string::npos) return 1;
  }
  long parsed = 0, refused = 0;
  for (long i = 0; i < iterations; ++i) {
    std::vector<std::byte> m = mutate(seeds[static_cast<std::size_t>(rng() % seeds.size())], rng);
    try {
      use(io::SafetensorsFile::parse(std::move(m), "mutant.safetensors"));
      ++parsed;
    } catch (const io::SafetensorsError& e) {
      if (std::string(e.what()).find("mutant.safetensors") == std::string::npos) {
        std::fprintf(stderr, "mutant %ld: an error that does not name the file: %s\n", i, e.what());
        return 1;
      }
      ++refused;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "mutant %ld: not a SafetensorsError: %s\n", i, e.what());
      return 1;
    }
  }
  std::printf("%ld mutants: %ld refused with a SafetensorsError, %ld loaded\n", iterations, refused, parsed);

  // Manifests: a valid one naming one real file, mutated as text.
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("fived_fuzz_manifest_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  {
    std::ofstream f(dir / "rank-00000.safetensors", std::ios::binary);
    f.write(reinterpret_cast<const char*>(seeds[0].data()), static_cast<std::streamsize>(seeds[0].size()));
  }
  checkpoint::Manifest valid{7, 7, 1, "Mesh<>", "a model", {}, {}};
  valid.files.push_back({"rank-00000.safetensors", seeds[0].size(), checkpoint::file_hash(dir / "rank-00000.safetensors")});
  checkpoint::write_manifest(dir, valid);
  std::string text;
  {
    std::ifstream in(dir / "manifest.json", std::ios::binary);
    text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  if (checkpoint::read_manifest(dir).step != 7) return 1;  // the seed reads
  long read = 0, bad = 0;
  for (long i = 0; i < iterations / 2; ++i) {
    std::vector<std::byte> header(8 + text.size());
    const std::uint64_t n = text.size();
    std::memcpy(header.data(), &n, 8);
    std::memcpy(header.data() + 8, text.data(), text.size());
    const std::vector<std::byte> m = mutate(header, rng);  // its JSON-aware edits, as if a header
    {
      std::ofstream out(dir / "manifest.json", std::ios::binary | std::ios::trunc);
      if (m.size() > 8) out.write(reinterpret_cast<const char*>(m.data()) + 8, static_cast<std::streamsize>(m.size() - 8));
    }
    try {
      (void)checkpoint::read_manifest(dir);
      ++read;
    } catch (const io::SafetensorsError& e) {
      const std::string w = e.what();
      if (w.find("manifest.json") == std::string::npos && w.find("rank-00000") == std::string::npos) {
        std::fprintf(stderr, "manifest mutant %ld: an error that names neither file: %s\n", i, e.what());
        return 1;
      }
      ++bad;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "manifest mutant %ld: not a SafetensorsError: %s\n", i, e.what());
      return 1;
    }
  }
  fs::remove_all(dir);
  std::printf("%ld manifest mutants: %ld refused with a SafetensorsError, %ld read\n", iterations / 2, bad, read);
  return 0;
}
