// A minimal io_uring ring over the raw system calls (no liburing: CI machines do not have it).
//
// [Note: the ring protocol]
// io_uring_setup gives a file descriptor and the offsets of three shared memory areas, which
// we mmap: the submission ring (head, tail, mask, and an index array), the submission entries
// (sqes), and the completion ring (head, tail, mask, cqes). We are the only producer of the
// submission ring and the only consumer of the completion ring, each from one thread, so the
// only ordering needed is with the kernel: a release store when we publish the sq tail or the
// cq head, an acquire load when we read the kernel's sq head or cq tail. io_uring_enter hands
// the published entries to the kernel and, with IORING_ENTER_GETEVENTS, waits for completions.
// Only IORING_OP_READV / IORING_OP_WRITEV (Linux 5.1) and IORING_OP_NOP are used.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#if defined(__linux__) && __has_include(<linux/io_uring.h>)
#include <linux/io_uring.h>
#define DS_AIO_HAVE_IO_URING 1
#ifndef IORING_FEAT_SINGLE_MMAP  // headers of Linux 5.1-5.3 predate it; the kernel then never sets it
#define IORING_FEAT_SINGLE_MMAP (1U << 0)
#endif
#else
#define DS_AIO_HAVE_IO_URING 0
#endif

namespace ds_aio {

constexpr bool kIoUringCompiledIn = DS_AIO_HAVE_IO_URING;

// io_uring cannot be used: the message says which call failed and why.
struct RingUnavailable : std::runtime_error {
  using std::runtime_error::runtime_error;
};

#if DS_AIO_HAVE_IO_URING

class Ring {
 public:
  // Sets up a ring of at least `entries` submission entries and checks that it answers a no-op;
  // throws RingUnavailable naming the failing call and errno.
  explicit Ring(unsigned entries);
  ~Ring();
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;

  unsigned capacity() const { return sq_entries_; }
  // The next free submission entry, zeroed, or nullptr when every entry awaits submission.
  io_uring_sqe* next_sqe();
  // Publishes the entry next_sqe() gave (it becomes part of the next enter()).
  void publish();
  unsigned unsubmitted() const { return unsubmitted_; }
  // io_uring_enter: submits up to `to_submit` published entries and, when `min_complete` > 0,
  // waits until that many completions are ready. Returns how many were submitted, or -errno.
  int enter(unsigned to_submit, unsigned min_complete);
  // Takes one completion off the ring; false when there is none.
  bool pop(uint64_t* user_data, int32_t* res);

 private:
  void map_rings(const io_uring_params& p);
  void release();

  int fd_ = -1;
  unsigned sq_entries_ = 0;
  unsigned unsubmitted_ = 0;  // published entries io_uring_enter has not taken yet
  void* sq_map_ = nullptr;
  size_t sq_map_len_ = 0;
  void* cq_map_ = nullptr;  // == sq_map_ when the kernel maps both rings at once
  size_t cq_map_len_ = 0;
  io_uring_sqe* sqes_ = nullptr;
  size_t sqes_len_ = 0;
  unsigned* sq_head_ = nullptr;
  unsigned* sq_tail_ = nullptr;
  unsigned* sq_mask_ = nullptr;
  unsigned* sq_array_ = nullptr;
  unsigned* cq_head_ = nullptr;
  unsigned* cq_tail_ = nullptr;
  unsigned* cq_mask_ = nullptr;
  io_uring_cqe* cqes_ = nullptr;
};

#else  // no <linux/io_uring.h> at build time: the engine never constructs a Ring

class Ring {
 public:
  explicit Ring(unsigned) { throw RingUnavailable("this build had no <linux/io_uring.h>"); }
};

#endif

}  // namespace ds_aio
