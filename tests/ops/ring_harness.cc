// Host harness for the staging ring's rules (custom_ops/csrc/fkv_staging_ring.h):
// the same Ring the CUDA launcher uses, over scripted events, allocations that can
// fail or block, and a virtual clock that advances one millisecond per poll. Built
// and driven by tests/ops/test_staging_ring.py; each scenario returns 0 or the
// number of the check that failed.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "fkv_internal.h"
#include "fkv_staging_ring.h"

namespace {

using namespace fkv;
using Event = int32_t;  // an index into Fake::done_at_ms
using Ms = std::chrono::milliseconds;

struct Fake {
  Ring<Event>* ring = nullptr;
  Deadline epoch = std::chrono::steady_clock::time_point{};
  std::atomic<int64_t> clock_ms{0};
  std::vector<int64_t> done_at_ms;  // per event: when it completes (INT64_MAX: never)
  std::mutex mu;                    // guards done_at_ms against the test's own thread
  bool fail_allocs = false;
  std::atomic<int> allocs{0};
  std::atomic<int> allocs_under_lock{0};
  // Blocking allocations: alloc_chunk waits until `unblock` (and says it is in).
  bool block_allocs = false;
  std::mutex gate_mu;
  std::condition_variable gate;
  bool in_alloc = false;
  bool unblock = false;

  Event new_event(int64_t done_at) {
    std::lock_guard<std::mutex> lock(mu);
    done_at_ms.push_back(done_at);
    return static_cast<Event>(done_at_ms.size() - 1);
  }
  void complete(Event e) {
    std::lock_guard<std::mutex> lock(mu);
    done_at_ms[e] = 0;
  }
};

struct FakeOps {
  Fake& f;
  int ready_locked() { return FKV_OK; }
  int query(Event e, bool* done) {
    std::lock_guard<std::mutex> lock(f.mu);
    *done = f.done_at_ms[e] <= f.clock_ms.load();
    return FKV_OK;
  }
  int alloc_chunk(RingChunk<Event>* c) {
    ++f.allocs;
    if (f.ring->mu.try_lock()) {
      f.ring->mu.unlock();
    } else {
      ++f.allocs_under_lock;
    }
    if (f.block_allocs) {
      std::unique_lock<std::mutex> lock(f.gate_mu);
      f.in_alloc = true;
      f.gate.notify_all();
      f.gate.wait(lock, [&] { return f.unblock; });
    }
    if (f.fail_allocs) return set_error(FKV_ENOMEM, "cudaMalloc(staging ring): out of memory");
    for (int k = 0; k < kSlotsPerChunk; ++k) c->events[k] = f.new_event(INT64_MAX);
    return FKV_OK;
  }
  Deadline now() { return f.epoch + Ms(f.clock_ms.load()); }
  void pause() { ++f.clock_ms; }
};

// A ring of `chunks` chunks whose slots are all claimed (busy).
void fill(Ring<Event>& ring, Fake& f, int chunks, std::vector<RingSlotRef<Event>>* refs) {
  for (int c = 0; c < chunks; ++c) {
    RingChunk<Event> chunk;
    for (int k = 0; k < kSlotsPerChunk; ++k) chunk.events[k] = f.new_event(INT64_MAX);
    ring.add_chunk_locked(chunk);
  }
  ring.grows = 0;
  FakeOps ops{f};
  for (size_t k = 0; k < ring.slots.size(); ++k) {
    RingSlotRef<Event> ref{};
    ring.acquire(ops, f.epoch + Ms(1), 0, 1, &ref);
    if (refs) refs->push_back(ref);
  }
}

}  // namespace

extern "C" {

// A full ring grows by one chunk, allocating without holding the ring's lock.
int ring_grows_outside_its_lock(int64_t* out /* allocs, allocs under lock, slots, grows */) {
  Ring<Event> ring;
  Fake f;
  f.ring = &ring;
  fill(ring, f, 1, nullptr);
  FakeOps ops{f};
  RingSlotRef<Event> ref{};
  if (ring.acquire(ops, f.epoch + Ms(100), 0, 100, &ref) != FKV_OK) return 1;
  if (ref.index != static_cast<size_t>(kSlotsPerChunk)) return 2;  // the new chunk's first
  out[0] = f.allocs;
  out[1] = f.allocs_under_lock;
  out[2] = static_cast<int64_t>(ring.slots.size());
  out[3] = ring.grows;
  return 0;
}

// While one thread is stuck allocating a chunk, another releases a slot and claims
// it again: neither waits for the allocation, and only one thread grows.
int ring_claims_proceed_while_it_grows(int64_t* out /* allocs, grower's index */) {
  Ring<Event> ring;
  Fake f;
  f.ring = &ring;
  std::vector<RingSlotRef<Event>> refs;
  fill(ring, f, 1, &refs);
  f.block_allocs = true;
  int grower_rc = -1;
  RingSlotRef<Event> grown{};
  std::thread grower([&] {
    FakeOps ops{f};
    grower_rc = ring.acquire(ops, f.epoch + Ms(1000000), 0, 1000000, &grown);
  });
  {
    std::unique_lock<std::mutex> lock(f.gate_mu);
    f.gate.wait(lock, [&] { return f.in_alloc; });
  }
  // The grower is inside alloc_chunk. Slot 5's readers finish; claim it here.
  f.complete(refs[5].event);
  ring.release(refs[5], true);
  FakeOps ops{f};
  RingSlotRef<Event> mine{};
  const int rc = ring.acquire(ops, f.epoch + Ms(1000000), 0, 1000000, &mine);
  bool still_blocked;
  {
    std::lock_guard<std::mutex> lock(f.gate_mu);
    still_blocked = !f.unblock;
    f.unblock = true;
  }
  f.gate.notify_all();
  grower.join();
  if (rc != FKV_OK) return 1;
  if (mine.index != 5) return 2;
  if (!still_blocked) return 3;
  if (grower_rc != FKV_OK) return 4;
  out[0] = f.allocs;
  out[1] = static_cast<int64_t>(grown.index);
  return 0;
}

// A transfer claiming several slots shares one deadline: the first claim waits
// for a slot's readers (until 60 ms), the second fails at the transfer's deadline
// (100 ms), not a full timeout after the first. `fail_allocs`: growing fails (its
// error is named); otherwise the ring is at kMaxSlots (and says so, allocating
// nothing). out: ms of the first claim, ms of the failure, allocations.
int ring_one_deadline_per_transfer(int32_t fail_allocs, int64_t* out, char* message,
                                   int32_t message_len) {
  Ring<Event> ring;
  Fake f;
  f.ring = &ring;
  std::vector<RingSlotRef<Event>> refs;
  fill(ring, f, fail_allocs ? 1 : kMaxSlots / kSlotsPerChunk, &refs);
  f.fail_allocs = fail_allocs != 0;
  // Slot 0's readers finish at 60 ms; every other slot stays claimed.
  {
    std::lock_guard<std::mutex> lock(f.mu);
    f.done_at_ms[refs[0].event] = 60;
  }
  ring.release(refs[0], true);
  FakeOps ops{f};
  const Deadline deadline = f.epoch + Ms(100);  // the transfer's one deadline
  RingSlotRef<Event> first{};
  if (ring.acquire(ops, deadline, 3, 100, &first) != FKV_OK) return 1;
  if (first.index != 0) return 2;
  out[0] = f.clock_ms.load();
  RingSlotRef<Event> second{};
  if (ring.acquire(ops, deadline, 3, 100, &second) != FKV_ETIMEDOUT) return 3;
  out[1] = f.clock_ms.load();
  out[2] = f.allocs;
  std::strncpy(message, fkv_last_error(), static_cast<size_t>(message_len) - 1);
  message[message_len - 1] = '\0';
  // The failed transfer holds nothing: slot 0, released, is claimable again.
  ring.release(first, true);
  RingSlotRef<Event> again{};
  if (ring.acquire(ops, f.epoch + Ms(1000), 3, 100, &again) != FKV_OK) return 4;
  if (again.index != 0) return 5;
  return 0;
}

// A released slot is not reused while its event is pending, and is once it has
// completed; a slot whose event record failed stays claimed for good.
int ring_reuses_a_slot_only_after_its_readers(int64_t* out /* indexes claimed */) {
  Ring<Event> ring;
  Fake f;
  f.ring = &ring;
  std::vector<RingSlotRef<Event>> refs;
  fill(ring, f, 1, &refs);
  f.fail_allocs = true;
  ring.release(refs[7], true);   // pending readers
  ring.release(refs[9], false);  // record failed: never reusable
  FakeOps ops{f};
  RingSlotRef<Event> ref{};
  if (ring.acquire(ops, f.epoch + Ms(5), 0, 5, &ref) != FKV_ETIMEDOUT) return 1;
  f.complete(refs[7].event);
  if (ring.acquire(ops, f.epoch + Ms(10), 0, 5, &ref) != FKV_OK) return 2;
  out[0] = static_cast<int64_t>(ref.index);
  if (ring.acquire(ops, f.epoch + Ms(15), 0, 5, &ref) != FKV_ETIMEDOUT) return 3;
  return 0;
}

}  // extern "C"
