// flagos_shm's c10d adapter: the one c10d::Backend that every torch (2.10 to 2.15) gets.
//
// torch registers a backend per device type only if it is a C++ c10d::Backend (torch 2.10-2.13
// cannot construct a Python subclass of Backend at all; 2.14 added a trampoline whose works
// forward wait() and get_future() only). This file is that C++ Backend. It holds the group's
// Python object (flagos_shm.backend.group.ShmGroup: staging, ordering, the Rust core) and
// forwards each virtual to the method of the same meaning there, with the GIL taken for the
// call; the core releases it while it moves data. What the Python side returns becomes:
//
//   * None: the call finished (a synchronous call, opts.asyncOp false): a null work, as c10d
//     allows ("the backend synchronised at C++ level"; dist.* then skips wait());
//   * a flagos_shm work: a ShmWork below, which the Python work tells when it finishes
//     (_on_complete), so that isCompleted(), isSuccess(), exception() and getFuture() answer
//     from C++ and are true on every torch; wait() asks the Python work, which keeps its own
//     semantics (running a queued call on the waiting thread, aborting the group on a timeout
//     or Ctrl-C) and raises the collective's own error (ValueError, RuntimeError, ...).
//
// Errors raised by the Python side cross C++ as pybind11::error_already_set and reach a
// Python caller as the original exception.
//
// Only the virtuals that torch 2.10 already has are overridden, under their 2.10 names
// (_allgather_base, _reduce_scatter_base, alltoall_base, allgather_into_tensor_coalesced,
// reduce_scatter_tensor_coalesced): newer torch forwards its new names (all_gather_single,
// ...) to these, so one source builds and behaves alike on every supported torch.
// flagos_shm.backend.adapter builds this file against the installed torch on first use.

#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/utils/pybind.h>

#include "staging.hpp"

#include <array>
#include <atomic>
#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace flagos_shm {
namespace {

constexpr const char* kBackendName = "flagos_shm";

bool python_alive() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() && !Py_IsFinalizing();
#else
  return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

// Drops Python references from any thread: with the GIL taken, or not at all once the
// interpreter is finalising (process exit, where taking the GIL would hang or abort).
void release(py::object& obj) {
  if (!obj) {
    return;
  }
  if (!python_alive()) {
    obj.release();  // the interpreter is going away with everything it holds
    return;
  }
  py::gil_scoped_acquire gil;
  obj = py::object();
}

// flagos_shm.backend.exiting.leaving_with_error and .returning_at_exit, looked up when this
// module is loaded; never released (the interpreter may be gone at process exit).
PyObject* leaving_with_error = nullptr;
PyObject* returning_at_exit = nullptr;
// Set (exit_handler_begins below) when flagos_shm's atexit handler begins: from then on a call
// that succeeds asks returning_at_exit too. Before, it costs one relaxed load per call.
std::atomic<bool> exit_begun{false};

// The GIL, taken to call the Python side, for a call that returns to torch: when the call
// raises, the thread is about to release the GIL and go back through torch's frames, where
// torch takes the GIL again to raise; if the interpreter finalizes meanwhile, CPython ends the
// thread there with pthread_exit and the process aborts. So before the GIL goes, a raising
// call asks flagos_shm.backend.exiting what to do (the reasons are there): park for good, or
// go back, noted so that the interpreter's exit waits for the thread to raise first.
class PythonCall {
 public:
  PythonCall() = default;
  PythonCall(const PythonCall&) = delete;
  PythonCall& operator=(const PythonCall&) = delete;

  ~PythonCall() {
    PyObject* ask = std::uncaught_exceptions() > uncaught_ ? leaving_with_error
                    : exit_begun.load(std::memory_order_relaxed) ? returning_at_exit
                                                                 : nullptr;
    if (ask != nullptr && must_park(ask)) {
      PyEval_SaveThread();  // never taken back: the interpreter abandons this thread
      for (;;) {
        std::this_thread::sleep_for(std::chrono::hours(24));
      }
    }
  }

 private:
  static bool must_park(PyObject* ask) noexcept {  // GIL held
    PyObject* type = nullptr;
    PyObject* value = nullptr;
    PyObject* trace = nullptr;
    PyErr_Fetch(&type, &value, &trace);  // none is set (pybind11 took it); keep it so
    PyObject* answer = PyObject_CallNoArgs(ask);
    const bool park = answer != nullptr && PyObject_IsTrue(answer) == 1;
    Py_XDECREF(answer);
    PyErr_Clear();
    PyErr_Restore(type, value, trace);
    return park;
  }

#ifdef FLAGOS_SHM_TEST_EXIT_WINDOW_US
  // Tests only (tests/test_shutdown_queued.py builds a copy of this module with it): widens
  // the two windows in which a thread crosses torch's frames without the GIL, before this
  // call takes it and after it has let it go (flagos_shm.backend.exiting explains them).
  struct Widen {
    Widen() { pause(); }
    ~Widen() { pause(); }
    static void pause() { std::this_thread::sleep_for(std::chrono::microseconds(FLAGOS_SHM_TEST_EXIT_WINDOW_US)); }
  } widen_;  // constructed before gil_, destroyed after it
#endif
  py::gil_scoped_acquire gil_;
  const int uncaught_ = std::uncaught_exceptions();
};

// The error a Python work finished with, kept as the Python exception itself: wherever it is
// rethrown (wait(), get_future().wait(), exception(), a C++ caller), a Python caller gets that
// exception back, as often as it asks (the translator registered below restores it); a C++
// caller (DDP's reducer) sees "<type>: <message>".
class PythonError : public std::runtime_error {
 public:
  explicit PythonError(const py::handle& error)  // GIL held
      : std::runtime_error(describe(error)),
        error_(std::make_shared<Held>(py::reinterpret_borrow<py::object>(error))) {}

  void restore() const {  // GIL held (pybind11 runs translators with it)
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error_->obj.ptr())), error_->obj.ptr());
  }

 private:
  struct Held {
    py::object obj;
    ~Held() {
      release(obj);
    }
  };

  static std::string describe(const py::handle& error) {
    return py::str(py::type::handle_of(error).attr("__name__")).cast<std::string>() + ": " +
           py::str(error).cast<std::string>();
  }

  std::shared_ptr<Held> error_;  // copies of the exception (exception_ptr, throw) share it
};

// The work of one flagos_shm call (see the file comment).
class ShmWork : public c10d::Work {
 public:
  ShmWork(py::object work, c10d::OpType type, std::vector<at::Tensor> outputs)
      : Work(-1, type), work_(std::move(work)), outputs_(std::move(outputs)) {}

  ~ShmWork() override {
    release(work_);
  }

  // Wraps the Python work `work` and asks it to report its completion. GIL held.
  static c10::intrusive_ptr<ShmWork> wrap(py::object work, c10d::OpType type, std::vector<at::Tensor> outputs) {
    auto self = c10::make_intrusive<ShmWork>(work, type, std::move(outputs));
    // completer()(handle, error) is called once, on whichever thread finishes the work (at
    // once if it already has), before the Python work's wait() returns. The handle owns a
    // reference to this work: callers may keep only its future (DDP's reducer does:
    // `allreduce(...)->getFuture()`), which must still complete. One function serves every
    // work (making one per work cost several us a call).
    auto handle = reinterpret_cast<uintptr_t>(c10::intrusive_ptr<ShmWork>(self).release());
    work.attr("_on_complete")(completer(), handle);
    return self;
  }

  // The function every Python work calls when it completes: (handle, error or None).
  static const py::object& completer() {
    static const py::object* fn = new py::object(py::cpp_function([](uintptr_t handle, const py::object& error) {
      auto self = c10::intrusive_ptr<ShmWork>::reclaim(reinterpret_cast<ShmWork*>(handle));
      self->complete(error);
    }));  // never destroyed: the interpreter may be gone at process exit
    return *fn;
  }

  bool wait(std::chrono::milliseconds timeout) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (completed_ && !exception_) {
        return true;
      }
    }
    PythonCall gil;
    try {
      // Raises the collective's error; a timeout (> 0) that passes aborts the group and raises.
      work_.attr("wait")(timeout.count() > 0 ? py::cast(timeout) : py::none());
    } catch (py::error_already_set&) {
      completedEarly();
      throw;
    }
    completedEarly();
    return true;
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    std::unique_lock<std::mutex> lock(mutex_);
    if (completed_ && !finished_) {
      // Completed early (see completedEarly): a future taken now is complete, as NCCL's
      // would be, so waiting for it returns and a callback attached to it runs at once;
      // future_'s own callbacks still run when complete() settles it.
      auto error = exception_;
      lock.unlock();
      auto future = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
      settle(future, error);
      return future;
    }
    if (!future_) {
      future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
      auto future = future_;
      if (finished_) {
        auto error = exception_;
        lock.unlock();
        settle(future, error);
        return future;
      }
      lock.unlock();
      // Callbacks may now be attached that issue collectives when the work completes: the
      // group places those calls here, before any issued later (ShmWork._future_taken).
      // Not under mutex_: complete() takes it with the GIL held.
      PythonCall gil;
      work_.attr("_future_taken")();
      return future;
    }
    return future_;
  }

  std::vector<at::Tensor> result() override {
    return outputs_;
  }

  int sourceRank() const override {
    py::gil_scoped_acquire gil;
    return work_.attr("_source_rank")().cast<int>();
  }

 private:
  void complete(const py::object& error) {  // GIL held
    std::exception_ptr eptr = error.is_none() ? nullptr : std::make_exception_ptr(PythonError(error));
    c10::intrusive_ptr<c10::ivalue::Future> future;
    std::function<void()> end;
    {
      // What Work::finish does, plus taking the future in the same critical section, so
      // that a getFuture() racing with this either sees the work completed or is settled here.
      std::lock_guard<std::mutex> lock(mutex_);
      if (finished_) {
        return;
      }
      finished_ = completed_ = true;
      exception_ = eptr;
      future = future_;
      end = std::move(recordFunctionEndCallback_);
      recordFunctionEndCallback_ = nullptr;
    }
    if (end) {
      end();  // the profiler's record of the collective ends here
    }
    cv_.notify_all();
    if (future) {
      settle(future, eptr);
    }
  }

  // After the Python work's wait() has returned or raised (GIL held). A work waited for from
  // a callback of a work whose future was taken before this one's completes in two parts
  // (ShmWork._complete, early): its results are in now, but complete(), which settles its
  // future and so runs the callbacks attached to it, runs only once that callback has
  // returned, as NCCL runs them (after it: they were attached later). The work is complete
  // now, with its error if it failed. Nothing to do after complete() has run, or if the
  // wait gave up (a timeout or Ctrl-C: the work is not complete).
  void completedEarly() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (completed_) {
        return;
      }
    }
    if (!work_.attr("is_completed")().cast<bool>()) {
      return;
    }
    py::object error = work_.attr("exception")();
    std::exception_ptr eptr = error.is_none() ? nullptr : std::make_exception_ptr(PythonError(error));
    std::lock_guard<std::mutex> lock(mutex_);
    if (!completed_) {
      completed_ = true;
      exception_ = eptr;
    }
  }

  void settle(const c10::intrusive_ptr<c10::ivalue::Future>& future, const std::exception_ptr& error) {
    if (error) {
      future->setError(error);
    } else {
      future->markCompleted(c10::IValue(outputs_));
    }
  }

  py::object work_;
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;  // made on demand (DDP asks for it)
  // complete() has run (and settled future_ if taken). Work::completed_ may be set before,
  // by a wait() that returned while the future's callbacks were put off (completedEarly).
  bool finished_ = false;
};

// The Python methods a backend calls, looked up once per backend.
enum Method : size_t {
  kAllreduce,
  kAllreduceSparse,
  kAllreduceCoalesced,
  kBroadcast,
  kReduce,
  kAllgather,
  kAllGatherSingle,
  kAllgatherCoalesced,
  kAllGatherSingleCoalesced,
  kGather,
  kScatter,
  kReduceScatter,
  kReduceScatterSingle,
  kReduceScatterSingleCoalesced,
  kAllToAllSingle,
  kAllToAll,
  kBarrier,
  kSend,
  kRecv,
  kRecvAnysource,
  kMethodCount,
};

constexpr std::array<const char*, kMethodCount> kMethodNames = {
    "allreduce",
    "allreduce_sparse",
    "allreduce_coalesced",
    "broadcast",
    "reduce",
    "allgather",
    "all_gather_single",
    "allgather_coalesced",
    "all_gather_single_coalesced",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_single_coalesced",
    "all_to_all_single",
    "alltoall",
    "barrier",
    "send",
    "recv",
    "recv_anysource",
};

std::vector<at::Tensor> flatten(const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<at::Tensor> out;
  for (const auto& list : lists) {
    out.insert(out.end(), list.begin(), list.end());
  }
  return out;
}

// flagos_shm as the c10d backend of some device types of a process group.
class ShmBackend : public c10d::Backend {
 public:
  // A dtype the digested allreduce takes: its core name and the ops allowed for it.
  struct FastType {
    py::object name;  // a Python str, passed as it is
    uint32_t ops = 0;  // bit 1 << RedOpType
  };

  // `group`: the Python ShmGroup this backend forwards to. GIL held.
  ShmBackend(py::object group, int rank, int size) : Backend(rank, size), group_(std::move(group)) {
    for (size_t i = 0; i < kMethodCount; ++i) {
      methods_[i] = group_.attr(kMethodNames[i]);
    }
    digested_allreduce_ = group_.attr("_allreduce_digested");
    digested_broadcast_ = group_.attr("_broadcast_digested");
    digested_allgather_ = group_.attr("_all_gather_single_digested");
    digested_alltoall_ = group_.attr("_all_to_all_single_digested");
    digested_reduce_scatter_ = group_.attr("_reduce_scatter_single_digested");
    staged_allreduce_ = group_.attr("_allreduce_staged");
    can_stage_ = group_.attr("_can_stage_directly");
    slow_ = py::module_::import("flagos_shm.backend.collectives.base").attr("SLOW");
    // {torch dtype: (core dtype name, mask of allowed ops)}: the Python side states the rules.
    py::dict table = py::module_::import("flagos_shm.backend.options").attr("fast_op_table")();
    for (auto item : table) {
      if (!THPDtype_Check(item.first.ptr())) {
        continue;
      }
      auto type = reinterpret_cast<THPDtype*>(item.first.ptr())->scalar_type;
      auto entry = item.second.cast<py::tuple>();
      auto& fast = fast_[static_cast<size_t>(type)];
      fast.name = entry[0].cast<py::str>();
      fast.ops = entry[1].cast<uint32_t>();
    }
  }

  ~ShmBackend() override {
    for (auto& method : methods_) {
      release(method);
    }
    for (auto& fast : fast_) {
      release(fast.name);
    }
    release(digested_allreduce_);
    release(digested_broadcast_);
    release(digested_allgather_);
    release(digested_alltoall_);
    release(digested_reduce_scatter_);
    release(staged_allreduce_);
    release(can_stage_);
    release(slow_);
    release(group_);
  }

  py::object group() const {
    return group_;
  }

  const std::string getBackendName() const override {
    return kBackendName;
  }

  bool supportsSplitting() const override {
    return true;
  }

  bool supportsCoalescing() const override {
    return true;
  }

  c10::intrusive_ptr<Options> getBackendOptions() override {
    py::gil_scoped_acquire gil;
    auto seconds = group_.attr("_timeout_s").cast<double>();
    return c10::make_intrusive<Options>(
        kBackendName, std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0)));
  }

  void setTimeout(std::chrono::milliseconds timeout) override {
    py::gil_scoped_acquire gil;
    group_.attr("set_timeout")(timeout);
  }

  // ---- collectives ------------------------------------------------------------------

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    // The common case, taken apart here as allreduce's is (below): one contiguous CPU tensor.
    if (tensors.size() == 1 && opts.rootTensor == 0 && opts.timeout == c10d::kUnsetTimeout &&
        tensors[0].device().is_cpu()) {
      const at::Tensor& t = tensors[0];
      if (const FastType* fast = fast_type(t)) {
        PythonCall gil;
        const int64_t numel = t.numel();
        py::object result = digested_broadcast_(tensors, reinterpret_cast<uintptr_t>(t.data_ptr()),
                                                numel * static_cast<int64_t>(t.element_size()), numel, fast->name,
                                                opts.rootRank, opts.asyncOp);
        if (!result.is(slow_)) {
          return wrap(std::move(result), c10d::OpType::BROADCAST, tensors);
        }
      }
    }
    if (tensors.size() == 1 && !opts.asyncOp && opts.timeout == c10d::kUnsetTimeout && tensors[0].numel() > 0 &&
        staged_here(kBroadcast, tensors[0], tensors[0], opts, [&](const at::Tensor& out, const at::Tensor&) {
          return methods_[kBroadcast](std::vector<at::Tensor>{out}, opts);
        })) {
      return {};
    }
    return issue(kBroadcast, c10d::OpType::BROADCAST, tensors, tensors, opts);
  }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    // The common case (one contiguous CPU tensor, default options), taken apart here so that
    // the Python side only checks the group's state and calls the core: the per-call cost
    // of a small allreduce (DDP's buckets, metrics) is mostly this layer's.
    // A device tensor likewise goes straight to staging (ShmGroup._allreduce_staged).
    if (tensors.size() == 1 && opts.timeout == c10d::kUnsetTimeout && !opts.sparseIndices.has_value()) {
      const at::Tensor& t = tensors[0];
      const auto op = static_cast<uint32_t>(opts.reduceOp.op_);
      const FastType* fast = fast_type(t);
      if (fast != nullptr && op < 32 && (fast->ops >> op & 1U) != 0) {
        PythonCall gil;
        py::object result;
        if (t.device().is_cpu()) {
          const int64_t numel = t.numel();
          result = digested_allreduce_(tensors, reinterpret_cast<uintptr_t>(t.data_ptr()),
                                       numel * static_cast<int64_t>(t.element_size()), numel, fast->name, op,
                                       opts.asyncOp);
        } else if (!opts.asyncOp && can_stage_().cast<bool>()) {
          py::gil_scoped_release no_gil;
          if (allreduce_staged_here(t, *fast, op)) {
            return {};  // finished: the result is on its way back on the tensor's stream
          }
          result = slow_;
        } else {
          result = staged_allreduce_(tensors, fast->name, op, opts.asyncOp);
        }
        if (!result.is(slow_)) {
          return wrap(std::move(result), c10d::OpType::ALLREDUCE, tensors);
        }
      }
    }
    return issue(kAllreduce, c10d::OpType::ALLREDUCE, tensors, tensors, opts);
  }

  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) override {
    return issue(kAllreduceSparse, c10d::OpType::ALLREDUCE, tensors, tensors, opts);
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override {
    return issue(kAllreduceCoalesced, c10d::OpType::ALLREDUCE_COALESCED, tensors, tensors, opts);
  }

  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override {
    return issue(kReduce, c10d::OpType::REDUCE, tensors, tensors, opts);
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override {
    return issue(kAllgather, c10d::OpType::ALLGATHER, flatten(outputs), outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override {
    // FSDP2's parameter all-gather on CPU tensors, taken apart here (overlap: Python).
    if (const FastType* fast = fast_cpu_pair(input, output, opts.timeout, input.numel() * getSize())) {
      PythonCall gil;
      py::object result = digested_allgather_(output, input, reinterpret_cast<uintptr_t>(input.data_ptr()),
                                              input.numel() * static_cast<int64_t>(input.element_size()),
                                              reinterpret_cast<uintptr_t>(output.data_ptr()),
                                              output.numel() * static_cast<int64_t>(output.element_size()),
                                              input.numel(), fast->name, opts.asyncOp);
      if (!result.is(slow_)) {
        return wrap(std::move(result), c10d::OpType::_ALLGATHER_BASE, {output});
      }
    }
    if (!opts.asyncOp && opts.timeout == c10d::kUnsetTimeout && input.numel() * getSize() == output.numel() &&
        output.numel() > 0 &&
        staged_here(kAllGatherSingle, output, input, opts, [&](const at::Tensor& out, const at::Tensor& in) {
          return methods_[kAllGatherSingle](out, in, opts);
        })) {
      return {};
    }
    return issue(kAllGatherSingle, c10d::OpType::_ALLGATHER_BASE, {output}, output, input, opts);
  }

  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override {
    return issue(kAllgatherCoalesced, c10d::OpType::ALLGATHER_COALESCED, flatten(outputs), outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override {
    return issue(kAllGatherSingleCoalesced, c10d::OpType::COALESCED, outputs, outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override {
    return issue(kGather, c10d::OpType::GATHER, flatten(outputs), outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override {
    return issue(kScatter, c10d::OpType::SCATTER, outputs, outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    return issue(kReduceScatter, c10d::OpType::REDUCE_SCATTER, outputs, outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override {
    const auto op = static_cast<uint32_t>(opts.reduceOp.op_);
    // FSDP2's gradient reduce-scatter on CPU tensors, taken apart here (overlap: Python).
    if (const FastType* pair = fast_cpu_pair(output, input, opts.timeout, output.numel() * getSize());
        pair != nullptr && op < 32 && (pair->ops >> op & 1U) != 0) {
      PythonCall gil;
      const auto es = static_cast<int64_t>(output.element_size());
      py::object result = digested_reduce_scatter_(output, input, reinterpret_cast<uintptr_t>(input.data_ptr()),
                                                   input.numel() * es, reinterpret_cast<uintptr_t>(output.data_ptr()),
                                                   output.numel() * es, output.numel(), pair->name, op,
                                                   opts.asyncOp);
      if (!result.is(slow_)) {
        return wrap(std::move(result), c10d::OpType::_REDUCE_SCATTER_BASE, {output});
      }
    }
    const FastType* fast = fast_type(input);
    if (!opts.asyncOp && opts.timeout == c10d::kUnsetTimeout && fast != nullptr && op < 32 &&
        (fast->ops >> op & 1U) != 0 && output.numel() * getSize() == input.numel() && output.numel() > 0 &&
        staged_here(kReduceScatterSingle, output, input, opts, [&](const at::Tensor& out, const at::Tensor& in) {
          return methods_[kReduceScatterSingle](out, in, opts);
        })) {
      return {};
    }
    return issue(kReduceScatterSingle, c10d::OpType::_REDUCE_SCATTER_BASE, {output}, output, input, opts);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override {
    return issue(kReduceScatterSingleCoalesced, c10d::OpType::COALESCED, outputs, outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts) override {
    // `dist.all_to_all_single(out, inp)` on CPU tensors, taken apart here (overlap: Python).
    if (output_split_sizes.empty() && input_split_sizes.empty() && input.dim() > 0 && output.dim() > 0 &&
        input.size(0) % getSize() == 0 && output.size(0) % getSize() == 0) {
      if (const FastType* fast = fast_cpu_pair(input, output, opts.timeout, input.numel())) {
        PythonCall gil;
        const int64_t nbytes = input.numel() * static_cast<int64_t>(input.element_size());
        py::object result = digested_alltoall_(output, input, reinterpret_cast<uintptr_t>(input.data_ptr()),
                                               reinterpret_cast<uintptr_t>(output.data_ptr()), nbytes,
                                               input.numel() / getSize(), fast->name, opts.asyncOp);
        if (!result.is(slow_)) {
          return wrap(std::move(result), c10d::OpType::ALLTOALL_BASE, {output});
        }
      }
    }
    if (output_split_sizes.empty() && input_split_sizes.empty() && !opts.asyncOp &&
        opts.timeout == c10d::kUnsetTimeout && input.numel() == output.numel() && input.numel() % getSize() == 0 &&
        staged_here(kAllToAllSingle, output, input, opts, [&](const at::Tensor& out, const at::Tensor& in) {
          return methods_[kAllToAllSingle](out, in, output_split_sizes, input_split_sizes, opts);
        })) {
      return {};
    }
    return issue(kAllToAllSingle, c10d::OpType::ALLTOALL_BASE, {output}, output, input, output_split_sizes,
                 input_split_sizes, opts);
  }

  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override {
    return issue(kAllToAll, c10d::OpType::ALLTOALL, outputs, outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    return issue(kBarrier, c10d::OpType::BARRIER, {}, opts);
  }

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) override {
    return issue(kSend, c10d::OpType::SEND, tensors, tensors, dst_rank, tag);
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) override {
    return issue(kRecv, c10d::OpType::RECV, tensors, tensors, src_rank, tag);
  }

  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    return issue(kRecvAnysource, c10d::OpType::RECVANYSOURCE, tensors, tensors, tag);
  }

  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override {
    PythonCall gil;
    group_.attr("monitored_barrier")(opts, wait_all_ranks);
  }

  // ---- coalescing, sequence numbers, groups made from this one, lifetime -----------------

  void startCoalescing() override {
    py::gil_scoped_acquire gil;
    group_.attr("start_coalescing")();
  }

  c10::intrusive_ptr<c10d::Work> endCoalescing() override {
    PythonCall gil;
    return wrap(group_.attr("end_coalescing")(), c10d::OpType::COALESCED, {});
  }

  void setSequenceNumberForGroup() override {}  // the core numbers its collectives itself

  uint64_t getSequenceNumberForGroup() override {
    py::gil_scoped_acquire gil;
    return group_.attr("_get_sequence_number_for_group")().cast<uint64_t>();
  }

  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store,
                                          const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<Options>& opts) override {
    py::gil_scoped_acquire gil;
    py::object child = group_.attr("split")(store, ranks, opts);
    if (child.is_none()) {
      return {};  // this rank is not in `ranks`
    }
    int rank = child.attr("_rank").cast<int>();
    int size = child.attr("_world_size").cast<int>();
    return c10::make_intrusive<ShmBackend>(std::move(child), rank, size);
  }

  void eagerConnectSingleDevice(at::Device /*device*/) override {}  // attached at creation

  void abort() override {
    py::gil_scoped_acquire gil;
    group_.attr("abort")();
  }

  void shutdown() override {
    py::gil_scoped_acquire gil;
    group_.attr("shutdown")();
  }

 private:
  // What a collective returns: None -> a null work (finished); a flagos_shm work -> ShmWork.
  static c10::intrusive_ptr<c10d::Work> wrap(py::object result, c10d::OpType type, std::vector<at::Tensor> outputs) {
    if (result.is_none()) {
      return {};
    }
    return ShmWork::wrap(std::move(result), type, std::move(outputs));
  }

  template <typename... Args>
  c10::intrusive_ptr<c10d::Work> issue(Method method, c10d::OpType type, std::vector<at::Tensor> outputs,
                                       Args&&... args) {
    PythonCall gil;
    py::object result = methods_[method](std::forward<Args>(args)...);
    return wrap(std::move(result), type, std::move(outputs));
  }

  // A synchronous call on contiguous device tensors (one device, one dtype), staged here:
  // `input` copied out, `call(host output, host input)` (the Python side's method for CPU
  // tensors, run on the host copies), `output` copied back. `output` and `input` may be the
  // same tensor (broadcast: copied out and back). Returns false (nothing done) when the
  // tensors are not such, or the group has earlier asynchronous writes pending; raises what
  // the call raised (the device tensors untouched).
  template <typename Options, typename Call>
  bool staged_here(Method method, const at::Tensor& output, const at::Tensor& input, const Options& /*opts*/,
                   Call&& call) {
    const bool same = output.is_same(input);
    if (output.device().is_cpu() || output.device() != input.device() ||
        output.scalar_type() != input.scalar_type() || fast_type(output) == nullptr ||
        fast_type(input) == nullptr) {
      return false;
    }
    {
      py::gil_scoped_acquire gil;
      if (!can_stage_().cast<bool>()) {
        return false;
      }
    }
    std::optional<Staged> in;
    std::optional<Staged> out;
    try {
      if (same) {
        out.emplace(output, /*read=*/true, /*write=*/true);
      } else {
        in.emplace(input, /*read=*/true, /*write=*/false, /*sync=*/false);
        out.emplace(output, /*read=*/false, /*write=*/true);
        in->synchronize();
      }
    } catch (const std::exception& e) {  // the device runtime failed: the peers must not wait
      tell_peers(kMethodNames[method], e.what());
      throw;
    }
    {
      PythonCall gil;
      py::object result = call(out->host(), same ? out->host() : in->host());
      if (!result.is_none()) {  // a work: wait for it (asyncOp is false: it has finished)
        result.attr("wait")();
      }
    }
    out->finish();
    return true;
  }

  void tell_peers(const char* name, const char* what) {
    py::gil_scoped_acquire gil;
    try {
      group_.attr("_comm").attr("fail")(name, std::string("RuntimeError: ") + what);
    } catch (const py::error_already_set&) {  // the caller's error matters more
    }
  }

  // A synchronous allreduce of one contiguous device tensor, staged here (staging.hpp) and
  // reduced by the Python side's CPU path on the host copy: the call costs its two copies,
  // the CPU call and little more. Called without the GIL, after can_stage_() said yes.
  // Returns false when the Python side refused the host call (it then takes the device call
  // through its own path); raises what the call raised.
  bool allreduce_staged_here(const at::Tensor& t, const FastType& fast, uint32_t op) {
    std::optional<Staged> staged;
    try {
      staged.emplace(t);
    } catch (const std::exception& e) {  // the device runtime failed: the peers must not wait
      tell_peers("allreduce", e.what());
      throw;
    }
    const at::Tensor& host = staged->host();
    {
      PythonCall gil;
      const int64_t numel = host.numel();
      py::object result = digested_allreduce_(std::vector<at::Tensor>{host},
                                              reinterpret_cast<uintptr_t>(host.data_ptr()),
                                              numel * static_cast<int64_t>(host.element_size()), numel, fast.name,
                                              op, false);
      if (result.is(slow_)) {
        return false;
      }
    }
    staged->finish();
    return true;
  }

  // The dtype's entry if `t` is what the digested allreduce takes as it is (a dense,
  // contiguous tensor without lazy negation or conjugation, of a core dtype; on the CPU at an
  // address aligned to its element size, or on an accelerator, meta excluded), else nullptr.
  const FastType* fast_type(const at::Tensor& t) const {
    if (!t.defined() || t.layout() != at::kStrided || !t.is_contiguous() || t.is_neg() || t.is_conj() ||
        t.is_meta()) {
      return nullptr;
    }
    const auto& fast = fast_[static_cast<size_t>(t.scalar_type())];
    if (!fast.name ||
        (t.device().is_cpu() && reinterpret_cast<uintptr_t>(t.data_ptr()) % t.element_size() != 0)) {
      return nullptr;
    }
    return &fast;
  }

  // The dtype's entry if `first` and `second` are both CPU tensors that `fast_type` takes, of
  // one dtype, `first` not empty and `second` of `second_numel` elements, and no per-call
  // timeout was given; else nullptr. (The digested two-tensor calls: allgather and all-to-all
  // pass (input, output), reduce-scatter (output, input).)
  template <typename Timeout>
  const FastType* fast_cpu_pair(const at::Tensor& first, const at::Tensor& second, const Timeout& timeout,
                                int64_t second_numel) const {
    if (timeout != c10d::kUnsetTimeout || !first.defined() || !second.defined() || !first.device().is_cpu() ||
        !second.device().is_cpu() || first.scalar_type() != second.scalar_type() || first.numel() == 0 ||
        second.numel() != second_numel) {
      return nullptr;
    }
    const FastType* fast = fast_type(first);
    return fast != nullptr && fast_type(second) != nullptr ? fast : nullptr;
  }

  py::object group_;
  std::array<py::object, kMethodCount> methods_;
  py::object digested_allreduce_;
  py::object digested_broadcast_;
  py::object digested_allgather_;
  py::object digested_alltoall_;
  py::object digested_reduce_scatter_;
  py::object staged_allreduce_;
  py::object can_stage_;
  py::object slow_;  // what the Python side returns when the call needs the full path
  std::array<FastType, static_cast<size_t>(at::ScalarType::NumOptions)> fast_;
};

}  // namespace
}  // namespace flagos_shm

PYBIND11_MODULE(flagos_shm_c10d, m) {
  m.doc() = "flagos_shm's c10d adapter (built against the installed torch by flagos_shm.backend.adapter)";
  py::module_::import("torch._C._distributed_c10d");  // registers c10d.Backend, Work, the options
  py::module_ exiting = py::module_::import("flagos_shm.backend.exiting");
  flagos_shm::leaving_with_error = exiting.attr("leaving_with_error").cast<py::object>().release().ptr();
  flagos_shm::returning_at_exit = exiting.attr("returning_at_exit").cast<py::object>().release().ptr();
  m.def("exit_handler_begins", []() { flagos_shm::exit_begun.store(true); },
        "from now on a call that succeeds asks flagos_shm.backend.exiting.returning_at_exit whether its "
        "thread parks");
  // A work's error, met by any pybind11 binding (torch's Work.wait, Future.wait, ...), becomes
  // the Python exception it came from.
  m.def("set_pinned_pool_limit", [](int64_t bytes) { flagos_shm::pinned_pool().set_limit(bytes); },
        py::arg("bytes"), "idle pinned bytes the adapter's own staging pool keeps between calls");
  m.def("pinned_pool_idle_bytes", []() { return flagos_shm::pinned_pool().idle_bytes(); },
        "idle pinned bytes the adapter's own staging pool holds now");
  py::register_exception_translator([](std::exception_ptr error) {
    try {
      if (error) {
        std::rethrow_exception(error);
      }
    } catch (const flagos_shm::PythonError& e) {
      e.restore();
    }
  });
  // Registered so that pybind11 finds the works' own type when it hands one to Python (an
  // unregistered subclass sends every cast through its slower polymorphic fallback).
  py::class_<flagos_shm::ShmWork, c10d::Work, c10::intrusive_ptr<flagos_shm::ShmWork>>(
      m, "ShmWork", "the work of a flagos_shm call (torch's Work API)");
  py::class_<flagos_shm::ShmBackend, c10d::Backend, c10::intrusive_ptr<flagos_shm::ShmBackend>>(m, "ShmBackend")
      .def(py::init<py::object, int, int>(), py::arg("group"), py::arg("rank"), py::arg("size"))
      .def_property_readonly("group", &flagos_shm::ShmBackend::group,
                             "the flagos_shm.backend.group.ShmGroup this backend forwards to")
      // torch >= 2.14 binds this on c10d.Backend; 2.10's split_group reads it too, but 2.10
      // binds it on its own backends only.
      .def_property_readonly("options", &flagos_shm::ShmBackend::getBackendOptions,
                             "Backend.Options naming flagos_shm, with the group's timeout")
      .def("__repr__", [](const flagos_shm::ShmBackend& self) {
        return "ShmBackend(rank=" + std::to_string(self.getRank()) + ", world_size=" +
               std::to_string(self.getSize()) + ")";
      });
}
