// The engine's shared parts and its thread-pool backend; see aio_engine.h for the design notes
// and aio_uring.cpp for the io_uring backend.

#include "aio_engine.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <sstream>

#include "aio_uring.h"

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

const char* backend_name(Backend b) { return b == Backend::kIoUring ? "io_uring" : "thread_pool"; }

Op::~Op() {
  if (fd >= 0) ::close(fd);
}

Engine::Engine(const EngineOptions& opts)
    : options(opts), block_size(opts.block_size), queue_depth(opts.queue_depth), thread_count(opts.thread_count) {
  if (block_size <= 0) throw std::invalid_argument("aio_handle: block_size must be > 0, got " + std::to_string(block_size));
  if (queue_depth <= 0) throw std::invalid_argument("aio_handle: queue_depth must be > 0, got " + std::to_string(queue_depth));
  if (thread_count <= 0) throw std::invalid_argument("aio_handle: thread_count must be > 0, got " + std::to_string(thread_count));
  for (int i = 0; i < thread_count; ++i) lanes_.push_back(std::make_unique<Lane>());
  choose_backend();
  for (auto& lane : lanes_) {
    Lane* raw = lane.get();
    if (backend_ == Backend::kIoUring) {
      lane->thread = std::thread([this, raw] { uring_loop(*raw); });
    } else {
      lane->thread = std::thread([this, raw] { pool_loop(*raw); });
    }
  }
}

void Engine::choose_backend() {
  const std::string& want = options.backend;
  if (want == "thread_pool") return;
  if (want != "auto" && want != "io_uring") {
    throw std::invalid_argument("aio_handle: backend must be 'auto', 'io_uring' or 'thread_pool', got '" + want +
                                "' (from the backend= argument or DS_AIO_BACKEND)");
  }
  // A ring per lane, sized for the lane's requests in flight; any failure (no io_uring in this
  // kernel or header, a seccomp filter, a memory limit) is the reason to fall back.
  std::string why = kIoUringCompiledIn ? "" : "this build had no <linux/io_uring.h>";
  const unsigned entries = static_cast<unsigned>(std::min<int64_t>(queue_depth, kMaxRingEntries));
  for (auto& lane : lanes_) {
    if (!why.empty()) break;
    try {
      lane->ring = std::make_unique<Ring>(entries);
    } catch (const RingUnavailable& e) {
      why = e.what();
    }
  }
  if (why.empty()) {
    backend_ = Backend::kIoUring;
    return;
  }
  for (auto& lane : lanes_) lane->ring.reset();
  if (want == "io_uring") throw IOError("aio_handle: backend 'io_uring' was asked for but " + why, ENOSYS);
  fallback_reason_ = why;
}

Engine::~Engine() {
  {
    std::unique_lock<std::mutex> lock(done_mutex_);
    all_done_.wait(lock, [this] { return in_flight_ == 0; });
  }
  for (auto& lane : lanes_) {
    std::lock_guard<std::mutex> lock(lane->mutex);
    stopping_ = true;
    lane->has_work.notify_all();
  }
  for (auto& lane : lanes_) lane->thread.join();
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
  const bool regular = ::fstat(op.fd, &st) == 0 && S_ISREG(st.st_mode);
  if (op.read && regular && st.st_size < op.offset + op.nbytes) {
    throw IOError(describe(op) + ": the file holds only " + std::to_string(st.st_size) + " bytes, " +
                      std::to_string(op.offset + op.nbytes) + " are needed",
                  EINVAL);
  }
  if (!op.read && regular && st.st_size < op.offset + op.nbytes) lay_out(op);
}

// [Note: a write that would extend its file is laid out first]
// An O_DIRECT write past the end of a file makes ext4 (and xfs) take the inode's lock
// exclusively, and io_uring, which cannot issue it without blocking, hands each such chunk to
// one worker thread per file: a fresh 512 MiB file was written at 0.48x dd's bandwidth (AMD
// EPYC, ext4, benchmarks/bench_aio.py), a preallocated one as fast as dd. So the range is
// allocated with fallocate(2) before the chunks go (what the write makes of the file is the
// same: its size becomes at least offset + nbytes). A file system without fallocate just
// writes as before; no room is an error before any chunk goes.
void Engine::lay_out(const Op& op) {
  if (::fallocate(op.fd, 0, op.offset, op.nbytes) == 0) return;
  const int e = errno;
  if (e == EOPNOTSUPP || e == ENOSYS || e == EINVAL) return;
  throw IOError(describe(op) + ": cannot reserve room for the write: " + std::strerror(e), e);
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

int64_t Engine::chunk_end(int64_t pos, int64_t run_end) const { return std::min(run_end, pos + block_size); }

int64_t Engine::request_bytes(const Op& op, int64_t pos, int64_t end) const {
  const int64_t want = end - pos;
  if (!options.split_transfers) return want;
  // Half the rest, kept a multiple of 4096 under O_DIRECT; the last piece is asked for whole.
  const int64_t half = op.direct ? want / 2 / kDirectAlign * kDirectAlign : want / 2;
  return half > 0 ? half : want;
}

Step Engine::account(Op& op, int64_t& pos, int64_t end, int64_t res) {
  if (res == -EINTR || res == -EAGAIN) return Step::kMore;  // nothing moved; ask again
  if (res > 0) {
    pos += res;
    if (pos >= end) return Step::kDone;
    short_transfers_.fetch_add(1, std::memory_order_relaxed);
    return Step::kMore;  // a short transfer is resumed where it stopped
  }
  // Zero bytes: a read met the end of the file; a write that moves nothing means a full disk.
  const int e = res < 0 ? static_cast<int>(-res) : (op.read ? 0 : ENOSPC);
  std::ostringstream s;
  s << describe(op) << ": failed at byte " << pos << " of " << op.nbytes << " (file offset " << op.offset + pos
    << "): " << (res == 0 && op.read ? "unexpected end of file" : std::strerror(e));
  std::lock_guard<std::mutex> lock(op.error_mutex);
  if (op.error.empty()) {
    op.error = s.str();
    op.error_errno = e;
  }
  return Step::kFailed;
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
    Lane& lane = *lanes_[i];
    std::unique_lock<std::mutex> lock(lane.mutex);
    lane.has_room.wait(lock, [&] { return static_cast<int>(lane.queue.size()) < queue_depth; });
    lane.queue.push_back(std::move(runs[i]));
    lane.has_work.notify_one();
  }
}

void Engine::pool_loop(Lane& lane) {
  for (;;) {
    Run run;
    {
      std::unique_lock<std::mutex> lock(lane.mutex);
      lane.has_work.wait(lock, [&] { return stopping_ || !lane.queue.empty(); });
      if (lane.queue.empty()) return;  // stopping, and nothing left
      run = std::move(lane.queue.front());
      lane.queue.pop_front();
      lane.has_room.notify_one();
    }
    run_chunks(run);
    finish_run(run.op);
  }
}

bool Engine::take_runs(Lane& lane, std::deque<Run>* into, bool idle, size_t most) {
  std::unique_lock<std::mutex> lock(lane.mutex);
  if (idle) lane.has_work.wait(lock, [&] { return stopping_ || !lane.queue.empty(); });
  if (lane.queue.empty()) return !(idle && stopping_);
  for (; most > 0 && !lane.queue.empty(); --most) {
    into->push_back(std::move(lane.queue.front()));
    lane.queue.pop_front();
  }
  lane.has_room.notify_all();
  return true;
}

void Engine::run_chunks(const Run& run) {
  Op& op = *run.op;
  for (int64_t chunk = run.begin; chunk < run.end;) {
    const int64_t end = chunk_end(chunk, run.end);
    int64_t pos = chunk;
    Step step = Step::kMore;
    while (step == Step::kMore) {
      const int64_t want = request_bytes(op, pos, end);
      const ssize_t got = op.read ? ::pread(op.fd, op.buffer + pos, want, op.offset + pos)
                                  : ::pwrite(op.fd, op.buffer + pos, want, op.offset + pos);
      step = account(op, pos, end, got < 0 ? -static_cast<int64_t>(errno) : got);
    }
    if (step == Step::kFailed) return;
    chunk = end;
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
  Stats s = stats_;
  s.short_transfers = short_transfers_.load();
  s.submit_calls = submit_calls_.load();
  return s;
}

}  // namespace ds_aio
