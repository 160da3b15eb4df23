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
// With --bad-rank R, rank R passes a gradient one element short at step 5: its step is
// refused, and so is every other rank's (hostopt::sharded_step_refused on each, nothing
// applied), instead of the others waiting in the norm's all-reduce for good. Training
// goes on from the next step.
//
//   mpirun -np 3 ./mpi_trainer [steps] [embedding rows, default 1000] [--bad-rank R]
//
// It prints the slowest rank's median time per step for the shard update and for the
// collectives, and the bytes of optimizer state each rank holds.
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
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
constexpr int bad_step = 5; // --bad-rank: the step that rank's bad gradient buffer is refused at

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
  int steps = 10, bad_rank = -1, positional = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--bad-rank" && i + 1 < argc) bad_rank = std::atoi(argv[++i]);
    else if (positional++ == 0) steps = std::atoi(argv[i]);
    else embed_rows = std::size_t(std::atol(argv[i]));
  }
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
    // --bad-rank: the step refused on every rank, how many ranks refused it, and whether
    // this rank's message says what it should (its reason, or to see the refusing rank's).
    int refused_step = -1, refused_ranks = 0, message_ok = 1;
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
      // A bad buffer on one rank (--bad-rank): one element short.
      const std::size_t short_by = t == bad_step && rank == bad_rank ? 1 : 0;
      hostopt::step_result r;
      try {
        r = opt.step({shard_grad.data(), shard_grad.size() - short_by, hostopt::dtype::f32},
                     {shard_params.data(), shard_params.size(), hostopt::dtype::f32}, o);
      } catch (const hostopt::sharded_step_refused& e) { // thrown on every rank: nothing applied anywhere
        std::printf("mpi_trainer: rank %d: step %d: %s\n", rank, t, e.what());
        refused_step = t;
        refused_ranks = e.refused_ranks();
        const std::string what = e.what();
        message_ok = what.find(rank == bad_rank ? "refused it: shard_grad.size" : "see that rank's error") !=
                     std::string::npos;
        norms.push_back(-1); // the replay leaves this step out
        continue;
      }
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
    // --bad-rank: every rank refused the same step, counting one refusing rank.
    const int refusal[3] = {refused_step, refused_ranks, message_ok};
    int rlo[3], rhi[3];
    MPI_Allreduce(refusal, rlo, 3, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    MPI_Allreduce(refusal, rhi, 3, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    const bool expect_refusal = bad_rank >= 0 && bad_rank < world && steps > bad_step;
    const bool refusal_agreed = expect_refusal ? rlo[0] == bad_step && rhi[0] == bad_step && rlo[1] == 1 &&
                                                     rhi[1] == 1 && rlo[2] == 1
                                               : rhi[0] == -1;
    if (rank == 0 && expect_refusal)
      std::printf("mpi_trainer: rank %d's bad buffer at step %d: %s\n", bad_rank, bad_step,
                  refusal_agreed ? "every rank refused the step together" : "RANKS DISAGREE on the refusal");

    if (rank == 0) { // the single-process optimizer on the same summed gradients
      hostopt::optimizer single(model(), {1, ""});
      for (const auto& s : single.segments())
        single.set_params(s.name, {init.data() + s.offset, s.size, hostopt::dtype::f32});
      std::vector<float> summed(n), out(n);
      for (int t = 0; t < steps; ++t) {
        if (t == refused_step) continue; // refused on every rank: applied nowhere
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
      std::printf("mpi_trainer: %d ranks, %d steps, %zu parameters, %zu bytes of state on rank 0 (%.0f%% of %zu): %s%s\n",
                  world, steps, single.num_params(), opt.local().state_bytes(),
                  100.0 * double(opt.local().state_bytes()) / double(single.state_bytes()), single.state_bytes(),
                  mismatched ? "MISMATCH with the single-process optimizer" : "bit-identical to the single process",
                  expect_refusal && refusal_agreed ? ", every rank refused the bad step together" : "");
      status = mismatched || !agreed || !refusal_agreed ? 1 : 0;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    status = 1;
  }
  MPI_Bcast(&status, 1, MPI_INT, 0, MPI_COMM_WORLD);
  MPI_Finalize();
  return status;
}
