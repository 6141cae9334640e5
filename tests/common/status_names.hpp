// Whether a refusal names its problem: the Status is an error whose message contains `text`
// (printed when it does not, so a changed message is easy to read in the failure).
#pragma once

#include <doctest/doctest.h>

#include <string>

#include "oscar/core/status.hpp"

namespace oscar::testing {

inline bool names(const Status& s, const std::string& text) {
  if (s.ok()) return false;
  if (s.message().find(text) == std::string::npos) {
    MESSAGE("message: " << s.message());
    return false;
  }
  return true;
}

}  // namespace oscar::testing
