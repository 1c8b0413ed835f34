#pragma once
// A decoder's way in for a [B, T] batch of token ids: checked on the host against the model
// (a kernel cannot report a bad id), then uploaded whole, or under context parallelism only
// this rank's two zig-zag chunks of each sequence (context/zigzag.hpp); with packed documents
// also where each token's document begins.

#include <cstddef>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "fived/context/documents.hpp"
#include "fived/device/buffer.hpp"

namespace fived {

// Facts: the model's DecoderFacts (nn/decoder_facts.hpp).
template <class Facts>
class DecoderBatch {
 public:
  // B, T and the ids for Facts::arch's forward, each refused with a sentence that says why.
  static void check(const int* tokens, const int* targets, int B, int T) {
    const std::string fn = std::string(Facts::arch::name) + "::forward: ";
    if (B < 1 || T < 1 || T > Facts::max_seq)
      throw std::invalid_argument(fn + "needs B >= 1 and 1 <= T <= max_seq = " + std::to_string(Facts::max_seq) +
                                  " (got B=" + std::to_string(B) + ", T=" + std::to_string(T) + ")");
    if (tokens == nullptr) throw std::invalid_argument(fn + "tokens is nullptr");
    const int Tl = Facts::local_length(T);
    constexpr int tp = Facts::tp;
    if (Facts::step_type::sp && (B * Tl) % tp != 0)
      throw std::invalid_argument(fn + "sequence parallelism splits this rank's B*T" +
                                  std::string(Facts::cp > 1 ? "/CP" : "") + " = " + std::to_string(B * Tl) +
                                  " tokens over TP = " + std::to_string(tp) +
                                  ", which does not divide them; use a batch or sequence length that makes them a "
                                  "multiple of TP, or NoSequenceParallel");
    const std::size_t n = static_cast<std::size_t>(B) * static_cast<std::size_t>(T);
    check_ids(fn, "tokens", tokens, n);
    if (targets != nullptr) check_ids(fn, "targets", targets, n);
  }

  // Where each token's document begins (packed documents: context/documents.hpp), from the
  // whole [B, T] ids, to dst as upload lays the ids out: a start can lie in another rank's chunk.
  template <class Ops, class Device>
  void upload_documents(Ops& ops, Buffer<int, Device>& dst, const int* ids, int B, int T, int cp_rank) {
    const std::size_t N = static_cast<std::size_t>(B) * static_cast<std::size_t>(T);
    starts_.resize(N);  // grows once
    document_starts(std::span<const int>(ids, N), B, T, Facts::dims::end_of_document, std::span<int>(starts_));
    upload(ops, dst, starts_.data(), B, T, cp_rank);
  }

  // A [B, T] batch of ids to dst: all of it, or under CP this rank's chunks (chunk-major).
  template <class Ops, class Device>
  void upload(Ops& ops, Buffer<int, Device>& dst, const int* ids, int B, int T, int cp_rank) {
    const std::size_t N = static_cast<std::size_t>(B) * static_cast<std::size_t>(T);
    if constexpr (Facts::cp == 1) {
      ops.upload_ids(dst, ids, N);
    } else {
      local_.resize(N / Facts::cp);  // grows once
      Facts::sequence_split::local_tokens(std::span<const int>(ids, N), B, T, cp_rank, std::span<int>(local_));
      ops.upload_ids(dst, local_.data(), local_.size());
    }
  }

 private:
  static void check_ids(const std::string& fn, const char* what, const int* ids, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i)
      if (ids[i] < 0 || ids[i] >= Facts::V)
        throw std::invalid_argument(fn + what + "[" + std::to_string(i) + "] = " + std::to_string(ids[i]) +
                                    " is outside [0, vocab = " + std::to_string(Facts::V) + ")");
  }

  std::vector<int> local_;   // CP: this rank's ids of a batch, on the host before upload
  std::vector<int> starts_;  // packed documents: every token's document start, before upload
};

}  // namespace fived
