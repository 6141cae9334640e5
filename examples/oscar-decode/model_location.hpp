// Where oscar-decode, and the tests that run its model, find the default model file:
// $OSCAR_MODEL, else ${OSCAR_MODEL_DIR:-$HOME/.cache/oscar}/SmolLM2-135M-Instruct.Q4_1.gguf,
// which is where scripts/fetch-model.sh puts it.
#pragma once

#include <cstdlib>
#include <string>

namespace oscar::decode {

inline constexpr const char* kDefaultModelName = "SmolLM2-135M-Instruct.Q4_1.gguf";

inline std::string default_model_path() {
  if (const char* m = std::getenv("OSCAR_MODEL"); m && *m) return m;
  std::string dir;
  if (const char* d = std::getenv("OSCAR_MODEL_DIR"); d && *d) {
    dir = d;
  } else {
    const char* home = std::getenv("HOME");
    dir = std::string(home ? home : ".") + "/.cache/oscar";
  }
  return dir + "/" + kDefaultModelName;
}

}  // namespace oscar::decode
