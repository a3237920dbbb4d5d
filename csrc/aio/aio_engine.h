// The async I/O engine behind deepspeed.ops.aio (no torch in here; py_aio.cpp binds it).
//
// An Engine owns `thread_count` lanes, each a worker thread with a queue of chunk runs. Each
// read or write (an "op": one buffer, one file, one file offset) is cut into `block_size`
// chunks; the chunks are dealt out to the lanes as contiguous runs (lane i gets the i-th run),
// so every lane streams one sequential stretch of the file. What a lane does with its runs
// depends on the backend (see [Note: backends]); how a run is cut into chunks and how one
// transfer's result moves a chunk along (Engine::chunk_end, Engine::account) is shared.
//
// [Note: backends]
// - io_uring: each lane owns one ring (aio_uring.h, raw syscalls, no liburing). It keeps up to
//   `queue_depth` chunk reads or writes in flight and reaps their completions itself.
//   `single_submit` makes it hand each request to the kernel with its own io_uring_enter
//   instead of one call for every request prepared; `overlap_events` makes it refill the
//   ring as each completion is reaped, instead of submitting a batch and waiting for all of
//   it before the next batch.
// - thread_pool: each lane issues pread/pwrite one chunk at a time, so the lanes together keep
//   `thread_count` requests in flight; single_submit and overlap_events change nothing.
// "auto" (the default) takes io_uring when every lane's ring can be set up and answers a
// no-op request, and the thread pool otherwise, keeping the reason (fallback_reason()).
//
// [Note: O_DIRECT]
// An op is opened with O_DIRECT when its buffer address, byte count, file offset and
// block_size are all multiples of kDirectAlign (4096); otherwise, or when the file system
// refuses O_DIRECT (tmpfs answers EINVAL), it goes through the page cache. stats() counts
// which path each op took. Both backends use the same rule.
//
// [Note: queue_depth]
// Each lane's queue holds at most `queue_depth` chunk runs; a submit that finds a queue full
// waits for room (back-pressure instead of unbounded memory). An io_uring lane takes runs off
// its queue only while it works on fewer than queue_depth, and caps the requests it has in
// flight at queue_depth (and at the ring's size, at most kMaxRingEntries). A lane blocked
// waiting for a completion sees newly queued runs at the next completion.
//
// [Note: errors]
// What the caller can get wrong (a missing file, a file shorter than the read) throws at
// submit, before anything is queued. An error during the transfer (a short write on a full
// disk, EIO, an end of file) is kept with its op, and wait() throws the first one after every
// pending op has finished, so no buffer is still being written when the caller sees the error.
// A transfer that moves fewer bytes than asked is not an error: the rest is asked for again.
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
constexpr unsigned kMaxRingEntries = 4096;

enum class Backend { kThreadPool, kIoUring };
const char* backend_name(Backend b);

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

struct Run {  // one lane's share of an op: a contiguous stretch of chunks
  std::shared_ptr<Op> op;
  int64_t begin = 0;  // byte offset into the buffer (and, plus op->offset, into the file)
  int64_t end = 0;
};

struct Stats {
  int64_t direct_ops = 0;
  int64_t buffered_ops = 0;
  int64_t bytes_read = 0;
  int64_t bytes_written = 0;
  int64_t short_transfers = 0;  // transfers that moved fewer bytes than asked (the rest was re-asked)
  int64_t submit_calls = 0;     // io_uring_enter calls that handed requests to the kernel
};

// What one transfer did to a chunk (Engine::account).
enum class Step { kMore, kDone, kFailed };

class Ring;  // aio_uring.h

struct EngineOptions {
  int64_t block_size = 1 << 20;
  int queue_depth = 128;
  int thread_count = 1;
  bool single_submit = false;
  bool overlap_events = false;
  std::string backend = "auto";  // "auto", "io_uring" or "thread_pool"
  // Ask for only part of each chunk per transfer, so the short-transfer path runs on any file
  // system (tests only; DS_AIO_SPLIT_TRANSFERS_FOR_TESTS=1).
  bool split_transfers = false;
};

class Engine {
 public:
  explicit Engine(const EngineOptions& options);
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
  Backend backend() const { return backend_; }
  // Why "auto" fell back to the thread pool; empty when it did not.
  const std::string& fallback_reason() const { return fallback_reason_; }

  const EngineOptions options;
  const int64_t block_size;
  const int queue_depth;
  const int thread_count;

  // --- shared by both backends (one source of truth for the chunking) ---
  // Where the chunk starting at `pos` ends within a run ending at `run_end`.
  int64_t chunk_end(int64_t pos, int64_t run_end) const;
  // How many bytes one transfer asks for, from `pos` to the chunk's `end`.
  int64_t request_bytes(const Op& op, int64_t pos, int64_t end) const;
  // Moves `pos` along after a transfer that returned `res` (bytes, or -errno): kMore (ask for
  // the rest, or again after EINTR/EAGAIN), kDone (the chunk is complete) or kFailed (the
  // failure is recorded on the op).
  Step account(Op& op, int64_t& pos, int64_t end, int64_t res);
  void finish_run(const std::shared_ptr<Op>& op);

 private:
  struct Lane {
    std::mutex mutex;
    std::condition_variable has_work;
    std::condition_variable has_room;
    std::deque<Run> queue;
    std::unique_ptr<Ring> ring;  // io_uring only
    std::thread thread;
  };

  void choose_backend();
  void pool_loop(Lane& lane);
  void uring_loop(Lane& lane);  // aio_uring.cpp
  // io_uring lanes: takes up to `most` queued runs; blocks for one only when `idle`. Returns
  // false when the engine is stopping and nothing is left.
  bool take_runs(Lane& lane, std::deque<Run>* into, bool idle, size_t most);
  void run_chunks(const Run& run);
  void open_file(Op& op);
  void lay_out(const Op& op);  // [Note: a write that would extend its file is laid out first]
  std::vector<Run> split(const std::shared_ptr<Op>& op) const;

  Backend backend_ = Backend::kThreadPool;
  std::string fallback_reason_;
  std::vector<std::unique_ptr<Lane>> lanes_;
  bool stopping_ = false;
  mutable std::mutex done_mutex_;
  std::condition_variable all_done_;
  int in_flight_ = 0;  // ops submitted and not yet finished
  int finished_ = 0;   // ops finished since the last wait()
  std::vector<std::shared_ptr<Op>> failed_;
  std::vector<std::shared_ptr<Op>> done_;
  Stats stats_;
  std::atomic<int64_t> short_transfers_{0};
  std::atomic<int64_t> submit_calls_{0};

  friend class UringLane;
};

// Why io_uring cannot be used in this process ("" when a ring sets up and answers a no-op).
std::string io_uring_unavailable_reason();

}  // namespace ds_aio
