#pragma once
// The benchmarks' command lines: "--name value" options, numbers parsed with std::sto*, every
// mistake (a missing value, a bad number, an unknown option) sent to the program's usage().
//
//   bench::parse_options(argc, argv, usage, [&](std::string_view name, auto value) {
//     if (name == "--steps") o.steps = std::stoi(value());
//     else return false;  // unknown
//     return true;
//   });

#include <stdexcept>
#include <string>
#include <string_view>

namespace bench {

template <class Usage, class Handle>
void parse_options(int argc, char** argv, Usage usage, Handle handle) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view name = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage("missing value after " + std::string(name));
      return argv[++i];
    };
    try {
      if (!handle(name, value)) usage("unknown argument " + std::string(name));
    } catch (const std::logic_error&) {
      usage("bad number after " + std::string(name));
    }
  }
}

}  // namespace bench
