// ZeRO-2 with offload over MPI: every rank keeps only its shard of the optimizer state.
// Each step: MPI_Reduce_scatter sums the ranks' gradients into each rank's shard, the
// global norm for the non-finite check and clipping is the MPI_Allreduce of the shards' sums
// of squares (the step calls it through set_norm_reduction), each rank steps its shard
// with hostopt, and MPI_Allgatherv brings every rank the new parameters. At step 3 one
// rank's micro-batch holds a NaN that lands in the last shard only: every rank skips.
//
// It then checks itself: every rank made the same decisions, and rank 0 replays the same
// summed gradients through the single-process optimizer and compares the parameters bit
// for bit.
//
//   mpirun -np 3 ./mpi_trainer [steps] [embedding rows, default 1000]
//
// It prints the slowest rank's median time per step for the shard update and for the
// collectives, and the bytes of optimizer state each rank holds.
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <hostopt/hostopt.hpp>

namespace {

std::size_t embed_rows = 1000;

std::vector<hostopt::param_group> model() {
  hostopt::adam_config decay, plain;
  decay.lr = 1e-2;
  decay.weight_decay = 0.1;
  return {{decay, {{"embed", {std::int64_t(embed_rows), 32}}, {"w1", {32, 128}}, {"w2", {128, 32}}}},
          {plain, {{"b1", {128}}, {"b2", {32}}, {"norm", {32}}}}};
}

// This rank's micro-batch gradient: multiples of 2^-12 with |g| < 1, so sums over up to
// thousands of ranks are exact in f32 whatever order MPI adds them in.
constexpr int nan_step = 3;

float grad_of(int step, int rank, std::size_t i) {
  const std::uint32_t h = std::uint32_t(i * 2654435761u) ^ std::uint32_t(step * 40503 + rank * 977);
  return float(int(h % 4001) - 2000) / 4096.0f;
}

} // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  const int steps = argc > 1 ? std::atoi(argv[1]) : 10;
  if (argc > 2) embed_rows = std::size_t(std::atol(argv[2]));
  int status = 0;
  try {
    hostopt::sharded_optimizer opt(model(), world, rank, {1, ""});
    const std::size_t n = opt.arena_size();
    std::vector<int> counts(world), displs(world);
    for (int r = 0; r < world; ++r) {
      const auto s = hostopt::shard_of(n, world, r);
      counts[r] = int(s.end - s.begin);
      displs[r] = int(s.begin);
    }
    std::vector<float> init(n);
    for (std::size_t i = 0; i < n; ++i) init[i] = std::sin(0.01f * float(i));
    for (const auto& s : opt.segments())
      opt.set_params(s.name, std::span<const float>(init.data() + s.offset, s.size));

    // Skips and clipping are global decisions: the shard's sum of squares is all-reduced
    // inside the step (this callback), so every rank judges the same norm.
    opt.set_norm_reduction([](double local) {
      double total = 0;
      MPI_Allreduce(&local, &total, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
      return total;
    });
    std::vector<float> grad(n), shard_grad(counts[rank]), params(n), shard_params(counts[rank]);
    std::vector<double> norms, update_s, comm_s;
    int skipped_here = 0;
    for (int t = 0; t < steps; ++t) {
      for (std::size_t i = 0; i < n; ++i) grad[i] = grad_of(t, rank, i);
      // Step 3: a NaN in the last rank's micro-batch, at an element only the last shard holds.
      if (t == nan_step && rank == world - 1) grad[n - 1] = std::nanf("");
      MPI_Barrier(MPI_COMM_WORLD);
      const double t0 = MPI_Wtime();
      MPI_Reduce_scatter(grad.data(), shard_grad.data(), counts.data(), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      hostopt::step_options o; // checks non-finite gradients (the default), clips at 50
      o.max_grad_norm = 50.0;
      const double t1 = MPI_Wtime();
      const hostopt::step_result r = opt.step({shard_grad.data(), shard_grad.size(), hostopt::dtype::f32},
                                              {shard_params.data(), shard_params.size(), hostopt::dtype::f32}, o);
      const double t2 = MPI_Wtime();
      norms.push_back(r.grad_norm);
      skipped_here += !r.applied;
      MPI_Allgatherv(shard_params.data(), counts[rank], MPI_FLOAT, params.data(), counts.data(), displs.data(),
                     MPI_FLOAT, MPI_COMM_WORLD);
      update_s.push_back(t2 - t1);
      comm_s.push_back(MPI_Wtime() - t2 + (t1 - t0));
    }
    std::sort(update_s.begin(), update_s.end());
    std::sort(comm_s.begin(), comm_s.end());
    double med[2] = {update_s[update_s.size() / 2], comm_s[comm_s.size() / 2]}, slowest[2];
    MPI_Reduce(med, slowest, 2, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    if (rank == 0)
      std::printf("mpi_trainer: %d ranks: shard update %.2f ms, collectives %.2f ms per step (median, slowest rank)\n",
                  world, slowest[0] * 1e3, slowest[1] * 1e3);
    // Every rank skipped the step whose NaN only the last shard saw, and the counts agree.
    const long long mine[2] = {skipped_here, opt.local().step_count()};
    long long lo[2], hi[2];
    MPI_Allreduce(mine, lo, 2, MPI_LONG_LONG, MPI_MIN, MPI_COMM_WORLD);
    MPI_Allreduce(mine, hi, 2, MPI_LONG_LONG, MPI_MAX, MPI_COMM_WORLD);
    const bool agreed = lo[0] == hi[0] && lo[1] == hi[1] && lo[0] == (steps > nan_step ? 1 : 0);
    if (rank == 0)
      std::printf("mpi_trainer: skipped steps %lld..%lld and step counts %lld..%lld across ranks: %s\n", lo[0], hi[0],
                  lo[1], hi[1], agreed ? "every rank made the same decision" : "RANKS DISAGREE");

    if (rank == 0) { // the single-process optimizer on the same summed gradients
      hostopt::optimizer single(model(), {1, ""});
      for (const auto& s : single.segments())
        single.set_params(s.name, {init.data() + s.offset, s.size, hostopt::dtype::f32});
      std::vector<float> summed(n), out(n);
      for (int t = 0; t < steps; ++t) {
        for (std::size_t i = 0; i < n; ++i) {
          float sum = 0;
          for (int r = 0; r < world; ++r) sum += grad_of(t, r, i);
          summed[i] = sum;
        }
        if (t == nan_step) summed[n - 1] = std::nanf("");
        hostopt::step_options o; // the same decisions, from the ranks' all-reduced norm (its bits)
        o.known_grad_norm = norms[t];
        o.max_grad_norm = 50.0;
        single.step({summed.data(), n, hostopt::dtype::f32}, {out.data(), n, hostopt::dtype::f32}, o);
      }
      std::size_t mismatched = 0;
      for (const auto& s : single.segments())
        mismatched += std::memcmp(params.data() + s.offset, out.data() + s.offset, s.size * 4) != 0;
      std::printf("mpi_trainer: %d ranks, %d steps, %zu parameters, %zu bytes of state on rank 0 (%.0f%% of %zu): %s\n",
                  world, steps, single.num_params(), opt.local().state_bytes(),
                  100.0 * double(opt.local().state_bytes()) / double(single.state_bytes()), single.state_bytes(),
                  mismatched ? "MISMATCH with the single-process optimizer" : "bit-identical to the single process");
      status = mismatched || !agreed ? 1 : 0;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    status = 1;
  }
  MPI_Bcast(&status, 1, MPI_INT, 0, MPI_COMM_WORLD);
  MPI_Finalize();
  return status;
}
