// The CPU executor: threads spawned per loop or lent by an engine (worker_pool, thread_pool) run
// the same chunks, every index once, exceptions reach the caller, and a pool serves many loops.
#include <atomic>
#include <cstdint>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include <doctest/doctest.h>
#include <infkv/cpu.hpp>

using namespace infkv;

TEST_CASE("executor: a lent pool runs the same chunks as spawned threads, every index once") {
  cpu::thread_pool pool(4);
  CHECK(pool.size() == 4);
  for (const int threads : {1, 2, 3, 4})
    for (const std::int64_t n : {0, 1, 3, 4, 17, 1000}) {
      CAPTURE(threads);
      CAPTURE(n);
      std::vector<std::int64_t> spawned(std::size_t(n), -1), lent(std::size_t(n), -1);
      cpu::parallel_for_workers({threads}, n, [&](std::int64_t w, std::int64_t i) { spawned[std::size_t(i)] = w; });
      cpu::parallel_for_workers({threads, &pool}, n, [&](std::int64_t w, std::int64_t i) { lent[std::size_t(i)] = w; });
      CHECK(lent == spawned);  // the worker of each index: the chunks do not depend on who runs them
      for (const auto w : lent) CHECK((w >= 0 && w < threads));
    }
}

TEST_CASE("executor: the pool's workers are distinct threads, and the pool serves many loops") {
  cpu::thread_pool pool(3);
  const cpu::executor ex{.threads = 3, .pool = &pool};
  std::atomic<std::int64_t> sum{0}, misplaced{0};
  std::set<std::thread::id> ids;
  std::mutex m;
  for (int round = 0; round < 2000; ++round)
    cpu::parallel_for_workers(ex, 3, [&](std::int64_t w, std::int64_t i) {
      sum += i + 1;
      if (round == 0) {
        const std::lock_guard lock(m);
        ids.insert(std::this_thread::get_id());
      }
      if (w != i) ++misplaced;
    });
  CHECK(sum == 2000 * 6);
  CHECK(misplaced == 0);
  CHECK(ids.size() == 3);
  CHECK(ids.count(std::this_thread::get_id()) == 1);  // worker 0 is the caller
}

TEST_CASE("executor: an exception in any worker reaches the caller, and the pool goes on") {
  cpu::thread_pool pool(2);
  const cpu::executor ex{.threads = 2, .pool = &pool};
  CHECK_THROWS_WITH_AS(cpu::parallel_for(ex, 10,
                                         [](std::int64_t i) {
                                           if (i == 7) throw std::runtime_error("slot 7");
                                         }),
                       "slot 7", std::runtime_error);
  std::atomic<int> count{0};
  cpu::parallel_for(ex, 10, [&](std::int64_t) { ++count; });
  CHECK(count == 10);
}

TEST_CASE("executor: bad executors and pools are refused by name") {
  CHECK_THROWS_WITH_AS(cpu::thread_pool(0), doctest::Contains("thread_pool.threads = 0"), invalid_argument);
  cpu::thread_pool two(2);
  CHECK_THROWS_WITH_AS(cpu::workers({.threads = 3, .pool = &two}, 10),
                       doctest::Contains("executor.threads = 3: exceeds the lent pool's size (2)"), invalid_argument);
  CHECK_THROWS_WITH_AS(cpu::workers({.threads = 0}, 10), doctest::Contains("executor.threads = 0"), invalid_argument);
  CHECK_THROWS_WITH_AS(two.run(3, [](std::int64_t) {}), doctest::Contains("workers = 3"), invalid_argument);
}
