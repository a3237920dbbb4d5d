// The io_uring backend of the async I/O engine: the Ring (see [Note: the ring protocol] in
// aio_uring.h) and a lane's loop over it (see [Note: backends] in aio_engine.h).

#include "aio_uring.h"

#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <list>
#include <vector>

#include "aio_engine.h"

#if DS_AIO_HAVE_IO_URING
// Old C libraries lack the names; the numbers are the same on every architecture (Linux 5.1).
#ifndef __NR_io_uring_setup
#define __NR_io_uring_setup 425
#endif
#ifndef __NR_io_uring_enter
#define __NR_io_uring_enter 426
#endif
#endif

namespace ds_aio {

#if DS_AIO_HAVE_IO_URING

namespace {

std::string setup_failure(int e) {
  std::string why = std::string("io_uring_setup failed: ") + std::strerror(e) + " (errno " + std::to_string(e) + ")";
  if (e == ENOSYS) why += ": the kernel has no io_uring (Linux 5.1 or later is needed)";
  if (e == EPERM) why += ": io_uring is blocked here (a seccomp filter, such as a container's default profile, or sysctl kernel.io_uring_disabled)";
  if (e == ENOMEM) why += ": the locked-memory limit is too low for the ring (ulimit -l; kernels before 5.12)";
  return why;
}

}  // namespace

Ring::Ring(unsigned entries) {
  io_uring_params p {};
  fd_ = static_cast<int>(::syscall(__NR_io_uring_setup, entries, &p));
  if (fd_ < 0) throw RingUnavailable(setup_failure(errno));
  try {
    map_rings(p);
    // A no-op round trip: a filter may allow io_uring_setup and still refuse io_uring_enter.
    io_uring_sqe* sqe = next_sqe();
    sqe->opcode = IORING_OP_NOP;
    publish();
    const int ret = enter(1, 1);
    uint64_t data = 0;
    int32_t res = -1;
    if (ret < 0) throw RingUnavailable(std::string("io_uring_enter failed: ") + std::strerror(-ret));
    if (!pop(&data, &res) || res != 0) throw RingUnavailable("io_uring did not complete a no-op request");
  } catch (...) {
    release();  // a constructor that throws gets no destructor call
    throw;
  }
}

Ring::~Ring() { release(); }

void Ring::release() {
  if (sqes_ != nullptr) ::munmap(sqes_, sqes_len_);
  if (cq_map_ != nullptr && cq_map_ != sq_map_) ::munmap(cq_map_, cq_map_len_);
  if (sq_map_ != nullptr) ::munmap(sq_map_, sq_map_len_);
  if (fd_ >= 0) ::close(fd_);
  sqes_ = nullptr;
  cq_map_ = sq_map_ = nullptr;
  fd_ = -1;
}

void Ring::map_rings(const io_uring_params& p) {
  sq_entries_ = p.sq_entries;
  sq_map_len_ = p.sq_off.array + p.sq_entries * sizeof(unsigned);
  cq_map_len_ = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
  // Since Linux 5.4 both rings live in one mapping; before, each has its own.
  const bool single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
  if (single) sq_map_len_ = cq_map_len_ = std::max(sq_map_len_, cq_map_len_);
  auto map = [this](size_t len, off_t what) {
    void* ptr = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, what);
    if (ptr == MAP_FAILED) throw RingUnavailable(std::string("mmap of the io_uring rings failed: ") + std::strerror(errno));
    return ptr;
  };
  sq_map_ = map(sq_map_len_, IORING_OFF_SQ_RING);
  cq_map_ = single ? sq_map_ : map(cq_map_len_, IORING_OFF_CQ_RING);
  sqes_len_ = p.sq_entries * sizeof(io_uring_sqe);
  sqes_ = static_cast<io_uring_sqe*>(map(sqes_len_, IORING_OFF_SQES));
  char* sq = static_cast<char*>(sq_map_);
  sq_head_ = reinterpret_cast<unsigned*>(sq + p.sq_off.head);
  sq_tail_ = reinterpret_cast<unsigned*>(sq + p.sq_off.tail);
  sq_mask_ = reinterpret_cast<unsigned*>(sq + p.sq_off.ring_mask);
  sq_array_ = reinterpret_cast<unsigned*>(sq + p.sq_off.array);
  char* cq = static_cast<char*>(cq_map_);
  cq_head_ = reinterpret_cast<unsigned*>(cq + p.cq_off.head);
  cq_tail_ = reinterpret_cast<unsigned*>(cq + p.cq_off.tail);
  cq_mask_ = reinterpret_cast<unsigned*>(cq + p.cq_off.ring_mask);
  cqes_ = reinterpret_cast<io_uring_cqe*>(cq + p.cq_off.cqes);
}

io_uring_sqe* Ring::next_sqe() {
  const unsigned tail = *sq_tail_;  // only we write it
  if (tail - __atomic_load_n(sq_head_, __ATOMIC_ACQUIRE) >= sq_entries_) return nullptr;
  io_uring_sqe* sqe = &sqes_[tail & *sq_mask_];
  std::memset(sqe, 0, sizeof(*sqe));
  return sqe;
}

void Ring::publish() {
  const unsigned tail = *sq_tail_;
  sq_array_[tail & *sq_mask_] = tail & *sq_mask_;
  __atomic_store_n(sq_tail_, tail + 1, __ATOMIC_RELEASE);  // the kernel may read the entry now
  ++unsubmitted_;
}

int Ring::enter(unsigned to_submit, unsigned min_complete) {
  const unsigned flags = min_complete > 0 ? IORING_ENTER_GETEVENTS : 0;
  const long ret = ::syscall(__NR_io_uring_enter, fd_, to_submit, min_complete, flags, nullptr, 0);
  if (ret < 0) return -errno;
  unsubmitted_ -= static_cast<unsigned>(ret);
  return static_cast<int>(ret);
}

bool Ring::pop(uint64_t* user_data, int32_t* res) {
  const unsigned head = *cq_head_;  // only we write it
  if (head == __atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE)) return false;
  const io_uring_cqe& cqe = cqes_[head & *cq_mask_];
  *user_data = cqe.user_data;
  *res = cqe.res;
  __atomic_store_n(cq_head_, head + 1, __ATOMIC_RELEASE);  // the kernel may reuse the slot now
  return true;
}

// One io_uring lane: the runs it was dealt, the chunk requests it has in flight, and the loop
// that keeps the ring busy (see [Note: backends] for single_submit and overlap_events).
class UringLane {
 public:
  UringLane(Engine& engine, Engine::Lane& lane)
      : engine_(engine), lane_(lane), ring_(*lane.ring), overlap_(engine.options.overlap_events),
        single_submit_(engine.options.single_submit), max_runs_(static_cast<size_t>(engine.queue_depth)) {
    const unsigned n = std::min<unsigned>(static_cast<unsigned>(engine.queue_depth), ring_.capacity());
    slots_.resize(n);
    for (unsigned i = 0; i < n; ++i) free_.push_back(n - 1 - i);
  }

  void run() {
    std::deque<Run> incoming;
    for (;;) {
      const bool idle = active_.empty() && busy() == 0;
      const size_t room = active_.size() < max_runs_ ? max_runs_ - active_.size() : 0;
      if ((idle || room > 0) && !engine_.take_runs(lane_, &incoming, idle, std::max<size_t>(room, 1))) return;
      for (Run& r : incoming) active_.push_back(ActiveRun{r, r.begin});
      incoming.clear();
      // overlap_events: top the ring up after every reap; otherwise start a batch only once
      // the last one (and every remainder of its short transfers) has completed.
      if (overlap_ || busy() == 0) fill();
      if (busy() == 0) continue;
      submit_and_wait(overlap_ ? 1 : busy());
      reap();
    }
  }

 private:
  struct ActiveRun {
    Run run;
    int64_t next;         // the first byte no request has been made for yet
    int outstanding = 0;  // chunks in flight
    bool failed = false;  // a chunk failed: ask for no more, finish once the others are back
  };
  struct Slot {  // one chunk request in flight; its index is the request's user_data
    std::list<ActiveRun>::iterator owner;
    int64_t pos = 0;  // the next byte of the chunk to transfer (moves on after a short transfer)
    int64_t end = 0;
    iovec iov{};  // READV/WRITEV read it until the request completes
  };

  unsigned busy() const { return static_cast<unsigned>(slots_.size() - free_.size()); }

  void fill() {
    for (auto it = active_.begin(); it != active_.end() && !free_.empty(); ++it) {
      while (!it->failed && it->next < it->run.end && !free_.empty()) {
        const unsigned index = free_.back();
        free_.pop_back();
        Slot& slot = slots_[index];
        slot.owner = it;
        slot.pos = it->next;
        slot.end = engine_.chunk_end(it->next, it->run.end);
        it->next = slot.end;
        ++it->outstanding;
        prepare(index);
      }
    }
  }

  void prepare(unsigned index) {
    Slot& slot = slots_[index];
    Op& op = *slot.owner->run.op;
    io_uring_sqe* sqe = ring_.next_sqe();
    if (sqe == nullptr) fatal("the submission ring is full although a request slot is free");
    slot.iov.iov_base = op.buffer + slot.pos;
    slot.iov.iov_len = static_cast<size_t>(engine_.request_bytes(op, slot.pos, slot.end));
    sqe->opcode = op.read ? IORING_OP_READV : IORING_OP_WRITEV;
    sqe->fd = op.fd;
    sqe->off = static_cast<uint64_t>(op.offset + slot.pos);
    sqe->addr = reinterpret_cast<uint64_t>(&slot.iov);
    sqe->len = 1;
    sqe->user_data = index;
    ring_.publish();
    if (single_submit_) enter(1, 0);  // one request per system call, handed over at once
  }

  // Hands every published request to the kernel and waits for `min_complete` completions.
  void submit_and_wait(unsigned min_complete) {
    for (;;) {
      const unsigned to_submit = ring_.unsubmitted();
      const int ret = enter(to_submit, min_complete);
      // The kernel skips the wait when it takes fewer requests than offered: offer the rest.
      if (ret >= 0 && static_cast<unsigned>(ret) < to_submit) continue;
      // Refused for now (EAGAIN / EBUSY): wait for one of the requests it holds, if any, rather
      // than spin; the caller reaps and offers the rest again.
      const unsigned held = busy() - ring_.unsubmitted();
      if (ret < 0 && held > 0) enter(0, 1);
      return;
    }
  }

  // io_uring_enter, retried after a signal. EAGAIN / EBUSY (the kernel is short of memory, or
  // completions are backing up) return so that the caller reaps; the requests stay published.
  int enter(unsigned to_submit, unsigned min_complete) {
    for (;;) {
      const int ret = ring_.enter(to_submit, min_complete);
      if (ret == -EINTR) continue;
      if (ret == -EAGAIN || ret == -EBUSY) return ret;
      if (ret < 0) fatal(std::string("io_uring_enter failed: ") + std::strerror(-ret));
      if (to_submit > 0) engine_.submit_calls_.fetch_add(1, std::memory_order_relaxed);
      return ret;
    }
  }

  void reap() {
    uint64_t index = 0;
    int32_t res = 0;
    while (ring_.pop(&index, &res)) complete(static_cast<unsigned>(index), res);
  }

  void complete(unsigned index, int32_t res) {
    Slot& slot = slots_[index];
    ActiveRun& run = *slot.owner;
    const Step step = engine_.account(*run.run.op, slot.pos, slot.end, res);
    if (step == Step::kMore) {  // a short transfer (or EAGAIN): ask for the rest in this slot
      prepare(index);
      return;
    }
    free_.push_back(index);
    --run.outstanding;
    if (step == Step::kFailed) run.failed = true;
    if ((run.failed || run.next >= run.run.end) && run.outstanding == 0) {
      const std::shared_ptr<Op> op = run.run.op;
      active_.erase(slot.owner);
      engine_.finish_run(op);
    }
  }

  // A ring that stops answering leaves requests the kernel may still complete into caller
  // buffers; carrying on could corrupt memory, so this is the one place the engine aborts.
  [[noreturn]] static void fatal(const std::string& why) {
    std::fprintf(stderr, "deepspeed.ops.aio io_uring backend: %s; aborting\n", why.c_str());
    std::abort();
  }

  Engine& engine_;
  Engine::Lane& lane_;
  Ring& ring_;
  const bool overlap_;
  const bool single_submit_;
  const size_t max_runs_;  // runs worked on at once (see [Note: queue_depth])
  std::list<ActiveRun> active_;  // runs in arrival order; a list, so slots' iterators stay valid
  std::vector<Slot> slots_;
  std::vector<unsigned> free_;
};

void Engine::uring_loop(Lane& lane) { UringLane(*this, lane).run(); }

std::string io_uring_unavailable_reason() {
  try {
    Ring probe(2);
    return "";
  } catch (const RingUnavailable& e) {
    return e.what();
  }
}

#else  // no <linux/io_uring.h>: choose_backend() never picks io_uring

void Engine::uring_loop(Lane&) {}

std::string io_uring_unavailable_reason() { return "this build had no <linux/io_uring.h>"; }

#endif

}  // namespace ds_aio
