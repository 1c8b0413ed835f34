#pragma once
// Device memory whose pages can be given back while its buffer keeps its addresses: the
// device counterpart of device/host_pages.hpp, the trick behind PyTorch's expandable segments.
//
//   Buffer<float, Cuda> grads(n, releasable_pages);                      // reserved, mapped, zeroed
//   cuda::release_pages(grads.span().subspan(b, k), stream);            // its memory to the pool
//   cuda::commit_pages(grads.span().subspan(b, k), stream);             // mapped again, zeros
//   cuda::trim_pages();                                                  // the pool's free chunks freed
//   cuda::page_stats();                                                  // what the pool holds
//
// A releasable buffer reserves its address range (cuMemAddressReserve) for its whole life;
// under it, each chunk of the device's allocation granularity (2 MiB on Hopper) is mapped to
// physical memory of its own or not. The buffer knows which bytes are live (committed and
// not released since). Releasing a range zeroes it where its chunks still hold live bytes,
// and a chunk left with none is pending: unmapped once the work queued on the releasing
// stream has finished (an event), when a commit needs memory and the pool has none free. A
// pending chunk committed again before that is simply kept (its stream waits for the event),
// so a range given back and taken again at once costs no unmap and map. Its physical memory
// goes to one pool per process, which the next commit maps again, so a steady state
// allocates nothing. When a commit finds the pool empty while released chunks still wait for
// their streams, the host waits for the oldest of them (as PyTorch FSDP's rate limiter waits
// for an old all-gather): memory is bounded by what the step holds at once, not by how far
// the host runs ahead. Only when nothing is pending does the pool grow. trim_pages gives the
// pool's free chunks back to the driver (after ZeRO cuts its shards: the device then holds
// what a step holds at once, which the pool grows back to in the first step).
//
// Unlike host pages, which the kernel maps again on the first touch, a device chunk must be
// committed before it is written: a kernel that touches a released chunk stops with an
// illegal address instead of reading zeros. A span outside every releasable buffer (plain
// cudaMalloc memory) is only zeroed by release_pages, and commit_pages does nothing to it.
//
// The host's waits here (the pool's, settle_pages, trim_pages) are not bounded: like reading
// a loss, they wait for the device, and a collective queued before them whose peer died
// holds them up for good (only the communicator's own polls are bounded: comm/nccl.hpp).
//
// One process drives one device (fived's ranks are processes); the pool is that device's.
// Host code only; the driver calls are found at run time (device/cuda_driver.hpp).

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "fived/device/buffer.hpp"
#include "fived/device/cuda_driver.hpp"
#include "fived/device/cuda_error.hpp"
#include "fived/device/live_ranges.hpp"

namespace fived::cuda {

// The pool's figures, in bytes: held (physical memory taken from the driver and not given
// back: mapped, or free for the next commit), mapped now, the most mapped at once since
// reset_page_peak(); and the chunks ever created (cuMemCreate: none in a steady state).
struct PageStats {
  std::size_t chunk = 0, held = 0, mapped = 0, peak_mapped = 0;
  std::size_t chunks_created = 0;
};

class PagedMemory;

namespace pages_detail {

// Physical chunks of one device, and the releasable buffers that map them.
class Pool {
 public:
  static Pool& get() {
    static Pool pool;
    return pool;
  }
  std::size_t chunk() const { return chunk_; }
  int device() const { return device_; }
  PageStats& stats() { return stats_; }
  std::uint64_t next_release() { return ++clock_; }
  // The driver calls need the device's primary context current on the calling thread (the
  // runtime makes it so for its own calls only).
  void on_this_thread() {
    thread_local bool current = false;
    if (!current) FIVED_CUDA_CHECK(cudaSetDevice(device_)), current = true;
  }

  void add(PagedMemory* m) { buffers_.push_back(m); }
  void remove(PagedMemory* m) { buffers_.erase(std::remove(buffers_.begin(), buffers_.end(), m), buffers_.end()); }
  PagedMemory* find(const void* p) const;

  // A physical chunk to map: from the pool, after the finished releases; else after the
  // oldest pending one; else a new one.
  CUmemGenericAllocationHandle take();
  void give(CUmemGenericAllocationHandle h) { free_.push_back(h); }
  // Unmaps every released chunk whose stream has passed its release (wait: all of them,
  // waiting for their streams).
  void reap(bool wait);

  // The free chunks back to the driver.
  void trim() {
    for (CUmemGenericAllocationHandle h : free_) FIVED_CU_CHECK(driver().mem_release(h));
    stats_.held -= free_.size() * chunk_;
    free_.clear();
  }
  ~Pool() {
    for (CUmemGenericAllocationHandle h : free_) (void)driver().mem_release(h);
  }

 private:
  Pool() {
    FIVED_CUDA_CHECK(cudaFree(nullptr));  // the runtime's primary context, current for the driver calls
    FIVED_CUDA_CHECK(cudaGetDevice(&device_));
    prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop_.location.id = device_;
    FIVED_CU_CHECK(driver().mem_get_allocation_granularity(&chunk_, &prop_, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    stats_.chunk = chunk_;
  }

  int device_ = 0;
  CUmemAllocationProp prop_{};
  std::size_t chunk_ = 0;
  std::uint64_t clock_ = 0;
  PageStats stats_;
  std::vector<CUmemGenericAllocationHandle> free_;
  std::vector<PagedMemory*> buffers_;
};

}  // namespace pages_detail

// The reservation of one releasable buffer and its chunks.
class PagedMemory {
 public:
  explicit PagedMemory(std::size_t bytes) : pool_(pages_detail::Pool::get()), bytes_(bytes) {
    const std::size_t g = pool_.chunk();
    chunks_.resize((bytes + g - 1) / g);
    pending_.reserve(chunks_.size());
    FIVED_CU_CHECK(driver().mem_address_reserve(&base_, chunks_.size() * g, g, 0, 0));
    pool_.add(this);
    try {
      commit(0, bytes, nullptr);
      FIVED_CUDA_CHECK(cudaStreamSynchronize(nullptr));  // zero for every stream, as Buffer<T, Cuda> is
    } catch (...) {
      destroy();
      throw;
    }
  }
  PagedMemory(const PagedMemory&) = delete;
  PagedMemory& operator=(const PagedMemory&) = delete;
  ~PagedMemory() { destroy(); }

  void* data() const { return reinterpret_cast<void*>(base_); }
  bool holds(const void* p) const {
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    return a >= base_ && a < base_ + bytes_;
  }
  // Bytes of mapped chunks under [b, e) (byte offsets).
  std::size_t resident(std::size_t b, std::size_t e) const {
    std::size_t n = 0;
    for_chunks(b, e, [&](std::size_t c) { n += chunks_[c].handle != 0 ? pool_.chunk() : 0; });
    return n;
  }

  // [b, e) holds nothing live any more: zeroed on `s` where its chunks stay mapped; the
  // others unmapped once `s` has passed this point.
  void release(std::size_t b, std::size_t e, cudaStream_t s) {
    if (b >= e) return;
    pool_.on_this_thread();
    live_.remove(b, e);
    for_chunks(b, e, [&](std::size_t c) {
      Chunk& k = chunks_[c];
      if (k.handle == 0) return;
      if (has_live(c)) {
        const std::size_t lo = std::max(b, c * pool_.chunk()), hi = std::min(e, (c + 1) * pool_.chunk());
        FIVED_CUDA_CHECK(cudaMemsetAsync(reinterpret_cast<void*>(base_ + lo), 0, hi - lo, s));
        return;
      }
      if (k.done == nullptr) FIVED_CUDA_CHECK(cudaEventCreateWithFlags(&k.done, cudaEventDisableTiming));
      FIVED_CUDA_CHECK(cudaEventRecord(k.done, s));
      if (!k.pending) {
        k.pending = true;
        pending_.push_back(c);
      }
      k.released_at = pool_.next_release();
    });
  }

  // [b, e) is about to be written on `s`: every chunk under it mapped; a chunk mapped now
  // reads as zeros on `s`.
  void commit(std::size_t b, std::size_t e, cudaStream_t s) {
    if (b >= e) return;
    pool_.on_this_thread();
    live_.add(b, e);
    for_chunks(b, e, [&](std::size_t c) {  // released, not unmapped yet: kept, after its release
      Chunk& k = chunks_[c];
      if (!k.pending) return;
      k.pending = false;
      pending_.erase(std::find(pending_.begin(), pending_.end(), c));
      FIVED_CUDA_CHECK(cudaStreamWaitEvent(s, k.done, 0));
      zero_chunk(c, s);
    });
    for_chunks(b, e, [&](std::size_t c) {  // the rest from the pool (a chunk mapped with live
      if (chunks_[c].handle != 0) return;  // bytes beside: its released part was zeroed then)
      chunks_[c].handle = pool_.take();
      map(c);
      zero_chunk(c, s);
    });
  }

  // Unmaps the chunks whose release the device has passed (wait: all of them, waiting).
  // Returns them to the pool.
  void reap(bool wait) {
    std::size_t kept = 0;
    for (std::size_t c : pending_) {
      Chunk& k = chunks_[c];
      const cudaError_t q = wait ? cudaEventSynchronize(k.done) : cudaEventQuery(k.done);
      if (q == cudaErrorNotReady) {
        pending_[kept++] = c;
        continue;
      }
      FIVED_CUDA_CHECK(q);
      k.pending = false;
      unmap(c);
    }
    pending_.resize(kept);
  }
  // The pending release the pool should wait for first: (its order, this buffer), or none.
  std::uint64_t oldest_pending() const {
    std::uint64_t o = 0;
    for (std::size_t c : pending_)
      if (o == 0 || chunks_[c].released_at < o) o = chunks_[c].released_at;
    return o;
  }
  void wait_for(std::uint64_t order) {
    for (std::size_t c : pending_)
      if (chunks_[c].released_at == order) FIVED_CUDA_CHECK(cudaEventSynchronize(chunks_[c].done));
    reap(false);
  }

 private:
  struct Chunk {
    CUmemGenericAllocationHandle handle = 0;  // 0: unmapped
    bool pending = false;                     // mapped, nothing live: unmapped once `done` has passed
    std::uint64_t released_at = 0;            // the order of its release among the pool's
    cudaEvent_t done = nullptr;
  };

  template <class F>
  void for_chunks(std::size_t b, std::size_t e, F&& f) const {
    if (b >= e) return;
    for (std::size_t c = b / pool_.chunk(); c <= (e - 1) / pool_.chunk(); ++c) f(c);
  }
  bool has_live(std::size_t c) const { return live_.intersects(c * pool_.chunk(), (c + 1) * pool_.chunk()); }
  void zero_chunk(std::size_t c, cudaStream_t s) {
    FIVED_CUDA_CHECK(cudaMemsetAsync(reinterpret_cast<void*>(base_ + c * pool_.chunk()), 0, pool_.chunk(), s));
  }
  void map(std::size_t c) {
    const CUdeviceptr at = base_ + c * pool_.chunk();
    FIVED_CU_CHECK(driver().mem_map(at, pool_.chunk(), 0, chunks_[c].handle, 0));
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = pool_.device();
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    FIVED_CU_CHECK(driver().mem_set_access(at, pool_.chunk(), &access, 1));
    PageStats& st = pool_.stats();
    st.peak_mapped = std::max(st.peak_mapped, st.mapped += pool_.chunk());
  }
  void unmap(std::size_t c) {
    FIVED_CU_CHECK(driver().mem_unmap(base_ + c * pool_.chunk(), pool_.chunk()));
    pool_.give(std::exchange(chunks_[c].handle, 0));
    pool_.stats().mapped -= pool_.chunk();
  }
  void destroy() noexcept {
    if (base_ == 0) return;
    (void)cudaDeviceSynchronize();  // nothing queued may still use the chunks
    for (std::size_t c = 0; c < chunks_.size(); ++c) {
      Chunk& k = chunks_[c];
      if (k.handle != 0) {
        (void)driver().mem_unmap(base_ + c * pool_.chunk(), pool_.chunk());
        pool_.give(std::exchange(k.handle, 0));
        pool_.stats().mapped -= pool_.chunk();
      }
      if (k.done != nullptr) (void)cudaEventDestroy(k.done);
    }
    (void)driver().mem_address_free(base_, chunks_.size() * pool_.chunk());
    pool_.remove(this);
    base_ = 0;
  }

  pages_detail::Pool& pool_;
  std::size_t bytes_ = 0;
  CUdeviceptr base_ = 0;
  std::vector<Chunk> chunks_;
  std::vector<std::size_t> pending_;  // chunks released and not yet unmapped
  LiveRanges live_;  // committed and not released since
};

namespace pages_detail {

inline PagedMemory* Pool::find(const void* p) const {
  for (PagedMemory* m : buffers_)
    if (m->holds(p)) return m;
  return nullptr;
}

inline void Pool::reap(bool wait) {
  for (PagedMemory* m : buffers_) m->reap(wait);
}

inline CUmemGenericAllocationHandle Pool::take() {
  if (free_.empty()) reap(false);
  while (free_.empty()) {  // the oldest release first: the device reaches it soonest
    PagedMemory* oldest = nullptr;
    std::uint64_t order = 0;
    for (PagedMemory* m : buffers_) {
      const std::uint64_t o = m->oldest_pending();
      if (o != 0 && (order == 0 || o < order)) order = o, oldest = m;
    }
    if (oldest == nullptr) break;
    oldest->wait_for(order);
  }
  if (!free_.empty()) {
    const CUmemGenericAllocationHandle h = free_.back();
    free_.pop_back();
    return h;
  }
  CUmemGenericAllocationHandle h = 0;
  FIVED_CU_CHECK(driver().mem_create(&h, chunk_, &prop_, 0));
  stats_.held += chunk_;
  ++stats_.chunks_created;
  return h;
}

}  // namespace pages_detail

inline PageStats page_stats() { return pages_detail::Pool::get().stats(); }
inline void reset_page_peak() {
  PageStats& s = pages_detail::Pool::get().stats();
  s.peak_mapped = s.mapped;
}
// Waits for every pending release and unmaps it (a measurement's or a test's settling
// point: the host waits for the device).
inline void settle_pages() { pages_detail::Pool::get().reap(true); }
// settle_pages, then the pool's free chunks back to the driver: after a buffer has given
// back what it will not hold again (ZeRO's shards cut, a model freed), so that the pool
// grows back only to what a step holds at once.
inline void trim_pages() {
  settle_pages();
  pages_detail::Pool::get().trim();
}

namespace pages_detail {

// The releasable buffer holding `range`, and the range's byte offsets in it (none: plain memory).
struct Located {
  PagedMemory* memory = nullptr;
  std::size_t begin = 0, end = 0;
};
inline Located locate(const void* p, std::size_t bytes) {
  PagedMemory* m = Pool::get().find(p);
  if (m == nullptr) return {};
  const auto b = static_cast<std::size_t>(static_cast<const std::byte*>(p) - static_cast<const std::byte*>(m->data()));
  return {m, b, b + bytes};
}

}  // namespace pages_detail

// Gives `range` back: zeroed where its chunks stay mapped, the others unmapped once `stream`
// has passed this point. A range outside every releasable buffer is only zeroed.
template <class T>
void release_pages(std::span<T> range, cudaStream_t stream) {
  if (range.empty()) return;
  const pages_detail::Located at = pages_detail::locate(range.data(), range.size_bytes());
  if (at.memory == nullptr) FIVED_CUDA_CHECK(cudaMemsetAsync(range.data(), 0, range.size_bytes(), stream));
  else at.memory->release(at.begin, at.end, stream);
}

// Before `range` is written on `stream` again: mapped, reading as zeros where it was given
// back. Nothing to do outside releasable buffers.
template <class T>
void commit_pages(std::span<T> range, cudaStream_t stream) {
  if (range.empty()) return;
  const pages_detail::Located at = pages_detail::locate(range.data(), range.size_bytes());
  if (at.memory != nullptr) at.memory->commit(at.begin, at.end, stream);
}

// Bytes of device memory mapped under `range` (whole chunks; plain memory counts whole).
template <class T>
std::size_t resident_bytes(std::span<const T> range) {
  if (range.empty()) return 0;
  const pages_detail::Located at = pages_detail::locate(range.data(), range.size_bytes());
  return at.memory == nullptr ? range.size_bytes() : at.memory->resident(at.begin, at.end);
}

}  // namespace fived::cuda
