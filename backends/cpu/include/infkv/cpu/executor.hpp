// infkv CPU backend: the executor (how many threads the caller lends) and a parallel loop.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include <infkv/error.hpp>

namespace infkv::cpu {

/// Where CPU work runs: `threads` worker threads (1 = the calling thread only). No global pool:
/// threads live for one call.
struct executor {
  int threads = 1;
};

/// Calls f(w, i) for i in [0, n), split into contiguous chunks over min(ex.threads, n) workers
/// w = 0, 1, ... (worker 0 is the calling thread; the others live for this call); the first
/// exception thrown by any f is rethrown in the caller. With one worker nothing is allocated.
/// How many workers `ex` runs for n items: min(ex.threads, n); checks the thread count. Scratch
/// sized per worker uses it too.
inline std::int64_t workers(const executor& ex, std::int64_t n) {
  INFKV_REQUIRE(ex.threads >= 1, "executor.threads", ex.threads, "must be >= 1");
  return std::min<std::int64_t>(ex.threads, n);
}

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
      std::lock_guard lock(m);
      if (!err) err = std::current_exception();
    }
  };
  std::vector<std::thread> pool;
  for (std::int64_t w = 1; w < workers; ++w) pool.emplace_back(work, w);
  work(0);
  for (auto& t : pool) t.join();
  if (err) std::rethrow_exception(err);
}

/// Calls f(i) for i in [0, n) over ex.threads threads (see parallel_for_workers).
template <class F>
void parallel_for(const executor& ex, std::int64_t n, F&& f) {
  parallel_for_workers(ex, n, [&](std::int64_t, std::int64_t i) { f(i); });
}

}  // namespace infkv::cpu
