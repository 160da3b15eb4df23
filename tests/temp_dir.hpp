#pragma once
// A directory of the test's own under the system's temporary directory (on a drive with
// O_DIRECT where the tests need one: TMPDIR names another), removed with the object. Each
// object has its own: the process id and a count keep two alive at once apart.
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <string>

namespace hostopt_test {

class temp_dir {
public:
  explicit temp_dir(const std::string& what = "test") {
    static std::atomic<int> made{0};
    path = std::filesystem::temp_directory_path() /
           ("hostopt_" + what + "_" + std::to_string(::getpid()) + "_" + std::to_string(made++));
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~temp_dir() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
  std::string str() const { return path.string(); }

  std::filesystem::path path;
};

} // namespace hostopt_test
