// Pipeline schedules drawn: each rank's timeline under the cost model F = 1,
// B = 2, I = W = 1 (messages free), with the bubble and the peak activations,
// in the terminal and, with --svg, as a figure like those of the GPipe, 1F1B and
// zero-bubble papers.
//
//   build/examples/schedule                                    all six, P = 4, M = 8
//   build/examples/schedule --schedule zbv --pp 4 --micro 8
//   build/examples/schedule --schedule interleaved --pp 4 --micro 8 --chunks 2 --svg out.svg
//
// Cells: the action's letter (F, B, I, W) and micro-batch, then a letter for the
// chunk when there are several (a = chunk 0, b = chunk 1, ...); a 2-unit B is
// "B3" then "b3". Colour (background by kind, lighter for later chunks) when
// stdout is a terminal.

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <fived/pipeline/schedule.hpp>

namespace pp = fived::pipeline;

namespace {

const char* const names[] = {"gpipe", "1f1b", "interleaved", "zbh1", "zbv", "dualpipev"};

struct Options {
  std::vector<std::string> schedules;  // empty: all of them
  int ranks = 4, micro = 8, chunks = 2;
  std::string svg;
};

[[noreturn]] void usage(const std::string& msg) {
  std::fprintf(stderr,
               "%s\nusage: schedule [--schedule gpipe|1f1b|interleaved|zbh1|zbv|dualpipev] [--pp P] [--micro M] "
               "[--chunks V (interleaved)] [--svg out.svg]\n",
               msg.c_str());
  std::exit(2);
}

int positive(std::string_view option, std::string_view text) {
  int v = 0;
  const auto [end, err] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (err != std::errc{} || end != text.data() + text.size() || v < 1)
    usage("error: " + std::string(option) + " takes a positive integer, got '" + std::string(text) + "'");
  return v;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    auto value = [&]() -> std::string_view {
      if (i + 1 >= argc) usage("error: missing value after " + std::string(a));
      return argv[++i];
    };
    if (a == "--schedule") {
      const std::string_view s = value();
      if (std::find(std::begin(names), std::end(names), s) == std::end(names))
        usage("error: unknown schedule '" + std::string(s) + "' (gpipe, 1f1b, interleaved, zbh1, zbv or dualpipev)");
      o.schedules.emplace_back(s);
    } else if (a == "--pp") {
      o.ranks = positive(a, value());
    } else if (a == "--micro") {
      o.micro = positive(a, value());
    } else if (a == "--chunks") {
      o.chunks = positive(a, value());
    } else if (a == "--svg") {
      o.svg = value();
    } else if (a == "-h" || a == "--help") {
      usage("Draws pipeline schedules and prints their bubble and peak activations.");
    } else {
      usage("error: unknown option '" + std::string(a) + "'");
    }
  }
  if (o.ranks > 64 || o.micro > 1024 || o.chunks > 16) usage("error: at most --pp 64, --micro 1024, --chunks 16");
  return o;
}

struct Drawn {
  std::string name, formula;  // "1F1B", "(P-1)/(M+P-1)"
  double closed_form = 0;
  pp::Schedule schedule;
  pp::Run run;
  pp::Figures figures;
};

Drawn make(const std::string& which, const Options& o) {
  const int P = o.ranks, M = o.micro, V = o.chunks;
  Drawn d;
  auto closed = [&](int den) { return static_cast<double>(P - 1) / den; };
  if (which == "gpipe") d = {"GPipe", "(P-1)/(M+P-1)", closed(M + P - 1), pp::gpipe(P, M), {}, {}};
  if (which == "1f1b") d = {"1F1B", "(P-1)/(M+P-1)", closed(M + P - 1), pp::one_f_one_b(P, M), {}, {}};
  if (which == "interleaved")
    d = {"interleaved 1F1B, V = " + std::to_string(V), "(P-1)/(V*M+P-1)", closed(V * M + P - 1),
         pp::interleaved_1f1b(P, M, V), {}, {}};
  if (which == "zbh1") d = {"ZB-H1", "(P-1)/(3M+P-1)", closed(3 * M + P - 1), pp::zb_h1(P, M), {}, {}};
  if (which == "zbv") d = {"ZB-V", "(P-1)/(6M+P-1)", closed(6 * M + P - 1), pp::zb_v(P, M), {}, {}};
  if (which == "dualpipev")  // at these unit costs ZB-V's bubble: its overlap of F and B is not modelled
    d = {"DualPipeV", "(P-1)/(6M+P-1)", closed(6 * M + P - 1), pp::dualpipe_v(P, M), {}, {}};
  if (const pp::Verdict v = pp::verify(d.schedule); !v.ok())  // generated tables are proven; say so if not
    throw std::logic_error(std::string(pp::describe(v.failed)));
  d.run = pp::simulate(d.schedule);
  d.figures = pp::measure(d.schedule);
  return d;
}

// ---- terminal ------------------------------------------------------------------------------

// The compute action each rank runs at each time unit (index into its program), or -1.
std::vector<std::vector<int>> occupancy(const Drawn& d) {
  std::vector<std::vector<int>> at(static_cast<std::size_t>(d.schedule.ranks()),
                                   std::vector<int>(static_cast<std::size_t>(d.figures.makespan), -1));
  for (int r = 0; r < d.schedule.ranks(); ++r) {
    const auto prog = d.schedule.program(r);
    for (std::size_t i = 0; i < prog.size(); ++i)
      if (pp::is_compute(prog[i].op))
        for (int t = d.run.start[static_cast<std::size_t>(r)][i]; t < d.run.end[static_cast<std::size_t>(r)][i]; ++t)
          at[static_cast<std::size_t>(r)][static_cast<std::size_t>(t)] = static_cast<int>(i);
  }
  return at;
}

std::string label(const pp::Action& a, int chunks, bool first_unit) {
  std::string s(1, first_unit ? pp::op_letter(a.op) : static_cast<char>(pp::op_letter(a.op) + ('a' - 'A')));
  s += std::to_string(a.mb);
  if (chunks > 1) s += static_cast<char>('a' + a.chunk);
  return s;
}

// ANSI 256-colour backgrounds: blue F, green B, teal I, olive W; later chunks lighter.
int colour(pp::Op op, int chunk) {
  static constexpr int shades[4][4] = {{25, 33, 75, 117}, {28, 34, 77, 120}, {30, 37, 80, 123}, {100, 142, 184, 186}};
  const int k = op == pp::Op::forward ? 0 : op == pp::Op::backward ? 1 : op == pp::Op::input_grad ? 2 : 3;
  return shades[k][std::min(chunk, 3)];
}

void print_timeline(const Drawn& d, bool tty) {
  const auto& sh = d.schedule.shape;
  const auto at = occupancy(d);
  int width = 2 + static_cast<int>(std::to_string(sh.micro_batches - 1).size()) + (sh.chunks > 1 ? 1 : 0);
  int columns = 160;
  if (const char* c = std::getenv("COLUMNS")) columns = std::max(40, std::atoi(c));
  const int per_line = std::max(10, (columns - 8) / width);
  for (int from = 0; from < d.figures.makespan; from += per_line) {
    const int to = std::min(d.figures.makespan, from + per_line);
    std::string axis(static_cast<std::size_t>((to - from) * width), ' ');  // a tick every 5 units
    for (int t = (from + 4) / 5 * 5; t < to; t += 5) {
      const std::string n = std::to_string(t);
      axis.replace(static_cast<std::size_t>((t - from) * width), n.size(), n);
    }
    std::printf("        %s\n", axis.c_str());
    for (int r = 0; r < sh.ranks; ++r) {
      std::printf("rank %-2d ", r);
      const auto prog = d.schedule.program(r);
      for (int t = from; t < to; ++t) {
        const int i = at[static_cast<std::size_t>(r)][static_cast<std::size_t>(t)];
        if (i < 0) {
          std::printf("%-*s", width, tty ? "" : ".");
          continue;
        }
        const pp::Action& a = prog[static_cast<std::size_t>(i)];
        const bool first = d.run.start[static_cast<std::size_t>(r)][static_cast<std::size_t>(i)] == t;
        const std::string text = first ? label(a, sh.chunks, true) : (tty ? "" : label(a, sh.chunks, false));
        if (tty) std::printf("\033[48;5;%dm\033[97m%-*s\033[0m", colour(a.op, a.chunk), width, text.c_str());
        else std::printf("%-*s", width, text.c_str());
      }
      std::printf("\n");
    }
  }
}

void print(const Drawn& d, bool tty) {
  const auto& sh = d.schedule.shape;
  const auto& f = d.figures;
  std::printf("%s: P = %d, M = %d%s; F = 1, B = 2, I = W = 1 per chunk, messages free\n", d.name.c_str(), sh.ranks,
              sh.micro_batches, sh.chunks > 1 ? (", V = " + std::to_string(sh.chunks)).c_str() : "");
  print_timeline(d, tty);
  std::printf("makespan %d, bubble %.2f%% (%s = %.2f%%); with blocking sends: makespan %d, bubble %.2f%%\n",
              f.makespan, 100 * f.bubble(), d.formula.c_str(), 100 * d.closed_form, f.blocking_makespan,
              100 * f.blocking_bubble());
  std::printf("peak activations per rank, (micro-batch, chunk) pairs held from F to the end of B or I:");
  for (int p : f.peak_activations) std::printf(" %d", p);
  if (sh.chunks > 1)
    std::printf("\n  a chunk is 1/%d of a rank's layers: rank 0 holds %.1f micro-batches of a whole stage", sh.chunks,
                static_cast<double>(f.peak_activations[0]) / sh.chunks);
  std::printf("\n... held until the end of W:");
  for (int p : f.peak_pending) std::printf(" %d", p);
  std::printf("\n\n");
}

// ---- SVG -----------------------------------------------------------------------------------

std::string fill(pp::Op op, int chunk, int chunks) {
  // The papers' palette: blue forward, green backward; zero bubble: teal I, light green W.
  static constexpr int rgb[4][3] = {{78, 121, 199}, {89, 161, 79}, {118, 183, 178}, {164, 209, 125}};
  const int k = op == pp::Op::forward ? 0 : op == pp::Op::backward ? 1 : op == pp::Op::input_grad ? 2 : 3;
  const double lighten = chunks > 1 ? 0.55 * chunk / (chunks - 1) : 0.0;
  char buf[16];
  std::snprintf(buf, sizeof buf, "#%02x%02x%02x", static_cast<int>(rgb[k][0] + (255 - rgb[k][0]) * lighten),
                static_cast<int>(rgb[k][1] + (255 - rgb[k][1]) * lighten),
                static_cast<int>(rgb[k][2] + (255 - rgb[k][2]) * lighten));
  return buf;
}

void write_svg(const std::vector<Drawn>& all, const std::string& path) {
  constexpr int unit = 22, row = 26, left = 70, gap = 64;
  int width = 0, height = 20;
  for (const auto& d : all) {
    width = std::max(width, left + d.figures.makespan * unit + 20);
    height += gap + d.schedule.ranks() * row + 30;
  }
  std::ofstream out(path);
  if (!out) throw std::runtime_error("cannot write " + path);
  out << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
      << "\" font-family=\"Helvetica, Arial, sans-serif\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  int y = 20;
  for (const auto& d : all) {
    const auto& sh = d.schedule.shape;
    char title[256];
    std::snprintf(title, sizeof title, "%s (P = %d, M = %d): bubble %.1f%%, rank 0 holds at most %g micro-batches%s",
                  d.name.c_str(), sh.ranks, sh.micro_batches, 100 * d.figures.bubble(),
                  static_cast<double>(d.figures.peak_activations[0]) / sh.chunks,
                  sh.chunks > 1 ? " of a whole stage" : "");
    out << "<text x=\"" << left << "\" y=\"" << y + 30 << "\" font-size=\"15\" font-weight=\"bold\">" << title
        << "</text>\n";
    y += gap;
    for (int r = 0; r < sh.ranks; ++r) {
      const int top = y + r * row;
      out << "<text x=\"" << left - 10 << "\" y=\"" << top + row / 2 + 5 << "\" font-size=\"13\" text-anchor=\"end\">rank "
          << r << "</text>\n";
      out << "<rect x=\"" << left << "\" y=\"" << top << "\" width=\"" << d.figures.makespan * unit << "\" height=\""
          << row - 2 << "\" fill=\"#f4f4f4\" stroke=\"#cccccc\"/>\n";
      const auto prog = d.schedule.program(r);
      for (std::size_t i = 0; i < prog.size(); ++i) {
        const pp::Action& a = prog[i];
        if (!pp::is_compute(a.op)) continue;
        const int s = d.run.start[static_cast<std::size_t>(r)][i], e = d.run.end[static_cast<std::size_t>(r)][i];
        out << "<rect x=\"" << left + s * unit << "\" y=\"" << top << "\" width=\"" << (e - s) * unit << "\" height=\""
            << row - 2 << "\" fill=\"" << fill(a.op, a.chunk, sh.chunks) << "\" stroke=\"black\" stroke-width=\"0.6\"/>\n";
        out << "<text x=\"" << left + s * unit + (e - s) * unit / 2.0 << "\" y=\"" << top + row / 2 + 4
            << "\" font-size=\"11\" text-anchor=\"middle\">" << a.mb << "</text>\n";
      }
    }
    const int bottom = y + sh.ranks * row;
    for (int t = 0; t <= d.figures.makespan; t += 5)
      out << "<text x=\"" << left + t * unit << "\" y=\"" << bottom + 14 << "\" font-size=\"10\" fill=\"#666666\""
          << " text-anchor=\"middle\">" << t << "</text>\n";
    y = bottom + 30;
  }
  // Legend.
  const char* legend[] = {"F forward", "B backward", "I input gradient", "W weight gradient"};
  const pp::Op ops[] = {pp::Op::forward, pp::Op::backward, pp::Op::input_grad, pp::Op::weight_grad};
  for (int k = 0; k < 4; ++k) {
    out << "<rect x=\"" << left + k * 150 << "\" y=\"4\" width=\"14\" height=\"14\" fill=\"" << fill(ops[k], 0, 1)
        << "\" stroke=\"black\" stroke-width=\"0.6\"/><text x=\"" << left + k * 150 + 20
        << "\" y=\"16\" font-size=\"12\">" << legend[k] << "</text>\n";
  }
  out << "<text x=\"" << left + 4 * 150 << "\" y=\"16\" font-size=\"12\" fill=\"#555555\">lighter: later model chunks"
      << "; numbers: micro-batches</text>\n</svg>\n";
}

}  // namespace

int main(int argc, char** argv) {
  Options o = parse(argc, argv);
  const bool all = o.schedules.empty();
  if (all) o.schedules.assign(std::begin(names), std::end(names));
  std::vector<Drawn> drawn;
  for (const auto& s : o.schedules) {
    try {
      drawn.push_back(make(s, o));
    } catch (const std::invalid_argument& e) {
      if (!all) usage(std::string("error: ") + e.what());
      std::printf("%s: skipped for P = %d, M = %d: %s\n\n", s.c_str(), o.ranks, o.micro, e.what());
    }
  }
  const bool tty = isatty(fileno(stdout)) != 0;
  for (const auto& d : drawn) print(d, tty);
  if (!o.svg.empty()) {
    write_svg(drawn, o.svg);
    std::printf("wrote %s\n", o.svg.c_str());
  }
}
