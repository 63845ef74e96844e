// Host memory for cache tiers: NUMA-bound, pre-faulted in parallel, optionally
// registered with CUDA. Live allocations are kept in a registry so frees are
// checked and the CUDA path can tell pinned fastkv memory from anything else
// without asking the driver on every call.
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <shared_mutex>

#include "fkv_internal.h"

namespace fkv {
namespace {

constexpr size_t kHugePage = size_t{2} << 20;
// Linux mempolicy modes (uapi/linux/mempolicy.h); spelled out to avoid a libnuma
// dependency.
constexpr int kMpolPreferred = 1;
constexpr int kMpolFNode = 1 << 0;
constexpr int kMpolFAddr = 1 << 1;
constexpr int kMaxNumaNodes = 1024;

struct Allocation {
  size_t bytes;        // as requested
  void* map_base;      // the mapping after alignment trimming (what munmap takes)
  size_t map_bytes;
  bool pinned;
  int pin_device;      // the device current at registration (-1: the caller's)
};

std::shared_mutex g_mu;
std::map<uintptr_t, Allocation> g_allocs;  // keyed by the pointer handed out

// Preferred (not strict) binding: pages land on `node` while it has free memory
// and spill elsewhere instead of the OOM killer ending the process mid start-up.
int bind_to_node(void* p, size_t bytes, int node) {
  unsigned long mask[kMaxNumaNodes / (8 * sizeof(unsigned long))] = {};
  const size_t bits = 8 * sizeof(unsigned long);
  mask[node / bits] = 1UL << (node % bits);
  // The kernel counts maxnode one past the last bit it reads.
  const long rc = syscall(SYS_mbind, p, bytes, kMpolPreferred, mask, kMaxNumaNodes + 1, 0);
  if (rc == 0) return FKV_OK;
  const int err = errno;
  if (err == EINVAL) {
    return set_error(FKV_EINVAL, "numa_node: %d is not an online NUMA node (mbind: %s)", node,
                     strerror(err));
  }
  return set_error(FKV_ESYSTEM,
                   "numa_node: mbind to node %d failed: %s (in a container, mbind may need "
                   "CAP_SYS_NICE; pass numa_node=-1 to allocate unbound)",
                   node, strerror(err));
}

}  // namespace

bool registry_lookup(const void* p, size_t bytes, bool* pinned) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  std::shared_lock<std::shared_mutex> lock(g_mu);
  auto it = g_allocs.upper_bound(a);
  if (it == g_allocs.begin()) return false;
  --it;
  const uintptr_t base = it->first;
  if (a - base > it->second.bytes || bytes > it->second.bytes - (a - base)) return false;
  *pinned = it->second.pinned;
  return true;
}

bool registry_overrun(const void* p, size_t bytes, size_t* available) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  std::shared_lock<std::shared_mutex> lock(g_mu);
  auto it = g_allocs.upper_bound(a);
  if (it == g_allocs.begin()) return false;
  --it;
  const uintptr_t offset = a - it->first;
  if (offset >= it->second.bytes) return false;  // not inside one of ours
  *available = it->second.bytes - offset;
  return bytes > *available;
}

}  // namespace fkv

extern "C" {

FKV_API void* fkv_host_alloc(size_t bytes, int numa_node, int pin_for_cuda,
                             int pin_device) {
  using namespace fkv;
  clear_error();
  if (bytes == 0) {
    set_error(FKV_EINVAL, "bytes: must be > 0");
    return nullptr;
  }
  if (numa_node < -1 || numa_node >= kMaxNumaNodes) {
    set_error(FKV_EINVAL, "numa_node: %d out of range [-1, %d)", numa_node, kMaxNumaNodes);
    return nullptr;
  }
  if (pin_device < -1) {
    set_error(FKV_EINVAL, "pin_device: %d is neither -1 (current device) nor an ordinal",
              pin_device);
    return nullptr;
  }
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const bool huge = bytes >= kHugePage;
  const size_t align = huge ? kHugePage : page;
  if (bytes > SIZE_MAX - 2 * align) {
    set_error(FKV_EINVAL, "bytes: %zu is too large", bytes);
    return nullptr;
  }
  const size_t rounded = (bytes + align - 1) / align * align;
  // Over-map by one alignment unit and trim, so huge pages can back the whole range.
  const size_t map_bytes = huge ? rounded + align : rounded;
  void* map = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (map == MAP_FAILED) {
    set_error(FKV_ENOMEM, "bytes: mmap of %zu bytes failed: %s", map_bytes, strerror(errno));
    return nullptr;
  }
  char* p = static_cast<char*>(map);
  if (huge) {
    char* aligned = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(p) + align - 1) &
                                            ~(uintptr_t{align} - 1));
    if (aligned > p) munmap(p, aligned - p);
    char* tail = aligned + rounded;
    char* map_end = p + map_bytes;
    if (map_end > tail) munmap(tail, map_end - tail);
    p = aligned;
    // Best effort: without THP the allocation still works, just with 4 KiB pages.
    madvise(p, rounded, MADV_HUGEPAGE);
  }
  // A fork (a launcher, a tokenizer pool, a storage helper) must neither copy nor
  // share a tier of possibly hundreds of GB: copy-on-write of pinned pages either
  // duplicates them or leaves parent and child diverged under the DMA engine.
  if (madvise(p, rounded, MADV_DONTFORK) != 0) {
    set_error(FKV_ESYSTEM, "bytes: madvise(MADV_DONTFORK) failed: %s", strerror(errno));
    munmap(p, rounded);
    return nullptr;
  }
  if (numa_node >= 0) {
    const int rc = bind_to_node(p, rounded, numa_node);
    if (rc != FKV_OK) {
      munmap(p, rounded);
      return nullptr;
    }
  }
  parallel_first_touch(p, rounded, default_num_threads());
  if (pin_for_cuda) {
    const int rc = cuda_host_register(p, rounded, pin_device);
    if (rc != FKV_OK) {
      munmap(p, rounded);
      return nullptr;
    }
  }
  {
    std::unique_lock<std::shared_mutex> lock(g_mu);
    g_allocs[reinterpret_cast<uintptr_t>(p)] =
        Allocation{bytes, p, rounded, pin_for_cuda != 0, pin_device};
  }
  return p;
}

FKV_API int fkv_host_free(void* ptr, size_t bytes, int pinned) {
  using namespace fkv;
  if (ptr == nullptr) return set_error(FKV_EINVAL, "ptr: NULL");
  Allocation a;
  {
    std::unique_lock<std::shared_mutex> lock(g_mu);
    auto it = g_allocs.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == g_allocs.end()) {
      return set_error(FKV_EINVAL, "ptr: %p was not returned by fkv_host_alloc (or was freed)",
                       ptr);
    }
    if (it->second.bytes != bytes) {
      return set_error(FKV_EINVAL, "bytes: %zu does not match the allocation's %zu bytes", bytes,
                       it->second.bytes);
    }
    if (it->second.pinned != (pinned != 0)) {
      return set_error(FKV_EINVAL, "pinned: %d does not match the allocation (pinned=%d)",
                       pinned, it->second.pinned ? 1 : 0);
    }
    a = it->second;
    g_allocs.erase(it);
  }
  int rc = FKV_OK;
  if (a.pinned) rc = cuda_host_unregister(a.map_base, a.pin_device);
  if (munmap(a.map_base, a.map_bytes) != 0 && rc == FKV_OK) {
    rc = set_error(FKV_ESYSTEM, "ptr: munmap failed: %s", strerror(errno));
  }
  return rc;
}

FKV_API int fkv_numa_node_of(const void* addr) {
  if (addr == nullptr) return -1;
  int node = -1;
  // MPOL_F_NODE | MPOL_F_ADDR: the node of the page at addr (faulted in if needed).
  const long rc = syscall(SYS_get_mempolicy, &node, nullptr, 0, const_cast<void*>(addr),
                          fkv::kMpolFNode | fkv::kMpolFAddr);
  return rc == 0 ? node : -1;
}

}  // extern "C"
