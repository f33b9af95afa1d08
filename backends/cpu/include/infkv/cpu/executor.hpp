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

/// Calls f(i) for i in [0, n), split into contiguous chunks over ex.threads threads; the first
/// exception thrown by any f is rethrown in the caller.
template <class F>
void parallel_for(const executor& ex, std::int64_t n, F&& f) {
  infkv::detail::require(ex.threads >= 1, "executor.threads", ex.threads, "must be >= 1");
  const std::int64_t workers = std::min<std::int64_t>(ex.threads, n);
  if (workers <= 1) {
    for (std::int64_t i = 0; i < n; ++i) f(i);
    return;
  }
  std::exception_ptr err;
  std::mutex m;
  std::vector<std::thread> pool;
  for (std::int64_t w = 0; w < workers; ++w)
    pool.emplace_back([&, w] {
      try {
        for (std::int64_t i = n * w / workers; i < n * (w + 1) / workers; ++i) f(i);
      } catch (...) {
        std::lock_guard lock(m);
        if (!err) err = std::current_exception();
      }
    });
  for (auto& t : pool) t.join();
  if (err) std::rethrow_exception(err);
}

}  // namespace infkv::cpu
