#pragma once
// Timing and the nccl-tests-style table, shared by every backend's collective
// benchmark. A backend supplies a Communicator and a memory policy:
//
//   struct Memory {
//     template <class T> Buffer<T> buffer(std::size_t n);  // .span() -> std::span<T>
//     template <class C, class Op> double time_us(C& comm, Op&& op);  // runs op once, returns its time
//   };
//
// algbw = size / time; busbw = algbw × 2(n−1)/n for all-reduce, × (n−1)/n for
// all-gather, reduce-scatter and all-to-all, × 1 for broadcast (nccl-tests'
// definitions), so numbers compare with nccl-tests'. "size" is the larger of
// the two buffers, as in nccl-tests. Times are measured on rank 0, each sample
// starting after a barrier; the table shows the median sample.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <unistd.h>

#include "fived/comm/communicator.hpp"

namespace fived::bench {

enum class Collective { all_reduce, all_gather, reduce_scatter, all_to_all, broadcast };
inline constexpr std::array<Collective, 5> collectives{Collective::all_reduce, Collective::all_gather,
                                                        Collective::reduce_scatter, Collective::all_to_all,
                                                        Collective::broadcast};

constexpr std::string_view name(Collective c) {
  switch (c) {
    case Collective::all_reduce: return "all_reduce";
    case Collective::all_gather: return "all_gather";
    case Collective::reduce_scatter: return "reduce_scatter";
    case Collective::all_to_all: return "all_to_all";
    case Collective::broadcast: return "broadcast";
  }
  return "?";
}

// nccl-tests' bus bandwidth factor: what each rank's link carries relative to size.
constexpr double bus_factor(Collective c, int n) {
  switch (c) {
    case Collective::all_reduce: return 2.0 * (n - 1) / n;
    case Collective::all_gather:
    case Collective::reduce_scatter:
    case Collective::all_to_all: return static_cast<double>(n - 1) / n;
    case Collective::broadcast: return 1.0;
  }
  return 1.0;
}

struct Options {
  std::vector<int> ranks{2, 4, 8};  // host backend only: NCCL's world is the launch's
  std::size_t min_bytes = std::size_t{1} << 10;
  std::size_t max_bytes = std::size_t{16} << 20;
  int warmup = 3;
  int iters = 7;
};

struct Row {
  Collective collective;
  int ranks;
  std::size_t bytes, count;
  double time_us;
  double algbw() const { return static_cast<double>(bytes) / (time_us * 1e3); }  // GB/s
  double busbw() const { return algbw() * bus_factor(collective, ranks); }
};

namespace detail {

// "4096", "64K", "16M", "1G" (powers of 1024).
inline std::size_t parse_bytes(const std::string& s) {
  std::size_t pos = 0;
  const unsigned long long v = std::stoull(s, &pos);
  const std::string unit = s.substr(pos);
  const int shift = unit.empty() ? 0 : unit == "K" ? 10 : unit == "M" ? 20 : unit == "G" ? 30 : -1;
  if (shift < 0) throw std::invalid_argument("unknown size unit in '" + s + "' (use K, M or G)");
  return static_cast<std::size_t>(v) << shift;
}

inline std::vector<int> parse_list(const std::string& s) {
  std::vector<int> out;
  for (std::size_t at = 0; at <= s.size();) {
    const std::size_t comma = std::min(s.find(',', at), s.size());
    out.push_back(std::stoi(s.substr(at, comma - at)));
    at = comma + 1;
  }
  return out;
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : (v[m - 1] + v[m]) / 2;
}

}  // namespace detail

// --ranks 2,4,8 --min-bytes 1K --max-bytes 16M --warmup 3 --iters 7
inline Options parse_options(int argc, char** argv, const char* usage_note = "") {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--ranks") o.ranks = detail::parse_list(value());
    else if (arg == "--min-bytes") o.min_bytes = detail::parse_bytes(value());
    else if (arg == "--max-bytes") o.max_bytes = detail::parse_bytes(value());
    else if (arg == "--warmup") o.warmup = std::stoi(value());
    else if (arg == "--iters") o.iters = std::stoi(value());
    else {
      std::printf("usage: %s [--ranks 2,4,8] [--min-bytes 1K] [--max-bytes 16M] [--warmup 3] [--iters 7]\n%s",
                  argv[0], usage_note);
      std::exit(arg == "--help" || arg == "-h" ? 0 : 2);
    }
  }
  if (o.min_bytes == 0 || o.min_bytes > o.max_bytes || o.iters < 1 || o.warmup < 0)
    throw std::invalid_argument("need 0 < --min-bytes <= --max-bytes, --iters >= 1, --warmup >= 0");
  return o;
}

// Host name, CPU model and hardware threads: benchmark results name their machine.
inline std::string host_description() {
  char host[256] = "?";
  gethostname(host, sizeof host - 1);
  std::string cpu = "unknown CPU";
  std::ifstream info("/proc/cpuinfo");
  for (std::string line; std::getline(info, line);)
    if (line.rfind("model name", 0) == 0) {
      cpu = line.substr(line.find(':') + 2);
      break;
    }
  return std::string(host) + ", " + cpu + ", " + std::to_string(std::thread::hardware_concurrency()) +
         " hardware threads";
}

// Every collective at every size from min_bytes to max_bytes (doubling), on
// float32. Collective over `comm`: every rank calls it; all get the rows,
// timed on their own clocks (rank 0's are the ones to print).
template <Communicator C, class Memory>
std::vector<Row> run(C& comm, const Options& o, Memory& memory) {
  using T = float;
  const int n = comm.size();
  const std::size_t max_count = o.max_bytes / sizeof(T);
  auto send = memory.template buffer<T>(max_count);
  auto recv = memory.template buffer<T>(max_count);

  std::vector<Row> rows;
  for (Collective c : collectives) {
    for (std::size_t bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= 2) {
      // Whole blocks per rank for the collectives that split the buffer.
      const std::size_t count = bytes / sizeof(T) / n * n, block = count / n;
      if (block == 0) continue;
      std::span<T> s = send.span().first(count), r = recv.span().first(count);
      auto op = [&] {
        switch (c) {
          case Collective::all_reduce: comm.all_reduce(std::span<const T>(s), r, ReduceOp::sum); break;
          case Collective::all_gather: comm.all_gather(std::span<const T>(s.first(block)), r); break;
          case Collective::reduce_scatter: comm.reduce_scatter(std::span<const T>(s), r.first(block), ReduceOp::sum); break;
          case Collective::all_to_all: comm.all_to_all(std::span<const T>(s), r); break;
          case Collective::broadcast: comm.broadcast(r, 0); break;
        }
      };
      for (int i = 0; i < o.warmup; ++i) memory.time_us(comm, op);
      std::vector<double> samples;
      for (int i = 0; i < o.iters; ++i) {
        comm.barrier();
        samples.push_back(memory.time_us(comm, op));
      }
      rows.push_back({c, n, count * sizeof(T), count, detail::median(samples)});
    }
  }
  return rows;
}

inline void print_header(std::string_view backend, std::string_view machine, const Options& o) {
  std::printf("# fived collective benchmark\n# backend: %.*s\n# machine: %.*s\n", static_cast<int>(backend.size()),
              backend.data(), static_cast<int>(machine.size()), machine.data());
  std::printf("# float32; time = median of %d runs after %d warm-up runs, on rank 0\n", o.iters, o.warmup);
  std::printf("# busbw = algbw x 2(n-1)/n all_reduce, x (n-1)/n all_gather reduce_scatter all_to_all, x 1 broadcast\n#\n");
  std::printf("# %14s %6s %12s %11s %11s %12s %12s\n", "collective", "ranks", "size(B)", "count", "time(us)",
              "algbw(GB/s)", "busbw(GB/s)");
}

inline void print_rows(const std::vector<Row>& rows) {
  for (const Row& r : rows)
    std::printf("  %14s %6d %12zu %11zu %11.2f %12.3f %12.3f\n", std::string(name(r.collective)).c_str(), r.ranks,
                r.bytes, r.count, r.time_us, r.algbw(), r.busbw());
  std::fflush(stdout);
}

}  // namespace fived::bench
