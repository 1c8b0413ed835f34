#pragma once
// Data-parallel training steps on the host: every DP rank holds a whole model replica, takes
// its slice of each global batch, and the gradients are averaged over the DP group once per
// step (after all accumulation micro-batches, never once per micro-batch).
//
//   fived::host::run(4, [&](fived::host::Comm& comm) {
//     GPT<cfg> model(GptInit{.seed = 1});                                  // same init on every rank
//     fived::DataParallel<GPT<cfg>, 4, fived::ZeRO<1>> dp(model, comm, adamw_config, /*accum=*/3);
//     for (int step = 0; step < n; ++step) {
//       // tokens/targets: the GLOBAL batch of the step, accum micro-batches of [B, T], identical on every rank
//       double loss = dp.step(tokens, targets, B, T);                      // mean loss over the global batch
//     }
//   });
//
// Data: micro-batch k of the step is rows [k*B, (k+1)*B) of `tokens`; rank r reads rows
// [r*B/DP, (r+1)*B/DP) of each micro-batch (`rows(r, B)`), so the DP ranks together see exactly
// the tokens a serial run of the same global batch sees. B must be divisible by DP.
//
// Gradient: each rank accumulates the gradients of its micro-batches' mean losses, scales by
// 1/accum, and the DP average of that is the gradient of the mean loss over the global batch,
// the serial run's gradient (trained with the same accumulation) up to summation order.
//
// Policies (the optimizer's sharding over DP):
//   NoZeRO   bucketed all-reduce (avg) of the gradients over FlatBuckets<size, sizeof(T),
//            BucketBytes>; every rank clips and steps AdamW on the whole buffer.
//   ZeRO<1>  reduce-scatter (avg) of the gradients into this rank's shard of a buffer padded to
//            FlatShards<size, DP>::padded; the clip norm's sum of squares is summed over the
//            shard and all-reduced once; AdamW (moments for the shard only) updates the shard's
//            parameters; all-gather of the updated parameters into every replica.
// ZeRO<2> and ZeRO<3> are named but do not compile yet (static_assert).
//
// DP x TP: the model may itself be split over TP, bound to its TP communicator
// (nn::tp::Bound, nn/tp/gpt.hpp). Its layout is then one TP rank's buffer, which DP shards
// and reduces over the DP group of the same TP rank; the clip norm's sum of squares comes
// from the model (every parameter once over TP) and is summed over DP.
//
//   auto ctx = make_mesh_context<Mesh<DP<2>, TP<2>>>(world);
//   nn::tp::GPT<cfg, M, nn::tp::SequenceParallel> model(ctx.coord(), init);
//   nn::tp::Bound bound(model, ctx.comm<Axis::tp>());
//   DataParallel<decltype(bound), 2, ZeRO<1>> dp(bound, ctx.comm<Axis::dp>(), hp);
//
// Mixed precision: a bf16 model computes, and its gradients are reduced, in bf16 (the host
// backend sums bf16 in float and rounds once); AdamW keeps fp32 master weights and moments for
// the range it owns (all of it, or the ZeRO-1 shard) and writes bf16(master) back, so the
// replicas' bf16 weights come from the same fp32 masters.
//
// Overlap (NoZeRO): the model's backward reports each range of gradients it has finished
// (GPT::backward(grads_final): from the end of the buffer to the start), and each bucket is
// all-reduced as soon as it is finished, while the rest of backward runs; on NCCL the
// collective runs on the communication stream while the compute stream goes on. The host
// backend's collectives block, so there the reductions are interleaved with backward, not
// concurrent. ZeRO<1> reduce-scatters after backward (its shards span buckets), as does a
// model without the hook (nn::tp::Bound).

#include <algorithm>
#include <cstddef>
#include <functional>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "fived/comm/types.hpp"
#include "fived/device/bf16.hpp"
#include "fived/kernels/host/norm.hpp"
#include "fived/optim/adamw.hpp"
#include "fived/optim/flat_shards.hpp"

namespace fived {

// No optimizer sharding: gradients all-reduced, every rank holds all the optimizer state.
struct NoZeRO {
  static constexpr int stage = 0;
};
// ZeRO stage 1 (optimizer state sharded over DP); 2 and 3 are declared for later.
template <int Stage>
struct ZeRO {
  static_assert(Stage >= 1 && Stage <= 3, "fived::ZeRO<S>: the ZeRO stages are 1, 2 and 3");
  static constexpr int stage = Stage;
};

template <class Policy>
inline constexpr bool is_zero_policy = false;
template <>
inline constexpr bool is_zero_policy<NoZeRO> = true;
template <int S>
inline constexpr bool is_zero_policy<ZeRO<S>> = true;

template <class Model, int DP, class Policy = NoZeRO, std::size_t BucketBytes = (std::size_t{4} << 20)>
class DataParallel {
  static_assert(DP >= 1, "fived::DataParallel: the data-parallel size must be at least 1");
  static_assert(is_zero_policy<Policy>, "fived::DataParallel: the policy must be fived::NoZeRO or fived::ZeRO<S>");
  static_assert(Policy::stage <= 1,
                "fived::DataParallel: ZeRO<2> (gradient sharding) and ZeRO<3> (parameter sharding) come later in "
                "issue 5; this version supports NoZeRO and ZeRO<1>");
  static_assert(Model::on_host, "fived::DataParallel runs on the host backend for now (Model::on_host)");
  static_assert(std::is_same_v<typename Model::value_type, float> ||
                    std::is_same_v<typename Model::value_type, double> ||
                    std::is_same_v<typename Model::value_type, bf16>,
                "fived::DataParallel: the model's element type must be float, double or fived::bf16");

 public:
  using model_type = Model;
  using T = typename Model::value_type;
  using layout = typename Model::layout;
  using policy = Policy;
  using shards = FlatShards<layout::size, DP>;
  using buckets = FlatBuckets<layout::size, sizeof(T), BucketBytes>;
  using optimizer_type = AdamWFor<Model>;
  static constexpr int dp = DP;
  static constexpr bool zero1 = Policy::stage == 1;

  // comm: this rank's communicator of the DP group (size DP). accum: micro-batches per step.
  template <class Comm>
  DataParallel(Model& model, Comm& comm, const AdamWConfig& config, int accum = 1)
      : DataParallel(model, comm.rank(), comm.size(), config, accum) {
    reduce_ = [&comm](std::span<T> buf, std::span<T> shard, FlatRange bucket, Op op, double* scalar) {
      switch (op) {
        case Op::all_reduce_avg: comm.all_reduce(buf.subspan(bucket.begin, bucket.size()), ReduceOp::avg); break;
        case Op::reduce_scatter_avg: comm.reduce_scatter(std::span<const T>(buf), shard, ReduceOp::avg); break;
        case Op::all_gather: comm.all_gather(std::span<const T>(shard), buf); break;
        case Op::sum_scalar: comm.all_reduce(std::span<double>(scalar, 1), ReduceOp::sum); break;
        case Op::avg_scalar: comm.all_reduce(std::span<double>(scalar, 1), ReduceOp::avg); break;
      }
    };
  }

  // Rows of each micro-batch that DP rank r reads: [r*B/DP, (r+1)*B/DP).
  static FlatRange rows(int r, int B) {
    if (B < 1 || B % DP != 0)
      throw std::invalid_argument("fived::DataParallel: the global batch B = " + std::to_string(B) +
                                  " is not divisible by the data-parallel size " + std::to_string(DP) +
                                  " (every DP rank takes B / DP rows; use a multiple of " + std::to_string(DP) + ")");
    const std::size_t b = static_cast<std::size_t>(B / DP);
    return {static_cast<std::size_t>(r) * b, static_cast<std::size_t>(r + 1) * b};
  }

  // One optimizer step on the global batch: `accum` micro-batches of [B, T] token ids, rows
  // [k*B, (k+1)*B) for micro-batch k, the same on every rank. Returns the mean loss over the
  // global batch (the same value on every rank).
  double step(std::span<const int> tokens, std::span<const int> targets, int B, int T_) {
    const FlatRange mine = rows(rank_, B);
    const std::size_t want = static_cast<std::size_t>(accum_) * static_cast<std::size_t>(B) * static_cast<std::size_t>(T_);
    if (tokens.size() != want || targets.size() != want)
      throw std::invalid_argument("fived::DataParallel::step: tokens and targets must hold accum * B * T = " +
                                  std::to_string(want) + " ids (got " + std::to_string(tokens.size()) + " and " +
                                  std::to_string(targets.size()) + ")");
    const int b = static_cast<int>(mine.size());
    std::span<T> grads = model_.grads();
    // NoZeRO: each bucket is scaled by 1/accum and all-reduced, during the last micro-batch's
    // backward as soon as the model has finished it (overlap), or after backward.
    std::size_t pending = buckets::count;  // buckets [0, pending) are not reduced yet
    auto reduce_final = [&](std::size_t offset) {
      for (; pending > 0 && buckets::bucket(pending - 1).begin >= offset; --pending) {
        const FlatRange r = buckets::bucket(pending - 1);
        if (accum_ > 1) kernels::host::scale(grads.data() + r.begin, r.size(), 1.0f / static_cast<float>(accum_));
        reduce_(grads, {}, r, Op::all_reduce_avg, nullptr);
      }
    };
    model_.zero_grad();
    double loss = 0;
    for (int k = 0; k < accum_; ++k) {
      const std::size_t off = (static_cast<std::size_t>(k) * static_cast<std::size_t>(B) + mine.begin) *
                              static_cast<std::size_t>(T_);
      model_.forward(tokens.data() + off, targets.data() + off, b, T_);
      loss += model_.loss();
      if constexpr (can_overlap) {
        if (!zero1 && overlap_ && k == accum_ - 1) {
          model_.backward(std::function<void(std::size_t)>(reduce_final));
          continue;
        }
      }
      model_.backward();
    }
    loss /= accum_;
    if (zero1 && accum_ > 1) kernels::host::scale(grads.data(), grads.size(), 1.0f / static_cast<float>(accum_));
    reduce_({}, {}, {}, Op::avg_scalar, &loss);

    if constexpr (!zero1) {
      reduce_final(0);  // what backward did not reduce (all of it without overlap)
      const FlatRange all{0, layout::size};
      if (opt_.hp.max_norm > 0) opt_.clip(grads, all, sum_of_squares(grads, all));  // every replica: the same sum
      opt_.step(model_.params(), std::span<const T>(grads), all);
    } else {
      const FlatRange shard = shards::shard(rank_), owned = opt_.owned();
      std::span<T> flat(flat_);
      std::span<T> my_shard = flat.subspan(shard.begin, shard.size());
      std::copy(grads.begin(), grads.end(), flat.begin());
      std::fill(flat.begin() + static_cast<std::ptrdiff_t>(layout::size), flat.end(), T{});
      reduce_(flat, my_shard, {}, Op::reduce_scatter_avg, nullptr);
      if (opt_.hp.max_norm > 0) {
        double s = sum_of_squares(flat, owned);
        reduce_({}, {}, {}, Op::sum_scalar, &s);  // the global norm: every element counted once
        opt_.clip(flat, owned, s);
      }
      std::span<T> params = model_.params();
      opt_.step(params, std::span<const T>(flat), owned);
      // this rank's updated parameters into its shard (padding stays zero), then everyone's
      std::copy(params.begin() + static_cast<std::ptrdiff_t>(owned.begin),
                params.begin() + static_cast<std::ptrdiff_t>(owned.end),
                flat.begin() + static_cast<std::ptrdiff_t>(owned.begin));
      std::fill(flat.begin() + static_cast<std::ptrdiff_t>(owned.end),
                flat.begin() + static_cast<std::ptrdiff_t>(shard.end), T{});
      reduce_(flat, my_shard, {}, Op::all_gather, nullptr);
      std::copy(flat.begin(), flat.begin() + static_cast<std::ptrdiff_t>(layout::size), params.begin());
    }
    return loss;
  }

  // Bytes this rank holds for training state, N = layout::size elements:
  //   fp32  NoZeRO 4N + 4N + 8N;   ZeRO<1> 4N + 4N + 8N/DP (moments for the shard only)
  //   bf16  NoZeRO 2N + 2N + 12N;  ZeRO<1> 2N + 2N + 12N/DP (fp32 master, m, v for the shard)
  // plus, under ZeRO<1>, the padded staging buffer of the reduce-scatter / all-gather
  // (sizeof(T) x padded).
  struct Memory {
    std::size_t params = 0, grads = 0, optimizer = 0, staging = 0;
    std::size_t total() const { return params + grads + optimizer + staging; }
  };
  Memory memory() const {
    return {layout::size * sizeof(T), layout::size * sizeof(T), opt_.state_bytes(), flat_.size() * sizeof(T)};
  }

  // NoZeRO: reduce each gradient bucket during the last micro-batch's backward, as soon as
  // the model has finished it (on by default; needs a model whose backward reports finished
  // ranges, as GPT does). Off: every reduction runs after backward. The results are the
  // same bit for bit; what changes is when the collectives are issued.
  void set_overlap(bool on) { overlap_ = on; }
  bool overlap() const { return can_overlap && !zero1 && overlap_; }

  optimizer_type& optimizer() { return opt_; }
  const optimizer_type& optimizer() const { return opt_; }
  int rank() const { return rank_; }
  int accum() const { return accum_; }

 private:
  enum class Op { all_reduce_avg, reduce_scatter_avg, all_gather, sum_scalar, avg_scalar };
  static constexpr bool can_overlap = requires(Model& m, const std::function<void(std::size_t)>& f) { m.backward(f); };

  // Sum of squares of grads[r] over the model's own group, every parameter once: the
  // model says how when it is itself split (nn::tp::Bound over TP), else a plain sum.
  double sum_of_squares(std::span<const T> grads, FlatRange r) const {
    if constexpr (requires { model_.grad_sum_of_squares(grads, r); }) return model_.grad_sum_of_squares(grads, r);
    else return optimizer_type::sum_of_squares(grads, r);
  }

  DataParallel(Model& model, int rank, int size, const AdamWConfig& config, int accum)
      : model_(model),
        rank_(rank),
        accum_(accum),
        opt_(config, zero1 ? shards::owned(rank) : FlatRange{0, layout::size}) {
    if (size != DP)
      throw std::invalid_argument("fived::DataParallel<..., " + std::to_string(DP) +
                                  ">: the communicator has " + std::to_string(size) +
                                  " ranks; it must be the DP group's (" + std::to_string(DP) + " ranks)");
    if (accum < 1)
      throw std::invalid_argument("fived::DataParallel: accum (micro-batches per step) must be at least 1, got " +
                                  std::to_string(accum));
    if constexpr (zero1) flat_.assign(shards::padded, T{});
  }

  Model& model_;
  int rank_;
  int accum_;
  bool overlap_ = true;
  optimizer_type opt_;
  std::vector<T> flat_;  // ZeRO-1: the padded buffer for reduce-scatter / all-gather
  // The collectives, bound to the communicator's type at construction.
  std::function<void(std::span<T>, std::span<T>, FlatRange, Op, double*)> reduce_;
};

}  // namespace fived
