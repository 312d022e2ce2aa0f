// Staging in C++: a device tensor's bytes through pinned host memory, for the calls the c10d
// adapter stages itself (synchronous allreduce, all_gather_into_tensor and
// reduce_scatter_tensor of contiguous device tensors: parameter checks, metrics, a training
// loop's small reductions, FSDP-style gathers issued synchronously). The semantics are those of
// flagos_shm/staging.py (the Python side stages every other call): the copy out is enqueued on
// the tensor's current stream and only that stream is synchronised; the copy back is enqueued
// non-blocking on the same stream, so later work there sees the result; the buffer goes back
// to the pool with an event recorded after that copy, and is reused only once the event has
// completed. Streams and events come from the device's c10 DeviceGuardImpl, so the emulated
// flagos device, a real torch_fl device and CUDA take the same path. No GIL is needed here.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <utility>

namespace flagos_shm {

// Pinned host buffers reused across calls, as staging.PinnedPool: power-of-two sizes (at
// least 64 KiB), at most `limit` bytes of idle ones kept (the smallest freed first).
class PinnedPool {
 public:
  struct Buffer {
    at::Tensor bytes;                    // 1-D uint8, pinned
    std::unique_ptr<c10::Event> event;  // recorded after the last copy from it, or null
  };

  void set_limit(int64_t limit) {
    std::lock_guard<std::mutex> lock(mutex_);
    limit_ = limit;
    trim();
  }

  int64_t idle_bytes() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return idle_bytes_;
  }

  // A buffer of at least `nbytes` bytes, free to overwrite (its last copy has completed).
  Buffer acquire(int64_t nbytes) {
    Buffer buf;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = idle_.lower_bound(nbytes);
      if (it != idle_.end()) {
        buf = std::move(it->second);
        idle_bytes_ -= it->first;
        idle_.erase(it);
      }
    }
    if (!buf.bytes.defined()) {
      int64_t size = kMinBytes;
      while (size < nbytes) {
        size <<= 1;
      }
      buf.bytes = at::empty({size}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    } else if (buf.event) {
      buf.event->synchronize();  // the copy that last read it has finished
      buf.event.reset();
    }
    return buf;
  }

  void release(Buffer buf) {
    std::lock_guard<std::mutex> lock(mutex_);
    const int64_t size = buf.bytes.numel();
    idle_bytes_ += size;
    idle_.emplace(size, std::move(buf));
    trim();
  }

 private:
  static constexpr int64_t kMinBytes = 64 << 10;

  void trim() {  // mutex_ held
    while (!idle_.empty() && idle_bytes_ > limit_) {
      auto it = idle_.begin();
      if (it->second.event) {
        it->second.event->synchronize();
      }
      idle_bytes_ -= it->first;
      idle_.erase(it);
    }
  }

  mutable std::mutex mutex_;
  std::multimap<int64_t, Buffer> idle_;  // by size
  int64_t idle_bytes_ = 0;
  int64_t limit_ = int64_t{256} << 20;
};

inline PinnedPool& pinned_pool() {
  static auto* pool = new PinnedPool();  // never destroyed: process exit must not free pinned memory twice
  return *pool;
}

// One device tensor staged in host memory for a call that reads it, writes it, or both.
class Staged {
 public:
  // `read`: copies `tensor` (contiguous, on an accelerator) out to pinned memory on its
  // current stream and waits for that stream (`sync` false: the caller waits, once for
  // several tensors, with synchronize()). `write`: finish() copies the result back.
  explicit Staged(const at::Tensor& tensor, bool read = true, bool write = true, bool sync = true)
      : tensor_(tensor),
        write_(write),
        impl_(tensor.device().type()),
        stream_(impl_.getStream(tensor.device())),
        buffer_(pinned_pool().acquire(static_cast<int64_t>(tensor.nbytes()))) {
    host_ = at::from_blob(buffer_.bytes.data_ptr(), tensor.sizes(), tensor.options().device(at::kCPU));
    if (read && tensor.numel() > 0) {
      at::NoGradGuard no_grad;
      host_.copy_(tensor, /*non_blocking=*/true);
      if (sync) {
        synchronize();
      }
    }
  }

  // Waits for the tensor's stream (the copy out has landed).
  void synchronize() {
    impl_.synchronizeStream(stream_);
  }

  Staged(const Staged&) = delete;
  Staged& operator=(const Staged&) = delete;

  // Gives the buffer back without copying anything back (the call failed or was not made).
  ~Staged() {
    if (buffer_.bytes.defined()) {
      pinned_pool().release(std::move(buffer_));
    }
  }

  const at::Tensor& host() const {
    return host_;
  }

  // Enqueues the copy back on the stream of the call, records the buffer's event after it,
  // and gives the buffer back.
  void finish() {
    if (write_ && tensor_.numel() > 0) {
      c10::StreamGuard guard(stream_);
      at::NoGradGuard no_grad;
      tensor_.copy_(host_, /*non_blocking=*/true);
      buffer_.event = std::make_unique<c10::Event>(tensor_.device().type());
      buffer_.event->record(stream_);
    }
    host_ = at::Tensor();
    pinned_pool().release(std::move(buffer_));
    buffer_ = PinnedPool::Buffer();
  }

 private:
  at::Tensor tensor_;
  bool write_;
  c10::impl::VirtualGuardImpl impl_;
  c10::Stream stream_;
  PinnedPool::Buffer buffer_;
  at::Tensor host_;
};

}  // namespace flagos_shm
