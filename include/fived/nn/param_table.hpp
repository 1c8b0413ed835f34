#pragma once
// The static parameter table: every tensor of a model, as a constexpr list of specs, and
// the flat buffer of one tensor-parallel rank laid out from it.
//
// Each layer contributes the specs of its own tensors (nn/embedding.hpp, nn/layernorm.hpp,
// nn/attention.hpp, nn/mlp.hpp, nn/head.hpp); a model concatenates them in execution order
// (nn/gpt.hpp). A spec says
//
//   name       the Hugging Face name ("attn.c_attn.weight"; a block's is prefixed with its
//              scope and layer: "h.{layer}." for GPT-2, "model.layers.{layer}." for Llama)
//   shape      the whole tensor in the buffer ([rows] or [rows, cols]); file_rows drops the
//              padded vocabulary rows in a file
//   tp         its placement on the TP axis: Replicate, or Shard on rows/columns, the
//              dimension cut as `groups` equal blocks each split over TP (3 for the fused
//              [q|k|v] projection, so a rank holds the q, k and v of the same heads)
//   reduce     the group its gradient is reduced over: the mesh's grad_group (DP x CP) for
//              every dense tensor, the expert-data group for experts
//   experts    > 0: the tensor stacks that many experts' matrices along its rows (each expert
//              rows / experts of them), split over EP by whole experts; a TP split of rows
//              then cuts each expert's rows (nn/moe.hpp); expert_files: one tensor per
//              expert in a file, under other names (Mixtral's)
//   sp_partial its gradient is a sum over the rows this rank holds, so under sequence
//              parallelism it is Partial over TP until the model reduces it (LayerNorms)
//   unit       what a trainer gathers, reduces and frees together (model/unit_hooks.hpp)
//   decays     AdamW's weight decay applies (2-D tensors, the GPT-2 rule)
//   init, stream   how it starts (nn/init.hpp); the stream is fixed forever, so adding a
//              layer or untying the head does not change any other tensor's first values
//
// ParamTable<Specs, TP, EP> lays out one rank's pieces back to back in spec order, so a unit
// is a contiguous range and every offset is a compile-time constant; TP = EP = 1 is the
// serial buffer. A model keeps dense and expert tensors in two tables (two flat buffers),
// because they reduce over different groups; Specs may then set `units` to the model's
// count, so units with no tensor of the table are empty ranges. From the table derive the offsets, units, names, initialisation by element
// (global_index), the serial <-> piece maps (slice, assemble) and which gradients a rank
// counts in the global norm (counted_once).

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "fived/optim/flat_range.hpp"

namespace fived {

enum class Init : std::uint8_t { zeros, ones, normal, normal_residual };  // residual: std / sqrt(2 layers)
enum class ReduceGroup : std::uint8_t { grad_group, expert_data };

// The placement of a parameter on the TP axis: Replicate (dim < 0) or Shard of dimension
// `dim`, seen as `groups` equal blocks side by side, each split over TP. With max_pieces > 0
// the dimension cuts into at most that many pieces (whole heads: grouped-query attention's
// key/value heads); a TP above it keeps each piece on TP / max_pieces consecutive ranks, its
// replicas, whose gradients the model sums over them.
struct TpSplit {
  int dim = -1;
  int groups = 1;
  int max_pieces = 0;
  constexpr bool replicated() const { return dim < 0; }
  constexpr int pieces(int TP) const { return max_pieces > 0 && TP > max_pieces ? max_pieces : TP; }
  constexpr int replicas(int TP) const { return TP / pieces(TP); }
};

// How a file holds a tensor of stacked experts: by default as it is; or one tensor per
// expert and part, named by these patterns ("{}" is the expert's index, after the block's
// scope), each expert's rows cut equally among the parts (Mixtral's w1 and w3 are the gate and
// up halves of an expert's gate_up_proj rows).
struct ExpertFiles {
  const char* part[2] = {nullptr, nullptr};
  constexpr int parts() const { return part[0] == nullptr ? 0 : part[1] == nullptr ? 1 : 2; }
};

struct TensorSpec {
  const char* name = "";
  int layer = -1;  // -1: not in a block
  int rank = 1;
  std::int64_t rows = 0, cols = 1, file_rows = 0;
  TpSplit tp{};
  ReduceGroup reduce = ReduceGroup::grad_group;
  bool sp_partial = false;
  int unit = 0;
  bool decays = false;
  Init init = Init::zeros;
  std::uint64_t stream = 0;
  int experts = 0;  // > 0: rows stack this many experts, split over EP
  // Held by two pipeline stages (the word embedding a tied head multiplies by: on the
  // embedding's stage, and as the head's copy on the last): its buckets are its own
  // (train/bucket_plan.hpp), so the two stages add its gradients piece by piece.
  bool tied = false;
  // A second copy of a tensor another pipeline stage owns (a tied output head's word
  // embedding on the last stage; tied too): the same name, values and updates; counted once
  // in the norm and in gathers (by its owner), its gradient summed with the owner's each step.
  bool tied_copy = false;
  const char* scope = "h.";  // what names a block's tensors start with, before the layer
  ExpertFiles expert_files{};  // experts > 0: their names and shapes in a file

  // "h.3.mlp.c_fc.weight", "wte.weight", "model.layers.0.mlp.up_proj.weight", ...
  std::string full_name() const { return (layer >= 0 ? scope + std::to_string(layer) + "." : std::string()) + name; }
  constexpr std::size_t size() const { return static_cast<std::size_t>(rows * cols); }
};

// A 1-D or 2-D spec: rows x cols (cols = 1 and rank 1 for vectors), in the file unpadded.
constexpr TensorSpec vector_spec(const char* name, int layer, std::int64_t n, TpSplit tp, int unit, Init init,
                                 std::uint64_t stream, bool sp_partial = false) {
  return {name, layer, 1, n, 1, n, tp, ReduceGroup::grad_group, sp_partial, unit, false, init, stream};
}
constexpr TensorSpec matrix_spec(const char* name, int layer, std::int64_t rows, std::int64_t cols, TpSplit tp, int unit,
                                 Init init, std::uint64_t stream, std::int64_t file_rows = -1) {
  return {name, layer, 2, rows, cols, file_rows < 0 ? rows : file_rows, tp, ReduceGroup::grad_group, false, unit,
          true, init, stream};
}

// Up to N specs built in a constexpr function: a layer's list when its length depends on
// the layer (a block with an MLP, or with a mixture of experts' router in its place).
template <std::size_t N>
struct SpecList {
  std::array<TensorSpec, N> specs{};
  std::size_t size = 0;

  template <std::size_t K>
  constexpr SpecList& operator+=(const std::array<TensorSpec, K>& more) {
    for (const TensorSpec& s : more) specs[size++] = s;
    return *this;
  }
  // Every spec's block names under `scope` ("model.layers.").
  constexpr SpecList& in_scope(const char* scope) {
    for (std::size_t i = 0; i < size; ++i) specs[i].scope = scope;
    return *this;
  }
  constexpr const TensorSpec* begin() const { return specs.data(); }
  constexpr const TensorSpec* end() const { return specs.data() + size; }
};

// Hands a layer's tensors out in the order its specs list them: a block builds its typed
// handles by taking them in turn, so no offset is written by hand.
template <class T>
class TensorCursor {
 public:
  TensorCursor() = default;
  explicit TensorCursor(T* const* next) : next_(next) {}
  T* take() { return *next_++; }

 private:
  T* const* next_ = nullptr;
};

// One tensor of a rank's flat buffer: its spec and its piece.
struct ParamInfo {
  TensorSpec spec;
  std::size_t offset = 0;            // first element of the piece in the flat buffer
  std::int64_t rows = 0, cols = 1;   // the piece's shape (the spec's without TP)

  constexpr std::size_t size() const { return static_cast<std::size_t>(rows * cols); }
  constexpr std::size_t end() const { return offset + size(); }
  constexpr int rank() const { return spec.rank; }
  constexpr bool decays() const { return spec.decays; }
  std::string name() const { return spec.full_name(); }
  // The shape in a Hugging Face file (whole tensor, no padded vocabulary rows).
  std::vector<std::int64_t> file_shape() const {
    return spec.rank == 2 ? std::vector<std::int64_t>{spec.file_rows, spec.cols} : std::vector<std::int64_t>{spec.file_rows};
  }
  std::size_t file_size() const { return static_cast<std::size_t>(spec.file_rows * spec.cols); }
};

// A rank's piece of a tensor, for any TP and EP extents (compile-time in ParamTable, read from a
// file by a checkpoint loader that reshards): its extent along dimension `dim`, and the index
// in the whole tensor of its element `local` (row-major in the piece) on TP rank r, EP rank e.
constexpr std::int64_t piece_extent(const TensorSpec& s, int dim, int TP, int EP) {
  const std::int64_t n = dim == 0 ? s.rows : s.cols;
  const std::int64_t e = dim == 0 && s.experts > 0 ? n / EP : n;
  return s.tp.dim == dim ? e / s.tp.pieces(TP) : e;
}
constexpr std::int64_t whole_index(const TensorSpec& s, int TP, int EP, int r, int e, std::int64_t local) {
  const std::int64_t piece_cols = piece_extent(s, 1, TP, EP);
  std::int64_t row = local / piece_cols, col = local % piece_cols;
  // along a split dimension of n elements cut as `groups` blocks: local index j of rank r
  auto split = [&](std::int64_t n, std::int64_t j) {
    const std::int64_t piece = n / s.tp.groups / s.tp.pieces(TP);
    return (j / piece) * (n / s.tp.groups) + static_cast<std::int64_t>(r / s.tp.replicas(TP)) * piece + j % piece;
  };
  if (s.experts > 0) {  // whole experts over EP, then each expert's rows over TP (as `groups` blocks)
    const std::int64_t rows_of = s.rows / s.experts, mine = s.tp.dim == 0 ? rows_of / TP : rows_of;
    const std::int64_t expert = e * (s.experts / EP) + row / mine, within = row % mine;
    const std::int64_t block = mine / s.tp.groups;  // a group's rows on this rank
    row = expert * rows_of + (s.tp.dim == 0 ? (within / block) * (rows_of / s.tp.groups) + r * block + within % block
                                            : within);
  } else if (s.tp.dim == 0) {
    row = split(s.rows, row);
  }
  if (s.tp.dim == 1) col = split(s.cols, col);
  return row * s.cols + col;
}

// The inverse of whole_index: which piece holds element `whole` of the whole tensor (its TP
// piece, r / replicas of the ranks that hold it; its EP rank), and the element's index there.
// Replicated dimensions give piece 0, tensors that are not experts EP rank 0: every rank's copy
// holds them.
struct PieceIndex {
  int piece = 0, ep_rank = 0;
  std::int64_t local = 0;
};
constexpr PieceIndex piece_index(const TensorSpec& s, int TP, int EP, std::int64_t whole) {
  std::int64_t row = whole / s.cols, col = whole % s.cols;
  PieceIndex at;
  // along a split dimension of n elements cut as `groups` blocks: the whole index w's piece and local index
  auto unsplit = [&](std::int64_t n, std::int64_t w) {
    const std::int64_t group = n / s.tp.groups, piece = group / s.tp.pieces(TP);
    at.piece = static_cast<int>(w % group / piece);
    return (w / group) * piece + w % group % piece;
  };
  if (s.experts > 0) {
    const std::int64_t rows_of = s.rows / s.experts, mine = s.tp.dim == 0 ? rows_of / TP : rows_of,
                       per_rank = s.experts / EP, expert = row / rows_of, in_expert = row % rows_of;
    std::int64_t within = in_expert;
    if (s.tp.dim == 0) {
      const std::int64_t block = mine / s.tp.groups, group = rows_of / s.tp.groups;
      at.piece = static_cast<int>(in_expert % group / block);
      within = (in_expert / group) * block + in_expert % group % block;
    }
    at.ep_rank = static_cast<int>(expert / per_rank);
    row = (expert % per_rank) * mine + within;
  } else if (s.tp.dim == 0) {
    row = unsplit(s.rows, row);
  }
  if (s.tp.dim == 1) col = unsplit(s.cols, col);
  at.local = row * piece_extent(s, 1, TP, EP) + col;
  return at;
}

// The expert layout of a model without a mixture of experts: no tensors (a serial table).
struct NoExperts {
  static constexpr int count = 0, tp = 1, ep = 1;
  static constexpr std::size_t size = 0;
  static constexpr std::array<ParamInfo, 0> tensors{};
  static std::optional<int> find(std::string_view) { return std::nullopt; }
};

// Specs: a type with `static constexpr std::array<TensorSpec, n> specs` and `static
// constexpr int layers` (for the residual init's std); optionally `static constexpr int
// units` (default: the last spec's unit + 1).
template <class Specs, int TP = 1, int EP = 1>
struct ParamTable {
  static constexpr auto& specs = Specs::specs;
  static constexpr int count = static_cast<int>(specs.size());
  static constexpr int tp = TP, ep = EP;
  static constexpr int layers = Specs::layers;
  static_assert(TP >= 1 && EP >= 1, "ParamTable: the TP and EP extents must be at least 1");

 private:
  static constexpr bool given_units = requires { Specs::units; };
  static constexpr std::int64_t piece(const TensorSpec& s, int dim) { return piece_extent(s, dim, TP, EP); }
  static constexpr bool splits_evenly() {
    for (const TensorSpec& s : specs) {
      if (s.experts > 0) {
        if (s.rows % s.experts != 0 || s.experts % EP != 0) return false;
        if (s.tp.dim == 0 && (s.rows / s.experts) % (static_cast<std::int64_t>(s.tp.groups) * TP) != 0) return false;
        if (s.tp.dim == 1 && s.cols % TP != 0) return false;
        continue;
      }
      const std::int64_t n = s.tp.dim == 0 ? s.rows : s.tp.dim == 1 ? s.cols : 0;
      if (s.tp.dim >= 0 && (s.tp.groups < 1 || n % (static_cast<std::int64_t>(s.tp.groups) * s.tp.pieces(TP)) != 0))
        return false;
      if (s.tp.dim >= 0 && TP % s.tp.pieces(TP) != 0) return false;  // replicas: TP a multiple of the pieces
    }
    return true;
  }
  static constexpr bool units_contiguous() {
    bool ok = count == 0 || given_units || specs[0].unit == 0;
    for (int i = 1; i < count; ++i) {  // (written without an early return: nvcc calls a loop after one unreachable)
      const int a = specs[static_cast<std::size_t>(i - 1)].unit, b = specs[static_cast<std::size_t>(i)].unit;
      ok = ok && (given_units ? b >= a : b == a || b == a + 1);
    }
    return ok;
  }
  static_assert(splits_evenly(),
                "ParamTable: a tensor split over TP (or its experts over EP) does not divide into equal pieces (per "
                "fused block); the model's own checks name which dimension to change");
  static_assert(units_contiguous(), "ParamTable: units must number 0, 1, 2, ... in spec order, each contiguous");

  static constexpr std::array<ParamInfo, count> build() {
    std::array<ParamInfo, count> t{};
    std::size_t off = 0;
    for (int i = 0; i < count; ++i) {
      const TensorSpec& s = specs[static_cast<std::size_t>(i)];
      t[static_cast<std::size_t>(i)] = ParamInfo{s, off, piece(s, 0), piece(s, 1)};
      off += t[static_cast<std::size_t>(i)].size();
    }
    return t;
  }

 public:
  static constexpr std::array<ParamInfo, count> tensors = build();
  static constexpr std::size_t size = count == 0 ? 0 : tensors[count == 0 ? 0 : count - 1].end();  // a rank's buffer
  // Real parameters of the whole model, as Hugging Face counts them (no padded rows).
  static constexpr std::size_t num_parameters = [] {
    std::size_t n = 0;
    for (const TensorSpec& s : specs) n += static_cast<std::size_t>(s.file_rows * s.cols);
    return n;
  }();

  // The tensor held by another pipeline stage too (a spec marked `tied`), empty when none.
  static constexpr FlatRange tied_range = [] {
    FlatRange r{};
    for (const ParamInfo& t : tensors)
      if (t.spec.tied) r = {t.offset, t.end()};
    return r;
  }();
  static_assert(std::count_if(specs.begin(), specs.end(), [](const TensorSpec& s) { return s.tied; }) <= 1,
                "ParamTable: at most one tensor is tied across pipeline stages");
  static_assert(std::all_of(specs.begin(), specs.end(), [](const TensorSpec& s) { return s.tied || !s.tied_copy; }),
                "ParamTable: a tied_copy spec is tied too (set both)");

  static constexpr int units = [] {
    if constexpr (given_units) return Specs::units;
    else return specs[count - 1].unit + 1;
  }();
  // Unit u is [unit_begin(u), unit_begin(u + 1)) of the flat buffer.
  static constexpr std::size_t unit_begin(int u) {
    for (const ParamInfo& t : tensors)
      if (t.spec.unit >= u) return t.offset;
    return size;
  }

  // Position of a tensor by Hugging Face name ("h.3.attn.c_proj.bias"), if there is one.
  static std::optional<int> find(std::string_view name) {
    for (int i = 0; i < count; ++i)
      if (tensors[static_cast<std::size_t>(i)].name() == name) return i;
    return std::nullopt;
  }

  // Element `local` (row-major in the piece) of tensor i on TP rank r (and EP rank e), as an
  // element index of the whole tensor: what initialises a piece by element and maps it to
  // the serial one.
  static constexpr std::int64_t global_index(int i, int r, std::int64_t local, int e = 0) {
    return whole_index(tensors[static_cast<std::size_t>(i)].spec, TP, EP, r, e, local);
  }

  // Whether TP rank r counts tensor i's gradient in the global norm: a split tensor's
  // pieces on every rank (the first of a piece's replicas), a replicated one (identical on
  // all) on rank 0 only.
  static constexpr bool counted_once(int i, int r) {
    const TensorSpec& s = tensors[static_cast<std::size_t>(i)].spec;
    if (s.tied_copy) return false;
    return s.tp.replicated() ? r == 0 : r % s.tp.replicas(TP) == 0;
  }
  // The parts of range `in` (flat offsets) whose gradients TP rank r counts.
  static std::vector<FlatRange> norm_parts(FlatRange in, int r) {
    std::vector<FlatRange> parts;
    for (int i = 0; i < count; ++i) {
      const ParamInfo& t = tensors[static_cast<std::size_t>(i)];
      const std::size_t b = std::max(t.offset, in.begin), e = std::min(t.end(), in.end);
      if (b >= e || !counted_once(i, r)) continue;
      if (!parts.empty() && parts.back().end == b) parts.back().end = e;
      else parts.push_back({b, e});
    }
    return parts;
  }

  // Rank (r, e)'s buffer (TP rank r, EP rank e) from the serial buffer (ParamTable<Specs>'s),
  // and back: all_pieces holds every rank's buffer, EP-major (piece e * TP + r);
  // replicated tensors are taken from TP rank 0.
  template <class T>
  static void slice(std::span<const T> serial, std::span<T> local, int r, int e = 0) {
    check_sizes(serial.size(), local.size(), 1, "slice");
    for_each_element(r, e, [&](std::size_t l, std::size_t g) { local[l] = serial[g]; });
  }
  template <class T>
  static void assemble(std::span<const T> all_pieces, std::span<T> serial) {
    check_sizes(serial.size(), all_pieces.size(), TP * EP, "assemble");
    for (int e = EP; e-- > 0;)
      for (int r = TP; r-- > 0;) {
        const std::span<const T> local = all_pieces.subspan(static_cast<std::size_t>(e * TP + r) * size, size);
        for_each_element(r, e, [&](std::size_t l, std::size_t g) { serial[g] = local[l]; });
      }
  }

  using serial = ParamTable<Specs, 1, 1>;

 private:
  // f(local offset, serial offset) for every element of rank (r, e)'s buffer.
  template <class F>
  static void for_each_element(int r, int e, F&& f) {
    for (int i = 0; i < count; ++i) {
      const ParamInfo& t = tensors[static_cast<std::size_t>(i)];
      const std::size_t g0 = serial::tensors[static_cast<std::size_t>(i)].offset;
      for (std::size_t j = 0; j < t.size(); ++j)
        f(t.offset + j, g0 + static_cast<std::size_t>(global_index(i, r, static_cast<std::int64_t>(j), e)));
    }
  }
  static void check_sizes(std::size_t serial_n, std::size_t local_n, int ranks, const char* fn) {
    if (serial_n != serial::size || local_n != size * static_cast<std::size_t>(ranks))
      throw std::invalid_argument(std::string("ParamTable::") + fn + ": buffers of " + std::to_string(serial_n) +
                                  " (serial) and " + std::to_string(local_n) + " (pieces) elements, expected " +
                                  std::to_string(serial::size) + " and " +
                                  std::to_string(size * static_cast<std::size_t>(ranks)));
  }
};

}  // namespace fived
