// Releasable device buffers (device/cuda_pages.hpp) on one GPU:
//   - a released range's whole chunks are unmapped (resident_bytes, the pool's mapped bytes),
//     its partial chunks stay mapped; committed again, the range reads zeros and the bytes
//     beside it keep their values;
//   - a second release and commit reuse the pool: no chunk is created;
//   - a commit that finds the pool empty waits for the oldest pending release instead of
//     growing it (no settle_pages between);
//   - a release whose chunks another stream commits again: that stream waits for it;
//   - release_pages on plain device memory only zeroes it.
// Without a GPU the program exits 77 (CTest: skipped).

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdio>
#include <span>
#include <vector>

#include <fived/device/cuda.hpp>

#include "gpu_support.hpp"

using namespace fived;

namespace {

std::size_t chunk() { return cuda::page_stats().chunk; }

std::vector<float> ones(std::size_t n) { return std::vector<float>(n, 1.0f); }

}  // namespace

TEST_CASE("a released range gives its whole chunks back and reads zeros when committed again") {
  const std::size_t per_chunk = chunk() / sizeof(float);
  const std::size_t n = 5 * per_chunk + 123;  // 6 chunks, the last partial
  Buffer<float, Cuda> b(n, releasable_pages);
  cuda::Stream s;
  b.upload(ones(n), s);
  CHECK(cuda::resident_bytes(std::span<const float>(b.span())) == 6 * chunk());

  // [per_chunk / 2, 4 * per_chunk + 7): chunks 1..3 whole, 0 and 4 partial
  const std::size_t lo = per_chunk / 2, hi = 4 * per_chunk + 7;
  const std::size_t mapped_before = cuda::page_stats().mapped;
  cuda::release_pages(b.span().subspan(lo, hi - lo), s);
  cuda::settle_pages();
  CHECK(cuda::resident_bytes(std::span<const float>(b.span())) == 3 * chunk());
  CHECK(cuda::page_stats().mapped == mapped_before - 3 * chunk());

  const std::size_t created = cuda::page_stats().chunks_created;
  cuda::commit_pages(b.span().subspan(lo, hi - lo), s);
  CHECK(cuda::page_stats().chunks_created == created);  // the three chunks from the pool
  CHECK(cuda::resident_bytes(std::span<const float>(b.span())) == 6 * chunk());
  std::vector<float> h(n);
  b.download(h, s);
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < n; ++i) wrong += h[i] != ((i >= lo && i < hi) ? 0.0f : 1.0f);
  CHECK(wrong == 0);

  // Again: the same chunks go round through the pool.
  cuda::release_pages(b.span().subspan(lo, hi - lo), s);
  cuda::commit_pages(b.span().subspan(lo, hi - lo), s);
  CHECK(cuda::page_stats().chunks_created == created);
}

TEST_CASE("a commit that finds the pool empty waits for the oldest release instead of growing it") {
  const std::size_t per_chunk = chunk() / sizeof(float);
  Buffer<float, Cuda> a(4 * per_chunk, releasable_pages), b(4 * per_chunk, releasable_pages);
  cuda::Stream s;
  cuda::release_pages(b.span(), s);
  cuda::settle_pages();  // b's four chunks are in the pool
  const std::size_t created = cuda::page_stats().chunks_created;
  for (int round = 0; round < 3; ++round) {  // a and b trade the same four chunks, no settling between
    cuda::release_pages(a.span(), s);
    cuda::commit_pages(b.span(), s);
    cuda::release_pages(b.span(), s);
    cuda::commit_pages(a.span(), s);
  }
  CHECK(cuda::page_stats().chunks_created == created);
  a.upload(ones(a.size()), s);
  std::vector<float> h(a.size());
  a.download(h, s);
  CHECK(h.front() == 1.0f);
  CHECK(h.back() == 1.0f);
}

TEST_CASE("a chunk released on one stream and committed on another: the second waits for the first") {
  const std::size_t per_chunk = chunk() / sizeof(float);
  Buffer<float, Cuda> b(2 * per_chunk, releasable_pages);
  Buffer<unsigned char, Cuda> busy(std::size_t{1} << 30);
  cuda::Stream s1, s2;
  const std::size_t bytes = b.size() * sizeof(float);
  for (int round = 0; round < 3; ++round) {
    for (int k = 0; k < 20; ++k) FIVED_CUDA_CHECK(cudaMemsetAsync(busy.data(), k, busy.size(), s1));  // s1 busy
    FIVED_CUDA_CHECK(cudaMemsetAsync(b.data(), 0x3f, bytes, s1));  // s1's last write to b
    cuda::release_pages(b.span(), s1);
    cuda::commit_pages(b.span(), s2);  // zeroed on s2 once s1 has passed its release
    FIVED_CUDA_CHECK(cudaMemsetAsync(b.data(), 0x40, bytes, s2));  // so this write comes last
    FIVED_CUDA_CHECK(cudaStreamSynchronize(s1));
    FIVED_CUDA_CHECK(cudaStreamSynchronize(s2));
    std::vector<unsigned char> h(bytes);
    FIVED_CUDA_CHECK(cudaMemcpy(h.data(), b.data(), bytes, cudaMemcpyDeviceToHost));
    std::size_t wrong = 0;
    for (unsigned char v : h) wrong += v != 0x40;
    CHECK(wrong == 0);
  }
}

TEST_CASE("release_pages on plain device memory zeroes it") {
  Buffer<float, Cuda> b(1000);
  cuda::Stream s;
  b.upload(ones(1000), s);
  cuda::release_pages(b.span().subspan(10, 500), s);
  cuda::commit_pages(b.span().subspan(10, 500), s);  // nothing to map
  std::vector<float> h(1000);
  b.download(h, s);
  CHECK(h[9] == 1.0f);
  CHECK(h[10] == 0.0f);
  CHECK(h[509] == 0.0f);
  CHECK(h[510] == 1.0f);
  CHECK(cuda::resident_bytes(std::span<const float>(b.span())) == 1000 * sizeof(float));
}

int main(int argc, char** argv) {
  if (fived::test::gpu_count() == 0) {
    std::puts("test_cuda_pages: no CUDA device, skipping");
    return fived::test::skip_code;
  }
  doctest::Context ctx;
  ctx.applyCommandLine(argc, argv);
  return ctx.run();
}
