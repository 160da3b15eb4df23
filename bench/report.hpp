#pragma once
// Results as rows of named columns, printed as an aligned table (people), JSON or CSV
// (machines). The JSON also carries the run's context (kernel, threads runtime, CPU).

#include <iosfwd>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace bench {

enum class output_format { table, json, csv };

class report {
public:
  explicit report(std::string title) : title_(std::move(title)) {}
  /// Context shown above the table and under "context" in JSON.
  void set_context(const std::string& key, nlohmann::ordered_json value) { context_[key] = std::move(value); }
  /// A row; the first row's keys fix the columns. Numbers are printed with `digits`
  /// significant decimals in the table.
  void add_row(nlohmann::ordered_json row) { rows_.push_back(std::move(row)); }
  /// A sentence under the table (a verdict, a ratio, a caveat).
  void add_note(std::string note) { notes_.push_back(std::move(note)); }
  const std::vector<nlohmann::ordered_json>& rows() const { return rows_; }
  void print(std::ostream& os, output_format f) const;

private:
  std::string title_;
  nlohmann::ordered_json context_ = nlohmann::ordered_json::object();
  std::vector<nlohmann::ordered_json> rows_;
  std::vector<std::string> notes_;
};

/// Machine facts for the context: CPU model, hardware threads, memory.
void add_machine_context(report& r);

} // namespace bench
