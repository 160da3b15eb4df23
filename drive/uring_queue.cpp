#include "uring_queue.hpp"

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>
#include <system_error>

#ifdef HOSTOPT_HAVE_URING
#include <liburing.h>
#endif

namespace hostopt::drive {

#ifdef HOSTOPT_HAVE_URING

namespace {

class uring_queue final : public io_queue {
public:
  explicit uring_queue(unsigned depth) : io_queue(depth) {
    const int rc = io_uring_queue_init(depth, &ring_, 0);
    if (rc < 0)
      throw std::system_error(-rc, std::generic_category(), "io_uring_queue_init (" + std::to_string(depth) + " entries)");
  }
  ~uring_queue() override {
    // Requests still in flight write into the caller's buffers: wait for them before the ring goes.
    for (std::size_t left = in_flight(); left > 0; --left) {
      io_uring_cqe* cqe = nullptr;
      if (io_uring_wait_cqe(&ring_, &cqe) < 0) break;
      io_uring_cqe_seen(&ring_, cqe);
    }
    io_uring_queue_exit(&ring_);
  }
  io_backend backend() const override { return io_backend::uring; }

protected:
  void start(const io_request& r) override {
    if (!failed_.empty()) throw std::runtime_error(failed_);
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (sqe == nullptr) throw std::logic_error("io_uring: no free submission entry (more than the depth in flight)");
    if (r.write)
      io_uring_prep_write(sqe, r.fd, r.buffer, static_cast<unsigned>(r.bytes), r.offset);
    else
      io_uring_prep_read(sqe, r.fd, r.buffer, static_cast<unsigned>(r.bytes), r.offset);
    io_uring_sqe_set_data64(sqe, r.tag);
    int rc;
    do rc = io_uring_submit(&ring_);
    while (rc == -EINTR);
    if (rc < 0) { // the entry stays in the ring, unsubmitted: no later submit may send it
      failed_ = "io_uring_submit failed (" + std::string(std::strerror(-rc)) + "): this queue takes no more requests";
      throw std::system_error(-rc, std::generic_category(), "io_uring_submit");
    }
  }
  void collect(std::size_t at_least, std::vector<io_completion>& out) override {
    while (out.size() < at_least) {
      io_uring_cqe* cqe = nullptr;
      const int rc = io_uring_wait_cqe(&ring_, &cqe);
      if (rc == -EINTR) continue;
      if (rc < 0 && !out.empty()) break; // (those already taken are handed back: they are done)
      if (rc < 0) throw std::system_error(-rc, std::generic_category(), "io_uring_wait_cqe");
      out.push_back({io_uring_cqe_get_data64(cqe), cqe->res});
      io_uring_cqe_seen(&ring_, cqe);
    }
    io_uring_cqe* cqe = nullptr; // (and whatever else is done)
    while (io_uring_peek_cqe(&ring_, &cqe) == 0 && cqe != nullptr) {
      out.push_back({io_uring_cqe_get_data64(cqe), cqe->res});
      io_uring_cqe_seen(&ring_, cqe);
    }
  }

private:
  io_uring ring_{};
  std::string failed_; // set when a submit failed: see start()
};

} // namespace

std::string uring_unavailable_reason() {
  static const std::string reason = [] {
    io_uring ring{};
    const int rc = io_uring_queue_init(2, &ring, 0);
    if (rc < 0) return "the kernel refuses io_uring (" + std::string(std::strerror(-rc)) + ")";
    io_uring_queue_exit(&ring);
    return std::string();
  }();
  return reason;
}

std::unique_ptr<io_queue> make_uring_queue(unsigned depth) {
  const std::string why = uring_unavailable_reason();
  if (!why.empty()) throw std::system_error(ENOSYS, std::generic_category(), "io_uring unavailable: " + why);
  return std::make_unique<uring_queue>(depth);
}

#else

std::string uring_unavailable_reason() { return "hostopt was built without liburing (apt-get install liburing-dev)"; }

std::unique_ptr<io_queue> make_uring_queue(unsigned) {
  throw std::system_error(ENOSYS, std::generic_category(), "io_uring unavailable: " + uring_unavailable_reason());
}

#endif

} // namespace hostopt::drive
