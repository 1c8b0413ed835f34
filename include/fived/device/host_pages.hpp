#pragma once
// Giving the memory of part of a host buffer back to the operating system, and measuring
// what a buffer holds.
//
//   fived::release_pages(std::span<float>(grads).subspan(b, n));  // reads as zeros afterwards
//   fived::resident_bytes(std::span<const float>(grads));         // bytes in RAM right now
//
// ZeRO-2 frees a gradient bucket once it has been reduce-scattered, and ZeRO-3 frees a
// unit's gathered parameters once it has run. The model's buffers stay where they are: its
// kernels keep their offsets, and only the physical pages go. release_pages zeroes the
// partial pages at the two ends of the range, and returns the whole pages between them to
// the system with madvise(MADV_DONTNEED). A private anonymous page given back that way reads
// as zero until it is written again, when the kernel maps a fresh page. So a released range
// is also a zeroed range, which is what a gradient buffer wants before the next backward.
// This is the host counterpart of unmapping physical memory under a reserved virtual range
// on a GPU (cuMemUnmap), the trick behind PyTorch's expandable segments.
//
// resident_bytes counts the pages of the span that are in RAM (mincore). Partial pages at
// the ends count whole. Reading a released page maps the system's shared zero page, which
// costs no memory but which mincore counts as resident. Where these calls do not exist (not Linux or macOS),
// release_pages only zeroes and resident_bytes reports the span's size.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#if defined(__linux__) || defined(__APPLE__)
#include <sys/mman.h>
#include <unistd.h>
#define FIVED_HOST_PAGES 1
#else
#define FIVED_HOST_PAGES 0
#endif

namespace fived {

inline std::size_t host_page_size() {
#if FIVED_HOST_PAGES
  static const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  return page;
#else
  return 4096;
#endif
}

// Zeroes `range` and returns its whole pages to the system. T must be a type whose zero is
// all zero bits (float, double, bf16, integers).
template <class T>
void release_pages(std::span<T> range) {
  static_assert(std::is_trivially_copyable_v<T>, "release_pages: the elements must be trivially copyable");
  if (range.empty()) return;
  auto* begin = reinterpret_cast<std::byte*>(range.data());
  std::byte* end = begin + range.size_bytes();
#if FIVED_HOST_PAGES
  const std::uintptr_t page = host_page_size();
  const std::uintptr_t b = reinterpret_cast<std::uintptr_t>(begin), e = reinterpret_cast<std::uintptr_t>(end);
  const std::uintptr_t first = (b + page - 1) / page * page, last = e / page * page;  // the whole pages
  if (first < last && madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED) == 0) {
    std::fill(begin, reinterpret_cast<std::byte*>(first), std::byte{0});
    std::fill(reinterpret_cast<std::byte*>(last), end, std::byte{0});
    return;
  }
#endif
  std::fill(begin, end, std::byte{0});
}

// Bytes of the pages under `range` that are resident in RAM.
template <class T>
std::size_t resident_bytes(std::span<const T> range) {
  if (range.empty()) return 0;
#if FIVED_HOST_PAGES
  const std::uintptr_t page = host_page_size();
  const std::uintptr_t b = reinterpret_cast<std::uintptr_t>(range.data()) / page * page;
  const std::uintptr_t e = reinterpret_cast<std::uintptr_t>(range.data() + range.size());
  const std::size_t pages = (e - b + page - 1) / page;
#if defined(__APPLE__)
  std::vector<char> in(pages);
#else
  std::vector<unsigned char> in(pages);
#endif
  if (mincore(reinterpret_cast<void*>(b), pages * page, in.data()) != 0) return range.size_bytes();
  std::size_t n = 0;
  for (auto v : in) n += (v & 1) ? 1 : 0;
  return n * page;
#else
  return range.size_bytes();
#endif
}

}  // namespace fived
