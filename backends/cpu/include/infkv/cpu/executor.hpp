// infkv CPU backend: where CPU work runs. An executor names a thread count, and optionally a
// pool of threads an engine lends (its own workers, or a cpu::thread_pool that lives as long as
// the engine); without one, the threads of a parallel loop live for that loop.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <concepts>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <infkv/error.hpp>

namespace infkv::cpu {

/// A non-owning reference to a callable `void(std::int64_t) const`: what a pool runs, passed
/// without allocating. The callable must outlive the reference.
class job_ref {
 public:
  template <class F>
  requires(!std::same_as<std::decay_t<F>, job_ref> && std::invocable<const F&, std::int64_t>)
      job_ref(const F& f)  // NOLINT: implicit, as a function parameter
      : obj_(std::addressof(f)), call_([](const void* o, std::int64_t w) { (*static_cast<const F*>(o))(w); }) {}
  void operator()(std::int64_t w) const { call_(obj_, w); }

 private:
  const void* obj_;
  void (*call_)(const void*, std::int64_t);
};

/// Threads an engine lends to infkv. `run(n, job)` calls job(w) for every worker w in [0, n)
/// (n <= size()), all at once, and returns when every call has returned; job(0) may run on the
/// calling thread. Jobs do not throw (the parallel loops catch inside). Implement it over an
/// engine's own thread pool, or use cpu::thread_pool.
class worker_pool {
 public:
  virtual ~worker_pool() = default;
  /// Workers that can run at once, the calling thread included (>= 1).
  virtual int size() const = 0;
  virtual void run(std::int64_t n, job_ref job) = 0;
};

/// A worker_pool of `threads - 1` persistent threads plus the calling thread. Between jobs a
/// worker polls for the next one for up to 50 us before it sleeps, so the back-to-back parallel
/// loops of one eviction start without a wake-up. One run at a time (concurrent callers wait for each
/// other); a job must not run the same pool again.
class thread_pool final : public worker_pool {
 public:
  explicit thread_pool(int threads) : size_(threads) {
    INFKV_REQUIRE(threads >= 1, "thread_pool.threads", threads, "must be >= 1");
    for (int w = 1; w < threads; ++w) threads_.emplace_back([this, w] { loop(w); });
  }
  ~thread_pool() override {
    {
      const std::lock_guard lock(m_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
  }
  thread_pool(const thread_pool&) = delete;
  thread_pool& operator=(const thread_pool&) = delete;

  int size() const override { return size_; }

  void run(std::int64_t n, job_ref job) override {
    INFKV_REQUIRE(n >= 0 && n <= size_, "workers", n, "must be in [0, thread_pool.size() = ", size_, "]");
    if (n == 0) return;
    const std::lock_guard one_run(run_);
    job_ = &job, n_ = n;  // every worker has checked in for the previous run: none reads these now
    pending_.store(size_ - 1, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);  // publishes job_ and n_
    {
      const std::lock_guard lock(m_);  // a worker about to sleep sees the new generation or the notify
    }
    wake_.notify_all();
    job(0);
    if (!spin([&] { return pending_.load(std::memory_order_acquire) == 0; })) {
      std::unique_lock lock(m_);
      done_.wait(lock, [&] { return pending_.load(std::memory_order_acquire) == 0; });
    }
  }

 private:
  /// Polls `ready` for up to 50 microseconds; true when it became true.
  template <class F>
  static bool spin(F&& ready) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(50);
    do {
      for (int i = 0; i < 64; ++i) {
        if (ready()) return true;
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
        __builtin_ia32_pause();
#else
        std::this_thread::yield();
#endif
      }
    } while (std::chrono::steady_clock::now() < until);
    return ready();
  }

  void loop(std::int64_t w) {
    std::uint64_t seen = 0;
    for (;;) {
      const auto fresh = [&] { return generation_.load(std::memory_order_acquire) != seen; };
      if (!spin(fresh)) {
        std::unique_lock lock(m_);
        wake_.wait(lock, [&] { return stop_ || fresh(); });
        if (stop_) return;
      }
      seen = generation_.load(std::memory_order_acquire);
      if (w < n_) (*job_)(w);
      if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {  // every worker checks in, working or not
        const std::lock_guard lock(m_);
        done_.notify_one();
      }
    }
  }

  int size_;
  std::vector<std::thread> threads_;
  std::mutex run_, m_;
  std::condition_variable wake_, done_;
  const job_ref* job_ = nullptr;
  std::int64_t n_ = 0;
  std::atomic<std::int64_t> pending_{0};
  std::atomic<std::uint64_t> generation_{0};
  bool stop_ = false;
};

/// Where CPU work runs: `threads` workers (1 = the calling thread only), from `pool` when one is
/// lent (it must hold at least `threads`), else threads that live for one parallel loop.
struct executor {
  int threads = 1;
  worker_pool* pool = nullptr;
};

/// How many workers `ex` runs for n items: min(ex.threads, n); checks the executor. Scratch sized
/// per worker uses it too.
inline std::int64_t workers(const executor& ex, std::int64_t n) {
  INFKV_REQUIRE(ex.threads >= 1, "executor.threads", ex.threads, "must be >= 1");
  INFKV_REQUIRE(!ex.pool || ex.pool->size() >= ex.threads, "executor.threads", ex.threads,
                "exceeds the lent pool's size (", ex.pool ? ex.pool->size() : 0, ")");
  return std::min<std::int64_t>(ex.threads, n);
}

/// Calls f(w, i) for i in [0, n), split into contiguous chunks over workers(ex, n) workers
/// w = 0, 1, ... (worker 0 is the calling thread); the first exception thrown by any f is
/// rethrown in the caller. The chunks depend only on the worker count, so results do not depend
/// on whether the threads are lent or spawned. With one worker nothing is allocated; with a lent
/// pool nothing either.
template <class F>
void parallel_for_workers(const executor& ex, std::int64_t n, F&& f) {
  const std::int64_t workers = cpu::workers(ex, n);
  if (workers <= 1) {
    for (std::int64_t i = 0; i < n; ++i) f(std::int64_t{0}, i);
    return;
  }
  std::exception_ptr err;
  std::mutex m;
  const auto work = [&](std::int64_t w) {
    try {
      for (std::int64_t i = n * w / workers; i < n * (w + 1) / workers; ++i) f(w, i);
    } catch (...) {
      const std::lock_guard lock(m);
      if (!err) err = std::current_exception();
    }
  };
  if (ex.pool) {
    ex.pool->run(workers, work);
  } else {
    std::vector<std::thread> spawned;
    for (std::int64_t w = 1; w < workers; ++w) spawned.emplace_back(work, w);
    work(0);
    for (auto& t : spawned) t.join();
  }
  if (err) std::rethrow_exception(err);
}

/// Calls f(i) for i in [0, n) over the executor's workers (see parallel_for_workers).
template <class F>
void parallel_for(const executor& ex, std::int64_t n, F&& f) {
  parallel_for_workers(ex, n, [&](std::int64_t, std::int64_t i) { f(i); });
}

}  // namespace infkv::cpu
