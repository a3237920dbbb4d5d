// Python bindings of the async I/O engine: the `aio_handle` class of deepspeed.ops.aio.
//
// A handle owns an Engine (aio_engine.h). Reads and writes take a contiguous CPU tensor; its
// bytes go to or come from the file starting at `file_offset`. An async op keeps a reference to
// its tensor until wait() returns, so the buffer cannot be freed while a worker uses it.
// Errors are raised as deepspeed.ops.aio's AsyncIOError (an OSError subclass with errno set).
//
// The backend comes from the handle's `backend=` argument, else $DS_AIO_BACKEND, else "auto"
// (io_uring when it works here, the thread pool otherwise: see [Note: backends]). The first
// handle of a process that falls back warns once, with the reason; get_backend_reason() keeps it.

#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <sys/mman.h>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <set>
#include <string>

#include "aio_engine.h"

namespace py = pybind11;

namespace {

// Tensors from new_cpu_locked_tensor start on a page boundary, so whole-tensor ops can use
// O_DIRECT; the pages are mlock'ed when the memlock limit allows (locked() says whether).
//
// [Note: locked buffers in huge pages]
// A buffer of at least one huge page (2 MiB) starts on a 2 MiB boundary and its whole 2 MiB
// stretches are madvised MADV_HUGEPAGE before mlock faults them in, as
// deepspeed/runtime/huge_pages.py does for CPU Adam's states. Each O_DIRECT request pins
// and maps its pages, and in a VM the host's copy walks two page tables per page: 2 MiB
// pages cut that work 512x. Measured on a virtio disk (Zen 4, 512 MiB file, 1 MiB O_DIRECT
// preads): 2140 MiB/s into 4 KiB pages, 3971 MiB/s into huge pages. The advice is a
// speed-up only: where THP is off or madvise fails, the buffer is the same in 4 KiB pages.
constexpr size_t kHugePage = size_t{2} << 20;
struct LockedAlloc {
  void* ptr;
  size_t bytes;
  bool locked;
};

std::string env_or(const char* name, const std::string& fallback) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? std::string(value) : fallback;
}

ds_aio::EngineOptions engine_options(int64_t block_size, int queue_depth, bool single_submit, bool overlap_events,
                                     int thread_count, const py::object& backend) {
  ds_aio::EngineOptions o;
  o.block_size = block_size;
  o.queue_depth = queue_depth;
  o.thread_count = thread_count;
  o.single_submit = single_submit;
  o.overlap_events = overlap_events;
  o.backend = backend.is_none() ? env_or("DS_AIO_BACKEND", "auto") : backend.cast<std::string>();
  o.split_transfers = env_or("DS_AIO_SPLIT_TRANSFERS_FOR_TESTS", "0") == "1";
  return o;
}

std::atomic<bool> g_fallback_warned{false};  // one fallback warning per process

class AioHandle {
 public:
  AioHandle(int64_t block_size, int queue_depth, bool single_submit, bool overlap_events, int thread_count,
            const py::object& backend)
      : engine_(engine_options(block_size, queue_depth, single_submit, overlap_events, thread_count, backend)) {
    const std::string& why = engine_.fallback_reason();
    if (!why.empty() && !g_fallback_warned.exchange(true)) {
      const std::string msg = "deepspeed.ops.aio: io_uring is not usable here (" + why +
                              "); using the thread-pool backend (set DS_AIO_BACKEND=thread_pool to choose it "
                              "and silence this warning)";
      if (PyErr_WarnEx(PyExc_RuntimeWarning, msg.c_str(), 1) != 0) throw py::error_already_set();
    }
  }

  std::string backend_reason() const {
    const std::string& why = engine_.fallback_reason();
    if (!why.empty()) return "auto fell back to the thread pool: " + why;
    if (engine_.options.backend != "auto") return "asked for (backend= or DS_AIO_BACKEND)";
    return "auto: io_uring works here";
  }

  int submit(const at::Tensor& buffer, const std::string& path, int64_t offset, bool read, bool async_op) {
    char* data = checked_data(buffer, path, read);
    auto owner = std::shared_ptr<void>(new at::Tensor(buffer), [](void* p) { delete static_cast<at::Tensor*>(p); });
    const int64_t nbytes = buffer.numel() * static_cast<int64_t>(buffer.element_size());
    {
      py::gil_scoped_release no_gil;
      engine_.submit(read, path, data, nbytes, offset, std::move(owner));
    }
    return async_op ? 0 : wait();
  }

  ~AioHandle() {  // let pending ops finish and drop their buffers here, before the workers go
    try {
      wait();
    } catch (const std::exception&) {  // nobody is left to report a failed op to
    }
  }

  // [Note: buffers are dropped with the GIL held]
  // Dropping the last C++ reference to a tensor that Python also holds takes the GIL. A worker
  // must never do it: the main thread may hold the GIL while it joins the workers (the handle's
  // destructor). So an op's buffer owner is only ever reset here, after the wait, under the GIL.
  int wait() {
    std::vector<std::shared_ptr<ds_aio::Op>> finished;
    int count = 0;
    try {
      py::gil_scoped_release no_gil;
      count = engine_.wait(&finished);
    } catch (...) {
      for (auto& op : finished) op->owner.reset();
      throw;
    }
    for (auto& op : finished) op->owner.reset();
    return count;
  }

  at::Tensor new_cpu_locked_tensor(int64_t num_elem, const at::Tensor& example) {
    if (num_elem < 0) throw std::invalid_argument("new_cpu_locked_tensor: num_elem must be >= 0");
    const size_t bytes = static_cast<size_t>(num_elem) * example.element_size();
    const size_t rounded = std::max<size_t>(ds_aio::kDirectAlign, (bytes + ds_aio::kDirectAlign - 1) / ds_aio::kDirectAlign * ds_aio::kDirectAlign);
    const bool huge = rounded >= kHugePage;  // see [Note: locked buffers in huge pages]
    void* ptr = nullptr;
    if (posix_memalign(&ptr, huge ? kHugePage : ds_aio::kDirectAlign, rounded) != 0) throw std::bad_alloc();
    if (huge) (void)::madvise(ptr, rounded / kHugePage * kHugePage, MADV_HUGEPAGE);  // the tail stays 4 KiB
    const bool locked = ::mlock(ptr, rounded) == 0;
    auto deleter = [rounded, locked](void* p) {
      if (locked) ::munlock(p, rounded);
      std::free(p);
    };
    at::Tensor t = at::from_blob(ptr, {num_elem}, deleter, example.options().device(at::kCPU));
    std::lock_guard<std::mutex> lock(locked_mutex_);
    locked_.insert(ptr);
    if (locked) ++locked_count_;
    return t;
  }

  bool free_cpu_locked_tensor(const at::Tensor& t) {
    std::lock_guard<std::mutex> lock(locked_mutex_);
    return locked_.erase(t.data_ptr()) > 0;  // the memory goes when the last reference does
  }

  py::dict io_stats() const {
    const ds_aio::Stats s = engine_.stats();
    py::dict d;
    d["direct_ops"] = s.direct_ops;
    d["buffered_ops"] = s.buffered_ops;
    d["bytes_read"] = s.bytes_read;
    d["bytes_written"] = s.bytes_written;
    d["short_transfers"] = s.short_transfers;
    d["submit_calls"] = s.submit_calls;
    d["pending_ops"] = engine_.pending();
    d["locked_tensors"] = locked_count_;
    return d;
  }

  int64_t block_size() const { return engine_.block_size; }
  int queue_depth() const { return engine_.queue_depth; }
  int thread_count() const { return engine_.thread_count; }
  bool single_submit() const { return engine_.options.single_submit; }
  bool overlap_events() const { return engine_.options.overlap_events; }
  std::string backend() const { return ds_aio::backend_name(engine_.backend()); }

 private:
  static char* checked_data(const at::Tensor& buffer, const std::string& path, bool read) {
    const std::string what = std::string(read ? "reading '" : "writing '") + path + "'";
    if (!buffer.device().is_cpu()) {
      throw std::invalid_argument(what + ": the buffer is on " + buffer.device().str() +
                                  "; pass a CPU tensor (new_cpu_locked_tensor gives an aligned, pinned one)");
    }
    if (!buffer.is_contiguous()) throw std::invalid_argument(what + ": the buffer must be contiguous (call .contiguous())");
    return static_cast<char*>(buffer.data_ptr());
  }

  ds_aio::Engine engine_;
  std::mutex locked_mutex_;
  std::set<void*> locked_;
  int64_t locked_count_ = 0;
};

py::exception<ds_aio::IOError>* g_io_error = nullptr;  // the AsyncIOError type, set at import

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "deepspeed.ops.aio: asynchronous file reads and writes of CPU tensors (io_uring or a thread pool)";
  // Why io_uring cannot be used in this process ("" when it can), probed once at import, and
  // the backend a handle made with no backend= argument gets at import time.
  const std::string unavailable = ds_aio::io_uring_unavailable_reason();
  m.attr("io_uring_unavailable_reason") = unavailable;
  const std::string forced = env_or("DS_AIO_BACKEND", "auto");
  m.attr("backend") = forced != "auto" ? forced : (unavailable.empty() ? "io_uring" : "thread_pool");
  // Never destroyed: the type must outlive any exception object raised with it.
  g_io_error = new py::exception<ds_aio::IOError>(m, "AsyncIOError", PyExc_OSError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ds_aio::IOError& e) {
      // OSError(errno, message): e.errno is set, str(e) is "[Errno N] message".
      PyErr_SetObject(g_io_error->ptr(), py::make_tuple(e.err, std::string(e.what())).ptr());
    }
  });

  auto offset = py::arg("file_offset") = 0;
  auto backend = py::arg("backend") = py::none();
  py::class_<AioHandle>(m, "aio_handle")
      .def(py::init<int64_t, int, bool, bool, int, const py::object&>(), py::arg("block_size") = 1 << 20,
           py::arg("queue_depth") = 128, py::arg("single_submit") = false, py::arg("overlap_events") = false,
           py::arg("thread_count") = 1, backend)
      .def(py::init([](int64_t bs, int qd, bool ss, bool oe, int iop, const py::object& b) {
             return new AioHandle(bs, qd, ss, oe, iop, b);
           }),
           py::arg("block_size") = 1 << 20, py::arg("queue_depth") = 128, py::arg("single_submit") = false,
           py::arg("overlap_events") = false, py::arg("intra_op_parallelism") = 1, backend)
      .def("async_pread", [](AioHandle& h, const at::Tensor& b, const std::string& f, int64_t o) { return h.submit(b, f, o, true, true); },
           py::arg("buffer"), py::arg("filename"), offset)
      .def("async_pwrite", [](AioHandle& h, const at::Tensor& b, const std::string& f, int64_t o) { return h.submit(b, f, o, false, true); },
           py::arg("buffer"), py::arg("filename"), offset)
      .def("sync_pread", [](AioHandle& h, const at::Tensor& b, const std::string& f, int64_t o) { return h.submit(b, f, o, true, false); },
           py::arg("buffer"), py::arg("filename"), offset)
      .def("sync_pwrite", [](AioHandle& h, const at::Tensor& b, const std::string& f, int64_t o) { return h.submit(b, f, o, false, false); },
           py::arg("buffer"), py::arg("filename"), offset)
      .def("pread", [](AioHandle& h, const at::Tensor& b, const std::string& f, bool async_op, int64_t o) { return h.submit(b, f, o, true, async_op); },
           py::arg("buffer"), py::arg("filename"), py::arg("async_op") = false, offset)
      .def("pwrite", [](AioHandle& h, const at::Tensor& b, const std::string& f, bool async_op, int64_t o) { return h.submit(b, f, o, false, async_op); },
           py::arg("buffer"), py::arg("filename"), py::arg("async_op") = false, offset)
      .def("wait", &AioHandle::wait)
      .def("new_cpu_locked_tensor", &AioHandle::new_cpu_locked_tensor, py::arg("num_elem"), py::arg("example_tensor"))
      .def("free_cpu_locked_tensor", &AioHandle::free_cpu_locked_tensor, py::arg("tensor"))
      .def("io_stats", &AioHandle::io_stats)
      .def("get_block_size", &AioHandle::block_size)
      .def("get_queue_depth", &AioHandle::queue_depth)
      .def("get_single_submit", &AioHandle::single_submit)
      .def("get_overlap_events", &AioHandle::overlap_events)
      .def("get_thread_count", &AioHandle::thread_count)
      .def("get_intra_op_parallelism", &AioHandle::thread_count)
      .def("get_backend", &AioHandle::backend)
      .def("get_backend_reason", &AioHandle::backend_reason);
}
