// Helpers shared by the CPU tests: open descriptors, environment overrides, thread groups and
// child processes with captured output.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "mkernel/bootstrap.h"
#include "mkernel/error.h"

namespace mk::test {

// Descriptors open in this process right now.
inline int count_open_fds() {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  int count = 0;
  while (const dirent* entry = readdir(dir)) {
    if (entry->d_name[0] != '.') ++count;
  }
  closedir(dir);
  return count - 1;  // the directory's own descriptor
}

// Sets (or, with nullptr, unsets) an environment variable for the life of the object.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      setenv(name_.c_str(), old_->c_str(), 1);
    } else {
      unsetenv(name_.c_str());
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  std::optional<std::string> old_;
};

// How one rank's function ended.
struct Outcome {
  bool threw = false;
  ErrorCode code = ErrorCode::kInternal;  // when it threw an mk::Error
  std::string message;
};

// Runs fn(rank) on `size` threads and returns how each ended (by rank).
inline std::vector<Outcome> run_threads(int size, const std::function<void(int)>& fn) {
  std::vector<Outcome> outcomes(size);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (const Error& e) {
        outcomes[r] = {true, e.code(), e.what()};
      } catch (const std::exception& e) {
        outcomes[r] = {true, ErrorCode::kInternal, e.what()};
      }
    });
  }
  for (std::thread& t : threads) t.join();
  return outcomes;
}

// Runs fn(bootstrap) for every rank of a fresh InProcessGroup, one thread per rank.
inline std::vector<Outcome> run_group(int size, const std::function<void(Bootstrap&)>& fn) {
  InProcessGroup group(size);
  std::vector<std::unique_ptr<Bootstrap>> bootstraps;
  for (int r = 0; r < size; ++r) bootstraps.push_back(group.bootstrap(r));
  return run_threads(size, [&](int r) { fn(*bootstraps[r]); });
}

struct ProcessResult {
  int exit_code = -1;           // -1 when killed by a signal
  int term_signal = 0;          // the signal, if any
  std::string output;           // stdout and stderr, interleaved as written
  double seconds = 0;           // wall time until exit
  bool killed_by_test = false;  // ran past limit_seconds
};

// Runs argv (with `env` added to this process's environment) and captures its output. After
// limit_seconds it gets SIGTERM (mkrun passes that on to its ranks), a second later SIGKILL, so
// that a hang fails the test instead of stalling the suite. When
// `trigger` is non-empty, `trigger_signal` is sent to the process once its output contains it.
inline ProcessResult run_process(const std::vector<std::string>& argv,
                                 const std::vector<std::pair<std::string, std::string>>& env = {},
                                 double limit_seconds = 30, const std::string& trigger = "",
                                 int trigger_signal = 0) {
  ProcessResult result;
  int out[2];
  if (pipe2(out, O_CLOEXEC) != 0) return result;
  const auto start = std::chrono::steady_clock::now();
  const pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);
    dup2(out[1], 1);
    dup2(out[1], 2);
    for (const auto& [name, value] : env) setenv(name.c_str(), value.c_str(), 1);
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  close(out[1]);
  bool triggered = trigger.empty();
  while (true) {
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (elapsed > limit_seconds && !result.killed_by_test) {
      kill(pid, SIGTERM);
      result.killed_by_test = true;
    }
    if (elapsed > limit_seconds + 1) {
      kill(-pid, SIGKILL);
      break;
    }
    pollfd p{out[0], POLLIN, 0};
    if (poll(&p, 1, 50) <= 0) continue;
    char chunk[4096];
    const ssize_t n = read(out[0], chunk, sizeof(chunk));
    if (n <= 0) break;
    result.output.append(chunk, static_cast<std::size_t>(n));
    if (!triggered && result.output.find(trigger) != std::string::npos) {
      kill(pid, trigger_signal);
      triggered = true;
    }
  }
  close(out[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (WIFEXITED(status)) result.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) result.term_signal = WTERMSIG(status);
  return result;
}

}  // namespace mk::test
