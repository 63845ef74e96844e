// A persistent thread pool shared by every copy in the process.
//
// A call splits its work into parts; parts are claimed from an atomic counter by
// the calling thread and by any worker that picks up one of the call's tickets.
// The caller never waits for a part nobody started: when it runs out of parts to
// claim it withdraws its unclaimed tickets and waits only for workers already
// inside one of its parts. So two Python threads swapping at once (H2D and D2H
// stream threads) share the workers without serializing or deadlocking, and a
// process forked while the pool exists still completes every call on its own.
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "fkv_internal.h"

namespace fkv {
namespace {

struct Job {
  void (*fn)(void*, int);
  void* ctx;
  int num_parts;
  std::atomic<int> next_part{0};
  int active_workers = 0;  // guarded by Pool::mu
  std::condition_variable idle;
};

class Pool {
 public:
  void run(Job* job) {
    const int helpers = job->num_parts - 1;
    if (helpers > 0) {
      std::unique_lock<std::mutex> lock(mu_);
      grow_locked(helpers);
      for (int i = 0; i < helpers; ++i) tickets_.push_back(job);
      lock.unlock();
      if (helpers == 1) {
        wake_.notify_one();
      } else {
        wake_.notify_all();
      }
    }
    work_on(job);
    if (helpers > 0) {
      std::unique_lock<std::mutex> lock(mu_);
      tickets_.erase(std::remove(tickets_.begin(), tickets_.end(), job), tickets_.end());
      job->idle.wait(lock, [job] { return job->active_workers == 0; });
    }
  }

  void lock_for_fork() { mu_.lock(); }
  void unlock_after_fork() { mu_.unlock(); }

  // In a forked child the workers are gone; forget them (their std::thread objects
  // must not be destroyed: they are joinable and would call std::terminate).
  void forget_workers_after_fork() {
    new std::vector<std::thread>(std::move(workers_));
    workers_.clear();
    tickets_.clear();
    mu_.unlock();
  }

 private:
  static void work_on(Job* job) {
    for (;;) {
      const int part = job->next_part.fetch_add(1, std::memory_order_relaxed);
      if (part >= job->num_parts) return;
      job->fn(job->ctx, part);
    }
  }

  void grow_locked(int want) {
    want = std::min(want, FKV_MAX_THREADS - 1);
    while (static_cast<int>(workers_.size()) < want) {
      workers_.emplace_back([this] { worker_loop(); });
    }
  }

  void worker_loop() {
    pthread_setname_np(pthread_self(), "fastkv-copy");
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      wake_.wait(lock, [this] { return !tickets_.empty(); });
      Job* job = tickets_.front();
      tickets_.pop_front();
      ++job->active_workers;
      lock.unlock();
      work_on(job);
      lock.lock();
      if (--job->active_workers == 0) job->idle.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable wake_;
  std::deque<Job*> tickets_;
  std::vector<std::thread> workers_;
};

// Never destroyed: workers sleep in it until process exit, and destroying it from
// a static destructor would race with threads still blocked on its mutex.
Pool* pool() {
  static Pool* instance = [] {
    Pool* p = new Pool();
    pthread_atfork([] { pool()->lock_for_fork(); }, [] { pool()->unlock_after_fork(); },
                   [] { pool()->forget_workers_after_fork(); });
    return p;
  }();
  return instance;
}

int compute_default_threads() {
  if (const char* env = std::getenv("FASTKV_NUM_THREADS")) {
    const int n = std::atoi(env);
    if (n > 0) return std::min(n, FKV_MAX_THREADS);
  }
  cpu_set_t set;
  int cpus = 0;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) cpus = CPU_COUNT(&set);
  if (cpus <= 0) cpus = static_cast<int>(std::thread::hardware_concurrency());
  return std::clamp(cpus, 1, 8);
}

struct TouchCtx {
  char* p;
  size_t bytes;
  int parts;
};

void touch_part(void* raw, int part) {
  const TouchCtx* c = static_cast<const TouchCtx*>(raw);
  const size_t page = 4096;
  const size_t pages = (c->bytes + page - 1) / page;
  const size_t begin = pages * part / c->parts;
  const size_t end = pages * (part + 1) / c->parts;
  for (size_t i = begin; i < end; ++i) {
    // A write (not a read) so the kernel allocates a real page under the VMA's
    // NUMA policy instead of mapping the shared zero page.
    static_cast<volatile char*>(c->p)[i * page] = 0;
  }
}

}  // namespace

void parallel_for(int num_parts, void (*fn)(void*, int), void* ctx) {
  if (num_parts <= 0) return;
  if (num_parts == 1) {
    fn(ctx, 0);
    return;
  }
  Job job;
  job.fn = fn;
  job.ctx = ctx;
  job.num_parts = num_parts;
  pool()->run(&job);
}

int default_num_threads() {
  static const int n = compute_default_threads();
  return n;
}

void parallel_first_touch(char* p, size_t bytes, int num_threads) {
  // Below 64 MiB waking workers costs more than zeroing the pages.
  const size_t per_part = size_t{64} << 20;
  const int parts =
      static_cast<int>(std::min<size_t>(num_threads, (bytes + per_part - 1) / per_part));
  TouchCtx ctx{p, bytes, std::max(parts, 1)};
  parallel_for(ctx.parts, touch_part, &ctx);
}

}  // namespace fkv
