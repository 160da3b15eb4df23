#include "report.hpp"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <ostream>

#include "bench_common.hpp"
#include "hostopt/kernels.hpp"
#include "hostopt/version.hpp"
#include "parallel.hpp"

namespace bench {

namespace {

std::string cell(const nlohmann::ordered_json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_number_float()) {
    const double x = v.get<double>();
    char buf[32];
    if (x != 0 && (std::abs(x) >= 1e5 || std::abs(x) < 1e-3)) std::snprintf(buf, sizeof buf, "%.3g", x);
    else if (std::abs(x) >= 100) std::snprintf(buf, sizeof buf, "%.0f", x);
    else if (std::abs(x) >= 10) std::snprintf(buf, sizeof buf, "%.1f", x);
    else std::snprintf(buf, sizeof buf, "%.3f", x);
    return buf;
  }
  if (v.is_null()) return "-";
  return v.dump();
}

std::string csv_cell(const nlohmann::ordered_json& v) {
  if (v.is_string()) {
    std::string s = v.get<std::string>();
    if (s.find_first_of(",\"\n") == std::string::npos) return s;
    std::string q = "\"";
    for (char c : s) q += c == '"' ? std::string("\"\"") : std::string(1, c);
    return q + "\"";
  }
  if (v.is_null()) return "";
  return v.dump();
}

} // namespace

void report::print(std::ostream& os, output_format f) const {
  if (f == output_format::json) {
    nlohmann::ordered_json j;
    j["benchmark"] = title_;
    j["context"] = context_;
    j["results"] = rows_;
    j["notes"] = notes_;
    os << j.dump(2) << "\n";
    return;
  }
  std::vector<std::string> cols;
  if (!rows_.empty())
    for (auto it = rows_.front().begin(); it != rows_.front().end(); ++it) cols.push_back(it.key());
  if (f == output_format::csv) {
    for (std::size_t c = 0; c < cols.size(); ++c) os << (c ? "," : "") << cols[c];
    os << "\n";
    for (const auto& r : rows_) {
      for (std::size_t c = 0; c < cols.size(); ++c) os << (c ? "," : "") << (r.contains(cols[c]) ? csv_cell(r[cols[c]]) : "");
      os << "\n";
    }
    return;
  }
  os << "hostopt-bench " << title_ << "\n";
  for (auto it = context_.begin(); it != context_.end(); ++it) os << "  " << it.key() << ": " << cell(it.value()) << "\n";
  os << "\n";
  std::vector<std::size_t> width(cols.size());
  std::vector<std::vector<std::string>> cells;
  for (std::size_t c = 0; c < cols.size(); ++c) width[c] = cols[c].size();
  for (const auto& r : rows_) {
    std::vector<std::string> line;
    for (std::size_t c = 0; c < cols.size(); ++c) {
      line.push_back(r.contains(cols[c]) ? cell(r[cols[c]]) : "");
      width[c] = std::max(width[c], line.back().size());
    }
    cells.push_back(std::move(line));
  }
  auto emit = [&](const std::vector<std::string>& line) {
    for (std::size_t c = 0; c < line.size(); ++c) {
      const std::string pad(width[c] - line[c].size(), ' ');
      os << (c ? "  " : "") << (c == 0 ? line[c] + pad : pad + line[c]);
    }
    os << "\n";
  };
  emit(cols);
  std::vector<std::string> rule;
  for (std::size_t c = 0; c < cols.size(); ++c) rule.push_back(std::string(width[c], '-'));
  emit(rule);
  for (const auto& line : cells) emit(line);
  if (!notes_.empty()) os << "\n";
  for (const auto& n : notes_) os << n << "\n";
}

void add_machine_context(report& r) {
  std::ifstream in("/proc/cpuinfo");
  std::string line, model;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) {
      model = line.substr(line.find(':') + 2);
      break;
    }
  r.set_context("hostopt", hostopt::library_version());
  r.set_context("cpu", model.empty() ? "unknown" : model);
  r.set_context("hardware threads", hardware_threads());
  r.set_context("threading", hostopt::detail::threading_backend());
  r.set_context("memory available GiB", double(available_memory_bytes()) / (1 << 30));
}

} // namespace bench
