// A trainer loop around the offload pipeline, in the two ways ZeRO-Offload users run it:
//
//   sync: each step waits for the new parameters before the next forward pass;
//   dpu:  delayed parameter update — the forward/backward of step k runs on the
//         parameters of step k-2 while step k-1's update is still in flight (one step
//         stale, as ZeRO-Offload's DPU), and waits only before issuing the next step.
//         The in-flight step reads one gradient buffer and writes one parameter buffer
//         while the forward uses the others, so device buffers come in pairs.
//
// Gradient accumulation: the first micro-batches of each step are streamed into the host
// accumulator (accumulate_async), so "the GPU" can free their gradients at once.
//
// The "GPU" here is the host copy engine (device memory is host memory), and the model is
// a least-squares problem whose gradient the "device" computes from its bf16 parameters.
// With a CUDA device, make_default_copy_engine() returns the CUDA engine and the same loop
// would hand pipeline_handle::device_event() to cudaStreamWaitEvent before the forward.
//
//   offload_trainer [sync|dpu] [steps] [micro_batches]
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <hostopt/hostopt.hpp>
#include <hostopt/offload_pipeline.hpp>

namespace {

using hostopt::dtype;

float bf16_to_float(std::uint16_t h) {
  const std::uint32_t u = std::uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The "device" side: two bf16 parameter buffers and two f32 gradient buffers, gradients
// of 0.5 * |w - target|^2 (plus a per-micro-batch offset), and the loss.
struct fake_device {
  hostopt::copy_engine& engine;
  std::size_t n;
  std::uint16_t* params[2];
  float* grads[2];
  std::vector<float> target;

  fake_device(hostopt::copy_engine& e, std::size_t elems) : engine(e), n(elems), target(n) {
    for (int i = 0; i < 2; ++i) {
      params[i] = static_cast<std::uint16_t*>(e.allocate_device(n * 2));
      grads[i] = static_cast<float*>(e.allocate_device(n * 4));
    }
    for (std::size_t i = 0; i < n; ++i) target[i] = std::sin(0.001f * float(i));
  }
  ~fake_device() {
    for (int i = 0; i < 2; ++i) {
      engine.free_device(params[i]);
      engine.free_device(grads[i]);
    }
  }
  double forward_backward(const std::uint16_t* p, float* g, int micro_batch) {
    double loss = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const float diff = bf16_to_float(p[i]) - target[i] + 0.01f * float(micro_batch % 3 - 1);
      g[i] = diff;
      loss += 0.5 * double(diff) * diff;
    }
    return loss / double(n);
  }
};

} // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "sync";
  const int steps = argc > 2 ? std::atoi(argv[2]) : 60;
  const int micro = argc > 3 ? std::atoi(argv[3]) : 2;
  if ((mode != "sync" && mode != "dpu") || steps < 1 || micro < 1) {
    std::fprintf(stderr, "usage: offload_trainer [sync|dpu] [steps >= 1] [micro_batches >= 1]\n");
    return 2;
  }
  try {
    hostopt::adam_config config;
    config.lr = 0.05;
    hostopt::optimizer opt({{config, {{"w", {4096}}}}});
    const std::size_t n = opt.arena_size();
    auto engine = hostopt::make_default_copy_engine();
    fake_device device(*engine, n);

    hostopt::pipeline_options po;
    po.chunk_elems = 1024;
    po.grad_type = dtype::f32;
    po.param_type = dtype::bf16;
    hostopt::offload_pipeline pipe(opt, *engine, po);
    for (auto* p : device.params) pipe.push_params({p, n, dtype::bf16}); // start from the master weights

    const bool dpu = mode == "dpu";
    double first_loss = 0, loss = 0;
    hostopt::pipeline_handle in_flight;
    for (int step = 0; step < steps; ++step) {
      // sync: one buffer pair, and the new parameters before the forward.
      // dpu: step k writes params[k % 2]; the forward of step k reads params[k % 2],
      // written by step k-2, while step k-1 (in flight) writes the other buffer.
      const int buf = dpu ? step % 2 : 0;
      if (!dpu && step > 0) in_flight.wait();
      for (int mb = 0; mb < micro; ++mb) {
        loss = device.forward_backward(device.params[buf], device.grads[buf], step * micro + mb);
        if (step == 0 && mb == 0) first_loss = loss;
        // (An accumulation waits for the step in flight: one pipeline operation at a time.)
        if (mb + 1 < micro) pipe.accumulate_async({device.grads[buf], n, dtype::f32}).wait();
      }
      if (dpu && step > 0) in_flight.wait(); // only before issuing the next step
      // 1/micro averages the accumulated micro-batches inside the same fused pass.
      in_flight = pipe.step_async({device.grads[buf], n, dtype::f32}, {device.params[buf], n, dtype::bf16},
                                  1.0f / float(micro));
    }
    const hostopt::step_result last = in_flight.wait();
    std::printf("%s: %d steps of %d micro-batches on the %s engine: loss %.5f -> %.5f (step count %lld)\n",
                mode.c_str(), steps, micro, std::string(engine->name()).c_str(), first_loss, loss,
                (long long)last.step);
    return loss < first_loss * 0.1 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
