#pragma once
// Writing a sharded checkpoint (train/checkpoint.hpp), now or behind the training.
//
//   checkpoint::Shard shard;                        // this rank's state, copied out of the model
//   shard.add("params/wte/0", std::vector<float>{...});
//   checkpoint::Saver saver;
//   saver.save(std::move(shard), record, world);     // returns when the step is committed
//   saver.start(std::move(shard), record, comm);     // returns at once; a thread writes it
//   int step = saver.wait();                         // the background save's step (0: none)
//
// A save is a collective of the ranks of `comm`: each writes its shard as rank-<r>.safetensors
// in dir/step-<step>/, every file's size and hash go to rank 0 (an all-reduce, which also says
// that every file is written), and rank 0 reads the files' headers for the index and writes the manifest (the commit: a step is complete
// only with it), removes what killed saves left and, with keep_last, the oldest complete steps.
//
// A background save holds its shard (the values were copied when the caller made it, so
// training may change the model meanwhile) and needs a communicator that nothing else uses
// while it runs: the caller's training collectives go on in the meantime (NCCL forbids two
// threads on one communicator; the host backend refuses it too). The next save, wait() or
// the saver's end waits for it; its error, if any, is rethrown by wait() (the destructor
// prints it). A kill while it writes loses nothing older: the manifest is written last.

#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <future>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "fived/comm/group_comm.hpp"
#include "fived/io/safetensors.hpp"
#include "fived/train/checkpoint.hpp"

namespace fived::checkpoint {

// A rank's file of a checkpoint: named tensors (one dimension, any element type) and
// metadata, with the values they hold (the writer only points at them), and each tensor's
// hash in the metadata.
class Shard {
 public:
  template <class U>
  void add(std::string name, std::vector<U> values) {
    auto kept = std::make_shared<const std::vector<U>>(std::move(values));
    util::Fnv1a64 h;
    h.add(std::as_bytes(std::span<const U>(*kept)));
    writer_.add_metadata(hash_key(name), detail::hex(h.value()));
    writer_.add(std::move(name), {static_cast<std::int64_t>(kept->size())}, std::span<const U>(*kept));
    held_.push_back(std::move(kept));
  }
  void add_metadata(std::string key, std::string value) { writer_.add_metadata(std::move(key), std::move(value)); }
  void write(const std::filesystem::path& file) const { writer_.write(file); }

 private:
  io::SafetensorsWriter writer_;
  std::vector<std::shared_ptr<const void>> held_;
};

// What a save records besides the files: where, which step, and the manifest's fields.
struct SaveRecord {
  std::filesystem::path dir;
  int step = 0, adam_step = 0;
  std::string mesh, model;
  std::map<std::string, std::string> run;
  int keep_last = 0;  // > 0: remove complete steps older than the newest keep_last
};

class Saver {
 public:
  Saver() = default;
  Saver(const Saver&) = delete;
  Saver& operator=(const Saver&) = delete;
  ~Saver() {
    if (!pending_.valid()) return;
    try {
      pending_.get();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "fived: a background checkpoint save failed: %s\n", e.what());
    }
  }

  // Writes and commits the save; returns when the step is complete on every rank.
  void save(const Shard& shard, const SaveRecord& record, GroupComm& comm) {
    wait();
    commit(shard, record, comm);
  }

  // The same in a thread of its own; returns at once. `comm` must outlive the save, and be
  // used by nothing else until wait() returns.
  void start(Shard shard, SaveRecord record, GroupComm& comm) {
    wait();
    pending_ = std::async(std::launch::async, [shard = std::move(shard), record = std::move(record), &comm] {
      comm.bind_thread();  // NCCL: the rank's device, not the new thread's device 0
      commit(shard, record, comm);
      return record.step;
    });
  }

  // Waits for the background save: its step, or 0 when none was pending; its error rethrown.
  int wait() { return pending_.valid() ? pending_.get() : 0; }

  // The collective every save ends in (see the top of this file).
  static void commit(const Shard& shard, const SaveRecord& r, GroupComm& comm) {
    const std::filesystem::path folder = step_folder(r.dir, r.step);
    std::filesystem::create_directories(folder);
    const int rank = comm.rank(), world = comm.size();
    const std::filesystem::path mine = folder / rank_file(rank);
    shard.write(mine);
    // every file's size and hash to rank 0 (as doubles: 32-bit halves, summed over the ranks)
    const std::uint64_t h = file_hash(mine), n = std::filesystem::file_size(mine);
    std::vector<double> all(3 * static_cast<std::size_t>(world), 0.0);
    const auto at = 3 * static_cast<std::size_t>(rank);
    all[at] = static_cast<double>(h >> 32), all[at + 1] = static_cast<double>(h & 0xffffffffu);
    all[at + 2] = static_cast<double>(n);
    comm.all_reduce_host(std::span<double>(all), ReduceOp::sum);  // also: every file is written
    if (rank == 0) {
      Manifest m{r.step, r.adam_step, world, r.mesh, r.model, {}, r.run};
      for (int q = 0; q < world; ++q) {
        const auto i = 3 * static_cast<std::size_t>(q);
        FileEntry& e = m.files.emplace_back(FileEntry{
            rank_file(q), static_cast<std::uint64_t>(all[i + 2]),
            static_cast<std::uint64_t>(all[i]) << 32 | static_cast<std::uint64_t>(all[i + 1])});
        index_file(io::SafetensorsFile::read_header(folder / e.name), e);
      }
      write_manifest(folder, m);
      remove_leftovers(r.dir, r.step);
      if (r.keep_last > 0) (void)keep_last(r.dir, r.keep_last);
    }
    comm.barrier();
  }

 private:
  std::future<int> pending_;
};

}  // namespace fived::checkpoint
