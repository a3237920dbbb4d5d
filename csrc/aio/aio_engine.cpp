// The thread-pool backend of the async I/O engine; see aio_engine.h for the design notes.

#include "aio_engine.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <sstream>

namespace ds_aio {

namespace {

std::string describe(const Op& op) {
  std::ostringstream s;
  s << (op.read ? "reading " : "writing ") << op.nbytes << " bytes " << (op.read ? "from" : "to") << " '"
    << op.path << "' at file offset " << op.offset;
  return s.str();
}

bool aligned(int64_t value) { return value % kDirectAlign == 0; }

}  // namespace

Op::~Op() {
  if (fd >= 0) ::close(fd);
}

Engine::Engine(int64_t block_size_, int queue_depth_, int thread_count_)
    : block_size(block_size_), queue_depth(queue_depth_), thread_count(thread_count_) {
  if (block_size <= 0) throw std::invalid_argument("aio_handle: block_size must be > 0, got " + std::to_string(block_size));
  if (queue_depth <= 0) throw std::invalid_argument("aio_handle: queue_depth must be > 0, got " + std::to_string(queue_depth));
  if (thread_count <= 0) throw std::invalid_argument("aio_handle: thread_count must be > 0, got " + std::to_string(thread_count));
  for (int i = 0; i < thread_count; ++i) workers_.push_back(std::make_unique<Worker>());
  for (auto& w : workers_) {
    Worker* raw = w.get();
    w->thread = std::thread([this, raw] { worker_loop(*raw); });
  }
}

Engine::~Engine() {
  {
    std::unique_lock<std::mutex> lock(done_mutex_);
    all_done_.wait(lock, [this] { return in_flight_ == 0; });
  }
  for (auto& w : workers_) {
    std::lock_guard<std::mutex> lock(w->mutex);
    stopping_ = true;
    w->has_work.notify_all();
  }
  for (auto& w : workers_) w->thread.join();
}

void Engine::open_file(Op& op) {
  const int flags = op.read ? O_RDONLY : (O_WRONLY | O_CREAT);
  const auto addr = reinterpret_cast<std::uintptr_t>(op.buffer);
  op.direct = aligned(static_cast<int64_t>(addr)) && aligned(op.nbytes) && aligned(op.offset) && aligned(block_size);
  if (op.direct) {
    op.fd = ::open(op.path.c_str(), flags | O_DIRECT, 0644);
    if (op.fd < 0 && errno == EINVAL) op.direct = false;  // the file system has no O_DIRECT
  }
  if (!op.direct) op.fd = ::open(op.path.c_str(), flags, 0644);
  if (op.fd < 0) {
    const int e = errno;
    throw IOError(describe(op) + ": cannot open the file: " + std::strerror(e), e);
  }
  struct stat st {};
  if (op.read && ::fstat(op.fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size < op.offset + op.nbytes) {
    throw IOError(describe(op) + ": the file holds only " + std::to_string(st.st_size) + " bytes, " +
                      std::to_string(op.offset + op.nbytes) + " are needed",
                  EINVAL);
  }
}

std::vector<Run> Engine::split(const std::shared_ptr<Op>& op) const {
  std::vector<Run> runs;
  if (op->nbytes == 0) return runs;
  const int64_t chunks = (op->nbytes + block_size - 1) / block_size;
  const int64_t n_runs = std::min<int64_t>(thread_count, chunks);
  const int64_t per_run = (chunks + n_runs - 1) / n_runs;
  for (int64_t begin = 0; begin < op->nbytes; begin += per_run * block_size) {
    runs.push_back(Run{op, begin, std::min(op->nbytes, begin + per_run * block_size)});
  }
  return runs;
}

void Engine::submit(bool read, const std::string& path, char* buffer, int64_t nbytes, int64_t offset,
                    std::shared_ptr<void> owner) {
  auto op = std::make_shared<Op>();
  op->read = read;
  op->path = path;
  op->buffer = buffer;
  op->nbytes = nbytes;
  op->offset = offset;
  op->owner = std::move(owner);
  if (offset < 0) throw std::invalid_argument(describe(*op) + ": the file offset must be >= 0");
  open_file(*op);
  std::vector<Run> runs = split(op);
  op->runs_left = static_cast<int>(std::max<size_t>(runs.size(), 1));
  {
    std::lock_guard<std::mutex> lock(done_mutex_);
    ++in_flight_;
  }
  if (runs.empty()) {  // zero bytes: nothing to transfer, the op is done
    finish_run(op);
    return;
  }
  for (size_t i = 0; i < runs.size(); ++i) {
    Worker& w = *workers_[i];
    std::unique_lock<std::mutex> lock(w.mutex);
    w.has_room.wait(lock, [&] { return static_cast<int>(w.queue.size()) < queue_depth; });
    w.queue.push_back(std::move(runs[i]));
    w.has_work.notify_one();
  }
}

void Engine::worker_loop(Worker& w) {
  for (;;) {
    Run run;
    {
      std::unique_lock<std::mutex> lock(w.mutex);
      w.has_work.wait(lock, [&] { return stopping_ || !w.queue.empty(); });
      if (w.queue.empty()) return;  // stopping, and nothing left
      run = std::move(w.queue.front());
      w.queue.pop_front();
      w.has_room.notify_one();
    }
    run_chunks(run);
    finish_run(run.op);
  }
}

void Engine::run_chunks(const Run& run) {
  Op& op = *run.op;
  int64_t pos = run.begin;
  while (pos < run.end) {
    const int64_t want = std::min(block_size, run.end - pos);
    const ssize_t got = op.read ? ::pread(op.fd, op.buffer + pos, want, op.offset + pos)
                                : ::pwrite(op.fd, op.buffer + pos, want, op.offset + pos);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      const int e = got < 0 ? errno : (op.read ? 0 : ENOSPC);
      std::ostringstream s;
      s << describe(op) << ": failed at byte " << pos << " of " << op.nbytes << " (file offset " << op.offset + pos
        << "): " << (got == 0 && op.read ? "unexpected end of file" : std::strerror(e));
      std::lock_guard<std::mutex> lock(op.error_mutex);
      if (op.error.empty()) {
        op.error = s.str();
        op.error_errno = e;
      }
      return;
    }
    pos += got;  // a short transfer is resumed where it stopped
  }
}

void Engine::finish_run(const std::shared_ptr<Op>& op) {
  if (--op->runs_left > 0) return;
  std::lock_guard<std::mutex> lock(done_mutex_);
  --in_flight_;
  ++finished_;
  (op->direct ? stats_.direct_ops : stats_.buffered_ops) += 1;
  if (op->error.empty()) {
    (op->read ? stats_.bytes_read : stats_.bytes_written) += op->nbytes;
  } else {
    failed_.push_back(op);
  }
  done_.push_back(op);
  all_done_.notify_all();
}

int Engine::wait(std::vector<std::shared_ptr<Op>>* finished_ops) {
  std::unique_lock<std::mutex> lock(done_mutex_);
  all_done_.wait(lock, [this] { return in_flight_ == 0; });
  const int count = finished_;
  finished_ = 0;
  std::vector<std::shared_ptr<Op>> failed;
  failed.swap(failed_);
  finished_ops->insert(finished_ops->end(), done_.begin(), done_.end());
  done_.clear();
  if (!failed.empty()) {
    std::string what = failed.front()->error;
    if (failed.size() > 1) what += " (and " + std::to_string(failed.size() - 1) + " more failed ops)";
    throw IOError(what, failed.front()->error_errno);
  }
  return count;
}

int Engine::pending() const {
  std::lock_guard<std::mutex> lock(done_mutex_);
  return in_flight_ + finished_;
}

Stats Engine::stats() const {
  std::lock_guard<std::mutex> lock(done_mutex_);
  return stats_;
}

}  // namespace ds_aio
