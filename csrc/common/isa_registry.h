// Which build of an op's vector kernels runs: each op compiles its loops for AVX-512, AVX2,
// NEON and the baseline, and keeps one `Registry` of the builds this CPU can run, best first.
// The active build is the best one, or the one named by the op's environment variable; `set`
// switches at run time (the tests run every build the machine supports). cpu_adam and the
// quantizer share this; each says which CPU features its builds need (`usable`), since
// `__builtin_cpu_supports` takes only literal feature names.

#pragma once

#include <c10/util/Exception.h>

#include <cstdlib>
#include <string>
#include <vector>

namespace ds_isa {

// `Kernels` is an op's table of function pointers with a `const char* name`.
template <class Kernels>
class Registry {
 public:
  Registry(const char* op, const std::vector<Kernels>& candidates, bool (*usable)(const Kernels&),
           const char* env_var)
      : op_(op) {
    for (const Kernels& k : candidates) {
      if (usable(k)) kernels_.push_back(k);
    }
    TORCH_CHECK(!kernels_.empty(), op_, ": no kernel build runs on this CPU");
    const char* env = std::getenv(env_var);
    active_ = &find(env != nullptr && *env != '\0' ? std::string(env) : std::string(kernels_.front().name));
  }

  const Kernels& active() const { return *active_; }

  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const Kernels& k : kernels_) out.emplace_back(k.name);
    return out;
  }

  const Kernels& find(const std::string& name) const {
    for (const Kernels& k : kernels_) {
      if (name == k.name) return k;
    }
    std::string names;
    for (const Kernels& k : kernels_) names += std::string(names.empty() ? "" : ", ") + k.name;
    TORCH_CHECK(false, op_, ": instruction set '", name, "' is not available on this CPU; choose one of: ", names);
    return kernels_.front();  // not reached
  }

  // Makes `name` the active build; returns the previous one's name.
  std::string set(const std::string& name) {
    const std::string previous = active_->name;
    active_ = &find(name);
    return previous;
  }

 private:
  const char* op_;
  std::vector<Kernels> kernels_;
  const Kernels* active_ = nullptr;
};

}  // namespace ds_isa
