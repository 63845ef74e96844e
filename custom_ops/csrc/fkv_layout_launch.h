// The order in which one layout transfer (fkv_layout_swap_ordered) stages its ids
// and enqueues its layers, written once over the calls it needs (Ops) so
// fkv_cuda.cu runs it on a CUDA stream and tests/ops/ring_harness.cc on a scripted
// fake stream with the real staging ring.
//
// stage_ids claims ring slots for the ids once (one slot per kSlotBytes of ids,
// however many layers the transfer covers). enqueue_layers then goes layer by
// layer: the stream waits for that layer's wait events (other copies' events of
// the same layer: a load into blocks an eviction still reads starts layer L once
// the eviction's layer L is copied, not once all of it is), the layer's copies
// are enqueued, and its own event is recorded. So a step whose load is ordered
// after an eviction is still one validation and one slot set, not one per layer.
// end_transfer, after a failure, enqueues the remaining layers' waits and records
// their events (no waiter hangs, and none is ordered before what it would have
// waited for), then releases the slots behind everything enqueued.
//
// Ops (Slot: a claimed ring slot, value type):
//   int acquire(Slot* out);                          // claim a slot (FKV_OK or error set)
//   int upload(const Slot& s, int64_t first_id, int64_t count);  // stage ids, queue upload
//   int wait(void* event, bool quiet);               // the stream waits for event
//   int enqueue_layer(int32_t layer, const std::vector<Slot>& slots);  // its copies
//   int record(void* event, bool quiet);             // record event on the stream
//   void release(const Slot& s);                     // record its event, free the claim
// `quiet`: on the failure path, where an error must not replace the first one.
#ifndef FASTKV_LAYOUT_LAUNCH_H_
#define FASTKV_LAYOUT_LAUNCH_H_

#include <stdint.h>

#include <algorithm>
#include <vector>

#include "fkv_internal.h"

namespace fkv {

// The layers of one call and what orders them. layer_events: num_layers entries
// (NULL entries, or NULL: record nothing); wait_events: waits_per_layer entries
// per layer, layer-major (NULL entries skipped), or NULL with waits_per_layer 0.
struct LayerOrder {
  int32_t first_layer;
  int32_t num_layers;
  void* const* layer_events;
  void* const* wait_events;
  int32_t waits_per_layer;

  void* event_of(int32_t layer) const {
    return layer_events != nullptr ? layer_events[layer - first_layer] : nullptr;
  }
  void* const* waits_of(int32_t layer) const {
    return wait_events + static_cast<size_t>(layer - first_layer) * waits_per_layer;
  }
  bool ordered() const { return wait_events != nullptr && waits_per_layer > 0; }
};

// Claims and fills the slots of `num_ids` ids, `per_slot` to a slot. Every slot
// claimed is in *slots, also after a failure (its upload may be queued): the
// caller releases them all (end_transfer).
template <typename Ops, typename Slot>
int stage_ids(Ops& ops, int64_t num_ids, int64_t per_slot, std::vector<Slot>* slots) {
  slots->clear();
  for (int64_t i0 = 0; i0 < num_ids; i0 += per_slot) {
    Slot s{};
    int rc = ops.acquire(&s);
    if (rc != FKV_OK) return rc;
    slots->push_back(s);
    rc = ops.upload(s, i0, std::min(per_slot, num_ids - i0));
    if (rc != FKV_OK) return rc;
  }
  return FKV_OK;
}

// Layer `layer`'s waits. quiet: on the failure path (errors ignored).
template <typename Ops>
int wait_for_layer(Ops& ops, const LayerOrder& o, int32_t layer, bool quiet) {
  if (!o.ordered()) return FKV_OK;
  void* const* waits = o.waits_of(layer);
  for (int32_t j = 0; j < o.waits_per_layer; ++j) {
    if (waits[j] == nullptr) continue;
    const int rc = ops.wait(waits[j], quiet);
    if (rc != FKV_OK && !quiet) return rc;
  }
  return FKV_OK;
}

// Enqueues layers [first_layer, first_layer + num_layers) in order, each after
// its waits and followed by its event. *layer: the first layer not enqueued
// intact when it fails.
template <typename Ops, typename Slot>
int enqueue_layers(Ops& ops, const LayerOrder& o, const std::vector<Slot>& slots,
                   int32_t* layer) {
  for (*layer = o.first_layer; *layer < o.first_layer + o.num_layers; ++*layer) {
    int rc = wait_for_layer(ops, o, *layer, false);
    if (rc == FKV_OK) rc = ops.enqueue_layer(*layer, slots);
    void* event = o.event_of(*layer);
    if (rc == FKV_OK && event != nullptr) rc = ops.record(event, false);
    if (rc != FKV_OK) return rc;
  }
  return FKV_OK;
}

// Ends a transfer that stopped with `rc` at `layer` (the first layer not enqueued
// intact; ignored when rc is FKV_OK): on a failure, the waits and events of that
// layer and the later ones are still enqueued, in order, so their waiters wake
// no earlier than the copies they were ordered after and never hang. Then every
// slot is released behind what was enqueued. Returns rc; *failed_layer gets -1
// or `layer`.
template <typename Ops, typename Slot>
int end_transfer(Ops& ops, int rc, const LayerOrder& o, int32_t layer,
                 const std::vector<Slot>& slots, int32_t* failed_layer) {
  *failed_layer = -1;
  if (rc != FKV_OK) {
    *failed_layer = layer;
    for (int32_t l = layer; l < o.first_layer + o.num_layers; ++l) {
      wait_for_layer(ops, o, l, true);
      void* event = o.event_of(l);
      if (event != nullptr) ops.record(event, true);
    }
  }
  for (const Slot& s : slots) ops.release(s);
  return rc;
}

}  // namespace fkv

#endif  // FASTKV_LAYOUT_LAUNCH_H_
