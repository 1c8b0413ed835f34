// Token data on the host: files of token ids (mapped, checked; nanoGPT's, llm.c's with its
// header, shards as one stream), and the samplers that cut a step's global batch from them:
// windows at random, or each window once an epoch in a shuffled order (IndexShuffle, a
// permutation evaluated one index at a time).

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "fived/train/token_data.hpp"
#include "fived/util/index_shuffle.hpp"

using namespace fived;

namespace {

// Each index of [0, n) exactly once.
bool is_permutation(const IndexShuffle& order) {
  std::vector<bool> seen(order.size());
  for (std::uint64_t i = 0; i < order.size(); ++i) {
    const std::uint64_t j = order(i);
    if (j >= order.size() || seen[j]) return false;
    seen[j] = true;
  }
  return true;
}

// A stream whose token at position i is i (so a window's first token says where it starts).
TokenStream positions(int n) {
  std::string s;
  for (int i = 0; i < n; ++i) s += static_cast<char>(i);
  return TokenStream::bytes_of(s, "positions");
}

// Where each row of `steps` consecutive global batches starts, and checks each row is the
// window there: tokens in order, targets one ahead, all inside the sampler's part.
std::vector<int> window_starts(const BatchSampler& sampler, std::uint64_t first_step, int steps, int micro_batches,
                               int B, int T) {
  std::vector<int> starts, tok, tgt;
  for (std::uint64_t step = first_step; step < first_step + static_cast<std::uint64_t>(steps); ++step) {
    sampler.fill(step, micro_batches, B, T, tok, tgt);
    for (std::size_t r = 0; r < tok.size() / static_cast<std::size_t>(T); ++r) {
      const int s = tok[r * static_cast<std::size_t>(T)];
      for (int t = 0; t < T; ++t) {
        REQUIRE(tok[r * static_cast<std::size_t>(T) + static_cast<std::size_t>(t)] == s + t);
        REQUIRE(tgt[r * static_cast<std::size_t>(T) + static_cast<std::size_t>(t)] == s + t + 1);
      }
      REQUIRE(s >= static_cast<int>(sampler.begin));
      REQUIRE(s + T < static_cast<int>(sampler.end));
      starts.push_back(s);
    }
  }
  return starts;
}

}  // namespace

TEST_CASE("token files: ids of 2 or 4 bytes, mapped; a bad file is an error that names it") {
  const auto dir = std::filesystem::temp_directory_path() / "fived_test_token_data";
  std::filesystem::create_directories(dir);
  const auto file = dir / "ids.bin";
  {
    std::ofstream f(file, std::ios::binary);
    const unsigned char bytes[] = {1, 0, 2, 1, 52, 0};  // 1, 258, 52 as uint16
    f.write(reinterpret_cast<const char*>(bytes), sizeof bytes);
  }
  const TokenStream s = TokenStream::map_file(file, 2, 300);
  REQUIRE(s.size() == 3);
  CHECK(s[0] == 1);
  CHECK(s[1] == 258);
  CHECK(s[2] == 52);
  const TokenStream small = TokenStream::map_file(file, 2, 100);
  CHECK_THROWS_WITH_AS(small[1], ("TokenStream: " + file.string() + ": token 1 is 258, outside the vocabulary of 100").c_str(),
                       std::runtime_error);
  CHECK_THROWS_WITH_AS(TokenStream::map_file(file, 4, 300),
                       ("TokenStream: " + file.string() + ": 6 bytes is not a whole number of 4-byte token ids").c_str(),
                       std::runtime_error);
  CHECK_THROWS_AS(TokenStream::map_file(dir / "missing.bin", 2, 300), std::runtime_error);
  CHECK_THROWS_WITH_AS(TokenStream::map_file(dir, 2, 300), ("TokenStream: " + dir.string() + ": not a regular file").c_str(),
                       std::runtime_error);
  std::filesystem::remove_all(dir);
}


namespace {

void write_bytes(const std::filesystem::path& file, const std::vector<unsigned char>& bytes) {
  std::ofstream f(file, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}
void put32(std::vector<unsigned char>& b, std::uint32_t v) {
  for (int k = 0; k < 4; ++k) b.push_back(static_cast<unsigned char>(v >> (8 * k)));
}
// An llm.c token file (dev/data/data_common.py): 256 int32s (magic, version, count), then the ids.
std::vector<unsigned char> llmc_file(std::uint32_t magic, std::uint32_t version, std::uint32_t count,
                                     const std::vector<std::uint32_t>& ids, int width) {
  std::vector<unsigned char> b;
  put32(b, magic), put32(b, version), put32(b, count);
  b.resize(1024, 0);
  for (const std::uint32_t id : ids)
    for (int k = 0; k < width; ++k) b.push_back(static_cast<unsigned char>(id >> (8 * k)));
  return b;
}

}  // namespace

TEST_CASE("llm.c's token files: the header read and skipped (GPT-2's 2-byte ids, Llama 3's 4-byte), and refused "
          "where it disagrees with the file or the width asked for") {
  const auto dir = std::filesystem::temp_directory_path() / "fived_test_token_data_llmc";
  std::filesystem::create_directories(dir);
  const auto gpt2 = dir / "gpt2.bin", llama = dir / "llama3.bin", bad = dir / "bad.bin";
  write_bytes(gpt2, llmc_file(20240520, 1, 5, {1, 258, 52, 7, 50256}, 2));
  const TokenStream g = TokenStream::map_file(gpt2, 2, 50257);
  REQUIRE(g.size() == 5);
  CHECK(g[0] == 1);
  CHECK(g[1] == 258);
  CHECK(g[4] == 50256);
  write_bytes(llama, llmc_file(20240801, 7, 3, {128000, 1, 70000}, 4));
  const TokenStream l = TokenStream::map_file(llama, 4, 128256);
  REQUIRE(l.size() == 3);
  CHECK(l[0] == 128000);
  CHECK(l[2] == 70000);
  CHECK_THROWS_WITH_AS(TokenStream::map_file(llama, 2, 128256),
                       ("TokenStream: " + llama.string() + ": its llm.c header says its ids are 4 bytes wide, not 2").c_str(),
                       std::runtime_error);
  write_bytes(bad, llmc_file(20240520, 1, 6, {1, 2, 3, 4, 5}, 2));
  CHECK_THROWS_WITH_AS(TokenStream::map_file(bad, 2, 100),
                       ("TokenStream: " + bad.string() + ": its llm.c header says 6 ids of 2 bytes, but 10 bytes follow it").c_str(),
                       std::runtime_error);
  write_bytes(bad, llmc_file(20240520, 2, 5, {1, 2, 3, 4, 5}, 2));
  CHECK_THROWS_WITH_AS(TokenStream::map_file(bad, 2, 100),
                       ("TokenStream: " + bad.string() + ": llm.c header of version 2 (magic 20240520 is version 1)").c_str(),
                       std::runtime_error);
  write_bytes(bad, {136, 216, 52, 1, 1, 0});  // 20240520, then no room for the header
  CHECK_THROWS_WITH_AS(TokenStream::map_file(bad, 2, 100),
                       ("TokenStream: " + bad.string() + ": begins with llm.c's magic 20240520 but is shorter than its "
                                                         "1024-byte header").c_str(),
                       std::runtime_error);
  std::filesystem::remove_all(dir);
}

TEST_CASE("shards: several files are one stream in the order given (a glob's in name order); an error names the "
          "file and the position in it") {
  const auto dir = std::filesystem::temp_directory_path() / "fived_test_token_data_shards";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  write_bytes(dir / "train_000001.bin", llmc_file(20240520, 1, 3, {10, 11, 12}, 2));
  write_bytes(dir / "train_000000.bin", {0, 0, 1, 0});                // 0, 1 without a header (nanoGPT's)
  write_bytes(dir / "train_000002.bin", llmc_file(20240520, 1, 2, {13, 99}, 2));
  const TokenStream s = TokenStream::map_glob((dir / "train_*.bin").string(), 2, 50);
  REQUIRE(s.size() == 7);
  CHECK(s.files() == 3);
  for (int i = 0; i < 6; ++i) CHECK(s[static_cast<std::size_t>(i)] == (i < 2 ? i : 8 + i));
  CHECK(s.name() == (dir / "train_000000.bin").string() + " and 2 more files");
  CHECK_THROWS_WITH_AS(s[6], ("TokenStream: " + (dir / "train_000002.bin").string() +
                              ": token 1 is 99, outside the vocabulary of 50").c_str(),
                       std::runtime_error);
  // Windows run across the files' ends: the stream is one sequence.
  const std::vector<std::filesystem::path> two = {dir / "train_000001.bin", dir / "train_000000.bin"};
  const TokenStream t = TokenStream::map_files(two, 2, 50);
  BatchSampler all(t, 0, t.size(), 1);
  all.order = SampleOrder::epochs;
  std::vector<int> tok, tgt;
  all.fill(0, 1, 1, 4, tok, tgt);
  CHECK(tok == std::vector<int>{10, 11, 12, 0});
  CHECK(tgt == std::vector<int>{11, 12, 0, 1});
  // A path without a pattern's characters is that file, with map_file's errors.
  CHECK(TokenStream::map_glob((dir / "train_000000.bin").string(), 2, 50).size() == 2);
  CHECK_THROWS_WITH_AS(TokenStream::map_glob((dir / "missing.bin").string(), 2, 50),
                       ("TokenStream: " + (dir / "missing.bin").string() + ": No such file or directory").c_str(),
                       std::runtime_error);
  CHECK_THROWS_WITH_AS(TokenStream::map_glob((dir / "valid_*.bin").string(), 2, 50),
                       ("TokenStream: no file matches " + (dir / "valid_*.bin").string()).c_str(), std::runtime_error);
  std::filesystem::remove_all(dir);
}

TEST_CASE("IndexShuffle: a permutation of [0, n) for every n, another for another key, none near the identity") {
  for (std::uint64_t n : {1, 2, 3, 4, 5, 7, 16, 17, 100, 1000, 4097, 65537}) {
    CAPTURE(n);
    CHECK(is_permutation(IndexShuffle(n, 1)));
    CHECK(is_permutation(IndexShuffle(n, 0xdeadbeef)));
  }
  const IndexShuffle a(1000, 1), b(1000, 2);
  int fixed = 0, same = 0;  // two random orders of 1000 share about one position; an order fixes about one
  for (std::uint64_t i = 0; i < 1000; ++i) fixed += a(i) == i, same += a(i) == b(i);
  CHECK(fixed < 10);
  CHECK(same < 10);
  // Small n, where the Feistel halves are two bits: over 2000 keys, the first position takes
  // each of 10 values about 200 times (binomial: standard deviation 13).
  std::vector<int> first(10);
  for (std::uint64_t key = 0; key < 2000; ++key) ++first[IndexShuffle(10, key)(0)];
  for (int v = 0; v < 10; ++v) {
    CAPTURE(v);
    CHECK(first[static_cast<std::size_t>(v)] > 140);
    CHECK(first[static_cast<std::size_t>(v)] < 260);
  }
  // A set too large to hold an order of: indices inside it, none twice.
  const std::uint64_t big = (std::uint64_t{1} << 40) + 3;
  const IndexShuffle huge(big, 7);
  std::set<std::uint64_t> drawn;
  for (std::uint64_t i = 0; i < 1000; ++i) {
    const std::uint64_t j = huge(big - 1 - i);
    CHECK(j < big);
    drawn.insert(j);
  }
  CHECK(drawn.size() == 1000);
  CHECK_THROWS_AS(IndexShuffle(0, 1), std::invalid_argument);
}

TEST_CASE("random windows: the same batch for the same step, windows inside the part") {
  const TokenStream text = positions(40);
  const BatchSampler sampler(text, 0, 20, 7);
  const std::vector<int> step3 = window_starts(sampler, 3, 1, 2, 2, 5);
  CHECK(step3 == window_starts(sampler, 3, 1, 2, 2, 5));  // a function of the step: no state between calls
  CHECK(step3 != window_starts(sampler, 4, 1, 2, 2, 5));
  BatchSampler reseeded = sampler;
  reseeded.seed = 8;
  CHECK(step3 != window_starts(reseeded, 3, 1, 2, 2, 5));
  reseeded.align = 5;
  for (const int start : window_starts(reseeded, 3, 4, 2, 2, 5)) CHECK(start % 5 == 0);
  std::vector<int> tok, tgt;
  CHECK_THROWS_AS(sampler.fill(1, 1, 1, 20, tok, tgt), std::invalid_argument);
}

TEST_CASE("epochs: each window of the part once an epoch, shuffled anew each epoch and for another seed; a batch "
          "may straddle two epochs") {
  const TokenStream text = positions(201);
  BatchSampler sampler(text, 7, 190, 3);
  sampler.order = SampleOrder::epochs;
  constexpr int T = 5, B = 3, M = 2;  // 6 rows a step
  REQUIRE(sampler.stride(T) == 5);
  REQUIRE(sampler.windows_per_epoch(T) == 36);  // starts 7, 12, ..., 182: the last window ends at 187
  std::vector<int> every;
  for (int w = 0; w < 36; ++w) every.push_back(7 + 5 * w);
  const auto sorted = [](std::vector<int> v) {
    std::sort(v.begin(), v.end());
    return v;
  };

  const std::vector<int> epoch0 = window_starts(sampler, 0, 6, M, B, T), epoch1 = window_starts(sampler, 6, 6, M, B, T);
  CHECK(sorted(epoch0) == every);
  CHECK(sorted(epoch1) == every);
  CHECK(epoch0 != epoch1);
  CHECK(epoch0 != every);  // shuffled, not in the file's order
  CHECK(window_starts(sampler, 2, 1, M, B, T) == std::vector<int>(epoch0.begin() + 12, epoch0.begin() + 18));

  // The rows of the steps are one sequence whatever the batch: 5 rows a step, the eighth
  // step's first row the first epoch's last window, its other four the second epoch's first.
  const std::vector<int> fives = window_starts(sampler, 0, 8, 1, 5, T);
  CHECK(std::vector<int>(fives.begin(), fives.begin() + 36) == epoch0);
  CHECK(std::vector<int>(fives.begin() + 36, fives.end()) == std::vector<int>(epoch1.begin(), epoch1.begin() + 4));

  BatchSampler other = sampler;
  other.seed = 4;
  const std::vector<int> reseeded = window_starts(other, 0, 6, M, B, T);
  CHECK(sorted(reseeded) == every);
  CHECK(reseeded != epoch0);

  // Too short a part for one window: an error, as for random windows.
  BatchSampler tiny(text, 0, 5, 1);
  tiny.order = SampleOrder::epochs;
  CHECK(tiny.windows_per_epoch(T) == 0);
  std::vector<int> tok, tgt;
  CHECK_THROWS_AS(tiny.fill(0, 1, 1, T, tok, tgt), std::invalid_argument);
}

TEST_CASE("epochs over samples of one length: windows start at a sample, T rounded up to whole samples apart") {
  const TokenStream text = positions(200);
  BatchSampler sampler(text, 20, 200, 5);
  sampler.order = SampleOrder::epochs;
  sampler.align = 10;
  for (const int T : {9, 10, 12}) {
    CAPTURE(T);
    const int stride = T <= 10 ? 10 : 20, windows = (180 - T - 1) / stride + 1;
    REQUIRE(static_cast<int>(sampler.stride(T)) == stride);
    REQUIRE(static_cast<int>(sampler.windows_per_epoch(T)) == windows);
    std::vector<int> starts = window_starts(sampler, 0, windows, 1, 1, T);
    std::sort(starts.begin(), starts.end());
    for (int w = 0; w < windows; ++w) CHECK(starts[static_cast<std::size_t>(w)] == 20 + stride * w);
  }
}
