// Emulated "flagos" accelerator: a PrivateUse1 runtime whose device memory is
// host memory. A test double for a vendor plugin (torch_fl), not a product.
//
// What it registers (all at load time, first come first served in torch):
//   * device allocator (c10::DeviceAllocator) for PrivateUse1, with stats;
//   * pinned host allocator (at::HostAllocator) for PrivateUse1;
//   * PrivateUse1 hooks (availability, generators, pinned memory, storage
//     resize used by FSDP2, current device);
//   * a device guard with streams and events; everything is synchronous, so
//     events only record a host timestamp and synchronize is a no-op;
//   * kernels for the ops that cannot go through the CPU fallback (factories,
//     copies, views, resize/set_), `at::native::cpu_fallback` for the rest,
//     convolution and the layer/group norms routed to the fallback
//     explicitly, the SDPA backend choice answered as on CPU (results match
//     CPU bit for bit), and an AutocastPrivateUse1 fallthrough;
//   * a small operator library `torch.ops.flagos_emu.*` that the Python device
//     module (flagos_shm.emulation) uses for device and stream state.
// The list of what a PrivateUse1 backend needs follows PyTorch's OpenReg test
// extension (test/cpp_extensions/open_registration_extension).
//
// Built without torch/extension.h (no pybind11) to keep the build short.

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/core/Tensor.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/ops/_fused_sdp_choice.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/native_batch_norm.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/library.h>

#include <sys/sysinfo.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <vector>

namespace flagos_emu {

using c10::Device;
using c10::DeviceIndex;
using c10::Stream;
using c10::StreamId;
constexpr c10::DeviceType kDev = c10::DeviceType::PrivateUse1;
constexpr int kMaxDevices = 64;

// ---------------------------------------------------------------- device state
std::atomic<int> g_device_count{8};
thread_local DeviceIndex t_device = 0;
// Current stream id per device for this thread; 0 is the default stream.
thread_local std::array<StreamId, kMaxDevices> t_stream{};
std::atomic<StreamId> g_next_stream{1};

void check_index(int64_t index) {
  TORCH_CHECK(
      index >= 0 && index < g_device_count.load(),
      "flagos (emulated): device index ", index, " is out of range; ",
      g_device_count.load(), " devices are configured");
}

DeviceIndex resolve(Device d) {
  if (d.index() < 0) return t_device;
  check_index(d.index());
  return d.index();
}

// ------------------------------------------------------------ device allocator
struct Block {
  size_t size;
  DeviceIndex device;
};

void device_free(void* ptr);

class DeviceAllocatorImpl final : public c10::DeviceAllocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    const DeviceIndex d = t_device;
    void* p = n ? c10::alloc_cpu(n) : nullptr;
    if (p) {
      std::lock_guard<std::mutex> lock(mu_);
      live_[reinterpret_cast<uintptr_t>(p)] = Block{n, d};
      auto& s = stats_[d];
      for (auto* a : {&s.allocation, &s.segment, &s.active}) agg(*a).increase(1);
      for (auto* a : {&s.allocated_bytes, &s.reserved_bytes, &s.active_bytes,
                      &s.requested_bytes}) agg(*a).increase(n);
      s.num_device_alloc++;
    }
    return {p, p, &device_free, Device(kDev, d)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &device_free; }
  void copy_data(void* dst, const void* src, size_t n) const override {
    if (n) std::memcpy(dst, src, n);
  }
  void release(void* p) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = live_.find(reinterpret_cast<uintptr_t>(p));
      if (it != live_.end()) {
        auto& s = stats_[it->second.device];
        const size_t n = it->second.size;
        for (auto* a : {&s.allocation, &s.segment, &s.active}) agg(*a).decrease(1);
        for (auto* a : {&s.allocated_bytes, &s.reserved_bytes, &s.active_bytes,
                        &s.requested_bytes}) agg(*a).decrease(n);
        s.num_device_free++;
        live_.erase(it);
      }
    }
    c10::free_cpu(p);
  }
  // Device that owns `p` (interior pointers included), if allocated here.
  std::optional<DeviceIndex> device_of(const void* p) {
    const auto key = reinterpret_cast<uintptr_t>(p);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.upper_bound(key);
    if (it == live_.begin()) return std::nullopt;
    --it;
    if (key < it->first + it->second.size) return it->second.device;
    return std::nullopt;
  }

  bool initialized() override { return true; }
  void emptyCache(c10::MempoolId_t) override {}
  void recordStream(const c10::DataPtr&, Stream) override {}
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(DeviceIndex d) override {
    check_index(d);
    std::lock_guard<std::mutex> lock(mu_);
    return stats_[d];
  }
  void resetAccumulatedStats(DeviceIndex d) override {
    check_index(d);
    std::lock_guard<std::mutex> lock(mu_);
    for_each_stat(stats_[d], [](c10::CachingAllocator::Stat& s) { s.reset_accumulated(); });
  }
  void resetPeakStats(DeviceIndex d) override {
    check_index(d);
    std::lock_guard<std::mutex> lock(mu_);
    for_each_stat(stats_[d], [](c10::CachingAllocator::Stat& s) { s.reset_peak(); });
  }
  // (free, total) bytes of host RAM, since device memory is host memory.
  std::pair<size_t, size_t> getMemoryInfo(DeviceIndex d) override {
    check_index(d);
    struct sysinfo info {};
    if (sysinfo(&info) != 0) return {0, 0};
    return {size_t(info.freeram) * info.mem_unit, size_t(info.totalram) * info.mem_unit};
  }

 private:
  using StatArray = c10::CachingAllocator::StatArray;
  static c10::CachingAllocator::Stat& agg(StatArray& a) {
    return a[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
  }
  template <typename F>
  static void for_each_stat(c10::CachingDeviceAllocator::DeviceStats& s, F f) {
    for (auto* a : {&s.allocation, &s.segment, &s.active, &s.inactive_split,
                    &s.allocated_bytes, &s.reserved_bytes, &s.active_bytes,
                    &s.inactive_split_bytes, &s.requested_bytes})
      for (auto& stat : *a) f(stat);
  }
  std::mutex mu_;
  std::map<uintptr_t, Block> live_;
  std::array<c10::CachingDeviceAllocator::DeviceStats, kMaxDevices> stats_;
};

DeviceAllocatorImpl g_device_alloc;
void device_free(void* ptr) { g_device_alloc.release(ptr); }
REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &g_device_alloc)

// -------------------------------------------------------- pinned host memory
void host_free(void* ptr);

class HostAllocatorImpl final : public at::HostAllocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    void* p = n ? c10::alloc_cpu(n) : nullptr;
    if (p) {
      std::lock_guard<std::mutex> lock(mu_);
      live_[reinterpret_cast<uintptr_t>(p)] = n;
      stats_.active_requests.increase(1);
      stats_.allocations.increase(1);
      stats_.active_bytes.increase(n);
      stats_.allocated_bytes.increase(n);
      stats_.num_host_alloc++;
    }
    return {p, p, &host_free, Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &host_free; }
  void copy_data(void* dst, const void* src, size_t n) const override {
    if (n) std::memcpy(dst, src, n);
  }
  void release(void* p) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = live_.find(reinterpret_cast<uintptr_t>(p));
      if (it != live_.end()) {
        stats_.active_requests.decrease(1);
        stats_.allocations.decrease(1);
        stats_.active_bytes.decrease(it->second);
        stats_.allocated_bytes.decrease(it->second);
        stats_.num_host_free++;
        live_.erase(it);
      }
    }
    c10::free_cpu(p);
  }
  bool is_pinned(const void* p) {
    const auto key = reinterpret_cast<uintptr_t>(p);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.upper_bound(key);
    if (it == live_.begin()) return false;
    --it;
    return key < it->first + it->second;
  }
  bool record_event(void*, void*, Stream) override { return true; }
  void empty_cache() override {}
  at::HostStats get_stats() override {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }
  void reset_accumulated_stats() override {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto* s : {&stats_.active_requests, &stats_.active_bytes,
                    &stats_.allocations, &stats_.allocated_bytes})
      s->reset_accumulated();
    stats_.num_host_alloc = stats_.num_host_free = 0;
  }
  void reset_peak_stats() override {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto* s : {&stats_.active_requests, &stats_.active_bytes,
                    &stats_.allocations, &stats_.allocated_bytes})
      s->reset_peak();
  }

 private:
  std::mutex mu_;
  std::map<uintptr_t, size_t> live_;
  at::HostStats stats_;
};

HostAllocatorImpl g_host_alloc;
void host_free(void* ptr) { g_host_alloc.release(ptr); }
REGISTER_HOST_ALLOCATOR(at::kPrivateUse1, &g_host_alloc)

// ------------------------------------------------------------------- hooks
// Storage.resize_ on a flagos storage (FSDP2 frees and re-grows parameter
// storage this way). Same semantics as resize_bytes_cpu: keep the prefix.
void resize_storage_bytes(const c10::Storage& storage, size_t newsize) {
  auto* impl = storage.unsafeGetStorageImpl();
  TORCH_CHECK(impl->resizable(), "flagos (emulated): storage is not resizable");
  c10::DeviceGuard guard(impl->device());
  c10::Allocator* alloc = impl->allocator() ? impl->allocator() : &g_device_alloc;
  c10::DataPtr fresh = alloc->allocate(newsize);
  const size_t keep = std::min(impl->nbytes(), newsize);
  if (keep) std::memcpy(fresh.get(), impl->data(), keep);
  impl->set_data_ptr_noswap(std::move(fresh));
  impl->set_nbytes(newsize);
}

// Random numbers: every op runs on the host through the CPU fallback and draws
// from the host (CPU) default generator, so the emulated devices share it.
struct Hooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  void init() const override {}
  const at::Generator& getDefaultGenerator(DeviceIndex) const override {
    return at::detail::getDefaultCPUGenerator();
  }
  at::Generator getNewGenerator(DeviceIndex) const override {
    return at::detail::createCPUGenerator();
  }
  Device getDeviceFromPtr(void* data) const override {
    auto d = g_device_alloc.device_of(data);
    TORCH_CHECK(d.has_value(), "flagos (emulated): pointer ", data,
                " was not allocated by the flagos device allocator");
    return Device(kDev, *d);
  }
  bool isPinnedPtr(const void* data) const override { return g_host_alloc.is_pinned(data); }
  c10::Allocator* getPinnedMemoryAllocator() const override { return &g_host_alloc; }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    resize_storage_bytes(storage, newsize);
  }
  DeviceIndex deviceCount() const override { return static_cast<DeviceIndex>(g_device_count.load()); }
  void setCurrentDevice(DeviceIndex d) const override {
    check_index(d);
    t_device = d;
  }
  DeviceIndex getCurrentDevice() const override { return t_device; }
  DeviceIndex exchangeDevice(DeviceIndex d) const override {
    const DeviceIndex old = t_device;
    if (d >= 0) setCurrentDevice(d);
    return old;
  }
  DeviceIndex maybeExchangeDevice(DeviceIndex d) const override { return exchangeDevice(d); }
};

const bool g_hooks_registered = [] {
  at::RegisterPrivateUse1HooksInterface(new Hooks());
  return true;
}();

// -------------------------------------------------- device guard, streams, events
struct EventRecord {
  std::chrono::steady_clock::time_point when;
};

struct GuardImpl final : public c10::impl::DeviceGuardImplInterface {
  GuardImpl() = default;
  explicit GuardImpl(c10::DeviceType t) {
    TORCH_INTERNAL_ASSERT(t == kDev);
  }
  c10::DeviceType type() const override { return kDev; }
  Device exchangeDevice(Device d) const override {
    const Device old = getDevice();
    setDevice(d);
    return old;
  }
  Device getDevice() const override { return Device(kDev, t_device); }
  void setDevice(Device d) const override {
    TORCH_CHECK(d.type() == kDev, "flagos (emulated): expected a flagos device, got ", d);
    if (d.index() >= 0) {
      check_index(d.index());
      t_device = d.index();
    }
  }
  void uncheckedSetDevice(Device d) const noexcept override {
    if (d.index() >= 0 && d.index() < g_device_count.load()) t_device = d.index();
  }
  Stream getStream(Device d) const override {
    const DeviceIndex i = resolve(d);
    return Stream(Stream::UNSAFE, Device(kDev, i), t_stream[i]);
  }
  Stream getDefaultStream(Device d) const override {
    return Stream(Stream::UNSAFE, Device(kDev, resolve(d)), 0);
  }
  Stream getNewStream(Device d, int /*priority*/) const override {
    return Stream(Stream::UNSAFE, Device(kDev, resolve(d)), g_next_stream++);
  }
  Stream getStreamFromGlobalPool(Device d, bool /*high_priority*/) const override {
    return getNewStream(d, 0);
  }
  Stream exchangeStream(Stream s) const override {
    const DeviceIndex i = resolve(s.device());
    const Stream old(Stream::UNSAFE, Device(kDev, i), t_stream[i]);
    t_stream[i] = s.id();
    return old;
  }
  DeviceIndex deviceCount() const noexcept override {
    return static_cast<DeviceIndex>(g_device_count.load());
  }
  // Work is synchronous: an event records the host time when it is recorded.
  void record(void** event, const Stream&, const DeviceIndex, const c10::EventFlag) const override {
    if (*event == nullptr) *event = new EventRecord();
    static_cast<EventRecord*>(*event)->when = std::chrono::steady_clock::now();
  }
  void block(void*, const Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void* event, const DeviceIndex) const noexcept override {
    delete static_cast<EventRecord*>(event);
  }
  bool queryStream(const Stream&) const override { return true; }
  void synchronizeStream(const Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const DeviceIndex) const override {}
  void recordDataPtrOnStream(const c10::DataPtr&, const Stream&) const override {}
  // Milliseconds from event1 to event2, as CUDA's cudaEventElapsedTime.
  double elapsedTime(void* event1, void* event2, const DeviceIndex) const override {
    TORCH_CHECK(event1 && event2,
                "flagos (emulated): both events must be recorded before elapsed_time");
    const auto dt = static_cast<EventRecord*>(event2)->when -
                    static_cast<EventRecord*>(event1)->when;
    return std::chrono::duration<double, std::milli>(dt).count();
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, GuardImpl);

// ------------------------------------------------------------------- kernels
// A CPU tensor aliasing the (host) memory of a flagos tensor.
at::Tensor host_alias(const at::Tensor& t) {
  if (t.is_cpu()) return t;
  if (t.numel() == 0) return at::empty(t.sizes(), t.options().device(c10::kCPU));
  at::Tensor out = at::from_blob(t.data_ptr(), t.sizes(), t.strides(),
                                 t.options().device(c10::kCPU));
  if (t.is_conj()) out._set_conj(true);
  if (t.is_neg()) out._set_neg(true);
  return out;
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout,
                               std::optional<Device> device, std::optional<bool> pin_memory,
                               std::optional<c10::MemoryFormat> memory_format) {
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided,
              "flagos (emulated): only strided tensors are supported");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory),
              "flagos (emulated): only CPU tensors can be pinned");
  const c10::DeviceGuard guard(c10::device_or_default(device));
  return at::detail::empty_generic(size, &g_device_alloc, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<c10::ScalarType> dtype, std::optional<c10::Layout> layout,
                         std::optional<Device> device, std::optional<bool> pin_memory) {
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided,
              "flagos (emulated): only strided tensors are supported");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory),
              "flagos (emulated): only CPU tensors can be pinned");
  const c10::DeviceGuard guard(c10::device_or_default(device));
  return at::detail::empty_strided_generic(size, stride, &g_device_alloc,
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

// self -> dst for cpu->flagos, flagos->cpu and flagos->flagos (any indices);
// synchronous, so non_blocking is accepted and has nothing left to do.
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool /*non_blocking*/) {
  if (dst.numel() == 0) return dst;
  at::Tensor src = host_alias(self);
  // The aliases hide that both sides share a storage; copy through a
  // temporary so overlapping ranges read the old values.
  if (!self.is_cpu() && !dst.is_cpu() && self.storage().is_alias_of(dst.storage()))
    src = src.clone();
  host_alias(dst).copy_(src);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  dst.resize_(self.sizes());
  return copy_from(self, dst, false);
}

at::Scalar local_scalar_dense(const at::Tensor& self) { return host_alias(self).item(); }

const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size,
                          std::optional<c10::MemoryFormat> memory_format) {
  const c10::DeviceGuard guard(self.device());
  return at::native::resize_(self, size, memory_format);
}

at::Tensor& set_storage(at::Tensor& self, c10::Storage source, int64_t offset,
                        c10::IntArrayRef size, c10::IntArrayRef stride) {
  const c10::DeviceGuard guard(source.device());
  return at::native::set_storage_cpu_(self, std::move(source), offset, size, stride);
}

at::Tensor& set_empty(at::Tensor& self) {
  const c10::DeviceGuard guard(self.device());
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, &g_device_alloc, /*resizable=*/true);
  return self.set_(storage, 0, {0}, {});
}

void record_stream(at::Tensor&, c10::Stream) {}

// FSDP2's set_data (param.data = t) needs this to accept flagos tensors.
bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  auto dense = [](const at::Tensor& t) {
    return t.layout() == c10::kStrided && !t.is_quantized() &&
           (t.device().type() == kDev || t.device().is_cpu());
  };
  if (dense(self) && dense(from)) return true;
  return self.unsafeGetTensorImpl()->has_compatible_shallow_copy_type(from.key_set());
}

// scaled_dot_product_attention asks this stub which kernel to use; answer as
// CPU would, so flagos runs the same (CPU) kernel through the fallback and
// matches CPU results bit for bit (without it, SDPA takes the math path).
int64_t fused_sdp_choice(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const std::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                         std::optional<double> scale, bool enable_gqa) {
  std::optional<at::Tensor> host_mask;
  if (mask.has_value() && mask->defined()) host_mask = host_alias(*mask);
  return at::_fused_sdp_choice(host_alias(q), host_alias(k), host_alias(v), host_mask,
                               dropout_p, is_causal, scale, enable_gqa);
}

}  // namespace flagos_emu

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &flagos_emu::fused_sdp_choice)
}  // namespace at::native

namespace flagos_emu {

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  at::native::cpu_fallback(op, stack);
}

// native_batch_norm updates running_mean and running_var in place in training,
// but its schema does not mark them as written (`Tensor?`), so the CPU fallback
// updated host copies and dropped them: BatchNorm's running statistics on flagos
// stayed at their initial values. Run CPU's kernel on host aliases instead (the
// emulated device's memory is host memory), so the updates land in place, and
// copy the three results to the input's device.
std::tuple<at::Tensor, at::Tensor, at::Tensor> native_batch_norm(
    const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var, bool training, double momentum, double eps) {
  auto host = [](const std::optional<at::Tensor>& t) -> std::optional<at::Tensor> {
    if (t.has_value() && t->defined()) return host_alias(*t);
    return t;
  };
  auto [out, mean, invstd] = at::native_batch_norm(host_alias(input), host(weight), host(bias),
                                                   host(running_mean), host(running_var),
                                                   training, momentum, eps);
  const Device device = input.device();
  return std::make_tuple(out.to(device), mean.to(device), invstd.to(device));
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("_local_scalar_dense", local_scalar_dense);
  m.impl("as_strided", at::native::as_strided_tensorimpl);
  m.impl("view", at::native::view);
  m.impl("_reshape_alias", at::native::_reshape_alias);
  m.impl("unfold", at::native::unfold);
  // View ops: cpu_fallback would return a copy (writes through the view would be lost).
  m.impl("view_as_real", at::native::view_as_real);
  m.impl("view_as_complex", at::native::view_as_complex);
  m.impl("resize_", resize_);
  m.impl("set_.source_Storage", at::native::set_);
  m.impl("set_.source_Storage_storage_offset", set_storage);
  m.impl("set_.source_Tensor", at::native::set_tensor_);
  m.impl("set_", set_empty);
  m.impl("record_stream", record_stream);
  m.impl("_has_compatible_shallow_copy_type", has_compatible_shallow_copy_type);
  m.impl("native_batch_norm", native_batch_norm);
  // CompositeExplicitAutograd kernels that PrivateUse1 would otherwise get:
  // convolution would pick a device backend ("convolution_overrideable"),
  // the norms a math decomposition that rounds differently from CPU's kernel.
  for (const char* op : {"convolution", "convolution_backward", "native_layer_norm",
                         "native_group_norm"})
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

// copy_ resolves a conjugate/negative source by calling _copy_from, whose
// math-bit fallback would resolve it with copy_ again (endless recursion).
// copy_from keeps the bits on its host aliases, so let them through.
TORCH_LIBRARY_IMPL(aten, Conjugate, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}
TORCH_LIBRARY_IMPL(aten, Negative, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

// Autocast on flagos runs ops in the dtypes given (no automatic casting).
TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

// ------------------------------------------- operators for the Python module
TORCH_LIBRARY(flagos_emu, m) {
  m.def("device_count() -> int", []() -> int64_t { return g_device_count.load(); });
  m.def("set_device_count(int n) -> ()", [](int64_t n) {
    TORCH_CHECK(n >= 1 && n <= kMaxDevices, "flagos (emulated): device_count must be in [1, ",
                kMaxDevices, "], got ", n);
    g_device_count.store(static_cast<int>(n));
  });
  m.def("current_device() -> int", []() -> int64_t { return t_device; });
  m.def("set_device(int index) -> ()", [](int64_t i) {
    check_index(i);
    t_device = static_cast<DeviceIndex>(i);
  });
  m.def("current_stream(int index) -> int", [](int64_t i) -> int64_t {
    if (i < 0) i = t_device;
    check_index(i);
    return t_stream[i];
  });
  m.def("exchange_stream(int index, int stream_id) -> int", [](int64_t i, int64_t id) -> int64_t {
    check_index(i);
    const int64_t old = t_stream[i];
    t_stream[i] = id;
    return old;
  });
  m.def("new_stream() -> int", []() -> int64_t { return g_next_stream++; });
  m.def("device_of_ptr(int ptr) -> int", [](int64_t p) -> int64_t {
    auto d = g_device_alloc.device_of(reinterpret_cast<void*>(p));
    return d.has_value() ? *d : -1;
  });
  // Allocator statistics of one device for torch.flagos.memory_stats and
  // friends (the module must not go through torch.accelerator, which calls it).
  // Layout: for each of kStatNames (aggregate pool) current, peak, allocated,
  // freed; then num_device_alloc, num_device_free.
  m.def("memory_stats(int index) -> int[]", [](int64_t i) -> std::vector<int64_t> {
    check_index(i);
    const auto s = g_device_alloc.getDeviceStats(static_cast<DeviceIndex>(i));
    std::vector<int64_t> out;
    for (const auto* a : {&s.allocation, &s.segment, &s.active, &s.inactive_split,
                          &s.allocated_bytes, &s.reserved_bytes, &s.active_bytes,
                          &s.inactive_split_bytes, &s.requested_bytes}) {
      const auto& st = (*a)[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
      out.insert(out.end(), {st.current, st.peak, st.allocated, st.freed});
    }
    out.push_back(s.num_device_alloc);
    out.push_back(s.num_device_free);
    return out;
  });
  m.def("reset_peak_memory_stats(int index) -> ()", [](int64_t i) {
    g_device_alloc.resetPeakStats(static_cast<DeviceIndex>(i));
  });
  m.def("reset_accumulated_memory_stats(int index) -> ()", [](int64_t i) {
    g_device_alloc.resetAccumulatedStats(static_cast<DeviceIndex>(i));
  });
  m.def("mem_get_info(int index) -> int[]", [](int64_t i) -> std::vector<int64_t> {
    const auto [free, total] = g_device_alloc.getMemoryInfo(static_cast<DeviceIndex>(i));
    return {static_cast<int64_t>(free), static_cast<int64_t>(total)};
  });
}

}  // namespace flagos_emu
