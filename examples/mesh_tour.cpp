// A tour of fived's foundation on the host backend (ranks as threads):
// the compile-time mesh, its groups, placements and the collectives that
// redistribute picks from them, checked against the serial computation.
//
//   build/examples/mesh_tour            (Mesh<DP<2>, PP<2>, TP<2>>, 8 threads)

#include <cstdio>
#include <mutex>
#include <numeric>
#include <vector>

#include <fived/fived.hpp>

using namespace fived;

using mesh = Mesh<DP<2>, PP<2>, TP<2>>;

template <class From, class To>
void print_transition(const char* from, const char* to) {
  using T = Transition<From, To>;
  std::printf("  %-9s -> %-9s  forward %-15s backward %s\n", from, to, collective_name(T::forward).data(),
              collective_name(T::backward).data());
}

int main() {
  std::printf("%s: %d ranks, TP fastest, PP slowest\n\n", mesh::name().c_str(), mesh::size);
  std::printf("rank  tp cp dp pp   tp group   dp group   pp group\n");
  for (int r = 0; r < mesh::size; ++r) {
    const Coord c = mesh::coord(r);
    auto tp = mesh::tp_group::members(r);
    auto dp = mesh::dp_group::members(r);
    auto pp = mesh::pp_group::members(r);
    std::printf("%4d  %2d %2d %2d %2d   {%d,%d}      {%d,%d}      {%d,%d}\n", r, c.tp, c.cp, c.dp, c.pp, tp[0], tp[1],
                dp[0], dp[1], pp[0], pp[1]);
  }

  std::printf("\ncollectives chosen by the placement types (decided at compile time):\n");
  print_transition<Partial, Replicate>("Partial", "Replicate");
  print_transition<Partial, Shard<0>>("Partial", "Shard<0>");
  print_transition<Shard<0>, Replicate>("Shard<0>", "Replicate");
  print_transition<Shard<0>, Shard<1>>("Shard<0>", "Shard<1>");
  print_transition<Replicate, Shard<1>>("Replicate", "Shard<1>");

  // A row-parallel product on every TP group: each TP rank multiplies its
  // slice of the inner dimension, so its output is a partial sum (Partial on
  // tp). Sequence-parallel style, it is reduce-scattered over rows and then
  // all-gathered; the result must equal the serial product exactly.
  constexpr int rows = 4, inner = 6, cols = 3;
  std::vector<long> a(rows * inner), b(inner * cols), serial(rows * cols, 0);
  std::iota(a.begin(), a.end(), 1);
  std::iota(b.begin(), b.end(), -7);
  for (int i = 0; i < rows; ++i)
    for (int k = 0; k < inner; ++k)
      for (int j = 0; j < cols; ++j) serial[i * cols + j] += a[i * inner + k] * b[k * cols + j];

  std::mutex print;
  int mismatches = 0;
  host::run(mesh::size, [&](host::Comm& world) {
    auto ctx = make_mesh_context<mesh>(world);
    auto& tp = ctx.comm<Axis::tp>();
    const int k0 = tp.rank() * inner / mesh::tp, k1 = (tp.rank() + 1) * inner / mesh::tp;
    std::vector<long> partial(rows * cols, 0);
    for (int i = 0; i < rows; ++i)
      for (int k = k0; k < k1; ++k)
        for (int j = 0; j < cols; ++j) partial[i * cols + j] += a[i * inner + k] * b[k * cols + j];

    using Out = ShardLayout<mesh, 2, Placements<On<Axis::tp, Partial>>>;
    Sharded<long, Out> y(Out({rows, cols}, ctx.coord()), partial);
    auto y_rows = redistribute<Axis::tp, Shard<0>>(y, tp);    // reduce-scatter over tp
    auto y_full = redistribute<Axis::tp, Replicate>(y_rows, tp);  // all-gather over tp

    std::lock_guard lk(print);
    if (y_full.storage() != serial) ++mismatches;
    if (world.rank() == 0)
      std::printf("\nrank 0 holds rows [%lld, %lld) after the reduce-scatter; after the all-gather, the full %dx%d "
                  "product\n",
                  static_cast<long long>(y_rows.layout().offset()[0]),
                  static_cast<long long>(y_rows.layout().offset()[0] + y_rows.layout().local_shape()[0]), rows, cols);
  });
  std::printf("parallel == serial on all %d ranks: %s\n", mesh::size, mismatches == 0 ? "yes" : "NO");
  return mismatches == 0 ? 0 : 1;
}
