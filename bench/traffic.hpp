// infkv benchmarks: the memory a piece of host code touches, page by page. An arena of anonymous
// memory hands out buffers; while tracking, every page of it starts inaccessible, the first read
// of a page faults once (the handler records it and opens the page for reading), the first write
// faults once more (recorded as written, opened for writing). So a step run on the host between
// begin() and end() reports the distinct bytes it read and wrote in the arena at 4 KiB
// resolution: the traffic a GPU kernel doing the same accesses must move between memory and its
// SMs when nothing it touches is reused from an earlier kernel (the footprint; a page read twice
// counts once). Pages hold many rows, so a step that gathers scattered rows would count whole
// pages it reads a little of: for such buffers begin() takes a precise range, whose every access
// faults (the page opened for one instruction, single-stepped, then closed again) and counts the
// 32-byte sectors it touches, as a GPU's memory moves them; slow (two signals an access), so kept
// to the steps that need it. Linux on x86-64 only (the fault's write bit is the page-fault error
// code's, single steps the trap flag's).
#pragma once

#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

namespace infkv_bench {

class traffic_arena {
 public:
  static constexpr std::size_t page = 4096;

  static constexpr std::size_t sector = 32;

  /// Distinct bytes (whole pages; sectors in the precise range) read and written between begin()
  /// and end().
  struct footprint {
    double read = 0, written = 0;
  };

  explicit traffic_arena(std::size_t bytes) : size_((bytes + page - 1) / page * page) {
    void* p = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("traffic_arena: mmap of " + std::to_string(size_) + " bytes failed");
    base_ = static_cast<std::byte*>(p);
    state_.assign(size_ / page, 0);
    if (current_ != nullptr) throw std::logic_error("traffic_arena: one arena at a time");
    current_ = this;
    struct sigaction sa {};
    sa.sa_sigaction = &traffic_arena::on_fault;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGSEGV, &sa, &previous_) != 0) throw std::runtime_error("traffic_arena: sigaction failed");
    sa.sa_sigaction = &traffic_arena::on_step;
    if (sigaction(SIGTRAP, &sa, &previous_trap_) != 0) throw std::runtime_error("traffic_arena: sigaction failed");
  }
  ~traffic_arena() {
    sigaction(SIGSEGV, &previous_, nullptr);
    sigaction(SIGTRAP, &previous_trap_, nullptr);
    munmap(base_, size_);
    current_ = nullptr;
  }
  traffic_arena(const traffic_arena&) = delete;
  traffic_arena& operator=(const traffic_arena&) = delete;

  /// `bytes` of the arena, 256-byte aligned (cudaMalloc's alignment); throws when it is full.
  template <class T = std::byte>
  T* take(std::size_t count) {
    const std::size_t bytes = (count * sizeof(T) + 255) / 256 * 256;
    if (used_ + bytes > size_)
      throw std::runtime_error("traffic_arena: " + std::to_string(used_ + bytes) + " bytes wanted of " +
                               std::to_string(size_));
    T* p = reinterpret_cast<T*>(base_ + used_);
    used_ += bytes;
    return p;
  }

  /// Starts counting: every page of the arena inaccessible, nothing recorded; the pages that lie
  /// wholly in [precise_begin, precise_end) counted per sector.
  void begin(const void* precise_begin = nullptr, const void* precise_end = nullptr) {
    std::memset(state_.data(), 0, state_.size());
    read_ = written_ = 0;
    lo_ = hi_ = 0;
    if (precise_begin != nullptr) {
      lo_ = (std::size_t(static_cast<const std::byte*>(precise_begin) - base_) + page - 1) / page;
      hi_ = std::size_t(static_cast<const std::byte*>(precise_end) - base_) / page;
      hi_ = std::max(hi_, lo_);
      sectors_.assign((hi_ - lo_) * (page / sector), 0);
    }
    protect(PROT_NONE);
  }
  /// Stops counting (every page accessible again) and returns what was touched since begin().
  footprint end() {
    protect(PROT_READ | PROT_WRITE);
    footprint f{double(read_) * page, double(written_) * page};
    for (const std::uint8_t s : sectors_) f.read += (s & 1) ? sector : 0, f.written += (s & 2) ? sector : 0;
    sectors_.clear();
    lo_ = hi_ = 0;
    return f;
  }

 private:
  static inline traffic_arena* current_ = nullptr;
  std::byte* base_ = nullptr;
  std::size_t size_ = 0, used_ = 0;
  std::vector<std::uint8_t> state_;    ///< per page: bit 0 read, bit 1 written
  std::vector<std::uint8_t> sectors_;  ///< per sector of the precise pages [lo_, hi_): the same bits
  std::size_t read_ = 0, written_ = 0, lo_ = 0, hi_ = 0;
  std::size_t open_[4] = {}, opened_ = 0;  ///< precise pages open for the instruction being stepped
  struct sigaction previous_ {
  }, previous_trap_{};

  void protect(int prot) {
    if (mprotect(base_, size_, prot) != 0) throw std::runtime_error("traffic_arena: mprotect failed");
  }

  static void on_fault(int sig, siginfo_t* info, void* uc) {
    traffic_arena* a = current_;
    auto* at = static_cast<std::byte*>(info->si_addr);
    if (a == nullptr || at < a->base_ || at >= a->base_ + a->size_) {  // not ours: the default action
      signal(sig, SIG_DFL);
      raise(sig);
      return;
    }
#if defined(__x86_64__)
    const bool write = (static_cast<ucontext_t*>(uc)->uc_mcontext.gregs[REG_ERR] & 2) != 0;
#else
#error "traffic_arena reads the page fault's write bit on x86-64 only"
#endif
    const std::size_t p = std::size_t(at - a->base_) / page;
    if (p >= a->lo_ && p < a->hi_) {  // precise: count the sector, open the page for one instruction
      std::uint8_t& s = a->sectors_[(std::size_t(at - a->base_) - a->lo_ * page) / sector];
      s |= write ? 2 : 1;
      if (a->opened_ == std::size(a->open_)) {  // an instruction touching more pages: cannot be
        signal(sig, SIG_DFL);
        raise(sig);
        return;
      }
      a->open_[a->opened_++] = p;
      mprotect(a->base_ + p * page, page, PROT_READ | PROT_WRITE);
      static_cast<ucontext_t*>(uc)->uc_mcontext.gregs[REG_EFL] |= 0x100;  // trap after it
      return;
    }
    std::uint8_t& s = a->state_[p];
    if (write) {
      if (!(s & 2)) ++a->written_;
      s |= 2;
    } else {
      if (!(s & 1)) ++a->read_;
      s |= 1;
    }
    // A page first written is opened for both (its later reads are of what the kernel wrote);
    // one first read is opened for reading only, so its first write faults once more.
    mprotect(a->base_ + p * page, page, (s & 2) ? PROT_READ | PROT_WRITE : PROT_READ);
  }

  /// After a single-stepped instruction: its precise pages closed again.
  static void on_step(int sig, siginfo_t*, void* uc) {
    traffic_arena* a = current_;
    if (a == nullptr || a->opened_ == 0) {
      signal(sig, SIG_DFL);
      raise(sig);
      return;
    }
    for (std::size_t i = 0; i < a->opened_; ++i) mprotect(a->base_ + a->open_[i] * page, page, PROT_NONE);
    a->opened_ = 0;
    static_cast<ucontext_t*>(uc)->uc_mcontext.gregs[REG_EFL] &= ~0x100;
  }
};

}  // namespace infkv_bench
