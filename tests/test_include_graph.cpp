// The include graph of fived's headers: no file cycles, no folder cycles, no stale includes.
//
//   test_include_graph <path to include/fived>
//
// Reads every .hpp / .cuh under the folder, collects its #include "fived/..." and
// #include <fived/...> lines, and fails (exit 1, one sentence per problem) when
//   - an include names a fived header that does not exist (a stale include),
//   - headers include each other in a cycle (a.hpp -> b.hpp -> a.hpp), or
//   - folders do. A header's folder is its directory relative to include/fived ("." for the
//     top); a header including one from another folder is an edge between the two folders.
//     A folder cycle means the folders are not layers: neither can be read, moved or
//     tested without the other.
// Every cycle is printed with the include lines behind it.

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <regex>
#include <string>
#include <vector>

namespace fs = std::filesystem;

// node -> (node it includes -> why: the first "file:line includes file" behind the edge)
using Graph = std::map<std::string, std::map<std::string, std::string>>;

// Depth-first search: an edge back to a node on the current path closes a cycle, kept as
// the path from that node around to itself (first == last).
void find_cycles(const Graph& g, const std::string& node, std::map<std::string, int>& state,
                 std::vector<std::string>& path, std::vector<std::vector<std::string>>& cycles) {
  state[node] = 1;  // on the path
  path.push_back(node);
  if (auto it = g.find(node); it != g.end()) {
    for (const auto& [next, why] : it->second) {
      if (state[next] == 1) {
        std::vector<std::string> cycle(std::find(path.begin(), path.end(), next), path.end());
        cycle.push_back(next);
        cycles.push_back(cycle);
      } else if (state[next] == 0) {
        find_cycles(g, next, state, path, cycles);
      }
    }
  }
  path.pop_back();
  state[node] = 2;  // done: no cycle through it is left to find
}

// Prints each cycle of g as a sentence; returns how many there are.
int report_cycles(const Graph& g, const std::string& what) {
  std::map<std::string, int> state;
  std::vector<std::string> path;
  std::vector<std::vector<std::string>> cycles;
  for (const auto& [node, edges] : g) {
    if (state[node] == 0) find_cycles(g, node, state, path, cycles);
  }
  for (const auto& cycle : cycles) {
    std::string nodes = cycle[0], whys;
    for (std::size_t i = 1; i < cycle.size(); ++i) {
      nodes += " -> " + cycle[i];
      whys += (i > 1 ? ", " : "") + g.at(cycle[i - 1]).at(cycle[i]);
    }
    std::cout << "include cycle between " << what << ": " << nodes << " (" << whys << ")\n";
  }
  return static_cast<int>(cycles.size());
}

int main(int argc, char** argv) {
  if (argc != 2 || !fs::is_directory(argv[1])) {
    std::cerr << "usage: test_include_graph <path to include/fived>\n";
    return 2;
  }
  const fs::path root = argv[1];
  std::vector<std::string> headers;  // relative to root, sorted: the output is deterministic
  for (const auto& entry : fs::recursive_directory_iterator(root)) {
    const auto ext = entry.path().extension();
    if (entry.is_regular_file() && (ext == ".hpp" || ext == ".cuh")) {
      headers.push_back(entry.path().lexically_relative(root).generic_string());
    }
  }
  std::sort(headers.begin(), headers.end());
  if (headers.empty()) {
    std::cerr << "no .hpp or .cuh files under " << root << "\n";
    return 2;
  }

  const auto folder = [](const std::string& header) {
    const std::string dir = fs::path(header).parent_path().generic_string();
    return dir.empty() ? std::string(".") : dir;
  };
  const std::regex include_line(R"(^\s*#\s*include\s*[<"]fived/([^">]+)[">])");
  Graph files, folders;
  int includes = 0, stale = 0;
  for (const auto& header : headers) {
    std::ifstream in(root / header);
    std::string line;
    for (int n = 1; std::getline(in, line); ++n) {
      std::smatch m;
      if (!std::regex_search(line, m, include_line)) continue;
      const std::string target = m[1];
      const std::string why = header + ":" + std::to_string(n) + " includes " + target;
      ++includes;
      if (!fs::is_regular_file(root / target)) {
        std::cout << "stale include: " << why << ", which does not exist\n";
        ++stale;
        continue;
      }
      files[header].emplace(target, why);  // emplace keeps the first reason
      if (folder(header) != folder(target)) folders[folder(header)].emplace(folder(target), why);
    }
  }

  const int cycles = report_cycles(files, "files") + report_cycles(folders, "folders");
  std::cout << headers.size() << " headers, " << includes << " fived includes: " << stale
            << " stale, " << cycles << " cycles\n";
  return stale + cycles == 0 ? 0 : 1;
}
