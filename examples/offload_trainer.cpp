// A trainer loop around the offload pipeline, written against its stream-ordered contract,
// in the two ways ZeRO-Offload users run it:
//
//   sync: the forward of step k+1 waits (on the device) for step k's new parameters;
//   dpu:  delayed parameter update — the forward of step k+1 runs on the parameters of
//         step k-1 while step k's update is still in flight (one step stale, as
//         ZeRO-Offload's DPU). Two parameter buffers: step k writes buffer k % 2.
//
// Two gradient buffers, taken in turn by the micro-batches: a backward waits only for the
// gradients of the micro-batch before the previous one to be copied in (which, chunk by
// chunk through the pipeline's staging, can last as long as that step's update).
//
// Gradient accumulation: the first micro-batches of each step are streamed into the host
// accumulator (accumulate_async); the next backward waits only for grads_consumed().
//
// The host thread never waits for the device inside the loop: every dependency is an
// event the compute stream waits on, and every pipeline call is ordered after the
// compute stream. The same code runs on the CUDA engine (the model's kernels are CUDA
// kernels) and on the host engine (the model's kernels are host functions on the stream).
//
// It reports what the pipeline is for: the step time, how busy the device kept computing
// (its forward/backward spans, from events on the compute stream), and the CPU update's
// time, over the steps after the first two. A size and a forward/backward time make it a
// model of a real run (bench/simulated_trainer.sh runs it on the CUDA double's link model).
//
// HOSTOPT_EXAMPLE_STORE=DIR keeps the optimizer state on a drive instead (a stored_optimizer
// in a new directory inside DIR, removed at the end): the same pipeline calls, the same bits.
//
//   offload_trainer [sync|dpu] [steps] [micro_batches] [parameters] [forward_backward_us]
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <hostopt/hostopt.hpp>
#include <hostopt/offload_pipeline.hpp>
#include <hostopt/stored_optimizer.hpp>

#include "toy_model.hpp"

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "sync";
  const int steps = argc > 2 ? std::atoi(argv[2]) : 60;
  const int micro = argc > 3 ? std::atoi(argv[3]) : 2;
  const long long size = argc > 4 ? std::atoll(argv[4]) : 4096;
  const int work_us = argc > 5 ? std::atoi(argv[5]) : 0;
  if ((mode != "sync" && mode != "dpu") || steps < 1 || micro < 1 || size < 1 || work_us < 0) {
    std::fprintf(stderr,
                 "usage: offload_trainer [sync|dpu] [steps >= 1] [micro_batches >= 1] [parameters >= 1] "
                 "[forward_backward_us >= 0]\n");
    return 2;
  }
  using hostopt::dtype;
  try {
    hostopt::adam_config config;
    config.lr = 0.05;
    const std::vector<hostopt::param_group> groups{{config, {{"w", {std::int64_t(size)}}}}};
    // The state in RAM, or on a drive: the pipeline drives either (a chunk_updater).
    std::optional<hostopt::optimizer> ram;
    std::optional<hostopt::stored_optimizer> stored;
    std::filesystem::path store_dir;
    struct remove_at_end {
      std::filesystem::path& dir;
      ~remove_at_end() {
        std::error_code ignored;
        if (!dir.empty()) std::filesystem::remove_all(dir, ignored);
      }
    } cleanup{store_dir};
    if (const char* where = std::getenv("HOSTOPT_EXAMPLE_STORE")) {
      store_dir = std::filesystem::path(where) / ("offload_trainer-store." + std::to_string(::getpid()));
      std::filesystem::create_directories(store_dir);
      hostopt::state_store_options so;
      so.dirs = {store_dir.string()};
      so.staging_bytes = 16 << 20;
      so.sync_every_step = false; // (a killed run keeps every step; a power loss may take the last ones)
      stored.emplace(hostopt::stored_optimizer::create(groups, so));
    } else {
      ram.emplace(groups);
    }
    hostopt::chunk_updater& opt = stored ? static_cast<hostopt::chunk_updater&>(*stored) : *ram;
    const std::size_t n = opt.arena_size();
#if defined(HOSTOPT_EXAMPLE_HAVE_CUDA)
    // CUDA when a device exists; HOSTOPT_EXAMPLE_ENGINE=host picks the host engine anyway
    // (its results are the CUDA run's, bit for bit: the digest printed below).
    const char* pick = std::getenv("HOSTOPT_EXAMPLE_ENGINE");
    auto engine = pick && std::string(pick) == "host" ? hostopt::make_host_copy_engine()
                                                      : hostopt::make_default_copy_engine();
#else
    auto engine = hostopt::make_host_copy_engine(); // no CUDA model kernels were compiled in
#endif
    const hostopt::device_stream compute = engine->create_stream();
    // Unless a time is given, the host engine's model takes 200 us (something to overlap with)
    // and CUDA's kernels what they take.
    const int model_us = work_us > 0 ? work_us : engine->name() == "cuda" ? 0 : 200;
    auto model = example::make_toy_model(*engine, n, model_us);

    hostopt::pipeline_options po;
    po.chunk_elems = n <= 65536 ? 1024 : 1 << 20; // several chunks even for the toy size
    po.grad_type = dtype::f32;
    po.param_type = dtype::bf16;
    hostopt::offload_pipeline pipe(opt, *engine, po);
    float* grad_buffers[2] = {static_cast<float*>(engine->allocate_device(n * 4)),
                              static_cast<float*>(engine->allocate_device(n * 4))};
    std::uint16_t* params[2] = {static_cast<std::uint16_t*>(engine->allocate_device(n * 2)),
                                static_cast<std::uint16_t*>(engine->allocate_device(n * 2))};
    for (auto* p : params) pipe.push_params({p, n, dtype::bf16}); // start from the master weights

    const bool dpu = mode == "dpu";
    double first_loss = 0, loss = 0;
    hostopt::pipeline_handle previous, before_previous; // steps k-1 and k-2
    hostopt::pipeline_handle last_reader[2];            // the last operation reading each gradient buffer
    const hostopt::device_order after_compute = hostopt::device_order::after(compute);
    // Events around every forward/backward: when the device computed (read at the end).
    std::vector<hostopt::device_event> spans(2 * std::size_t(steps) * micro);
    for (auto& e : spans) e = engine->create_event();
    for (int step = 0; step < steps; ++step) {
      const int buf = dpu ? step % 2 : 0;
      // The parameters this forward reads: step k-1's (sync) or step k-2's (dpu).
      const hostopt::pipeline_handle& producer = dpu ? before_previous : previous;
      if (producer.params_ready()) engine->stream_wait_event(compute, producer.params_ready());
      model->reset_loss(compute);
      for (int mb = 0; mb < micro; ++mb) {
        // The gradient buffer may be overwritten once the pipeline has copied it.
        const int g = (step * micro + mb) % 2;
        float* grads = grad_buffers[g];
        if (last_reader[g].grads_consumed())
          engine->stream_wait_event(compute, last_reader[g].grads_consumed());
        const std::size_t span = 2 * (std::size_t(step) * micro + mb);
        engine->record_event(spans[span], compute);
        model->forward_backward(compute, params[buf], grads, step * micro + mb);
        engine->record_event(spans[span + 1], compute);
        if (mb + 1 < micro)
          last_reader[g] = pipe.accumulate_async({grads, n, dtype::f32}, after_compute);
        else // 1/micro averages the accumulated micro-batches inside the same fused pass.
          last_reader[g] = pipe.step_async({grads, n, dtype::f32}, {params[buf], n, dtype::bf16},
                                           after_compute, 1.0f / float(micro));
      }
      // Only to print it: reading the loss waits for the device (first and last step).
      if (step == 0) first_loss = model->read_loss(compute) / micro;
      if (step + 1 == steps) loss = model->read_loss(compute) / micro;
      before_previous = previous;
      previous = last_reader[(step * micro + micro - 1) % 2];
    }
    const hostopt::step_result last = previous.wait();
    engine->synchronize_event(previous.params_ready()); // compute is done: the last read_loss waited
    const hostopt::pipeline_timeline timeline = pipe.last_timeline();
    std::printf("%s: %d steps of %d micro-batches on the %s engine (flags: %s), state %s: loss %.5f -> %.5f "
                "(step count %lld)\n",
                mode.c_str(), steps, micro, std::string(engine->name()).c_str(),
                engine->flag_mechanism().c_str(), stored ? "on a drive" : "in RAM", first_loss, loss,
                (long long)last.step);
    // FNV-1a of the master weights: equal digests are equal runs, bit for bit.
    std::vector<float> masters(n, 0.0f);
    if (stored) stored->copy_params_to({masters.data(), n, dtype::f32}); // (streamed from the drive)
    else std::copy(ram->params().begin(), ram->params().end(), masters.begin());
    std::uint64_t digest = 0xcbf29ce484222325ull;
    for (const unsigned char b : std::string_view(reinterpret_cast<const char*>(masters.data()), n * 4))
      digest = (digest ^ b) * 0x100000001b3ull;
    std::printf("master weights digest %016llx\n", (unsigned long long)digest);
    // Steady state: from the first forward of step `warm` to the first forward of the last
    // step, i.e. steps warm .. steps-2 whole, each with what overlaps it (the last step's
    // update, which nothing follows, is left out). The CPU and copy times are the last
    // step's (its timeline; the accumulations' passes are not in them).
    const int warm = steps >= 4 ? 2 : 0;
    if (steps - 1 > warm) {
      const auto t = [&](hostopt::device_event e) { return double(engine->event_time_ns(e)) * 1e-6; };
      const std::size_t first = 2 * std::size_t(warm) * micro, last = 2 * std::size_t(steps - 1) * micro;
      const double begin = t(spans[first]), end = t(spans[last]);
      double busy = 0;
      for (std::size_t i = first; i < last; i += 2) busy += t(spans[i + 1]) - t(spans[i]);
      const double step_ms = (end - begin) / (steps - 1 - warm);
      const double update_ms = timeline.busy_seconds(hostopt::pipeline_stage::update) * 1e3;
      std::printf(
          "timing over steps %d..%d, %zu parameters, %d chunks: step %.3f ms, device computing %.1f%% of "
          "it; the last step's CPU update %.3f ms (%.1f%% of a step), copy in %.3f ms, copy out %.3f ms\n",
          warm, steps - 2, n, int(pipe.num_chunks()), step_ms, 100 * busy / (end - begin), update_ms,
          100 * update_ms / step_ms, timeline.busy_seconds(hostopt::pipeline_stage::copy_in) * 1e3,
          timeline.busy_seconds(hostopt::pipeline_stage::copy_out) * 1e3);
    }
    for (auto e : spans) engine->destroy_event(e);
    engine->synchronize_stream(compute);
    for (auto* g : grad_buffers) engine->free_device(g);
    for (auto* p : params) engine->free_device(p);
    // A modelled forward/backward may skip the arithmetic (the CUDA double): a timing run.
    return work_us > 0 || loss < first_loss * 0.1 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
