// The safetensors reader and writer: exact round trips (F32, BF16, F64, I32, I64, U8,
// empty and scalar tensors), metadata with escapes, alignment, and the errors a damaged
// or hostile file must produce (truncated, bad JSON, overlapping or out-of-range offsets,
// holes, missing tensor, wrong dtype).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "fived/io/safetensors.hpp"

using namespace fived;
using namespace fived::io;

namespace {

// A file from a hand-written header and a data section (for the error cases).
std::vector<std::byte> make_file(const std::string& header, std::size_t data_bytes) {
  std::vector<std::byte> f(8 + header.size() + data_bytes, std::byte{0x5a});
  const std::uint64_t n = header.size();
  std::memcpy(f.data(), &n, 8);
  std::memcpy(f.data() + 8, header.data(), header.size());
  return f;
}

std::string error_of(const std::vector<std::byte>& bytes) {
  try {
    SafetensorsFile::parse(bytes, "test.safetensors");
  } catch (const SafetensorsError& e) {
    return e.what();
  }
  return "(no error)";
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("round trip of several dtypes, with metadata, bit-exact") {
  std::vector<float> a(2 * 3);
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = std::sin(1.0f + static_cast<float>(i)) * 1e3f;
  a[1] = -0.0f;
  a[2] = std::nanf("");
  a[3] = INFINITY;
  std::vector<bf16> b(5);
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = bf16(0.1f * static_cast<float>(i) - 0.3f);
  std::vector<double> c = {1e-300, -2.5, 3.141592653589793};
  std::vector<std::int32_t> d = {-1, 0, 2147483647};
  std::vector<std::int64_t> e = {-9223372036854775807LL, 42};
  std::vector<std::uint8_t> u = {1, 2, 3};  // 3 bytes: tests that alignment still holds after
  std::vector<float> empty;
  std::vector<float> scalar = {7.0f};

  SafetensorsWriter w;
  w.add("a.weight", {2, 3}, std::span<const float>(a));
  w.add("b", {5}, std::span<const bf16>(b));
  w.add("c", {3}, std::span<const double>(c));
  w.add("d", {3, 1}, std::span<const std::int32_t>(d));
  w.add("e", {2}, std::span<const std::int64_t>(e));
  w.add("u", {3}, std::span<const std::uint8_t>(u));
  w.add("empty", {0, 4}, std::span<const float>(empty));
  w.add("scalar", {}, std::span<const float>(scalar));
  w.add_metadata("format", "pt");
  w.add_metadata("note \"quoted\"", "line1\nline2\ttab \\ back \x01");

  const auto path = std::filesystem::temp_directory_path() / "fived_test_roundtrip.safetensors";
  w.write(path);
  CHECK_FALSE(std::filesystem::exists(path.string() + ".tmp"));
  const auto bytes = w.serialize();
  CHECK(std::filesystem::file_size(path) == bytes.size());

  std::uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  CHECK(n % 8 == 0);  // data section starts 8-byte aligned
  CHECK(static_cast<char>(bytes[8]) == '{');

  auto f = SafetensorsFile::read(path);
  CHECK(f.tensors().size() == 8);
  CHECK(f.metadata().at("format") == "pt");
  CHECK(f.metadata().at("note \"quoted\"") == "line1\nline2\ttab \\ back \x01");
  for (const auto& t : f.tensors()) CHECK(t.begin % dtype_size(t.dtype) == 0);  // each tensor aligned

  const auto& ea = f.at("a.weight");
  CHECK(ea.dtype == Dtype::F32);
  CHECK(ea.shape == std::vector<std::int64_t>{2, 3});
  auto ra = f.read<float>("a.weight");
  CHECK(std::memcmp(ra.data(), a.data(), a.size() * 4) == 0);  // bit-exact (NaN, -0)
  auto rb = f.read<bf16>("b");
  for (std::size_t i = 0; i < b.size(); ++i) CHECK(rb[i].bits == b[i].bits);
  CHECK(f.read<double>("c") == c);
  CHECK(f.read<std::int32_t>("d") == d);
  CHECK(f.at("d").shape == std::vector<std::int64_t>{3, 1});
  CHECK(f.read<std::int64_t>("e") == e);
  CHECK(f.read<std::uint8_t>("u") == u);
  CHECK(f.read<float>("empty").empty());
  CHECK(f.at("empty").shape == std::vector<std::int64_t>{0, 4});
  CHECK(f.read<float>("scalar") == scalar);
  CHECK(f.at("scalar").shape.empty());

  // Writing again gives the same bytes (deterministic order).
  CHECK(SafetensorsFile::read(path).tensors().size() == 8);
  CHECK(w.serialize() == bytes);
  std::filesystem::remove(path);
}

TEST_CASE("floating dtypes convert on read; other mismatches are errors") {
  std::vector<float> a = {1.5f, -2.0f, 0.1f};
  SafetensorsWriter w;
  w.add("a", {3}, std::span<const float>(a));
  std::vector<std::int32_t> i = {1};
  w.add("i", {1}, std::span<const std::int32_t>(i));
  auto f = SafetensorsFile::parse(w.serialize());
  auto d = f.read<double>("a");
  CHECK(d[0] == 1.5);
  CHECK(d[2] == static_cast<double>(0.1f));
  auto h = f.read<bf16>("a");
  CHECK(float(h[2]) == float(bf16(0.1f)));
  CHECK_THROWS_WITH_AS(f.read<float>("i"), doctest::Contains("'i' is I32, cannot read it as F32"), SafetensorsError);
  CHECK_THROWS_WITH_AS(f.read<std::int64_t>("a"), doctest::Contains("cannot read it as I64"), SafetensorsError);
}

TEST_CASE("F16 files are read by converting") {
  // 1.0, -2.0, 65504 (max), smallest subnormal, +inf
  const std::uint16_t h[] = {0x3c00, 0xc000, 0x7bff, 0x0001, 0x7c00};
  auto file = make_file(R"({"x":{"dtype":"F16","shape":[5],"data_offsets":[0,10]}})", 10);
  std::memcpy(file.data() + file.size() - 10, h, 10);
  auto v = SafetensorsFile::parse(file).read<float>("x");
  CHECK(v[0] == 1.0f);
  CHECK(v[1] == -2.0f);
  CHECK(v[2] == 65504.0f);
  CHECK(v[3] == std::ldexp(1.0f, -24));
  CHECK(std::isinf(v[4]));
}

TEST_CASE("a hand-written header with whitespace, escapes, unknown fields and metadata") {
  const std::string header =
      " {\n  \"__metadata__\" : { \"k\\u00e9y\" : \"v\\ud83d\\ude00\" },\n"
      "  \"t\\\"1\" : { \"shape\" : [ 2 ] , \"extra\": {\"x\": [1, -2.5e3, true, null]}, \"dtype\" : \"I32\","
      " \"data_offsets\" : [ 0 , 8 ] }\n}   ";
  // the header starts with a space: the spec says it must start with '{'
  CHECK(contains(error_of(make_file(header, 8)), "must start with a JSON object"));
  auto f = SafetensorsFile::parse(make_file(header.substr(1), 8));
  CHECK(f.metadata().at("k\xc3\xa9y") == "v\xf0\x9f\x98\x80");
  CHECK(f.at("t\"1").numel() == 2);
}

TEST_CASE("truncated files") {
  CHECK(contains(error_of({}), "truncated: the file has 0 bytes"));
  CHECK(contains(error_of(std::vector<std::byte>(5)), "truncated: the file has 5 bytes"));
  auto f = make_file(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 16);
  auto cut = f;
  cut.resize(20);  // inside the header
  CHECK(contains(error_of(cut), "truncated: the header length is"));
  cut = f;
  cut.resize(f.size() - 4);  // inside the data
  CHECK(contains(error_of(cut), "past the end of the data section (12 bytes; is the file truncated?)"));
  std::vector<std::byte> huge(16);
  const std::uint64_t n = 1ull << 40;
  std::memcpy(huge.data(), &n, 8);
  CHECK(contains(error_of(huge), "more than the 100000000 allowed"));
}

TEST_CASE("bad JSON names the byte and what was expected") {
  // byte 8 is the first header byte
  CHECK(contains(error_of(make_file("[]", 0)), "byte 8 of the file: expected '{'"));
  CHECK(contains(error_of(make_file(R"({"a" {}})", 0)), "byte 13 of the file: expected ':' after \"a\", found '{'"));
  CHECK(contains(error_of(make_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]})", 4)),
                 "expected ',' or '}' after a header entry, found the end of the header"));
  CHECK(contains(error_of(make_file(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4)),
                 "expected the shape element (a non-negative integer), found '-'"));
  CHECK(contains(error_of(make_file(R"({"a":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", 4)),
                 "to be an integer"));
  CHECK(contains(error_of(make_file(R"({"a":{"dtype":"Q8","shape":[1],"data_offsets":[0,1]}})", 1)),
                 "unknown dtype \"Q8\""));
  CHECK(contains(error_of(make_file(R"({"a":{"dtype":"F32","shape":[1]}})", 4)), "lacks \"data_offsets\""));
  CHECK(contains(error_of(make_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}} x)", 4)),
                 "expected only whitespace after the header object, found 'x'"));
  CHECK(contains(error_of(make_file("{\"a\x01\":{}}", 0)), "control character inside a string"));
  CHECK(contains(error_of(make_file(R"({"a\q":{}})", 0)), "unknown escape \\q"));
  CHECK(contains(error_of(make_file(R"({"__metadata__":{"k":1}})", 0)), "metadata values must be strings"));
  CHECK(contains(error_of(make_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8)),
                 "tensor \"a\" appears twice"));
  CHECK(contains(error_of(make_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", 4)),
                 "data_offsets of \"a\" must be [begin, end]"));
}

TEST_CASE("names are UTF-8 as the format requires: multi-byte characters kept, malformed bytes refused; "
          "\"__metadata__\": null is no metadata") {
  auto header = [](const std::string& name) {
    return "{\"" + name + R"(":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  };
  // 2, 3 and 4 bytes, the last code point (U+10FFFF) included
  for (const std::string name : {"w\xc3\xa9ight", "\xe2\x82\xac", "\xf0\x9f\x98\x80", "\xf4\x8f\xbf\xbf"})
    CHECK(SafetensorsFile::parse(make_file(header(name), 4)).at(name).numel() == 1);
  // a stray byte, a stray continuation, overlong '/', an overlong 3-byte form, a surrogate
  // (U+D800), above U+10FFFF, a truncated sequence
  for (const std::string name : {"a\xff", "\x80", "\xc0\xaf", "\xe0\x80\xaf", "\xed\xa0\x80", "\xf4\x90\x80\x80",
                                 "\xe2\x82"}) {
    CAPTURE(name);
    CHECK(contains(error_of(make_file(header(name), 4)), "invalid UTF-8 in a string"));
  }
  const auto f = SafetensorsFile::parse(
      make_file(R"({"__metadata__": null, "a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 4));
  CHECK(f.metadata().empty());
  CHECK(contains(error_of(make_file(R"({"__metadata__": nul})", 0)), "or null"));
}

TEST_CASE("offsets: size mismatch, overlap, out of range, holes") {
  CHECK(contains(error_of(make_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", 4)),
                 "tensor \"a\" is F32 [2] but its data_offsets [0, 4] span 4 bytes"));
  CHECK(contains(error_of(make_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12)),
                 "tensors 'a' (bytes [0, 8)) and 'b' (bytes [4, 12)) overlap"));
  CHECK(contains(error_of(make_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", 8)),
                 "data_offsets [8, 16] past the end of the data section (8 bytes"));
  CHECK(contains(error_of(make_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8)),
                 "bytes [0, 4) of the data section belong to no tensor"));
  CHECK(contains(error_of(make_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 8)),
                 "the data section has 8 bytes but the tensors cover 4"));
  CHECK(contains(error_of(make_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})", 8)),
                 "with begin > end"));
  CHECK(contains(error_of(make_file(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", 0)),
                 "span 0 bytes"));
}

TEST_CASE("missing tensor, and writer misuse") {
  std::vector<float> a = {1};
  SafetensorsWriter w;
  w.add("present", {1}, std::span<const float>(a));
  auto f = SafetensorsFile::parse(w.serialize(), "m.safetensors");
  CHECK(f.find("absent") == nullptr);
  CHECK_THROWS_WITH_AS(f.at("absent"),
                       "m.safetensors: no tensor named 'absent' (the file has 1 tensors: present)", SafetensorsError);
  CHECK_THROWS_WITH_AS(w.add("present", {1}, std::span<const float>(a)), doctest::Contains("added twice"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(w.add("x", {2}, std::span<const float>(a)),
                       "safetensors: tensor 'x' is F32 [2] (8 bytes) but 4 bytes were given", std::invalid_argument);
  CHECK_THROWS_AS(w.add("__metadata__", {1}, std::span<const float>(a)), std::invalid_argument);
  CHECK_THROWS_WITH_AS(SafetensorsFile::read(std::filesystem::temp_directory_path()),
                       doctest::Contains("not a regular file"), SafetensorsError);
  CHECK_THROWS_WITH_AS(SafetensorsFile::read("/nonexistent/dir/x.safetensors"), doctest::Contains("cannot open"),
                       SafetensorsError);
  CHECK_THROWS_WITH_AS(w.write("/nonexistent/dir/x.safetensors"), doctest::Contains("cannot open for writing"),
                       SafetensorsError);
}

TEST_CASE("a field or metadata key given twice is an error, not a silent merge") {
  CHECK(contains(error_of(make_file(R"({"a":{"dtype":"F32","shape":[1],"shape":[1],"data_offsets":[0,4]}})", 4)),
                 "tensor \"a\" has \"shape\" twice"));
  CHECK(contains(error_of(make_file(R"({"a":{"dtype":"F32","dtype":"F64","shape":[1],"data_offsets":[0,4]}})", 4)),
                 "tensor \"a\" has \"dtype\" twice"));
  CHECK(contains(error_of(make_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"data_offsets":[0,4]}})", 4)),
                 "tensor \"a\" has \"data_offsets\" twice"));
  CHECK(contains(error_of(make_file(R"({"__metadata__":{"k":"1","k":"2"}})", 0)), "metadata key \"k\" appears twice"));
}

TEST_CASE("writing: a failed rename says why; concurrent writers of one path never collide; nothing is left behind") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / "fived_test_safetensors_write";
  fs::remove_all(dir);
  fs::create_directories(dir / "a_folder");
  std::vector<float> a(1000, 1.0f);
  SafetensorsWriter w;
  w.add("x", {1000}, std::span<const float>(a));
  // Renaming a file over a non-empty folder fails: the message carries the rename's error.
  fs::create_directories(dir / "a_folder" / "inside");
  const std::string err = [&] {
    try {
      w.write(dir / "a_folder");
    } catch (const SafetensorsError& e) {
      return std::string(e.what());
    }
    return std::string();
  }();
  CHECK(contains(err, "cannot rename"));
  CHECK(!contains(err, "Success"));
  // Eight threads write the same path at once: each through its own temporary file, and the
  // file that stays is one of theirs, whole.
  std::vector<std::thread> writers;
  for (int i = 0; i < 8; ++i) writers.emplace_back([&] { w.write(dir / "same.safetensors"); });
  for (auto& t : writers) t.join();
  CHECK(SafetensorsFile::read(dir / "same.safetensors").at("x").shape == std::vector<std::int64_t>{1000});
  int files = 0;
  for (const auto& e : fs::directory_iterator(dir)) files += e.is_regular_file() ? 1 : 0;
  CHECK(files == 1);  // no temporary file left
  fs::remove_all(dir);
}
