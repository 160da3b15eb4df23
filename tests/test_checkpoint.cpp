// Checkpoints: exact resume, atomic replacement, and refusal of every kind of bad file
// with the optimizer left untouched.
#include <catch2/catch.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "reference.hpp"

using namespace hostopt;
namespace fs = std::filesystem;

namespace {

fs::path scratch_dir() {
  const fs::path d = fs::temp_directory_path() / ("hostopt_ckpt_test_" + std::to_string(::getpid()));
  fs::create_directories(d);
  return d;
}

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
  const fs::path dir = scratch_dir();
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
  fs::remove_all(dir);
}

TEST_CASE("the file is standard safetensors, replaced atomically", "[checkpoint]") {
  const fs::path dir = scratch_dir();
  const fs::path path = dir / "state.safetensors";
  std::mt19937 rng(2);
  optimizer opt(model());
  train(opt, 2, rng);
  save_checkpoint(opt, path.string());
  const auto [header, data] = split(read_file(path));
  CHECK(header["__metadata__"]["format"] == "hostopt");
  CHECK(header["__metadata__"]["version"] == "1");
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
  std::size_t files = 0;
  for (auto it = fs::directory_iterator(dir); it != fs::directory_iterator(); ++it) ++files;
  CHECK(files == 1);
  // A failed save leaves the previous checkpoint intact.
  CHECK_THROWS_WITH(save_checkpoint(opt, (dir / "no_such_dir" / "x.safetensors").string()),
                    Catch::Contains("no_such_dir") && Catch::Contains("No such file"));
  CHECK(split(read_file(path)).first["__metadata__"]["step"] == "3");
  fs::remove_all(dir);
}

TEST_CASE("bad checkpoints are refused with a message naming the problem; nothing changes", "[checkpoint][errors]") {
  const fs::path dir = scratch_dir();
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
      {"version '2' is unknown", [&] { return with_header([](nlohmann::json& h) { h["__metadata__"]["version"] = "2"; }); }},
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
  CHECK_THROWS_WITH(load_checkpoint(different, good.string()), Catch::Contains("different tensor names"));
  CHECK_THROWS_WITH(load_checkpoint(target, (dir / "missing.safetensors").string()), Catch::Contains("cannot open"));
  fs::remove_all(dir);
}
