// A c10d backend that does nothing: benches/torch_floor.py times torch.distributed's own
// per-call cost with it (the floor under any backend's dist.all_reduce).
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/utils/pybind.h>

namespace {

class NoopBackend : public c10d::Backend {
 public:
  NoopBackend(int rank, int size) : Backend(rank, size) {}
  const std::string getBackendName() const override { return "flagos_shm_bench_native_noop"; }
  // A null work: the call finished at C++ level (dist.* then skips wait()), as a
  // synchronous flagos_shm call that returns None does on the per-device route.
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>&, const c10d::AllreduceOptions&) override {
    return {};
  }
};

}  // namespace

PYBIND11_MODULE(flagos_shm_noop_backend, m) {
  py::module_::import("torch._C._distributed_c10d");
  py::class_<NoopBackend, c10d::Backend, c10::intrusive_ptr<NoopBackend>>(m, "NoopBackend")
      .def(py::init<int, int>(), py::arg("rank"), py::arg("size"));
}
