#pragma once
// SafetensorsWriter: a safetensors file (io/safetensors.hpp has the format) from
// (name, dtype, shape, bytes) views, written atomically (io/atomic_file.hpp). The
// header is padded with spaces to a multiple of 8 bytes, so the data section starts
// 8-byte aligned, and tensors are ordered by decreasing element size (then name), so
// every tensor is aligned to its element size: what the reference implementation does.

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "fived/io/atomic_file.hpp"
#include "fived/io/dtype.hpp"
#include "fived/io/error.hpp"
#include "fived/io/json.hpp"

namespace fived::io {

static_assert(std::endian::native == std::endian::little,
              "fived::io::SafetensorsWriter supports little-endian hosts only (the format is little-endian)");

// Collects tensors (views: the data must stay alive until write) and writes a file.
class SafetensorsWriter {
 public:
  void add(std::string name, Dtype dtype, std::vector<std::int64_t> shape, std::span<const std::byte> data) {
    if (name == "__metadata__") throw std::invalid_argument("safetensors: \"__metadata__\" is not a tensor name");
    for (const auto& t : tensors_)
      if (t.name == name) throw std::invalid_argument("safetensors: tensor '" + name + "' added twice");
    std::size_t n = dtype_size(dtype);
    for (auto d : shape) {
      if (d < 0) throw std::invalid_argument("safetensors: tensor '" + name + "' has a negative dimension");
      n *= static_cast<std::size_t>(d);
    }
    if (n != data.size())
      throw std::invalid_argument("safetensors: tensor '" + name + "' is " + std::string(dtype_name(dtype)) + " " +
                                  shape_string(shape) + " (" + std::to_string(n) + " bytes) but " +
                                  std::to_string(data.size()) + " bytes were given");
    tensors_.push_back(Item{std::move(name), dtype, std::move(shape), data});
  }
  template <class T>
  void add(std::string name, std::vector<std::int64_t> shape, std::span<const T> data) {
    add(std::move(name), dtype_of<T>, std::move(shape), std::as_bytes(data));
  }
  template <class T>
  void add(std::string name, std::vector<std::int64_t> shape, std::span<T> data) {
    add(std::move(name), std::move(shape), std::span<const T>(data));
  }
  void add_metadata(std::string key, std::string value) { metadata_[std::move(key)] = std::move(value); }

  // The whole file in memory (what write() puts on disk).
  std::vector<std::byte> serialize() const {
    std::vector<std::byte> out;
    emit([&](const void* p, std::size_t n) {
      auto b = static_cast<const std::byte*>(p);
      out.insert(out.end(), b, b + n);
    });
    return out;
  }

  // Writes the file atomically (detail::write_atomically).
  void write(const std::filesystem::path& path) const {
    std::vector<std::byte> bytes;
    emit([&](const void* p, std::size_t n) {
      auto b = static_cast<const std::byte*>(p);
      bytes.insert(bytes.end(), b, b + n);
    });
    detail::write_atomically(path, bytes.data(), bytes.size());
  }

 private:
  struct Item {
    std::string name;
    Dtype dtype;
    std::vector<std::int64_t> shape;
    std::span<const std::byte> data;
  };

  template <class Sink>
  void emit(Sink&& sink) const {
    std::vector<const Item*> order;
    for (const auto& t : tensors_) order.push_back(&t);
    std::stable_sort(order.begin(), order.end(), [](const Item* a, const Item* b) {
      if (dtype_size(a->dtype) != dtype_size(b->dtype)) return dtype_size(a->dtype) > dtype_size(b->dtype);
      return a->name < b->name;
    });
    std::string h = "{";
    bool first = true;
    if (!metadata_.empty()) {
      h += "\"__metadata__\":{";
      for (const auto& [k, v] : metadata_) {
        if (!first) h += ',';
        first = false;
        json_string(h, k);
        h += ':';
        json_string(h, v);
      }
      h += '}';
      first = false;
    }
    std::size_t off = 0;
    for (const Item* t : order) {
      if (!first) h += ',';
      first = false;
      json_string(h, t->name);
      h += ":{\"dtype\":\"";
      h += dtype_name(t->dtype);
      h += "\",\"shape\":[";
      for (std::size_t i = 0; i < t->shape.size(); ++i) {
        if (i) h += ',';
        h += std::to_string(t->shape[i]);
      }
      h += "],\"data_offsets\":[";
      h += std::to_string(off);
      h += ',';
      h += std::to_string(off + t->data.size());
      h += "]}";
      off += t->data.size();
    }
    h += '}';
    while (h.size() % 8 != 0) h += ' ';  // the data section starts 8-byte aligned
    const std::uint64_t n = h.size();
    sink(&n, 8);
    sink(h.data(), h.size());
    for (const Item* t : order) sink(t->data.data(), t->data.size());
  }

  std::vector<Item> tensors_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace fived::io
