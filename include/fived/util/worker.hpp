#pragma once
// One background thread that runs tasks in the order they were submitted: the host
// backend's communication stream. A data-parallel trainer submits each bucket's reduction
// as soon as backward has finished it and goes on with backward; it waits for a task (a
// ZeRO-3 gather it is about to use) or for all of them (before it touches the gradients
// again) through tickets.
//
//   fived::Worker w;
//   auto t = w.submit([&] { comm.all_reduce(bucket, ReduceOp::avg); });
//   ...                    // compute goes on
//   w.wait(t);             // that task and every one before it are done
//   w.drain();             // every task submitted so far is done
//
// An exception in a task is kept; the tasks after it are skipped, and wait() and drain()
// rethrow it, so a failed collective surfaces in the thread that waits. The destructor
// runs what is still queued (skipping it after a failure) and joins.

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

namespace fived {

class Worker {
 public:
  Worker() : thread_([this] { loop(); }) {}
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;
  ~Worker() {
    {
      std::lock_guard lk(mu_);
      stop_ = true;
    }
    more_.notify_all();
    thread_.join();
  }

  // Queues `task`; returns its ticket for wait().
  std::uint64_t submit(std::function<void()> task) {
    std::lock_guard lk(mu_);
    queue_.push_back(std::move(task));
    more_.notify_all();
    return ++submitted_;
  }

  // Blocks until the task with this ticket (and every earlier one) has run.
  void wait(std::uint64_t ticket) {
    std::unique_lock lk(mu_);
    done_.wait(lk, [&] { return completed_ >= ticket; });
    if (error_) std::rethrow_exception(error_);
  }
  void drain() {
    std::uint64_t last = 0;
    {
      std::lock_guard lk(mu_);
      last = submitted_;
    }
    wait(last);
  }
  bool idle() const {
    std::lock_guard lk(mu_);
    return completed_ == submitted_;
  }

 private:
  void loop() {
    for (;;) {
      std::function<void()> task;
      bool skip = false;
      {
        std::unique_lock lk(mu_);
        more_.wait(lk, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        task = std::move(queue_.front());
        queue_.pop_front();
        skip = error_ != nullptr;
      }
      std::exception_ptr e;
      if (!skip) {
        try {
          task();
        } catch (...) {
          e = std::current_exception();
        }
      }
      {
        std::lock_guard lk(mu_);
        if (e && !error_) error_ = e;
        ++completed_;
      }
      done_.notify_all();
    }
  }

  mutable std::mutex mu_;
  std::condition_variable more_, done_;
  std::deque<std::function<void()>> queue_;
  std::uint64_t submitted_ = 0, completed_ = 0;
  std::exception_ptr error_;
  bool stop_ = false;
  std::thread thread_;  // last: it starts once everything above exists
};

}  // namespace fived
