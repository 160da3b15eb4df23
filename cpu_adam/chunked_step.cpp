#include "chunked_step.hpp"

#include <stdexcept>
#include <string>

#include "hostopt/moment_format.hpp"

namespace hostopt::detail {

void chunked_step::open(const chunk_step_options& o, const step_decision& d) {
  options = o;
  decision = d;
  seen = {};
  updates = 0;
}

void chunked_step::check_next(std::size_t begin, std::size_t end, std::size_t size, bool q8_blocks,
                              const void* grad, const void* out, const float* accumulator) const {
  if (begin > end || end > size)
    throw std::invalid_argument("update_range: [" + std::to_string(begin) + ", " + std::to_string(end) +
                                "): expected a range inside [0, " + std::to_string(size) + ")");
  if (begin != covered)
    throw std::invalid_argument("update_range: [" + std::to_string(begin) + ", " + std::to_string(end) +
                                "): expected the next chunk, starting at " + std::to_string(covered) +
                                " (chunks cover the arena in order, once each)");
  if (begin == end) return;
  if (q8_blocks && end % q8_block && end != size)
    throw std::invalid_argument("update_range: [" + std::to_string(begin) + ", " + std::to_string(end) +
                                "): a group has 8-bit moments: expected a chunk ending on a multiple of 32 "
                                "(chunk_unit(), whole blocks) or at the arena's end");
  if (!grad) throw std::invalid_argument("update_range: grad is null: expected a gradient chunk");
  if (options.copy_out != (out != nullptr))
    throw std::invalid_argument(
        std::string("update_range: out is ") + (out ? "set" : "null") + ": expected " +
        (options.copy_out ? "an output chunk" : "none (begin_step had copy_out off)"));
  if (options.accumulator != (accumulator != nullptr))
    throw std::invalid_argument(std::string("update_range: accumulator is ") +
                                (accumulator ? "set" : "null") + ": expected " +
                                (options.accumulator ? "an accumulator chunk" : "none"));
}

void chunked_step::check_complete(std::size_t size) const {
  if (covered != size)
    throw std::logic_error("finish_step: the chunks cover [0, " + std::to_string(covered) + ") of the " +
                           std::to_string(size) + " elements: update the rest first, or abort_step()");
}

void chunked_step::close() {
  updates = 0;
  covered = 0;
}

void check_tensors_without_grad(const std::vector<std::size_t>& without, std::size_t tensors, bool whole,
                                const char* what) {
  if (without.empty()) return;
  if (!whole)
    throw std::invalid_argument(std::string(what) + ": tensors_without_grad on an optimizer that holds a range of "
                                "the arena (a shard), whose tensors share one step count");
  for (const std::size_t t : without)
    if (t >= tensors)
      throw std::invalid_argument(std::string(what) + ": tensors_without_grad names tensor " + std::to_string(t) +
                                  ": expected an index below " + std::to_string(tensors));
}

} // namespace hostopt::detail
