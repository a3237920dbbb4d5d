// The async I/O engine behind deepspeed.ops.aio (no torch in here; py_aio.cpp binds it).
//
// An Engine owns `thread_count` worker threads. Each read or write (an "op": one buffer, one
// file, one file offset) is cut into `block_size` chunks; the chunks are dealt out to the
// workers as contiguous runs (worker i gets the i-th run), so every worker streams one
// sequential stretch of the file. A worker issues pread/pwrite one chunk at a time; the
// workers together keep `thread_count` requests in flight (see [Note: queue_depth]).
//
// [Note: O_DIRECT]
// An op is opened with O_DIRECT when its buffer address, byte count, file offset and
// block_size are all multiples of kDirectAlign (4096); otherwise, or when the file system
// refuses O_DIRECT (tmpfs answers EINVAL), it goes through the page cache. stats() counts
// which path each op took.
//
// [Note: queue_depth]
// Each worker's queue holds at most `queue_depth` chunk runs; a submit that finds a queue full
// waits for room (back-pressure instead of unbounded memory). The thread-pool backend has
// one system call in flight per worker.
//
// [Note: errors]
// What the caller can get wrong (a missing file, a file shorter than the read) throws at
// submit, before anything is queued. An error during the transfer (a short write on a full
// disk, EIO) is kept with its op, and wait() throws the first one after every pending op has
// finished, so no buffer is still being written when the caller sees the error.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace ds_aio {

constexpr int64_t kDirectAlign = 4096;

// An I/O failure: the message names the path, the bytes and the system error.
struct IOError : std::runtime_error {
  int err;
  IOError(const std::string& what, int e) : std::runtime_error(what), err(e) {}
};

struct Op {
  bool read = true;
  std::string path;
  char* buffer = nullptr;
  int64_t nbytes = 0;
  int64_t offset = 0;
  int fd = -1;
  bool direct = false;
  std::shared_ptr<void> owner;  // keeps the buffer alive until wait() hands the op back
  std::atomic<int> runs_left{0};
  std::mutex error_mutex;
  std::string error;  // the first failure of any run; empty when the op succeeded
  int error_errno = 0;
  ~Op();
};

struct Run {  // one worker's share of an op: a contiguous stretch of chunks
  std::shared_ptr<Op> op;
  int64_t begin = 0;  // byte offset into the buffer (and, plus op->offset, into the file)
  int64_t end = 0;
};

struct Stats {
  int64_t direct_ops = 0;
  int64_t buffered_ops = 0;
  int64_t bytes_read = 0;
  int64_t bytes_written = 0;
};

class Engine {
 public:
  Engine(int64_t block_size, int queue_depth, int thread_count);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues one op; throws IOError when the file cannot be opened or is too short to read.
  void submit(bool read, const std::string& path, char* buffer, int64_t nbytes, int64_t offset,
              std::shared_ptr<void> owner);
  // Blocks until every queued op is done; returns how many there were; throws the first error.
  // `finished_ops` receives the ops (and the buffer owners they hold) so the caller can drop
  // them where it is safe to (with the GIL held).
  int wait(std::vector<std::shared_ptr<Op>>* finished_ops);
  int pending() const;
  Stats stats() const;

  const int64_t block_size;
  const int queue_depth;
  const int thread_count;

 private:
  struct Worker {
    std::mutex mutex;
    std::condition_variable has_work;
    std::condition_variable has_room;
    std::deque<Run> queue;
    std::thread thread;
  };

  void worker_loop(Worker& w);
  void run_chunks(const Run& run);
  void finish_run(const std::shared_ptr<Op>& op);
  void open_file(Op& op);
  std::vector<Run> split(const std::shared_ptr<Op>& op) const;

  std::vector<std::unique_ptr<Worker>> workers_;
  bool stopping_ = false;
  mutable std::mutex done_mutex_;
  std::condition_variable all_done_;
  int in_flight_ = 0;  // ops submitted and not yet finished
  int finished_ = 0;   // ops finished since the last wait()
  std::vector<std::shared_ptr<Op>> failed_;
  std::vector<std::shared_ptr<Op>> done_;
  Stats stats_;
};

}  // namespace ds_aio
