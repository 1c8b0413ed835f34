// The progress of a training run as a person reads it (a line per so many steps, averaged) and
// as a program does (a metrics file: a JSON line per step and per evaluation, exact).

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "fived/train/progress.hpp"
#include "support/file_text.hpp"

using namespace fived;

using test::file_text;

namespace {

// The two files a ProgressLog writes: the lines people read, the metrics programs read.
struct Files {
  std::FILE* out = std::tmpfile();
  std::FILE* metrics = std::tmpfile();
  Files() {
    REQUIRE(out != nullptr);
    REQUIRE(metrics != nullptr);
  }
  ~Files() { std::fclose(out), std::fclose(metrics); }
};

}  // namespace

TEST_CASE("a progress line averages the steps since the last; the metrics file has every step, exactly") {
  Files f;
  // 2 ranks, 1e6 FLOPs a token, a peak of 1e10 FLOP/s a device: 1024 tokens in 0.5 s are
  // 1024 tokens/s a rank, 10.24% MFU.
  ProgressLog log(f.out, 2, 1e6, 1e10, 2, f.metrics);
  log.header();
  log.add({1, 4.5, 1e-3, 1.5, 0.5, 1024}, 3 << 20);
  log.add({2, 3.25, 1e-3, 1.25, 0.5, 1024}, 3 << 20);
  log.held_out(2, 0.1 + 0.2, 4);
  log.add({3, 2.0, 5e-4, 1.0, 0.25, 1024}, 3 << 20, /*last=*/true);
  CHECK(file_text(f.out) ==
        "  step     loss        lr  grad norm   tokens/s  tok/s/GPU   MFU%     mem/GPU\n"
        "     2   3.8750  1.00e-03       1.25       2048       1024   10.2     3.0 MiB\n"
        "     2   held-out loss 0.3000 (4 batches)\n"
        "     3   2.0000  5.00e-04          1       4096       2048   20.5     3.0 MiB\n");
  CHECK(file_text(f.metrics) ==
        "{\"step\":1,\"loss\":4.5,\"lr\":0.001,\"grad_norm\":1.5,\"seconds\":0.5,\"tokens\":1024,\"tokens_per_s\":2048,"
        "\"tokens_per_s_per_gpu\":1024,\"mfu\":0.1024,\"memory_bytes\":3145728}\n"
        "{\"step\":2,\"loss\":3.25,\"lr\":0.001,\"grad_norm\":1.25,\"seconds\":0.5,\"tokens\":1024,\"tokens_per_s\":2048,"
        "\"tokens_per_s_per_gpu\":1024,\"mfu\":0.1024,\"memory_bytes\":3145728}\n"
        "{\"step\":2,\"held_out_loss\":0.30000000000000004,\"batches\":4}\n"
        "{\"step\":3,\"loss\":2,\"lr\":5e-04,\"grad_norm\":1,\"seconds\":0.25,\"tokens\":1024,\"tokens_per_s\":4096,"
        "\"tokens_per_s_per_gpu\":2048,\"mfu\":0.2048,\"memory_bytes\":3145728}\n");
}

TEST_CASE("without a peak there is no MFU (\"-\", null); a value that is not finite is null in the metrics file") {
  Files f;
  ProgressLog log(f.out, 1, 1e6, 0, 1, f.metrics);
  log.add({7, std::nan(""), 1e-3, INFINITY, 0.5, 64}, 0, /*last=*/true);
  CHECK(file_text(f.out) == "     7      nan  1.00e-03        inf        128        128      -       0.0 B\n");
  CHECK(file_text(f.metrics) ==
        "{\"step\":7,\"loss\":null,\"lr\":0.001,\"grad_norm\":null,\"seconds\":0.5,\"tokens\":64,\"tokens_per_s\":128,"
        "\"tokens_per_s_per_gpu\":128,\"mfu\":null,\"memory_bytes\":0}\n");
}

TEST_CASE("a number in the metrics file is the shortest text that reads back as the same double") {
  for (const double x : {0.1, 1.0 / 3, 2.0 / 3e-300, 123456789.0, 4.000000000000001, -0.0, 1e301})
    CHECK(std::strtod(ProgressLog::json(x).c_str(), nullptr) == x);
  CHECK(ProgressLog::json(0.1) == "0.1");
  CHECK(ProgressLog::json(1.0 / 3) == "0.3333333333333333");
  CHECK(ProgressLog::json(123456789.0) == "123456789");
  CHECK(ProgressLog::json(1e308 * 10) == "null");
}

TEST_CASE("a skipped step is marked in the metrics file, left out of the line's mean loss and counted after it") {
  Files f;
  ProgressLog log(f.out, 1, 0, 0, 3, f.metrics);
  log.add({1, 3.0, 1e-3, 1.0, 0.5, 64}, 0);
  log.add({2, std::nan(""), 1e-3, std::nan(""), 0.5, 64, /*skipped=*/true}, 0);
  log.add({3, 2.0, 1e-3, 1.0, 0.5, 64}, 0);
  CHECK(file_text(f.out) == "     3   2.5000  1.00e-03          1        128        128      -       0.0 B  (1 skipped)\n");
  const std::string lines = file_text(f.metrics);
  CHECK(lines.find("{\"step\":2,\"loss\":null,") == lines.find("\n") + 1);
  CHECK(lines.find(",\"memory_bytes\":0,\"skipped\":true}\n") != std::string::npos);
  CHECK(lines.find("skipped") == lines.rfind("skipped"));  // the one skipped step only
}
