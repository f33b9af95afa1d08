// The CUDA backend's steps run on the host: a launcher that calls each body once per index, in
// blocks of an odd size visited last block first (a body that depends on the order in which
// threads run, or reads past its index range, shows up here under ASan / UBSan), a stable sort
// standing in for CUB's radix sort, std::exclusive_scan for CUB's scan, and a GEMM standing in
// for cuBLAS's strided batched GEMM: the same arguments, checked as cuBLAS checks them, the
// referenced sub-matrices of A and B (exactly those the transposes, leading dimensions and
// strides name) converted to f32 and multiplied by OpenBLAS's column-major cblas_sgemm, one call
// per batch entry. Block-level steps (for_blocks, cuda/detail/block_steps.hpp) run block by
// block, last block first, every CUDA thread of a block a fiber with real barriers (fiber_block),
// the block's shared memory one buffer filled with 0xff bytes before each block (ASan sees every
// access past it); the blocks count their tile products and exponentials (the cost model's).
#pragma once

#include <cblas.h>

#include <ucontext.h>
#include <algorithm>
#include <memory>
#include <stdexcept>
#include <string>
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#endif
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <vector>

#include <infkv/cuda/detail/archive_steps.hpp>
#include <infkv/cuda/detail/cache_steps.hpp>

namespace infkv_test {

/// cublasGemmStridedBatchedEx's semantics on the host (column-major; strides and leading
/// dimensions in elements; C is f32, computed in f32). Raises invalid_argument where cuBLAS would
/// answer CUBLAS_STATUS_INVALID_VALUE (or not support the types).
inline void host_gemm_strided_batched(infkv::cuda::blas_op transa, infkv::cuda::blas_op transb, std::int64_t m,
                                      std::int64_t n, std::int64_t k, float alpha, const void* a, infkv::dtype atype,
                                      std::int64_t lda, std::int64_t stride_a, const void* b, infkv::dtype btype,
                                      std::int64_t ldb, std::int64_t stride_b, float beta, void* c, infkv::dtype ctype,
                                      std::int64_t ldc, std::int64_t stride_c, std::int64_t batch) {
  using infkv::cuda::blas_op;
  constexpr std::int64_t most = std::numeric_limits<int>::max();
  const std::int64_t ar = transa == blas_op::n ? m : k, ac = transa == blas_op::n ? k : m;  // A as stored
  const std::int64_t br = transb == blas_op::n ? k : n, bc = transb == blas_op::n ? n : k;
  INFKV_REQUIRE(m >= 0 && n >= 0 && k >= 0 && batch >= 0 && m <= most && n <= most && k <= most && batch <= most,
                "gemm sizes", m, "m, n, k and batchCount must be in [0, 2^31)");
  INFKV_REQUIRE(lda >= std::max<std::int64_t>(1, ar) && lda <= most, "lda", lda, "must be >= max(1, ", ar, ")");
  INFKV_REQUIRE(ldb >= std::max<std::int64_t>(1, br) && ldb <= most, "ldb", ldb, "must be >= max(1, ", br, ")");
  INFKV_REQUIRE(ldc >= std::max<std::int64_t>(1, m) && ldc <= most, "ldc", ldc, "must be >= max(1, ", m, ")");
  INFKV_REQUIRE(ctype == infkv::dtype::f32, "Ctype", infkv::to_string(ctype), "must be f32");
  INFKV_REQUIRE(atype == btype, "Atype", infkv::to_string(atype), "must equal Btype (", infkv::to_string(btype), ")");
  if (m == 0 || n == 0) return;
  const auto as_f32 = [](const void* base, infkv::dtype t, std::int64_t rows, std::int64_t cols, std::int64_t ld) {
    std::vector<float> out(std::size_t(rows * cols));
    const auto* bytes = static_cast<const std::byte*>(base);
    for (std::int64_t col = 0; col < cols; ++col)
      for (std::int64_t row = 0; row < rows; ++row)
        out[std::size_t(col * rows + row)] =
            infkv::cuda::detail::load(t, bytes + (col * ld) * std::int64_t(infkv::size_of(t)), row);
    return out;
  };
  static const bool one_thread = (openblas_set_num_threads(1), true);  // the tests share two cores
  (void)one_thread;
  const std::int64_t ea = std::int64_t(infkv::size_of(atype)), eb = std::int64_t(infkv::size_of(btype));
  for (std::int64_t x = 0; x < batch; ++x) {
    float* cx = static_cast<float*>(c) + x * stride_c;
    if (k == 0) {  // C = beta C (BLAS leaves it so; no A or B element is read)
      for (std::int64_t col = 0; col < n; ++col)
        for (std::int64_t row = 0; row < m; ++row) cx[col * ldc + row] = beta == 0.f ? 0.f : beta * cx[col * ldc + row];
      continue;
    }
    const std::vector<float> af = as_f32(static_cast<const std::byte*>(a) + x * stride_a * ea, atype, ar, ac, lda);
    const std::vector<float> bf = as_f32(static_cast<const std::byte*>(b) + x * stride_b * eb, btype, br, bc, ldb);
    cblas_sgemm(CblasColMajor, transa == blas_op::n ? CblasNoTrans : CblasTrans,
                transb == blas_op::n ? CblasNoTrans : CblasTrans, int(m), int(n), int(k), alpha, af.data(), int(ar),
                bf.data(), int(br), beta, cx, int(ldc));
  }
}

/// One block of CUDA threads emulated on the calling thread: every CUDA thread a fiber
/// (ucontext) with a stack of its own, run until it reaches a barrier or returns, the highest
/// thread first; a barrier releases its waiters when every thread of the block (ctx.sync) or of
/// the warp (ctx.warp_sync) that has not returned has arrived. So a body that reads what another
/// thread writes before a barrier separates them reads the 0xff bytes shared memory starts with
/// (NaN as floats), deterministically. Threads all waiting at barriers that can no longer open
/// raise logic_error, and so does a block whose threads passed different numbers of block
/// barriers (a barrier in divergent code: undefined on a GPU). ASan is told of every stack switch.
class fiber_block {
 public:
  struct context {
    std::int64_t block;
    int thread, threads;
    std::byte* shared;
    fiber_block* self;
    void sync() const { self->wait(0); }
    void warp_sync() const { self->wait(1 + thread / 32); }
    /// Counts, for the cost model: one warp's 16 x 16 x k tile product, one exponential.
    void count_product(int k) const { product_flops += 2.0 * 16 * 16 * k; }
    void count_exp() const { ++exps; }
  };
  /// Tensor-core FLOPs and exponentials of block-level steps run so far (any thread).
  static inline double product_flops = 0, exps = 0;

  fiber_block(int threads, std::size_t shared) : threads_(threads), shared_(shared), fibers_(std::size_t(threads)) {
    if (threads < 32 || threads > 1024 || threads % 32 != 0)
      throw std::invalid_argument("for_blocks: threads = " + std::to_string(threads) +
                                  " (a multiple of 32 up to 1024)");
    for (fiber& f : fibers_) f.stack.reset(new std::byte[stack_bytes]);  // untouched pages stay unmapped
  }

  template <class F>
  void run(std::int64_t block, F& body) {
    std::fill(shared_.begin(), shared_.end(), std::byte{0xff});
    bars_.assign(std::size_t(1 + threads_ / 32), barrier{});
    bars_[0].expected = threads_;
    for (std::size_t w = 1; w < bars_.size(); ++w) bars_[w].expected = 32;
    struct call {
      F* body;
      std::int64_t block;
      static void enter(void* p, fiber_block* self, int t) {
        const auto* c = static_cast<const call*>(p);
        (*c->body)(context{c->block, t, self->threads_, self->shared_.data(), self});
      }
    } c{&body, block};
    body_ = &c;
    enter_ = &call::enter;
    for (int t = 0; t < threads_; ++t) {
      fiber& f = fibers_[std::size_t(t)];
      f.state = phase::runnable, f.syncs = 0, f.waiting = -1, f.fake = nullptr;
      getcontext(&f.uc);
      f.uc.uc_stack.ss_sp = f.stack.get();
      f.uc.uc_stack.ss_size = stack_bytes;
      f.uc.uc_link = nullptr;
      makecontext(&f.uc, reinterpret_cast<void (*)()>(&fiber_block::trampoline), 0);
    }
    for (int done = 0; done < threads_;) {
      bool ran = false;
      for (int t = threads_ - 1; t >= 0; --t) {
        if (fibers_[std::size_t(t)].state != phase::runnable) continue;
        ran = true;
        switch_to(t);
        if (fibers_[std::size_t(t)].state == phase::done) ++done;
      }
      if (!ran && done < threads_)
        throw std::logic_error("for_blocks: in block " + std::to_string(block) +
                               " every thread left waits at a barrier the others no longer reach");
    }
    for (const fiber& f : fibers_)
      if (f.syncs != fibers_[0].syncs)
        throw std::logic_error("for_blocks: the threads of block " + std::to_string(block) +
                               " passed different numbers of block barriers");
  }

 private:
  static constexpr std::size_t stack_bytes = std::size_t(256) << 10;
  enum class phase { runnable, waiting, done };
  struct fiber {
    ucontext_t uc{};
    std::unique_ptr<std::byte[]> stack;
    phase state = phase::runnable;
    int syncs = 0, waiting = -1;
    void* fake = nullptr;  ///< ASan's fake stack of this fiber while switched away
  };
  struct barrier {
    int expected = 0, arrived = 0;
  };

  static inline thread_local fiber_block* current_ = nullptr;
  int threads_, running_ = -1;
  std::vector<std::byte> shared_;
  std::vector<fiber> fibers_;
  std::vector<barrier> bars_;
  ucontext_t main_{};
  void* body_ = nullptr;
  void (*enter_)(void*, fiber_block*, int) = nullptr;

  static void trampoline() {
    fiber_block* self = current_;
    self->resumed();
    const int t = self->running_;
    self->enter_(self->body_, self, t);
    fiber& f = self->fibers_[std::size_t(t)];
    f.state = phase::done;
    self->leave(0);
    self->leave(1 + t / 32);
    self->yield(true);
  }

  /// Arrives at barrier b (0: the block's, 1 + w: warp w's); returns when it opens.
  void wait(int b) {
    fiber& f = fibers_[std::size_t(running_)];
    if (b == 0) ++f.syncs;
    barrier& bar = bars_[std::size_t(b)];
    if (++bar.arrived == bar.expected) {
      open(b);
      return;
    }
    f.state = phase::waiting, f.waiting = b;
    yield(false);
  }
  /// A returned thread leaves barrier b: the others no longer wait for it.
  void leave(int b) {
    barrier& bar = bars_[std::size_t(b)];
    --bar.expected;
    if (bar.arrived > 0 && bar.arrived == bar.expected) open(b);
  }
  void open(int b) {
    bars_[std::size_t(b)].arrived = 0;
    for (fiber& g : fibers_)
      if (g.state == phase::waiting && g.waiting == b) g.state = phase::runnable, g.waiting = -1;
  }

  void switch_to(int t) {
    running_ = t;
    current_ = this;
    fiber& f = fibers_[std::size_t(t)];
    start_switch(&main_fake_, f.stack.get(), stack_bytes);
    swapcontext(&main_, &f.uc);
    finish_switch(main_fake_, nullptr, nullptr);
  }
  /// Back to the scheduler (`last`: the fiber has returned and is never resumed).
  void yield(bool last) {
    fiber& f = fibers_[std::size_t(running_)];
    start_switch(last ? nullptr : &f.fake, main_bottom_, main_size_);
    if (last) {
      setcontext(&main_);
    } else {
      swapcontext(&f.uc, &main_);
      resumed();
    }
  }
  /// In a fiber that has just been switched to: tells ASan, and learns the scheduler's stack.
  void resumed() { finish_switch(fibers_[std::size_t(running_)].fake, &main_bottom_, &main_size_); }

  // ASan's fiber annotations (nothing without ASan).
  void* main_fake_ = nullptr;
  const void* main_bottom_ = nullptr;
  std::size_t main_size_ = 0;
#if defined(__SANITIZE_ADDRESS__)
  static void start_switch(void** fake, const void* bottom, std::size_t size) {
    __sanitizer_start_switch_fiber(fake, bottom, size);
  }
  static void finish_switch(void* fake, const void** bottom, std::size_t* size) {
    __sanitizer_finish_switch_fiber(fake, bottom, size);
  }
#else
  static void start_switch(void**, const void*, std::size_t) {}
  static void finish_switch(void*, const void**, std::size_t*) {}
#endif
};

struct host_launcher {
  std::int64_t block = 37;

  /// One-thread-per-index launches made so far.
  static inline std::int64_t each_launches = 0;

  template <class F>
  void for_each(std::int64_t n, F f) const {
    ++each_launches;
    const std::int64_t blocks = (n + block - 1) / block;
    for (std::int64_t b = blocks - 1; b >= 0; --b)
      for (std::int64_t t = 0; t < block; ++t)
        if (const std::int64_t i = b * block + t; i < n) f(i);
  }

  using block_context = fiber_block::context;

  /// Block-level launches made so far (the tests check which path a step takes).
  static inline std::int64_t block_launches = 0;

  /// f(ctx) for every thread of `blocks` blocks of `threads` threads (fiber_block).
  template <class F>
  void for_blocks(std::int64_t blocks, int threads, std::size_t shared, F f) const {
    ++block_launches;
    if (blocks <= 0) return;
    fiber_block fb(threads, shared);
    for (std::int64_t b = blocks - 1; b >= 0; --b) fb.run(b, f);
  }

  struct temp_space {
    void sort_pairs(const std::uint64_t* kin, std::uint64_t* kout, const std::int64_t* vin, std::int64_t* vout,
                    std::int64_t n, int bits) const {
      const std::uint64_t mask = bits >= 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << bits) - 1;
      std::vector<std::int64_t> idx(static_cast<std::size_t>(n));
      std::iota(idx.begin(), idx.end(), std::int64_t{0});
      std::stable_sort(idx.begin(), idx.end(),
                       [&](std::int64_t a, std::int64_t b) { return (kin[a] & mask) < (kin[b] & mask); });
      std::vector<std::uint64_t> k(idx.size());
      std::vector<std::int64_t> v(idx.size());
      for (std::size_t i = 0; i < idx.size(); ++i) k[i] = kin[idx[i]], v[i] = vin[idx[i]];
      std::copy(k.begin(), k.end(), kout);
      std::copy(v.begin(), v.end(), vout);
    }
    void exclusive_scan(const std::int64_t* in, std::int64_t* out, std::int64_t n) const {
      std::exclusive_scan(in, in + n, out, std::int64_t{0});
    }
  };
  static std::size_t temp_bytes(std::int64_t) { return 0; }
  temp_space temp(std::span<std::byte>) const { return {}; }

  /// GEMM calls made so far (the tests check which path the window attention takes).
  static inline std::int64_t gemm_calls = 0;
  struct gemmer {
    template <class... A>
    void gemm_strided_batched(A... args) const {
      ++gemm_calls;
      host_gemm_strided_batched(args...);
    }
  };
  static void prepare_gemm() {}
  static std::size_t gemm_scratch_bytes() { return 0; }
  gemmer gemm_scratch(std::span<std::byte>) const { return {}; }
};

/// The CUDA backend's algorithm, run on the host.
using host_cuda_backend = infkv::cuda::basic_backend<host_launcher>;

}  // namespace infkv_test
