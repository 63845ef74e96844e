// The staging ring's claim and release rules, written once over the calls they
// need (Ops) so fkv_cuda.cu runs them on CUDA events and memory and
// tests/ops/ring_harness.cc runs them on a scripted fake with a virtual clock.
//
// A slot is reused only after the event recorded behind the launches that read it
// has completed. When no slot is free the ring grows by a chunk of kSlotsPerChunk
// slots. The allocation (cudaMalloc, cudaHostAlloc: they may synchronize the
// device) runs outside the ring's lock, one thread at a time, so a grow never
// holds up the launches that release and claim other slots meanwhile. When the
// ring cannot grow (at kMaxSlots, or an allocation failed) the caller polls until
// its transfer's one deadline and then fails: every slot of a transfer shares a
// deadline, so a transfer of k slots waits at most one timeout, not k.
//
// Ops (all called with the lock held unless noted):
//   using Event = ...;                       // trivially copyable, value-initializable
//   int ready_locked();                      // FKV_OK, or an error already set
//   int query(Event e, bool* done);          // FKV_OK, or an error code with it set
//   int alloc_chunk(RingChunk<Event>* c);    // WITHOUT the lock; FKV_OK or error set
//   Deadline now();  void pause();           // without the lock: the clock, one poll's wait
#ifndef FASTKV_STAGING_RING_H_
#define FASTKV_STAGING_RING_H_

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <chrono>
#include <cinttypes>
#include <mutex>
#include <vector>

#include "fkv_internal.h"

namespace fkv {

// 64 KiB holds about 4,000 block ids (plus run lengths); a larger transfer takes
// several slots. One slot per transfer (not per layer), so 64 slots cover 64
// queued transfers; the ring grows by that much when all are in use.
constexpr size_t kSlotBytes = size_t{64} << 10;
constexpr int kSlotsPerChunk = 64;
constexpr int kMaxSlots = 1024;  // 64 MiB device + 64 MiB pinned at most

using Deadline = std::chrono::steady_clock::time_point;

template <typename Event>
struct RingChunk {
  char* device = nullptr;
  char* host = nullptr;
  Event events[kSlotsPerChunk] = {};
};

template <typename Event>
struct RingSlotRef {
  size_t index;
  char* device;
  char* host;
  Event event;
};

template <typename Event>
struct Ring {
  struct Slot {
    char* device;
    char* host;
    Event event;
    bool busy;  // claimed by a caller that has not recorded its event yet
    bool used;  // its event was recorded at least once
  };

  std::mutex mu;
  std::vector<Slot> slots;
  size_t cursor = 0;
  bool growing = false;  // a thread is allocating a chunk outside mu
  int64_t grows = 0;

  // Caller holds mu.
  void add_chunk_locked(const RingChunk<Event>& c) {
    for (int k = 0; k < kSlotsPerChunk; ++k) {
      slots.push_back({c.device + k * kSlotBytes, c.host + k * kSlotBytes, c.events[k], false,
                       false});
    }
    ++grows;
  }

  // Claims a slot whose readers have finished, growing the ring when none is free
  // (see the file comment); fails with FKV_ETIMEDOUT at `deadline`. `timeout_ms`
  // and `device` only name the bound and the ring in that error.
  template <typename Ops>
  int acquire(Ops& ops, Deadline deadline, int device, int64_t timeout_ms, RingSlotRef<Event>* out) {
    char growth_error[256] = "";
    for (;;) {
      bool grow = false;
      {
        std::lock_guard<std::mutex> lock(mu);
        const int rc = ops.ready_locked();
        if (rc != FKV_OK) return rc;
        const size_t n = slots.size();
        for (size_t k = 0; k < n; ++k) {
          const size_t idx = (cursor + k) % n;
          Slot& s = slots[idx];
          if (s.busy) continue;
          if (s.used) {
            bool done = false;
            const int q = ops.query(s.event, &done);
            if (q != FKV_OK) return q;
            if (!done) continue;
          }
          s.busy = true;
          cursor = (idx + 1) % n;
          *out = {idx, s.device, s.host, s.event};
          return FKV_OK;
        }
        if (n < static_cast<size_t>(kMaxSlots) && growth_error[0] == '\0' && !growing) {
          growing = true;
          grow = true;
        }
      }
      if (grow) {
        RingChunk<Event> c;
        const int rc = ops.alloc_chunk(&c);
        std::lock_guard<std::mutex> lock(mu);
        growing = false;
        if (rc == FKV_OK) {
          add_chunk_locked(c);
          continue;
        }
        snprintf(growth_error, sizeof(growth_error), "; growing it failed: %s", fkv_last_error());
      }
      if (ops.now() >= deadline) {
        std::lock_guard<std::mutex> lock(mu);
        return set_error(FKV_ETIMEDOUT,
                         "staging ring of device %d: all %zu slots are still read by queued "
                         "launches after %" PRId64 " ms%s (is a stream blocked?); "
                         "FASTKV_CUDA_STAGING_TIMEOUT_MS bounds each transfer's wait",
                         device, slots.size(), timeout_ms,
                         growth_error[0] ? growth_error : " (at its size limit)");
      }
      ops.pause();
    }
  }

  // Frees a claim once the caller has recorded the slot's event behind the
  // launches that read it. If that record failed the slot stays claimed for good:
  // a queued copy may still read it.
  void release(const RingSlotRef<Event>& ref, bool recorded) {
    std::lock_guard<std::mutex> lock(mu);
    if (!recorded) return;
    slots[ref.index].busy = false;
    slots[ref.index].used = true;
  }
};

}  // namespace fkv

#endif  // FASTKV_STAGING_RING_H_
