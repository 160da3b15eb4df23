// Checkpoints: exact resume, atomic replacement, and refusal of every kind of bad file
// with the optimizer left untouched.
#include <catch2/catch.hpp>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <thread>

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/file.h>
#include <unistd.h>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "reference.hpp"
#include "temp_dir.hpp"

using namespace hostopt;
namespace fs = std::filesystem;

namespace {

std::vector<param_group> model() {
  adam_config a, b;
  a.lr = 3e-3;
  a.weight_decay = 0.1;
  b.mode = adam_mode::adam;
  b.nesterov = true;
  return {{a, {{"embed", {50, 8}}, {"scalar", {}}}}, {b, {{"bias", {8}}, {"empty", {0}}}}};
}

void train(optimizer& opt, int steps, std::mt19937& rng) {
  for (int i = 0; i < steps; ++i) {
    const auto g = ref::random_grad(dtype::bf16, opt.arena_size(), rng);
    opt.step(g.view(), {}, step_options{});
  }
}

std::string read_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

void write_file(const fs::path& p, const std::string& s) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f << s;
}

// Splits a file into its JSON header and data, and joins them back.
std::pair<nlohmann::json, std::string> split(const std::string& file) {
  std::uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= std::uint64_t(static_cast<unsigned char>(file[i])) << (8 * i);
  return {nlohmann::json::parse(file.substr(8, n)), file.substr(8 + n)};
}

std::string join(const nlohmann::json& header, const std::string& data) {
  const std::string text = header.dump();
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = char((text.size() >> (8 * i)) & 0xFF);
  return out + text + data;
}

struct snapshot {
  std::vector<float> p, m, v;
  std::int64_t step;
  double lr0;
  explicit snapshot(const optimizer& o)
      : p(o.params().begin(), o.params().end()), m(o.exp_avg().begin(), o.exp_avg().end()),
        v(o.exp_avg_sq().begin(), o.exp_avg_sq().end()), step(o.step_count()), lr0(o.group_config(0).lr) {}
  bool operator==(const snapshot& s) const {
    return p == s.p && m == s.m && v == s.v && step == s.step && lr0 == s.lr0;
  }
};

} // namespace

TEST_CASE("10 steps, save, load into a fresh optimizer, 10 steps == 20 straight steps", "[checkpoint]") {
  const hostopt_test::temp_dir scratch("ckpt_test");
  const fs::path& dir = scratch.path;
  std::mt19937 rng_a(1), rng_b(1);
  optimizer straight(model());
  train(straight, 20, rng_a);

  optimizer first(model());
  train(first, 10, rng_b);
  first.set_skipped_steps(3);
  save_checkpoint(first, (dir / "ckpt.safetensors").string());
  auto other = model();
  other[0].config.lr = 99; // the checkpoint's hyper-parameters replace these
  optimizer resumed(other);
  load_checkpoint(resumed, (dir / "ckpt.safetensors").string());
  CHECK(resumed.step_count() == 10);
  CHECK(resumed.skipped_steps() == 3);
  CHECK(resumed.group_config(0).lr == 3e-3);
  CHECK(resumed.group_config(1).nesterov);
  train(resumed, 10, rng_b);
  CHECK(std::memcmp(resumed.params().data(), straight.params().data(), straight.arena_size() * 4) == 0);
  CHECK(std::memcmp(resumed.exp_avg_sq().data(), straight.exp_avg_sq().data(), straight.arena_size() * 4) == 0);
  CHECK(resumed.step_count() == 20);
}

TEST_CASE("the file is standard safetensors, replaced atomically", "[checkpoint]") {
  const hostopt_test::temp_dir scratch("ckpt_test");
  const fs::path& dir = scratch.path;
  const fs::path path = dir / "state.safetensors";
  std::mt19937 rng(2);
  optimizer opt(model());
  train(opt, 2, rng);
  save_checkpoint(opt, path.string());
  const auto [header, data] = split(read_file(path));
  CHECK(header["__metadata__"]["format"] == "hostopt");
  CHECK(header["__metadata__"]["version"] == "2");
  CHECK(header["__metadata__"]["step"] == "2");
  CHECK(header["embed.param"]["dtype"] == "F32");
  CHECK(header["embed.exp_avg_sq"]["shape"] == nlohmann::json({50, 8}));
  CHECK(header["scalar.param"]["shape"] == nlohmann::json::array());
  const auto offs = header["embed.param"]["data_offsets"];
  float first;
  std::memcpy(&first, data.data() + offs[0].get<std::size_t>(), 4);
  CHECK(first == opt.params("embed")[0]);
  CHECK((8 + read_file(path).size() - data.size() - 8) % 8 == 0); // aligned data section
  // Saving again replaces the file, leaving no temporary behind.
  train(opt, 1, rng);
  save_checkpoint(opt, path.string());
  CHECK(split(read_file(path)).first["__metadata__"]["step"] == "3");
  optimizer reloaded(model());
  load_checkpoint(reloaded, path.string());
  CHECK(reloaded.step_count() == 3);
  std::size_t files = 0;
  for (auto it = fs::directory_iterator(dir); it != fs::directory_iterator(); ++it) ++files;
  CHECK(files == 1);
  // A failed save leaves the previous checkpoint intact.
  CHECK_THROWS_WITH(save_checkpoint(opt, (dir / "no_such_dir" / "x.safetensors").string()),
                    Catch::Contains("no_such_dir") && Catch::Contains("No such file"));
  CHECK(split(read_file(path)).first["__metadata__"]["step"] == "3");
}

TEST_CASE("bad checkpoints are refused with a message naming the problem, nothing changes", "[checkpoint][errors]") {
  const hostopt_test::temp_dir scratch("ckpt_test");
  const fs::path& dir = scratch.path;
  const fs::path good = dir / "good.safetensors", bad = dir / "bad.safetensors";
  std::mt19937 rng(3);
  optimizer source(model());
  train(source, 4, rng);
  save_checkpoint(source, good.string());
  const std::string file = read_file(good);
  const auto parts = split(file);
  const nlohmann::json header = parts.first;
  const std::string data = parts.second;

  optimizer target(model());
  train(target, 1, rng);
  const snapshot before(target);
  using edit = std::function<std::string()>;
  auto with_header = [&, h = header, d = data](const std::function<void(nlohmann::json&)>& f) {
    nlohmann::json copy = h;
    f(copy);
    return join(copy, d);
  };
  const std::vector<std::pair<std::string, edit>> cases{
      {"truncated", [&] { return file.substr(0, 4); }},
      {"the header claims", [&] { return file.substr(0, 20); }},
      {"truncated", [&] { return file.substr(0, file.size() - 5); }},
      {"checksum mismatch", [&] { std::string f = file; f[f.size() - 3] ^= 0x40; return f; }},
      {"not valid JSON", [&] { std::string f = file; f[9] = '#'; return f; }},
      {"absurd", [&] { std::string f = file; f[7] = 0x10; return f; }},
      {"version '3' is unknown", [&] { return with_header([](nlohmann::json& h) { h["__metadata__"]["version"] = "3"; }); }},
      {"version '1' is unknown", [&] { return with_header([](nlohmann::json& h) { h["__metadata__"]["version"] = "1"; }); }},
      // Metadata is under the checksum: a valid-looking change of lr or of a count is caught.
      {"checksum mismatch", [&] { return with_header([](nlohmann::json& h) {
         auto g = nlohmann::json::parse(h["__metadata__"]["groups"].get<std::string>());
         g[0]["lr"] = 0.5;
         h["__metadata__"]["groups"] = g.dump();
       }); }},
      {"checksum mismatch", [&] { return with_header([](nlohmann::json& h) { h["__metadata__"]["step"] = "5"; }); }},
      {"checksum mismatch", [&] { return with_header([](nlohmann::json& h) { h["__metadata__"]["skipped_steps"] = "1"; }); }},
      // Counts parse strictly.
      {"'step' = \"3xyz\"", [&] { return with_header([](nlohmann::json& h) { h["__metadata__"]["step"] = "3xyz"; }); }},
      {"'step' = \"0x10\"", [&] { return with_header([](nlohmann::json& h) { h["__metadata__"]["step"] = "0x10"; }); }},
      {"'step' = \" 3\"", [&] { return with_header([](nlohmann::json& h) { h["__metadata__"]["step"] = " 3"; }); }},
      {"'step' = \"3.9\"", [&] { return with_header([](nlohmann::json& h) { h["__metadata__"]["step"] = "3.9"; }); }},
      {"'skipped_steps' = \"-1\"", [&] { return with_header([](nlohmann::json& h) { h["__metadata__"]["skipped_steps"] = "-1"; }); }},
      {"above hostopt::max_step_count", [&] { return with_header([](nlohmann::json& h) { h["__metadata__"]["step"] = "9223372036854775807"; }); }},
      // Bytes that belong to no tensor.
      {"belong to no tensor", [&] { return file + std::string(4096, '\0'); }},
      {"format 'other'", [&] { return with_header([](nlohmann::json& h) { h["__metadata__"]["format"] = "other"; }); }},
      {"no __metadata__", [&] { return with_header([](nlohmann::json& h) { h.erase("__metadata__"); }); }},
      {"'bias.exp_avg' is missing", [&] { return with_header([](nlohmann::json& h) { h.erase("bias.exp_avg"); }); }},
      {"has dtype \"F16\"", [&] { return with_header([](nlohmann::json& h) { h["embed.param"]["dtype"] = "F16"; }); }},
      {"has shape [8,50]", [&] { return with_header([](nlohmann::json& h) { h["embed.param"]["shape"] = {8, 50}; }); }},
      {"outside the", [&] { return with_header([](nlohmann::json& h) { h["bias.param"]["data_offsets"] = {0, 1u << 30}; }); }},
      {"overlap", [&] { return with_header([](nlohmann::json& h) { h["bias.param"]["data_offsets"] = {0, 32}; }); }},
      {"different tensor names", [&] { return with_header([](nlohmann::json& h) { h["extra.param"] = h["bias.param"]; }); }},
      {"beta1 = 1", [&] { return with_header([](nlohmann::json& h) {
         auto g = nlohmann::json::parse(h["__metadata__"]["groups"].get<std::string>());
         g[0]["beta1"] = 1.0;
         h["__metadata__"]["groups"] = g.dump();
       }); }},
      {"another group", [&] { return with_header([](nlohmann::json& h) {
         auto g = nlohmann::json::parse(h["__metadata__"]["tensor_groups"].get<std::string>());
         g["bias"] = 0;
         h["__metadata__"]["tensor_groups"] = g.dump();
       }); }},
  };
  for (const auto& [words, make] : cases) {
    write_file(bad, make());
    INFO("expecting: " << words);
    try {
      load_checkpoint(target, bad.string());
      FAIL("accepted a bad checkpoint");
    } catch (const std::runtime_error& e) {
      INFO("message: " << e.what());
      CHECK_THAT(e.what(), Catch::Contains(words) && Catch::Contains("bad.safetensors"));
    }
    CHECK(snapshot(target) == before);
  }
  // A model with other tensors is refused too.
  optimizer different({{adam_config{}, {{"embed", {50, 8}}}}});
  CHECK_THROWS_WITH(load_checkpoint(different, good.string()),
                    Catch::Contains("different tensor names") || Catch::Contains("a different model"));
  CHECK_THROWS_WITH(load_checkpoint(target, (dir / "missing.safetensors").string()), Catch::Contains("cannot open"));
}

TEST_CASE("saves replace only regular files, links, fifos, devices and directories are refused", "[checkpoint][files]") {
  const hostopt_test::temp_dir scratch("ckpt_test");
  const fs::path& dir = scratch.path;
  optimizer opt(model());
  std::mt19937 rng(4);
  train(opt, 1, rng);
  // A fifo stays a fifo.
  const fs::path fifo = dir / "fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK_THROWS_WITH(save_checkpoint(opt, fifo.string()), Catch::Contains("not a regular file"));
  CHECK(fs::is_fifo(fs::symlink_status(fifo)));
  // A symbolic link is neither replaced nor written through.
  const fs::path target = dir / "target.safetensors", link = dir / "link.safetensors";
  write_file(target, "precious");
  fs::create_symlink(target, link);
  CHECK_THROWS_WITH(save_checkpoint(opt, link.string()), Catch::Contains("symbolic link"));
  CHECK(fs::is_symlink(fs::symlink_status(link)));
  CHECK(read_file(target) == "precious");
  // A directory.
  fs::create_directories(dir / "sub");
  CHECK_THROWS_WITH(save_checkpoint(opt, (dir / "sub").string()), Catch::Contains("not a regular file"));
  CHECK(fs::is_directory(dir / "sub"));
  // A character device (made here, never a real /dev node; needs root to make).
  const fs::path dev = dir / "null_device";
  if (::mknod(dev.c_str(), S_IFCHR | 0600, makedev(1, 3)) == 0) {
    CHECK_THROWS_WITH(save_checkpoint(opt, dev.string()), Catch::Contains("not a regular file"));
    CHECK(fs::is_character_file(fs::symlink_status(dev)));
    optimizer other(model());
    CHECK_THROWS_WITH(load_checkpoint(other, dev.string()), Catch::Contains("not a regular file"));
  }
  // Nothing was left behind by the refused saves.
  for (auto it = fs::directory_iterator(dir); it != fs::directory_iterator(); ++it)
    CHECK(it->path().filename().string().find("hostopt-tmp") == std::string::npos);
}

TEST_CASE("loading from a fifo is refused at once instead of blocking", "[checkpoint][files]") {
  const hostopt_test::temp_dir scratch("ckpt_test");
  const fs::path& dir = scratch.path;
  const fs::path fifo = dir / "fifo.safetensors";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  optimizer opt(model());
  // No writer ever opens the fifo: a load that opened it blocking would never return (the
  // suite's timeout then fails it). No clock is read here: a busy machine cannot fail it.
  CHECK_THROWS_WITH(load_checkpoint(opt, fifo.string()), Catch::Contains("not a regular file"));
}

TEST_CASE("temp files are unique per save, and a dead writer's are removed by the next save", "[checkpoint][files]") {
  const hostopt_test::temp_dir scratch("ckpt_test");
  const fs::path& dir = scratch.path;
  const fs::path path = dir / "state.safetensors";
  optimizer opt(model());
  std::mt19937 rng(5);
  train(opt, 2, rng);
  // Leftovers of a writer killed mid-save (nobody holds their lock) — one named with this
  // very pid, as a restarted process that reuses a pid would see — and one a live writer
  // is still writing (it holds the lock).
  const fs::path stale = dir / ("state.safetensors.hostopt-tmp." + std::to_string(::getpid()) + ".0000000000000000");
  const fs::path other = dir / "state.safetensors.hostopt-tmp.1.00000000000000ff";
  const fs::path alive = dir / "state.safetensors.hostopt-tmp.2.0000000000000001";
  for (const auto& p : {stale, other, alive}) write_file(p, std::string(1000, 'x'));
  const int held = ::open(alive.c_str(), O_RDONLY);
  REQUIRE(held >= 0);
  REQUIRE(::flock(held, LOCK_EX) == 0);
  save_checkpoint(opt, path.string());
  CHECK_FALSE(fs::exists(stale));
  CHECK_FALSE(fs::exists(other));
  CHECK(fs::exists(alive)); // its writer still holds it
  ::close(held);
  fs::remove(alive);
  // Two threads saving to one path both succeed; the file is one of them, whole.
  std::vector<std::string> errors(2);
  auto saver = [&](int i) {
    try {
      for (int k = 0; k < 20; ++k) save_checkpoint(opt, path.string());
    } catch (const std::exception& e) {
      errors[i] = e.what();
    }
  };
  std::thread a(saver, 0), b(saver, 1);
  a.join();
  b.join();
  CHECK(errors[0].empty());
  CHECK(errors[1].empty());
  optimizer loaded(model());
  load_checkpoint(loaded, path.string());
  CHECK(snapshot(loaded) == snapshot(opt));
  std::size_t files = 0;
  for (auto it = fs::directory_iterator(dir); it != fs::directory_iterator(); ++it) ++files;
  CHECK(files == 1);
}

TEST_CASE("paths with a NUL byte are refused, not truncated", "[checkpoint][files]") {
  const hostopt_test::temp_dir scratch("ckpt_test");
  const fs::path& dir = scratch.path;
  optimizer opt(model());
  const std::string with_nul = (dir / "a.safetensors").string() + std::string("\0.bak", 5);
  CHECK_THROWS_WITH(save_checkpoint(opt, with_nul), Catch::Contains("NUL"));
  CHECK_FALSE(fs::exists(dir / "a.safetensors"));
  CHECK_THROWS_WITH(load_checkpoint(opt, with_nul), Catch::Contains("NUL"));
  CHECK_THROWS_AS(save_checkpoint(opt, ""), std::invalid_argument);
}

TEST_CASE("loading needs no second copy of the state and refuses trailing bytes", "[checkpoint]") {
  const hostopt_test::temp_dir scratch("ckpt_test");
  const fs::path& dir = scratch.path;
  const fs::path path = dir / "big.safetensors";
  // 8M parameters: 96 MiB of state. A load that staged the whole data section would add
  // 96 MiB to the peak; the streaming load adds a few MiB of buffers.
  optimizer opt({{adam_config{}, {{"w", {8 << 20}}}}}, {2, ""});
  std::mt19937 rng(6);
  const auto g = ref::random_grad(dtype::f32, opt.arena_size(), rng);
  opt.step(g.view());
  save_checkpoint(opt, path.string());
  optimizer target({{adam_config{}, {{"w", {8 << 20}}}}}, {2, ""});
  auto peak_rss_kb = [] {
    std::ifstream f("/proc/self/status");
    std::string line;
    while (std::getline(f, line))
      if (line.rfind("VmHWM:", 0) == 0) return std::stol(line.substr(6));
    return 0L;
  };
  { // reset the high-water mark to now (Linux >= 4.0); without that the check means nothing
    std::ofstream clear("/proc/self/clear_refs");
    clear << "5";
    clear.flush();
    if (!clear) {
      WARN("cannot reset the RSS high-water mark (/proc/self/clear_refs): peak not measured");
      return;
    }
  }
  const long before = peak_rss_kb();
  load_checkpoint(target, path.string());
  const long grown_mib = (peak_rss_kb() - before) / 1024;
  INFO("peak RSS grew by " << grown_mib << " MiB while loading 96 MiB of state");
  CHECK(grown_mib < 48);
  CHECK(std::memcmp(target.params().data(), opt.params().data(), opt.arena_size() * 4) == 0);
  // Appended bytes (zeros, as a botched copy leaves) are refused; the state stays.
  { std::ofstream f(path, std::ios::binary | std::ios::app); f << std::string(1 << 20, '\0'); }
  optimizer fresh({{adam_config{}, {{"w", {8 << 20}}}}});
  CHECK_THROWS_WITH(load_checkpoint(fresh, path.string()), Catch::Contains("belong to no tensor"));
  CHECK(fresh.step_count() == 0);
}

TEST_CASE("many tensors, empty ones among them, save and load exactly", "[checkpoint]") {
  // Empty tensors share their data offset with the next one: the overlap check must not
  // mistake them for an overlap (an unstable sort did, with six or more tensors).
  const hostopt_test::temp_dir scratch("ckpt_test");
  const fs::path& dir = scratch.path;
  std::vector<tensor_spec> tensors;
  for (int i = 0; i < 24; ++i) tensors.push_back({"t" + std::to_string(i), {i % 3 == 0 ? 0 : i}});
  const std::vector<param_group> groups{{adam_config{}, tensors}};
  optimizer opt(groups), loaded(groups);
  std::mt19937 rng(7);
  train(opt, 2, rng);
  save_checkpoint(opt, (dir / "many.safetensors").string());
  load_checkpoint(loaded, (dir / "many.safetensors").string());
  CHECK(snapshot(loaded) == snapshot(opt));
}

namespace {

// The checkpoint checksum (checkpoint.hpp's format: 8-byte words mixed by multiply and
// rotate over the length, the header with its checksum digits read as zeros, and the
// data), so a test can craft a file that only the loader's own checks can refuse.
std::uint64_t file_checksum(const std::string& header_text, const std::string& data) {
  std::string all(8, '\0');
  for (int i = 0; i < 8; ++i) all[i] = char((std::uint64_t(header_text.size()) >> (8 * i)) & 0xFF);
  all += header_text + data;
  std::uint64_t h = 0x9E3779B97F4A7C15ull;
  std::size_t i = 0;
  for (; i + 8 <= all.size(); i += 8) {
    std::uint64_t w;
    std::memcpy(&w, all.data() + i, 8);
    h = (h ^ w) * 0x100000001B3ull;
    h = (h << 31) | (h >> 33);
  }
  unsigned char last[8] = {};
  std::memcpy(last, all.data() + i, all.size() - i);
  std::uint64_t w;
  std::memcpy(&w, last, 8);
  std::uint64_t x = h ^ (w + all.size());
  x ^= x >> 33;
  x *= 0xFF51AFD7ED558CCDull;
  x ^= x >> 33;
  return x;
}

// A file of this header text (padded, its checksum re-stamped) and data.
std::string stamped(std::string text, const std::string& data) {
  text.append((8 - text.size() % 8) % 8, ' ');
  const std::string key = "\"checksum\":\"";
  const std::size_t at = text.find(key) + key.size();
  REQUIRE(at != std::string::npos + key.size());
  text.replace(at, 16, "0000000000000000");
  char digits[17];
  std::snprintf(digits, sizeof digits, "%016llx", (unsigned long long)file_checksum(text, data));
  text.replace(at, 16, digits);
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = char((text.size() >> (8 * i)) & 0xFF);
  return out + text + data;
}

std::string header_text(const std::string& file) {
  std::uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= std::uint64_t(static_cast<unsigned char>(file[i])) << (8 * i);
  return file.substr(8, n);
}

std::string replaced(std::string text, const std::string& from, const std::string& to) {
  const std::size_t at = text.find(from);
  REQUIRE(at != std::string::npos);
  return text.replace(at, from.size(), to);
}

// Rewrites checkpoint `path` with element `index` of entry `entry` (values of `width`
// bytes) set to `bits`, checksum restamped: the crafted file a buggy writer would make
// (save_checkpoint itself refuses a negative second moment).
void write_value(const std::string& path, const std::string& entry, std::size_t index, std::uint32_t bits,
                 unsigned width) {
  const std::string file = read_file(path);
  const std::string text = header_text(file);
  std::string data = file.substr(8 + text.size());
  const auto header = nlohmann::json::parse(text);
  const std::uint64_t at = header[entry]["data_offsets"][0].get<std::uint64_t>() + index * width;
  REQUIRE(at + width <= header[entry]["data_offsets"][1].get<std::uint64_t>());
  std::memcpy(data.data() + at, &bits, width);
  write_file(path, stamped(text, data));
}
std::uint32_t bits_of(float x) {
  std::uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

} // namespace

TEST_CASE("a file with a valid checksum and a negative exp_avg_sq is refused, naming tensor and index, "
          "what a step writes (NaN, inf) loads",
          "[checkpoint][errors]") {
  const hostopt_test::temp_dir scratch("ckpt_test");
  const fs::path& dir = scratch.path;
  const std::string path = (dir / "v.safetensors").string();
  std::mt19937 rng(11);
  optimizer source(model());
  train(source, 2, rng);
  optimizer target(model());
  train(target, 1, rng);
  const snapshot before(target);
  for (const float bad : {-1.0f, -1e-30f, -std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::denorm_min()}) {
    INFO("exp_avg_sq = " << bad);
    for (const auto& [name, at] : {std::pair<const char*, std::size_t>{"embed", 7}, {"embed", 399}, {"scalar", 0},
                                   {"bias", 5}}) {
      save_checkpoint(source, path);
      write_value(path, std::string(name) + ".exp_avg_sq", at, bits_of(bad), 4); // only the value check can refuse it
      try {
        load_checkpoint(target, path);
        FAIL("accepted a negative exp_avg_sq");
      } catch (const std::runtime_error& e) {
        CHECK_THAT(e.what(), Catch::Contains(std::string("tensor '") + name + "' exp_avg_sq[" + std::to_string(at) + "]") &&
                                 Catch::Contains("never negative") && Catch::Contains("v.safetensors"));
      }
      CHECK(snapshot(target) == before);
    }
  }
  // What steps can write loads: +inf (a huge finite gradient, unchecked), NaN (a NaN
  // gradient, unchecked), and -0.0 (zero in every use; views and write_moments take it).
  std::vector<float> g(source.arena_size(), 0.5f);
  g[source.tensor("embed").offset + 3] = 1e20f;
  g[source.tensor("bias").offset + 2] = std::numeric_limits<float>::quiet_NaN();
  source.step({g.data(), g.size(), dtype::f32}, {}, ref::trusting());
  CHECK(std::isinf(source.exp_avg_sq("embed")[3]));
  CHECK(std::isnan(source.exp_avg_sq("bias")[2]));
  source.exp_avg_sq("embed")[9] = -0.0f;
  save_checkpoint(source, path);
  load_checkpoint(target, path);
  CHECK(std::memcmp(target.exp_avg_sq().data(), source.exp_avg_sq().data(), source.arena_size() * 4) == 0);
}

TEST_CASE("a negative bf16 exp_avg_sq code is refused too, and a value cut by the loader's read blocks is read whole",
          "[checkpoint][errors]") {
  const hostopt_test::temp_dir scratch("ckpt_test");
  const fs::path& dir = scratch.path;
  const std::string path = (dir / "v16.safetensors").string();
  // An 8-bit tensor of 33 elements first (202 bytes: the entries after it are 2 mod 4), then
  // a bf16 group and an f32 group large enough that the loader reads the data in blocks.
  adam_config c;
  std::vector<param_group> groups{{c, {{"q", {33}}}, moment_format::q8, 1},
                                  {c, {{"h", {1000}}}, moment_format::bf16, 2},
                                  {c, {{"f", {800000}}}}};
  optimizer source(groups, {1, ""});
  std::mt19937 rng(12);
  train(source, 2, rng);
  optimizer target(groups, {1, ""});
  const std::vector<float> params_before(target.params().begin(), target.params().end());
  auto refused = [&](const std::string& message) {
    try {
      load_checkpoint(target, path);
      FAIL("accepted a negative exp_avg_sq");
    } catch (const std::runtime_error& e) {
      CHECK_THAT(e.what(), Catch::Contains(message) && Catch::Contains("never negative"));
    }
    CHECK(target.step_count() == 0);
    CHECK(std::equal(params_before.begin(), params_before.end(), target.params().begin()));
    std::vector<float> m(1000), v(1000);
    target.read_moments("h", m, v);
    CHECK(std::all_of(v.begin(), v.end(), [](float x) { return x == 0.0f; }));
  };
  auto* h = static_cast<std::uint16_t*>(source.moment_codes("h").exp_avg_sq);
  for (const std::uint16_t bits : {std::uint16_t(0xBF80) /* -1 */, std::uint16_t(0x8001) /* -tiny */,
                                   std::uint16_t(0xFF80) /* -inf */}) {
    INFO("bf16 bits " << bits);
    save_checkpoint(source, path);
    write_value(path, "h.exp_avg_sq", 999, bits, 2);
    refused("tensor 'h' exp_avg_sq[999]");
  }
  // NaN bits (of either sign: x86 writes 0xFFC0) and -0.0 are loaded.
  for (const std::uint16_t bits : {std::uint16_t(0xFFC0), std::uint16_t(0x7FC0), std::uint16_t(0x8000)}) {
    const std::uint16_t was = h[4];
    h[4] = bits;
    save_checkpoint(source, path);
    h[4] = was;
    optimizer takes(groups, {1, ""});
    load_checkpoint(takes, path);
    CHECK(static_cast<std::uint16_t*>(takes.moment_codes("h").exp_avg_sq)[4] == bits);
  }
  // An f32 value whose 4 bytes straddle a 4 MiB boundary of the data section (the size of
  // the loader's read blocks): found and named like any other.
  save_checkpoint(source, path);
  const auto header = nlohmann::json::parse(header_text(read_file(path)));
  const std::uint64_t begin = header["f.exp_avg_sq"]["data_offsets"][0].get<std::uint64_t>();
  REQUIRE(begin % 4 != 0); // the layout above: every value of f's exp_avg_sq sits 2 bytes off the word grid
  const std::uint64_t boundary = (begin / (std::uint64_t(4) << 20) + 1) * (std::uint64_t(4) << 20);
  const std::size_t cut = std::size_t((boundary - begin) / 4); // its bytes 0-1 before the boundary, 2-3 after
  REQUIRE(cut < 800000);
  for (const std::size_t at : {cut, cut - 1, cut + 1, std::size_t(799999)}) {
    INFO("f element " << at);
    save_checkpoint(source, path);
    write_value(path, "f.exp_avg_sq", at, bits_of(-2.0f), 4);
    refused("tensor 'f' exp_avg_sq[" + std::to_string(at) + "] = -2");
  }
}

TEST_CASE("hostopt never writes a file it would refuse: a negative exp_avg_sq from a view is refused by save "
          "(naming tensor and index, nothing written), and by write_moments for f32 as for bf16",
          "[checkpoint][errors]") {
  const hostopt_test::temp_dir scratch("ckpt_test");
  const fs::path& dir = scratch.path;
  const fs::path path = dir / "own.safetensors";
  adam_config c;
  std::vector<param_group> groups{{c, {{"w", {4, 3}}}}, {c, {{"b", {40}}}, moment_format::bf16, 2}};
  optimizer opt(groups, {1, ""});
  std::mt19937 rng(21);
  train(opt, 2, rng);
  save_checkpoint(opt, path.string());
  const std::string saved = read_file(path);
  auto refused = [&](const std::string& words) {
    try {
      save_checkpoint(opt, path.string());
      FAIL("saved a negative exp_avg_sq");
    } catch (const std::invalid_argument& e) {
      CHECK_THAT(e.what(), Catch::Contains(words) && Catch::Contains("never negative") &&
                               Catch::Contains("nothing saved") && Catch::Contains("own.safetensors"));
    }
    CHECK(read_file(path) == saved); // the earlier save stays, untouched
    std::size_t files = 0;
    for (const auto& e : fs::directory_iterator(dir)) files += e.is_regular_file();
    CHECK(files == 1); // no temporary file left
  };
  // Through the f32 view.
  const float was = opt.exp_avg_sq("w")[7];
  opt.exp_avg_sq("w")[7] = -1.0f;
  refused("tensor 'w' exp_avg_sq[7] = -1");
  opt.exp_avg_sq("w")[7] = was;
  // Through the bf16 codes.
  auto* h = static_cast<std::uint16_t*>(opt.moment_codes("b").exp_avg_sq);
  const std::uint16_t code = h[39];
  h[39] = 0xBF80; // -1
  refused("tensor 'b' exp_avg_sq[39] = -1");
  h[39] = code;
  save_checkpoint(opt, path.string());
  optimizer back(groups, {1, ""});
  load_checkpoint(back, path.string());
  // write_moments: f32 refuses a negative v as the bf16 encoder does, changing nothing.
  for (const char* name : {"w", "b"}) {
    INFO(name);
    const std::size_t n = opt.tensor(name).size;
    std::vector<float> m0(n), v0(n), m1(n), v1(n);
    opt.read_moments(name, m0, v0);
    std::vector<float> m(n, 0.25f), v(n, 1.0f);
    v[n - 1] = -1.0f;
    CHECK_THROWS_WITH(opt.write_moments(name, m, v), Catch::Contains("exp_avg_sq[" + std::to_string(n - 1) + "]") &&
                                                         Catch::Contains("never negative"));
    opt.read_moments(name, m1, v1);
    CHECK(m1 == m0);
    CHECK(v1 == v0);
  }
}

TEST_CASE("a key twice in a header object (last wins in a JSON reader) is refused, checksum valid or not",
          "[checkpoint][errors]") {
  const hostopt_test::temp_dir scratch("ckpt_test");
  const fs::path& dir = scratch.path;
  const fs::path good = dir / "good.safetensors", bad = dir / "dup.safetensors";
  std::mt19937 rng(13);
  optimizer source(model());
  train(source, 4, rng);
  save_checkpoint(source, good.string());
  const std::string file = read_file(good);
  const std::string text = header_text(file), data = file.substr(8 + text.size());
  REQUIRE(stamped(text, data) == file); // the test's checksum is the file's

  optimizer target(model());
  train(target, 1, rng);
  const snapshot before(target);
  auto groups_with = [&](const std::string& from, const std::string& to) {
    // The groups list is a JSON string inside the header: edited as the string it is.
    auto h = nlohmann::json::parse(text);
    h["__metadata__"]["groups"] = replaced(h["__metadata__"]["groups"].get<std::string>(), from, to);
    return h.dump();
  };
  const std::vector<std::pair<std::string, std::string>> cases{
      {"the key 'step' twice in '__metadata__'", replaced(text, "\"step\":\"4\"", "\"step\":\"4\",\"step\":\"1\"")},
      {"the key 'step' twice in '__metadata__'", replaced(text, "\"step\":\"4\"", "\"step\":\"1\",\"step\":\"4\"")},
      {"the key 'skipped_steps' twice", replaced(text, "\"skipped_steps\":\"0\"", "\"skipped_steps\":\"0\",\"skipped_steps\":\"2\"")},
      {"the key 'bias.param' twice", replaced(text, "\"bias.param\":", "\"bias.param\":{},\"bias.param\":")},
      {"the key 'dtype' twice in 'embed.param'", [&] { // within one tensor's entry
         const std::size_t at = text.find("\"dtype\"", text.find("\"embed.param\":"));
         return std::string(text).insert(at, "\"dtype\":\"F16\",");
       }()},
      {"__metadata__ 'groups' holds the key 'lr' twice", groups_with("\"lr\":", "\"lr\":0.5,\"lr\":")},
      {"the key '' twice in '__metadata__'", replaced(text, "\"step\":\"4\"", "\"\":\"1\",\"\":\"2\",\"step\":\"4\"")},
      {"the key '' twice", replaced(text, "\"bias.param\":", "\"\":{},\"\":{},\"bias.param\":")},
  };
  for (const auto& [words, header] : cases) {
    INFO("expecting: " << words);
    write_file(bad, stamped(header, data));
    try {
      load_checkpoint(target, bad.string());
      FAIL("accepted a header with a duplicated key");
    } catch (const std::runtime_error& e) {
      CHECK_THAT(e.what(), Catch::Contains(words) && Catch::Contains("dup.safetensors"));
    }
    CHECK(snapshot(target) == before);
  }
}
