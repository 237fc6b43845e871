// The SIMT executor (simt.h): a grid's threads as fibers on the stream's
// thread, block after block.
#include "simt.h"

#include <sys/mman.h>

#include <atomic>
#include <bit>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#if !defined(__x86_64__)
#error "the CUDA emulation's SIMT executor switches fibers with x86-64 code (simt.cc)"
#endif

// switch(save, to): pushes the callee-saved registers, stores the stack
// pointer in *save, loads `to` and pops the registers saved there. A new
// fiber's stack holds start's address and, in r12 and r13, the argument and
// the function that start calls (which never returns).
asm(R"(
  .text
  .globl ciuic_simt_switch
  .hidden ciuic_simt_switch
  .type ciuic_simt_switch, @function
ciuic_simt_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size ciuic_simt_switch, .-ciuic_simt_switch

  .globl ciuic_simt_start
  .hidden ciuic_simt_start
  .type ciuic_simt_start, @function
ciuic_simt_start:
  movq %r12, %rdi
  callq *%r13
  ud2
  .size ciuic_simt_start, .-ciuic_simt_start
)");

extern "C" {
void ciuic_simt_switch(void** save, void* to);
void ciuic_simt_start();
}

namespace ciuic::cuda_emulation::simt {
namespace {

constexpr unsigned kMaxThreads = 1024;  // a block's, as on every GPU ciuic targets
constexpr unsigned kWarp = 32;
constexpr size_t kStackBytes = 64 << 10;
constexpr size_t kGuardBytes = 4096;
constexpr size_t kSlotBytes = kStackBytes + kGuardBytes;

enum class State : uint8_t { kRunnable, kAtSync, kAtShuffle, kEnded };

// The seed of the threads' orders: CIUIC_CUDA_EMULATION_SEED, else the
// time, so that each run tries other orders; faults name it, so that a
// failing order can be tried again (with the same executors in the same
// order, the same sequences).
uint64_t SeedBase() {
  static const uint64_t base = [] {
    const char* env = std::getenv("CIUIC_CUDA_EMULATION_SEED");
    if (env != nullptr && *env != '\0')
      return static_cast<uint64_t>(std::strtoull(env, nullptr, 0));
    return static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  }();
  return base;
}

// A GPU thread.
struct Thread {
  void* sp = nullptr;  // where its fiber waits, while it waits
  bool started = false;
  unsigned slot = 0;  // its fiber's stack, once started
  Dim idx;
  State state = State::kRunnable;
  unsigned shuffle_mask = 0;
  unsigned shuffle_lane_mask = 0;
  uint64_t shuffle_in = 0;
  uint64_t shuffle_out = 0;
};

// One per stream thread: runs a block's threads on fibers. The scheduler
// makes passes over the block, in a random order (up or down from a random
// thread: a GPU keeps no order either), resuming each runnable thread. A
// thread not started yet gets a fiber with a free stack; when it ends, its
// fiber goes on with the pass's next threads that have not started, so the
// threads of a kernel that never waits run one after another on one stack.
// When a pass leaves every thread ended or waiting, the barriers that every
// thread concerned reached are released, or the block deadlocks.
//
// kMaxThreads stacks, each above a guard page (set as blocks first need
// the stack).
class Executor {
 public:
  Executor() {
    void* p = mmap(nullptr, kSlotBytes * kMaxThreads, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      std::perror("ciuic CUDA emulation: the SIMT executor's stacks");
      std::abort();
    }
    stacks_ = static_cast<char*>(p);
  }
  ~Executor() { munmap(stacks_, kSlotBytes * kMaxThreads); }
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  bool Run(const char* kernel, unsigned grid, unsigned block, const std::function<void()>& body) {
    grid_dim_ = {grid, 1, 1};
    block_dim_ = {block, 1, 1};
    body_ = &body;
    for (unsigned b = 0; b < grid; ++b) {
      block_idx_ = {b, 0, 0};
      if (!RunBlock(kernel, b, block)) return false;
    }
    return true;
  }

  // From a thread: waits in `state` until the scheduler releases it.
  void Wait(State state) {
    Thread* t = current_;
    t->state = state;
    ++(state == State::kAtSync ? at_sync_ : at_shuffle_);
    ciuic_simt_switch(&t->sp, scheduler_sp_);
  }

  Thread* current() const { return current_; }
  const Dim& block_idx() const { return block_idx_; }
  const Dim& block_dim() const { return block_dim_; }
  const Dim& grid_dim() const { return grid_dim_; }

 private:
  // A fiber: runs current_, then the pass's next threads not started.
  static void FiberMain(Executor* e) {
    Thread* t = e->current_;
    const unsigned slot = t->slot;
    while (true) {
      (*e->body_)();
      t = e->current_;  // the thread now on this stack
      t->state = State::kEnded;
      --e->live_;
      t = e->NextUnstarted();
      if (t == nullptr) break;
      t->started = true;
      t->slot = slot;
      e->current_ = t;
    }
    e->free_[e->free_count_++] = slot;
    void* ended = nullptr;
    ciuic_simt_switch(&ended, e->scheduler_sp_);
    __builtin_trap();  // a fiber that ended is never resumed
  }

  // The pass's next thread if it has not started (skipping those ended or
  // waiting); nullptr at the end of the pass or before a waiting thread
  // that is runnable again, which only the scheduler resumes.
  Thread* NextUnstarted() {
    while (cursor_ < order_count_) {
      Thread* t = &threads_[order_[cursor_]];
      if (t->state != State::kRunnable) {
        ++cursor_;
        continue;
      }
      if (t->started) return nullptr;
      ++cursor_;
      return t;
    }
    return nullptr;
  }

  // A fiber with a free stack, to run `t` first.
  void StartFiber(Thread* t) {
    const unsigned slot = free_[--free_count_];
    while (guarded_ <= slot) mprotect(stacks_ + kSlotBytes * guarded_++, kGuardBytes, PROT_NONE);
    auto top = reinterpret_cast<uintptr_t>(stacks_ + kSlotBytes * (slot + 1)) & ~uintptr_t{15};
    // What ciuic_simt_switch pops: r15 r14 r13 r12 rbx rbp, then the return
    // address; start's call then finds the stack 16-byte aligned.
    auto* sp = reinterpret_cast<uintptr_t*>(top) - 7;
    sp[0] = sp[1] = 0;
    sp[2] = reinterpret_cast<uintptr_t>(&FiberMain);
    sp[3] = reinterpret_cast<uintptr_t>(this);
    sp[4] = sp[5] = 0;
    sp[6] = reinterpret_cast<uintptr_t>(&ciuic_simt_start);
    t->sp = sp;
    t->started = true;
    t->slot = slot;
  }

  bool RunBlock(const char* kernel, unsigned b, unsigned n) {
    for (unsigned i = 0; i < n; ++i) {
      Thread& t = threads_[i];
      t.started = false;
      t.state = State::kRunnable;
      t.idx = {i, 0, 0};
    }
    // Lowest stack first: it is the one in the caches.
    free_count_ = n;
    for (unsigned i = 0; i < n; ++i) free_[i] = n - 1 - i;
    at_sync_ = at_shuffle_ = 0;
    live_ = n;
    while (true) {
      const auto first = static_cast<unsigned>(NextRandom() % n);
      const bool down = (NextRandom() & 1) != 0;
      unsigned k = 0;
      if (down) {
        for (unsigned t = first + 1; t-- > 0;) order_[k++] = t;
        for (unsigned t = n; t-- > first + 1;) order_[k++] = t;
      } else {
        for (unsigned t = first; t < n; ++t) order_[k++] = t;
        for (unsigned t = 0; t < first; ++t) order_[k++] = t;
      }
      order_count_ = n;
      cursor_ = 0;
      while (cursor_ < order_count_) {
        Thread* t = &threads_[order_[cursor_++]];
        if (t->state != State::kRunnable) continue;
        if (!t->started) StartFiber(t);
        current_ = t;
        ciuic_simt_switch(&scheduler_sp_, t->sp);
        current_ = nullptr;
      }
      if (live_ == 0) return true;
      // Every thread that has not ended waits at a barrier now.
      if (at_shuffle_ != 0) {
        bool released = false;
        if (!ReleaseShuffles(kernel, b, n, &released)) return false;
        if (released) continue;
      }
      if (at_sync_ == live_) {
        for (unsigned i = 0; i < n; ++i) {
          if (threads_[i].state == State::kAtSync) threads_[i].state = State::kRunnable;
        }
        at_sync_ = 0;
        continue;
      }
      Fault(Where(kernel, b) + ": its threads deadlock: " + std::to_string(at_sync_) +
            " wait at __syncthreads and " + std::to_string(at_shuffle_) +
            " at a warp shuffle that not all of their warp reach");
      return false;
    }
  }

  // Releases every warp whose threads that have not ended all wait at a
  // shuffle; a mask that is not exactly those lanes, or a partner lane that
  // does not take part, is a fault.
  bool ReleaseShuffles(const char* kernel, unsigned b, unsigned n, bool* released) {
    for (unsigned lo = 0; lo < n; lo += kWarp) {
      const unsigned lanes = n - lo < kWarp ? n - lo : kWarp;
      unsigned waiting = 0, alive = 0;
      for (unsigned l = 0; l < lanes; ++l) {
        const State s = threads_[lo + l].state;
        if (s == State::kAtShuffle) waiting |= 1u << l;
        if (s != State::kEnded) alive |= 1u << l;
      }
      if (waiting == 0 || waiting != alive) continue;
      for (unsigned l = 0; l < lanes; ++l) {
        if ((waiting >> l & 1u) == 0) continue;
        const Thread& t = threads_[lo + l];
        const unsigned src = l ^ t.shuffle_lane_mask;
        if (t.shuffle_mask != waiting || src >= kWarp || (waiting >> src & 1u) == 0) {
          char what[160];
          std::snprintf(what, sizeof what,
                        ": lane %u of warp %u shuffles with mask 0x%08x and partner lane %u, "
                        "but lanes 0x%08x take part",
                        l, lo / kWarp, t.shuffle_mask, src, waiting);
          Fault(Where(kernel, b) + what);
          return false;
        }
      }
      for (unsigned l = 0; l < lanes; ++l) {
        if ((waiting >> l & 1u) == 0) continue;
        Thread& t = threads_[lo + l];
        t.shuffle_out = threads_[lo + (l ^ t.shuffle_lane_mask)].shuffle_in;
      }
      for (unsigned l = 0; l < lanes; ++l) {
        if ((waiting >> l & 1u) != 0) threads_[lo + l].state = State::kRunnable;
      }
      at_shuffle_ -= static_cast<unsigned>(std::popcount(waiting));
      *released = true;
    }
    return true;
  }

  static std::string Where(const char* kernel, unsigned b) {
    return std::string("kernel ") + kernel + ", block " + std::to_string(b) +
           " (thread orders from CIUIC_CUDA_EMULATION_SEED=" + std::to_string(SeedBase()) + ")";
  }

  // Each executor's own sequence of the process's seed (SeedBase).
  static uint64_t Seed() {
    static std::atomic<uint64_t> executors{0};
    const uint64_t n = executors.fetch_add(1);
    uint64_t z = SeedBase() + 0x9e3779b97f4a7c15ull * (n + 1);  // splitmix64
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return (z ^ (z >> 31)) | 1;
  }

  uint64_t NextRandom() {  // xorshift64
    rng_ ^= rng_ << 13;
    rng_ ^= rng_ >> 7;
    rng_ ^= rng_ << 17;
    return rng_;
  }

  char* stacks_ = nullptr;
  unsigned guarded_ = 0;
  unsigned free_[kMaxThreads];  // free stacks: free_[0, free_count_)
  unsigned free_count_ = 0;
  Thread threads_[kMaxThreads];
  unsigned order_[kMaxThreads];  // this pass's order: order_[cursor_, order_count_) to come
  unsigned order_count_ = 0;
  unsigned cursor_ = 0;
  unsigned live_ = 0;        // threads of the block that have not ended
  unsigned at_sync_ = 0;     // waiting at __syncthreads
  unsigned at_shuffle_ = 0;  // waiting at a warp shuffle
  void* scheduler_sp_ = nullptr;
  Thread* current_ = nullptr;
  Dim block_idx_, block_dim_, grid_dim_;
  const std::function<void()>* body_ = nullptr;
  uint64_t rng_ = Seed();
};

// initial-exec: the kernels ask for their coordinates at every step, and
// the general TLS model would make each a __tls_get_addr call.
__attribute__((tls_model("initial-exec"))) thread_local Executor* t_executor = nullptr;

// The stream thread's executor, destroyed with the thread.
Executor& Exec() {
  if (t_executor == nullptr) {
    static thread_local std::unique_ptr<Executor> owner;
    owner = std::make_unique<Executor>();
    t_executor = owner.get();
  }
  return *t_executor;
}

}  // namespace

const Dim& ThreadIdx() { return t_executor->current()->idx; }
const Dim& BlockIdx() { return t_executor->block_idx(); }
const Dim& BlockDim() { return t_executor->block_dim(); }
const Dim& GridDim() { return t_executor->grid_dim(); }

void SyncThreads() { t_executor->Wait(State::kAtSync); }

uint64_t ShuffleXor(unsigned mask, uint64_t bits, unsigned lane_mask) {
  Thread* f = t_executor->current();
  f->shuffle_mask = mask;
  f->shuffle_lane_mask = lane_mask;
  f->shuffle_in = bits;
  t_executor->Wait(State::kAtShuffle);
  return f->shuffle_out;
}

bool RunGrid(const char* kernel, unsigned grid, unsigned block,
             const std::function<void()>& thread) {
  return Exec().Run(kernel, grid, block, thread);
}

}  // namespace ciuic::cuda_emulation::simt
