// Runs a command line through the shell for the command-line tests, its stdout and stderr
// captured through files in a scratch folder (the caller's, created beforehand).
#pragma once

#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace oscar::testing {

struct CommandResult {
  int code;  // the exit status, or -1 where the command did not exit normally
  std::string out, err;
};

inline CommandResult run_command(const std::string& command_line, const std::filesystem::path& scratch_dir) {
  const std::string out = (scratch_dir / "stdout").string(), err = (scratch_dir / "stderr").string();
  const int status = std::system((command_line + " >" + out + " 2>" + err).c_str());
  auto slurp = [](const std::string& path) {
    std::ifstream f(path);
    std::stringstream s;
    s << f.rdbuf();
    return s.str();
  };
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp(out), slurp(err)};
}

}  // namespace oscar::testing
