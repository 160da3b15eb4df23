// Per-stage busy time, overlap, and the Chrome trace export of a pipeline timeline.
#include <algorithm>
#include <cstdio>
#include <string>

#include "hostopt/offload_pipeline.hpp"

namespace hostopt {

double pipeline_timeline::busy_seconds(pipeline_stage s) const {
  std::int64_t ns = 0;
  for (const auto& span : spans)
    if (span.stage == s) ns += span.end_ns - span.start_ns;
  return double(ns) * 1e-9;
}

double pipeline_timeline::wall_over_slowest_stage() const {
  double slowest = 0;
  for (auto s : {pipeline_stage::copy_in, pipeline_stage::update, pipeline_stage::copy_out, pipeline_stage::accumulate})
    slowest = std::max(slowest, busy_seconds(s));
  return slowest > 0 ? wall_seconds() / slowest : 0.0;
}

std::string pipeline_timeline::chrome_trace_json() const {
  // Complete events ("ph":"X") in microseconds from the operation's start; one track
  // (tid) per stage, named by metadata events.
  std::string out = "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[";
  char buf[256];
  bool first = true;
  auto add = [&](const char* text) {
    if (!first) out += ",";
    first = false;
    out += text;
  };
  for (int s = 0; s < 4; ++s) {
    std::snprintf(buf, sizeof buf,
                  "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":1,\"tid\":%d,\"args\":{\"name\":\"%s\"}}", s,
                  stage_name(pipeline_stage(s)));
    add(buf);
  }
  for (const auto& span : spans) {
    std::snprintf(buf, sizeof buf,
                  "{\"name\":\"%s %zu\",\"cat\":\"%s\",\"ph\":\"X\",\"pid\":1,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f,"
                  "\"args\":{\"chunk\":%zu}}",
                  stage_name(span.stage), span.chunk, stage_name(span.stage), int(span.stage),
                  double(span.start_ns - start_ns) * 1e-3, double(span.end_ns - span.start_ns) * 1e-3, span.chunk);
    add(buf);
  }
  out += "]}";
  return out;
}

} // namespace hostopt
