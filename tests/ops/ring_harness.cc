// Host harness for the staging ring's rules (custom_ops/csrc/fkv_staging_ring.h):
// the same Ring the CUDA launcher uses, over scripted events, allocations that can
// fail or block, and a virtual clock that advances one millisecond per poll. Built
// and driven by tests/ops/test_staging_ring.py; each scenario returns 0 or the
// number of the check that failed.
//
// The evict_then_load scenarios run a layout transfer's staging and layer order
// (custom_ops/csrc/fkv_layout_launch.h, as fkv_cuda.cu runs it) over that ring and
// a scripted stream, counting validations, slot claims and ring growth.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "fkv_cuda_plan.h"
#include "fkv_internal.h"
#include "fkv_layout_launch.h"
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

// ------------------------------------------------ a layout transfer's layer order

namespace {

// One scripted stream and its events, with CUDA's semantics: an event's state is
// its latest record's; a wait waits for the record latest when it was enqueued; a
// never-recorded event reads complete. Work runs as soon as nothing holds it.
struct FakeGpu {
  struct Ev {
    int64_t recorded = 0;  // records issued
    int64_t reached = 0;   // records the stream has run
  };
  enum Kind { kWait, kUpload, kCopy, kRecord };
  struct Op {
    Kind kind;
    int32_t arg;      // event, or layer for kCopy
    int64_t target;   // kWait / kRecord: the record it waits for / is
  };
  std::vector<Ev> events;
  std::deque<Op> queue;
  std::vector<int32_t> copied;  // layers in the order the stream copied them
  int64_t native_calls = 0, validations = 0, claims = 0, uploads = 0, waits = 0;
  int32_t fail_at_layer = -1;  // enqueue_layer fails there (a launch error)

  int32_t new_event() {
    events.push_back({});
    return static_cast<int32_t>(events.size() - 1);
  }
  bool done(int32_t e) const { return events[e].reached >= events[e].recorded; }
  void run() {
    while (!queue.empty()) {
      const Op op = queue.front();
      if (op.kind == kWait && events[op.arg].reached < op.target) return;
      if (op.kind == kRecord) events[op.arg].reached = std::max(events[op.arg].reached, op.target);
      if (op.kind == kCopy) copied.push_back(op.arg);
      queue.pop_front();
    }
  }
  void push(Kind kind, int32_t arg) {
    int64_t target = 0;
    if (kind == kRecord) target = ++events[arg].recorded;
    if (kind == kWait) target = events[arg].recorded, ++waits;
    queue.push_back({kind, arg, target});
    run();
  }
  // An event recorded on another stream (the eviction's), pending until complete().
  void record_elsewhere(int32_t e) { ++events[e].recorded; }
  void complete(int32_t e) {
    events[e].reached = events[e].recorded;
    run();
  }
};

void* as_handle(int32_t e) { return reinterpret_cast<void*>(static_cast<intptr_t>(e) + 1); }
int32_t as_event(void* h) { return static_cast<int32_t>(reinterpret_cast<intptr_t>(h) - 1); }

struct GpuRingOps {
  FakeGpu& g;
  int64_t& allocs;
  int ready_locked() { return FKV_OK; }
  int query(Event e, bool* done) {
    *done = g.done(e);
    return FKV_OK;
  }
  int alloc_chunk(RingChunk<Event>* c) {
    ++allocs;
    for (int k = 0; k < kSlotsPerChunk; ++k) c->events[k] = g.new_event();
    return FKV_OK;
  }
  Deadline now() { return Deadline{}; }
  void pause() {}
};

// fkv_layout_launch.h's calls on the fake: what CudaLayoutOps does on CUDA.
struct FakeLayoutOps {
  using Slot = RingSlotRef<Event>;
  FakeGpu& g;
  Ring<Event>& ring;
  int64_t& allocs;
  int acquire(Slot* out) {
    ++g.claims;
    GpuRingOps ops{g, allocs};
    return ring.acquire(ops, Deadline{} + Ms(1), 0, 1, out);
  }
  int upload(const Slot&, int64_t, int64_t) {
    ++g.uploads;
    g.push(FakeGpu::kUpload, 0);
    return FKV_OK;
  }
  int wait(void* e, bool) {
    g.push(FakeGpu::kWait, as_event(e));
    return FKV_OK;
  }
  int enqueue_layer(int32_t layer, const std::vector<Slot>& slots) {
    if (slots.empty()) return FKV_EINVAL;
    if (layer == g.fail_at_layer) return set_error(FKV_ECUDA, "swap_kernel launch: injected");
    g.push(FakeGpu::kCopy, layer);
    return FKV_OK;
  }
  int record(void* e, bool) {
    g.push(FakeGpu::kRecord, as_event(e));
    return FKV_OK;
  }
  void release(const Slot& s) {
    g.push(FakeGpu::kRecord, s.event);
    ring.release(s, true);
  }
};

constexpr int64_t kBlocks = int64_t{1} << 20;

// fkv_layout_swap_ordered on the fake: one validation of the ids, then the same
// staging and layer order as cuda_layout_swap's per-layer path.
int fake_layout_swap(FakeGpu& g, Ring<Event>& ring, int64_t& allocs, const int64_t* dev,
                     const int64_t* host, int64_t n, int32_t first, int32_t count,
                     void* const* layer_events, void* const* waits, int32_t waits_per_layer,
                     int32_t* failed) {
  ++g.native_calls;
  ++g.validations;
  std::vector<BlockRun> runs;
  int rc = validate_ids(kBlocks, kBlocks, dev, host, n, FKV_H2D, &runs);
  if (rc != FKV_OK) return rc;
  FakeLayoutOps ops{g, ring, allocs};
  const LayerOrder order{first, count, layer_events, waits, waits_per_layer};
  std::vector<RingSlotRef<Event>> slots;
  rc = stage_ids(ops, n, ids_per_slot(kSlotBytes, 0, false), &slots);
  int32_t layer = first;
  if (rc == FKV_OK) rc = enqueue_layers(ops, order, slots, &layer);
  return end_transfer(ops, rc, order, layer, slots, failed);
}

}  // namespace

extern "C" {

// An eviction of `num_ids` blocks, ordered per layer (its blocks have a new owner),
// is in flight on another stream: its per-layer events are pending and it holds
// one staging slot. This step loads into those very blocks. one_call = 0: as the
// controller did, per layer a stream wait on the eviction's layer event and a
// one-layer fkv_layout_swap; one_call = 1: one fkv_layout_swap_ordered with the
// eviction's events as the per-layer waits. fail_at: a layer whose launch fails
// (-1: none). Then the eviction completes layer by layer, and every layer of the
// load must copy only after the eviction's same layer, and its event complete
// only after that copy.
// out: native calls, validations, slot claims, uploads, ring slots, ring grows,
//      chunk allocations, stream waits, failed layer.
int evict_then_load(int32_t one_call, int32_t layers, int32_t num_ids, int32_t fail_at,
                    int64_t* out) {
  FakeGpu g;
  g.fail_at_layer = fail_at;
  Ring<Event> ring;
  int64_t allocs = 0;
  {
    RingChunk<Event> chunk;  // the ring as a device starts with it: one chunk
    for (int k = 0; k < kSlotsPerChunk; ++k) chunk.events[k] = g.new_event();
    ring.add_chunk_locked(chunk);
    ring.grows = 0;
  }
  // The eviction: one slot claimed behind its pending launches, per-layer events.
  std::vector<int32_t> evicted(layers);
  for (int32_t l = 0; l < layers; ++l) {
    evicted[l] = g.new_event();
    g.record_elsewhere(evicted[l]);
  }
  RingSlotRef<Event> eviction_slot{};
  {
    GpuRingOps ops{g, allocs};
    if (ring.acquire(ops, Deadline{} + Ms(1), 0, 1, &eviction_slot) != FKV_OK) return 1;
    g.record_elsewhere(eviction_slot.event);
    ring.release(eviction_slot, true);
  }
  std::vector<int64_t> dev(num_ids), host(num_ids);
  for (int32_t i = 0; i < num_ids; ++i) dev[i] = 2 * i, host[i] = 3 * i + 1;
  std::vector<int32_t> loaded(layers);
  std::vector<void*> load_events(layers), wait_events(layers);
  for (int32_t l = 0; l < layers; ++l) {
    loaded[l] = g.new_event();
    load_events[l] = as_handle(loaded[l]);
    wait_events[l] = as_handle(evicted[l]);
  }
  int32_t failed = -2;
  int rc = FKV_OK;
  if (one_call) {
    rc = fake_layout_swap(g, ring, allocs, dev.data(), host.data(), num_ids, 0, layers,
                          load_events.data(), wait_events.data(), 1, &failed);
  } else {
    for (int32_t l = 0; l < layers; ++l) {
      ++g.native_calls;  // fkv_cuda_stream_wait_event
      g.push(FakeGpu::kWait, evicted[l]);
      int32_t f = -2;
      const int r = fake_layout_swap(g, ring, allocs, dev.data(), host.data(), num_ids, l, 1,
                                     &load_events[l], nullptr, 0, &f);
      if (r != FKV_OK && rc == FKV_OK) rc = r, failed = f;
    }
    if (rc == FKV_OK) failed = -1;
  }
  if ((fail_at < 0) != (rc == FKV_OK)) return 2;
  out[0] = g.native_calls;
  out[1] = g.validations;
  out[2] = g.claims;
  out[3] = g.uploads;
  out[4] = static_cast<int64_t>(ring.slots.size());
  out[5] = ring.grows;
  out[6] = allocs;
  out[7] = g.waits;
  out[8] = failed;
  // Nothing is copied while the eviction's layer 0 is pending.
  if (!g.copied.empty()) return 3;
  for (int32_t l = 0; l < layers; ++l) {
    if (g.done(loaded[l])) return 4;  // layer l's event before the eviction's layer l
    g.complete(evicted[l]);
    const bool copies = fail_at < 0 || l < fail_at;
    if (copies && (g.copied.empty() || g.copied.back() != l)) return 5;
    if (!g.done(loaded[l])) return 6;  // the layer's event once its copy (or failure) ran
    if (l + 1 < layers && g.done(loaded[l + 1])) return 7;
  }
  if (!g.queue.empty()) return 8;
  g.complete(eviction_slot.event);  // the eviction's launches are done too
  // Every slot is free again: as many claims as the ring has slots need no growth.
  std::vector<RingSlotRef<Event>> again(ring.slots.size());
  for (auto& ref : again) {
    GpuRingOps ops{g, allocs};
    if (ring.acquire(ops, Deadline{} + Ms(1), 0, 1, &ref) != FKV_OK) return 9;
  }
  if (ring.grows != out[5]) return 10;
  return 0;
}

// Several copies to wait for per layer, some already complete (NULL): every
// non-NULL wait is enqueued before its layer and none of the NULL ones.
// out: stream waits, layers copied.
int evict_then_load_with_several_waits(int32_t layers, int64_t* out) {
  FakeGpu g;
  Ring<Event> ring;
  int64_t allocs = 0;
  constexpr int32_t kWaits = 3;
  std::vector<int32_t> evictions(static_cast<size_t>(layers) * kWaits);
  std::vector<void*> waits(evictions.size(), nullptr);
  for (size_t k = 0; k < evictions.size(); ++k) {
    evictions[k] = g.new_event();
    g.record_elsewhere(evictions[k]);
    if (k % kWaits != 1) waits[k] = as_handle(evictions[k]);  // copy 1 finished: NULL
  }
  std::vector<int32_t> loaded(layers);
  std::vector<void*> load_events(layers);
  for (int32_t l = 0; l < layers; ++l) loaded[l] = g.new_event(), load_events[l] = as_handle(loaded[l]);
  const int64_t dev[2] = {5, 6};
  const int64_t host[2] = {7, 9};
  int32_t failed = -2;
  if (fake_layout_swap(g, ring, allocs, dev, host, 2, 0, layers, load_events.data(),
                       waits.data(), kWaits, &failed) != FKV_OK) {
    return 1;
  }
  if (failed != -1 || g.claims != 1) return 2;
  for (int32_t l = 0; l < layers; ++l) {
    g.complete(evictions[static_cast<size_t>(l) * kWaits]);
    if (static_cast<int32_t>(g.copied.size()) != l) return 3;  // copy 2 still pending
    g.complete(evictions[static_cast<size_t>(l) * kWaits + 2]);
    if (static_cast<int32_t>(g.copied.size()) != l + 1 || !g.done(loaded[l])) return 4;
  }
  out[0] = g.waits;
  out[1] = static_cast<int64_t>(g.copied.size());
  return 0;
}

}  // extern "C"
