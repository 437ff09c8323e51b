// tiermem's CPU allocator for PyTorch: the same 64-byte aligned memory as c10's default allocator, taken
// with plain malloc instead of posix_memalign. Why: see [Note: the CPU allocator] in tiermem/cpu_allocator.py,
// which also builds this file at run time against the installed torch's headers; the C interface at the
// end is what it calls through ctypes.
//
// Each block is [pad][raw pointer][size][data, 64-byte aligned], taken with malloc(n + 80): the data
// pointer is also the context, so the raw allocate/deallocate interface works, and the deleter finds the
// raw pointer and size in front. Allocations and frees are reported to PyTorch's memory profiler as the
// default allocator reports them.

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace {

constexpr std::size_t kAlignment = 64;                          // c10's gAlignment on x86-64 servers
constexpr std::size_t kHeader = 2 * sizeof(std::size_t);        // raw pointer and size, just before the data
constexpr std::size_t kSlack = kHeader + kAlignment;            // the header plus up to 63 bytes to align: 80

std::atomic<std::size_t> g_live_bytes{0};   // bytes handed out and not yet freed

void tm_delete(void* data) {
  if (data == nullptr) {
    return;
  }
  auto* header = static_cast<std::size_t*>(data) - 2;
  void* raw = reinterpret_cast<void*>(header[0]);
  std::size_t nbytes = header[1];
  c10::profiledCPUMemoryReporter().Delete(data);
  g_live_bytes.fetch_sub(nbytes, std::memory_order_relaxed);
  std::free(raw);
}

class TiermemCPUAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(std::size_t nbytes) override {
    if (nbytes == 0) {
      return {nullptr, nullptr, &tm_delete, c10::Device(c10::DeviceType::CPU)};
    }
    TORCH_CHECK(nbytes <= SIZE_MAX - kSlack, "tiermem CPU allocator: cannot allocate ", nbytes, " bytes");
    void* raw = std::malloc(nbytes + kSlack);
    if (raw == nullptr) {
      c10::profiledCPUMemoryReporter().OutOfMemory(nbytes);
      TORCH_CHECK(false, "tiermem CPU allocator: not enough memory: you tried to allocate ", nbytes,
                  " bytes (malloc failed). Lower the batch size, set memory.host_budget lower, or set "
                  "memory.cpu_allocator: torch to use PyTorch's own allocator.");
    }
    auto addr = (reinterpret_cast<std::uintptr_t>(raw) + kHeader + kAlignment - 1) & ~(kAlignment - 1);
    void* data = reinterpret_cast<void*>(addr);
    auto* header = static_cast<std::size_t*>(data) - 2;
    header[0] = reinterpret_cast<std::size_t>(raw);
    header[1] = nbytes;
    g_live_bytes.fetch_add(nbytes, std::memory_order_relaxed);
    c10::profiledCPUMemoryReporter().New(data, nbytes);
    return {data, data, &tm_delete, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &tm_delete;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

TiermemCPUAllocator g_allocator;
c10::Allocator* g_previous = nullptr;

}  // namespace

extern "C" {

// Make tiermem's allocator PyTorch's CPU allocator. Returns 1 when it is now in place (also when it
// already was), 0 when another allocator registered with a higher priority keeps its place.
int tm_cpu_alloc_install(void) {
  c10::Allocator* current = c10::GetCPUAllocator();
  if (current == &g_allocator) {
    return 1;
  }
  c10::SetCPUAllocator(&g_allocator, /*priority=*/0);
  if (c10::GetCPUAllocator() != &g_allocator) {
    return 0;
  }
  g_previous = current;
  return 1;
}

// Put back the allocator that was in place before tm_cpu_alloc_install. Tensors allocated meanwhile keep
// tiermem's deleter, so they are freed correctly whenever they go.
void tm_cpu_alloc_uninstall(void) {
  if (g_previous != nullptr && c10::GetCPUAllocator() == &g_allocator) {
    c10::SetCPUAllocator(g_previous, /*priority=*/0);
  }
  g_previous = nullptr;
}

int tm_cpu_alloc_installed(void) {
  return c10::GetCPUAllocator() == &g_allocator;
}

std::size_t tm_cpu_alloc_live_bytes(void) {
  return g_live_bytes.load(std::memory_order_relaxed);
}

}  // extern "C"
