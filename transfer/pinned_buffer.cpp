// RAII ownership of an engine's pinned host allocation.
#include "hostopt/copy_engine.hpp"

namespace hostopt {

pinned_buffer::pinned_buffer(copy_engine& engine, std::size_t bytes)
    : engine_(&engine), alloc_(engine.allocate_pinned(bytes)), bytes_(bytes) {}
pinned_buffer::~pinned_buffer() {
  if (engine_) engine_->free_pinned(alloc_, bytes_);
}
pinned_buffer::pinned_buffer(pinned_buffer&& o) noexcept : engine_(o.engine_), alloc_(o.alloc_), bytes_(o.bytes_) {
  o.engine_ = nullptr;
  o.alloc_ = {};
  o.bytes_ = 0;
}
pinned_buffer& pinned_buffer::operator=(pinned_buffer&& o) noexcept {
  if (this != &o) {
    if (engine_) engine_->free_pinned(alloc_, bytes_);
    engine_ = o.engine_;
    alloc_ = o.alloc_;
    bytes_ = o.bytes_;
    o.engine_ = nullptr;
    o.alloc_ = {};
    o.bytes_ = 0;
  }
  return *this;
}

} // namespace hostopt
