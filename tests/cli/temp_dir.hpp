// A scratch directory for a test, removed with its contents afterwards.
#pragma once

#include <stdlib.h>

#include <cstdlib>
#include <string>

namespace tierflow::testing {

// A fresh directory under `parent`, removed with its contents on destruction.
class temp_dir {
 public:
  explicit temp_dir(const std::string& parent = "/tmp") {
    std::string tmpl = parent + "/tierflow-test-XXXXXX";
    if (::mkdtemp(tmpl.data()) != nullptr) path_ = tmpl;
  }
  ~temp_dir() {
    if (!path_.empty()) std::system(("rm -rf '" + path_ + "'").c_str());
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
  const std::string& path() const { return path_; }
  bool ok() const { return !path_.empty(); }

 private:
  std::string path_;
};

}  // namespace tierflow::testing
