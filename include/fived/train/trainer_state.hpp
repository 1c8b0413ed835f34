#pragma once
// What a trainer of one pair of flat buffers (train/bucket_trainer.hpp: a DataParallel, or
// its experts') saves and restores: the ranges it writes, the values of each kind of state
// over them in the precision they are kept in, the ranges a restore needs, and the restore.
// Checkpoints (train/chunk_state.hpp) call these for every trainer of a chunk.
//
//   for (FlatRange r : save_ranges(dp)) save_state(dp, TrainState::exp_avg, r, f);
//   for (auto [kind, r] : state_wanted(dp)) ...read them...;  load_state(dp, fetch, adam_step);

#include <cstddef>
#include <span>
#include <utility>
#include <vector>

#include "fived/optim/flat_range.hpp"
#include "fived/train/zero_policy.hpp"

namespace fived::checkpoint {

// What this rank saves: its piece of every bucket (plan::owned), whatever the policy, so the
// group's ranks together save every element of the buffer once.
template <class D>
std::vector<FlatRange> save_ranges(const D& dp) {
  using plan = typename D::plan;
  std::vector<FlatRange> v;
  for (std::size_t i = 0; i < plan::count; ++i)
    if (const FlatRange r = plan::owned(i, dp.rank()); !r.empty()) v.push_back(r);
  return v;
}

// The values of a kind of state over `r` (one of save_ranges()), in host memory and in the
// precision they are kept in: the parameters (T), or AdamW's masters (bf16 models), first
// or second moments (optimizer_type::state_type). f(std::span<const U>) is given them.
template <class D, class F>
void save_state(D& dp, TrainState kind, FlatRange r, F&& f) {
  using T = typename D::T;
  auto& ops = dp.model().ops();
  if (kind == TrainState::params) {
    std::span<const T> from;
    if constexpr (D::stage == 3) {  // the piece holds the owned elements first
      const std::size_t i = D::bucket_of(r);
      from = dp.param_piece(i).subspan(r.begin - dp.owned(i).begin, r.size());
    } else {
      from = dp.model().params().subspan(r.begin, r.size());
    }
    const std::vector<T> h = ops.to_host(from);
    f(std::span<const T>(h));
    return;
  }
  using S = typename D::optimizer_type::state_type;
  const auto& opt = dp.optimizer();
  const std::span<const S> s = kind == TrainState::master    ? opt.master()
                               : kind == TrainState::exp_avg ? opt.exp_avg()
                                                             : opt.exp_avg_sq();
  const std::vector<S> h = ops.to_host(s.subspan(opt.state_offset(r), r.size()));
  f(std::span<const S>(h));
}

// What load_state asks of its fetch, in its order: the parameters this rank holds (under
// ZeRO-3 its owned piece of each bucket, else the whole buffer), then the AdamW state of
// each range its optimizer owns. A loader reads just these (train/checkpoint.hpp).
template <class D>
std::vector<std::pair<TrainState, FlatRange>> state_wanted(const D& dp) {
  std::vector<std::pair<TrainState, FlatRange>> w;
  if constexpr (D::stage == 3)
    for (std::size_t i = 0; i < D::plan::count; ++i) w.push_back({TrainState::params, dp.owned(i)});
  else
    w.push_back({TrainState::params, FlatRange{0, D::layout::size}});
  for (const FlatRange& r : dp.optimizer().owned()) {
    w.push_back({TrainState::exp_avg, r}), w.push_back({TrainState::exp_avg_sq, r});
    if constexpr (D::optimizer_type::has_master) w.push_back({TrainState::master, r});
  }
  return w;
}

// Restores the step's state: fetch(kind, range) gives the values of each range of the flat
// buffer that state_wanted() names (from a checkpoint of any mesh); `step` is AdamW's step
// count. (A mixture of experts' expert buffers are their own trainer's: dp.experts().)
template <class D, class Fetch>
void load_state(D& dp, Fetch&& fetch, int step) {
  using T = typename D::T;
  using S = typename D::optimizer_type::state_type;
  auto& ops = dp.model().ops();
  std::vector<S> m, v, master;
  std::size_t bucket = 0;  // ZeRO-3: the next bucket's piece
  for (const auto& [k, r] : state_wanted(dp)) {
    const std::vector<double> x = fetch(k, r);
    if (k == TrainState::params) {
      std::vector<T> p(x.size());
      for (std::size_t i = 0; i < x.size(); ++i) p[i] = static_cast<T>(x[i]);
      T* to = D::stage == 3 ? dp.param_piece(bucket++).data() : dp.model().params().data() + r.begin;
      ops.upload(to, p.data(), p.size());
      continue;
    }
    std::vector<S>& to = k == TrainState::exp_avg ? m : k == TrainState::exp_avg_sq ? v : master;
    for (double d : x) to.push_back(static_cast<S>(d));
  }
  dp.optimizer().restore(ops, step, m, v, master);
}

}  // namespace fived::checkpoint
