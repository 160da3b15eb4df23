// A trainer loop around the offload pipeline, written against its stream-ordered contract,
// in the two ways ZeRO-Offload users run it:
//
//   sync: the forward of step k+1 waits (on the device) for step k's new parameters;
//   dpu:  delayed parameter update — the forward of step k+1 runs on the parameters of
//         step k-1 while step k's update is still in flight (one step stale, as
//         ZeRO-Offload's DPU). Two parameter buffers: step k writes buffer k % 2.
//
// Gradient accumulation: the first micro-batches of each step are streamed into the host
// accumulator (accumulate_async); the next backward waits only for grads_consumed().
//
// The host thread never waits for the device inside the loop: every dependency is an
// event the compute stream waits on, and every pipeline call is ordered after the
// compute stream. The same code runs on the CUDA engine (the model's kernels are CUDA
// kernels) and on the host engine (the model's kernels are host functions on the stream).
//
//   offload_trainer [sync|dpu] [steps] [micro_batches]
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include <hostopt/hostopt.hpp>
#include <hostopt/offload_pipeline.hpp>

#include "toy_model.hpp"

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "sync";
  const int steps = argc > 2 ? std::atoi(argv[2]) : 60;
  const int micro = argc > 3 ? std::atoi(argv[3]) : 2;
  if ((mode != "sync" && mode != "dpu") || steps < 1 || micro < 1) {
    std::fprintf(stderr, "usage: offload_trainer [sync|dpu] [steps >= 1] [micro_batches >= 1]\n");
    return 2;
  }
  using hostopt::dtype;
  try {
    hostopt::adam_config config;
    config.lr = 0.05;
    hostopt::optimizer opt({{config, {{"w", {4096}}}}});
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
    auto model = example::make_toy_model(*engine, n, 200);

    hostopt::pipeline_options po;
    po.chunk_elems = 1024;
    po.grad_type = dtype::f32;
    po.param_type = dtype::bf16;
    hostopt::offload_pipeline pipe(opt, *engine, po);
    auto* grads = static_cast<float*>(engine->allocate_device(n * 4));
    std::uint16_t* params[2] = {static_cast<std::uint16_t*>(engine->allocate_device(n * 2)),
                                static_cast<std::uint16_t*>(engine->allocate_device(n * 2))};
    for (auto* p : params) pipe.push_params({p, n, dtype::bf16}); // start from the master weights

    const bool dpu = mode == "dpu";
    double first_loss = 0, loss = 0;
    hostopt::pipeline_handle previous, before_previous; // steps k-1 and k-2
    hostopt::pipeline_handle last_reader;               // the last operation reading `grads`
    const hostopt::device_order after_compute = hostopt::device_order::after(compute);
    for (int step = 0; step < steps; ++step) {
      const int buf = dpu ? step % 2 : 0;
      // The parameters this forward reads: step k-1's (sync) or step k-2's (dpu).
      const hostopt::pipeline_handle& producer = dpu ? before_previous : previous;
      if (producer.params_ready()) engine->stream_wait_event(compute, producer.params_ready());
      model->reset_loss(compute);
      for (int mb = 0; mb < micro; ++mb) {
        // The gradient buffer may be overwritten once the pipeline has copied it.
        if (last_reader.grads_consumed()) engine->stream_wait_event(compute, last_reader.grads_consumed());
        model->forward_backward(compute, params[buf], grads, step * micro + mb);
        if (mb + 1 < micro) last_reader = pipe.accumulate_async({grads, n, dtype::f32}, after_compute);
      }
      // Only to print it: reading the loss waits for the device (first and last step).
      if (step == 0) first_loss = model->read_loss(compute) / micro;
      if (step + 1 == steps) loss = model->read_loss(compute) / micro;
      // 1/micro averages the accumulated micro-batches inside the same fused pass.
      before_previous = previous;
      previous = last_reader = pipe.step_async({grads, n, dtype::f32}, {params[buf], n, dtype::bf16},
                                               after_compute, 1.0f / float(micro));
    }
    const hostopt::step_result last = previous.wait();
    std::printf("%s: %d steps of %d micro-batches on the %s engine (flags: %s): loss %.5f -> %.5f (step "
                "count %lld)\n",
                mode.c_str(), steps, micro, std::string(engine->name()).c_str(),
                engine->flag_mechanism().c_str(), first_loss, loss, (long long)last.step);
    // FNV-1a of the master weights: equal digests are equal runs, bit for bit.
    std::uint64_t digest = 0xcbf29ce484222325ull;
    for (const unsigned char b : std::string_view(reinterpret_cast<const char*>(opt.params().data()), n * 4))
      digest = (digest ^ b) * 0x100000001b3ull;
    std::printf("master weights digest %016llx\n", (unsigned long long)digest);
    engine->synchronize_stream(compute);
    engine->free_device(grads);
    for (auto* p : params) engine->free_device(p);
    return loss < first_loss * 0.1 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
