// mkrun - starts the ranks of an mkernel job on this host, one process per rank (see kHelp).
//
// One single-threaded poll() loop serves everything:
//   - each rank's launcher socket: the allgathers of bootstrap_from_launcher() (AllgatherServer,
//     wire format in src/runtime/launcher_protocol.h)
//   - each rank's stdout / stderr pipe: copied to mkrun's own, every line prefixed "[rank r] "
//   - a self-pipe written by the signal handler: SIGCHLD (a rank exited), SIGINT / SIGTERM / SIGHUP
//   - timers: --timeout for the whole job, --grace after the first failure, then SIGKILL
// mkrun never touches CUDA: each rank picks its own GPU.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <vector>

// mkrun sees only the library's public include path; these internal headers include nothing else
// from src/.
#include "../src/runtime/launcher_protocol.h"
#include "../src/runtime/socket_util.h"
#include "../src/runtime/text_util.h"

extern char** environ;

namespace {

using mk::detail::Deadline;
using mk::detail::format_ranks;
using mk::detail::format_seconds;
using mk::detail::UniqueFd;
namespace launcher = mk::detail::launcher;

constexpr int kExitOk = 0;
constexpr int kExitRankFailed = 1;
constexpr int kExitUsage = 2;
constexpr int kExitTimeout = 124;   // as timeout(1)
constexpr int kExitNotFound = 127;  // a rank could not find the program (as a shell)
constexpr int kExitNotExecutable = 126;
constexpr int kMaxRanks = 1024;
constexpr double kDefaultGraceSeconds = 30;
constexpr double kTermToKillSeconds = 5;         // after SIGTERM, SIGKILL follows this much later
constexpr std::size_t kReadChunk = 64 << 10;     // bytes per read() of a pipe or socket
constexpr std::size_t kMaxLineBytes = 64 << 10;  // a line is cut once this much lacks a newline

constexpr const char kHelp[] =
    R"(mkrun - start the ranks of an mkernel job on this host, one process per rank.

usage: mkrun -n <ranks> [--timeout <s>] [--grace <s>] [--] <program> [args...]

  -n, --np <ranks>   number of processes (ranks) to start, 1..1024
  --timeout <s>      stop the whole job after <s> seconds (default 0 = no limit)
  --grace <s>        once a rank has failed, give the others <s> seconds to finish before
                     they are terminated (default 30)
  -h, --help         this text

Each rank r runs <program> with its own environment:
  MKERNEL_RANK=r  MKERNEL_WORLD_SIZE=<ranks>  MKERNEL_LOCAL_RANK=r
  MKERNEL_LAUNCHER_FD=<fd>   a socket to mkrun through which mk::bootstrap_from_launcher()
                             performs the job's allgathers
The ranks pick their GPU themselves (mkernel programs use rank % device count); mkrun does not
touch CUDA. A rank's stdin is /dev/null; every line it writes to stdout / stderr appears on
mkrun's stdout / stderr prefixed with "[rank r] " (programs may buffer output written to a pipe:
flush it, or set PYTHONUNBUFFERED=1 for Python). Each rank runs in its own process group, and
mkrun passes SIGINT, SIGTERM and SIGHUP on to the ranks (a second one kills them).

An allgather fails at once on every rank that joined it when the ranks passed different byte
counts, or when a rank has exited or closed its connection without joining it. A rank waits at most
MKERNEL_BOOTSTRAP_TIMEOUT_S seconds (default 300) for the others.

When a rank fails (non-zero exit code or a signal), the others get --grace seconds to finish;
then mkrun sends SIGTERM to those still running, and SIGKILL 5 s later. The same happens to all
ranks when --timeout expires. At the end mkrun names every rank that failed and how.

Exit status: 0 if every rank exited with code 0; 1 if a rank failed; 124 if --timeout expired;
128 + n after passing on signal n; 2 for a usage error.
)";

// ---- output -------------------------------------------------------------------------------------

// Writes all of `text` to `fd` (blocking). Output that cannot be written (a closed pipe) is
// dropped.
void write_fully(int fd, const std::string& text) {
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n > 0) {
      done += static_cast<std::size_t>(n);
    } else if (n < 0 && errno != EINTR) {
      return;
    }
  }
}

// A message of mkrun's own, on its stderr.
void note(const std::string& message) { write_fully(STDERR_FILENO, "mkrun: " + message + "\n"); }

// Copies one output stream of a rank to one of mkrun's, a whole line per write() (so that lines
// of different ranks do not interleave), each line prefixed with "[rank r] ".
class LineForwarder {
 public:
  LineForwarder(int rank, int target)
      : prefix_("[rank " + std::to_string(rank) + "] "), target_(target) {}

  void feed(const char* data, std::size_t bytes) {
    pending_.append(data, bytes);
    std::size_t start = 0;
    for (std::size_t nl; (nl = pending_.find('\n', start)) != std::string::npos; start = nl + 1) {
      emit(pending_.substr(start, nl - start));
    }
    pending_.erase(0, start);
    if (pending_.size() >= kMaxLineBytes) finish();
  }

  // Emits a last line that has no newline.
  void finish() {
    if (!pending_.empty()) emit(pending_);
    pending_.clear();
  }

 private:
  void emit(const std::string& line) { write_fully(target_, prefix_ + line + "\n"); }

  std::string prefix_;
  int target_;
  std::string pending_;  // the unfinished last line
};

// ---- options ------------------------------------------------------------------------------------

struct Options {
  int ranks = 0;
  double timeout_seconds = 0;  // 0 = no limit
  double grace_seconds = kDefaultGraceSeconds;
  std::vector<std::string> command;  // program and its arguments
};

[[noreturn]] void usage_error(const std::string& problem) {
  note(problem +
       "\nusage: mkrun -n <ranks> [--timeout <s>] [--grace <s>] [--] <program> [args...]"
       " (see mkrun --help)");
  std::exit(kExitUsage);
}

Options parse_options(int argc, char** argv) {
  Options options;
  int i = 1;
  auto value = [&](const std::string& flag) -> const char* {
    if (i + 1 >= argc) usage_error(flag + " needs a value");
    return argv[++i];
  };
  auto seconds = [&](const std::string& flag) {
    const char* text = value(flag);
    double s = 0;
    if (!mk::detail::parse_seconds(text, &s)) {
      usage_error(flag + " '" + text + "' is not valid; expected a number of seconds >= 0");
    }
    return s;
  };
  for (; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") {
      ++i;
      break;
    } else if (arg == "-h" || arg == "--help") {
      write_fully(STDOUT_FILENO, kHelp);
      std::exit(kExitOk);
    } else if (arg == "-n" || arg == "--np") {
      const char* text = value(arg);
      long long n = 0;
      if (!mk::detail::parse_int(text, 1, kMaxRanks, &n)) {
        usage_error(arg + " '" + text + "' is not valid; expected a number of ranks in [1, " +
                    std::to_string(kMaxRanks) + "]");
      }
      options.ranks = static_cast<int>(n);
    } else if (arg == "--timeout") {
      options.timeout_seconds = seconds(arg);
    } else if (arg == "--grace") {
      options.grace_seconds = seconds(arg);
    } else if (arg.size() > 1 && arg[0] == '-') {
      usage_error("unknown option '" + arg + "'");
    } else {
      break;
    }
  }
  options.command.assign(argv + i, argv + argc);
  if (options.ranks == 0) usage_error("-n <ranks> is required");
  if (options.command.empty()) usage_error("no program given");
  return options;
}

// ---- signals ------------------------------------------------------------------------------------

constexpr int kHandledSignals[] = {SIGCHLD, SIGINT, SIGTERM, SIGHUP};
int g_signal_pipe_write = -1;

void on_signal(int signo) {
  const int saved = errno;
  const unsigned char byte = static_cast<unsigned char>(signo);
  [[maybe_unused]] const ssize_t n = write(g_signal_pipe_write, &byte, 1);  // full pipe: dropped
  errno = saved;
}

// Routes the handled signals into a pipe that the poll loop reads; returns its read end.
UniqueFd install_signal_handlers() {
  int p[2];
  if (pipe2(p, O_CLOEXEC | O_NONBLOCK) != 0) mk::detail::throw_system_error("mkrun: pipe2", errno);
  g_signal_pipe_write = p[1];  // kept open for the life of the process
  struct sigaction action {};
  action.sa_handler = on_signal;
  action.sa_flags = SA_RESTART | SA_NOCLDSTOP;
  sigemptyset(&action.sa_mask);
  for (int signo : kHandledSignals) sigaction(signo, &action, nullptr);
  signal(SIGPIPE, SIG_IGN);  // a rank that went away shows up as EPIPE instead
  return UniqueFd(p[0]);
}

std::string signal_name(int signo) {
  const char* abbrev = sigabbrev_np(signo);
  return abbrev ? std::string("SIG") + abbrev : "signal " + std::to_string(signo);
}

// ---- the allgather service ----------------------------------------------------------------------

// Answers the ranks' allgathers (protocol in launcher_protocol.h). Replies are queued and written
// when the socket has room, so a slow rank never blocks the loop.
class AllgatherServer {
 public:
  explicit AllgatherServer(int world) : links_(world) {}

  void attach(int rank, UniqueFd socket) { links_[rank].socket = std::move(socket); }
  int fd(int rank) const { return links_[rank].socket.get(); }
  short events(int rank) const {
    const Link& link = links_[rank];
    if (!link.socket) return 0;
    return static_cast<short>(POLLIN | (link.outbox.empty() ? 0 : POLLOUT));
  }

  void on_ready(int rank, short revents) {
    if (revents & POLLOUT) flush(rank);
    if (revents & (POLLIN | POLLHUP | POLLERR)) receive(rank);
  }

  // The rank's process has exited: take what it sent, then treat the connection as closed even
  // if a process it started still holds the socket open.
  void on_exit(int rank) {
    if (!links_[rank].socket) return;
    receive(rank);
    disconnect(rank);
  }

 private:
  struct Link {
    UniqueFd socket;                     // closed once the rank is gone
    std::string inbox;                   // bytes received that do not yet form a message
    std::optional<std::string> request;  // the rank's contribution to the allgather in progress
    uint64_t requests = 0;               // allgathers the rank has asked for (answered or not)
    std::deque<std::shared_ptr<const std::string>> outbox;  // replies not yet fully sent
    std::size_t sent = 0;                                   // bytes of outbox.front() already sent
  };

  void receive(int rank) {
    Link& link = links_[rank];
    char chunk[kReadChunk];
    while (link.socket) {
      const ssize_t n = recv(link.socket.get(), chunk, sizeof(chunk), MSG_DONTWAIT);
      if (n > 0) {
        link.inbox.append(chunk, static_cast<std::size_t>(n));
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        break;
      } else {  // EOF, or the connection broke
        disconnect(rank);
        return;
      }
    }
    parse(rank);
    try_complete();
  }

  void parse(int rank) {
    Link& link = links_[rank];
    launcher::Header header;
    while (link.socket && link.inbox.size() >= sizeof(header)) {
      std::memcpy(&header, link.inbox.data(), sizeof(header));
      if (header.magic != launcher::kMagic || header.kind != launcher::MessageKind::kAllgather ||
          header.bytes > launcher::kMaxRankBytes) {
        return protocol_error(rank, "sent a malformed message");
      }
      if (link.inbox.size() - sizeof(header) < header.bytes) return;  // the rest is on its way
      if (link.request) {
        return protocol_error(rank, "sent a second allgather before the answer to its first");
      }
      link.request = link.inbox.substr(sizeof(header), header.bytes);
      ++link.requests;
      link.inbox.erase(0, sizeof(header) + header.bytes);
    }
  }

  void protocol_error(int rank, const std::string& what) {
    note("rank " + std::to_string(rank) + " " + what + " on its launcher connection; closing it");
    disconnect(rank);
  }

  void disconnect(int rank) {
    if (links_[rank].request) {
      // It gave up (timed out) or died while waiting: those who had not joined are to blame.
      const std::vector<int> missing = not_joined();
      note("rank " + std::to_string(rank) + " left allgather #" + std::to_string(round_) +
           " while waiting in it" +
           (missing.empty() ? "" : "; not joined: " + mk::detail::format_rank_list(missing)));
    }
    links_[rank] = Link{};
    try_complete();
  }

  // Connected ranks that have not yet asked for the allgather in progress (those already refused
  // because a rank is gone did ask).
  std::vector<int> not_joined() const {
    std::vector<int> ranks;
    for (int r = 0; r < static_cast<int>(links_.size()); ++r) {
      if (links_[r].socket && links_[r].requests <= round_) ranks.push_back(r);
    }
    return ranks;
  }

  // Answers the allgather in progress once it can be answered: with the result when every rank
  // has joined, with an error when the sizes differ or as soon as a rank is gone (it can never
  // join, and its contribution, if any, went with it).
  void try_complete() {
    std::vector<int> waiting;
    std::vector<int> gone;
    for (int r = 0; r < static_cast<int>(links_.size()); ++r) {
      if (links_[r].request) waiting.push_back(r);
      if (!links_[r].socket) gone.push_back(r);
    }
    if (waiting.empty()) return;
    const std::string name = "allgather #" + std::to_string(round_);
    if (!gone.empty()) {
      const std::vector<int> missing = not_joined();
      return refuse(
          waiting,
          name + " cannot complete: " +
              (gone.size() == 1 ? "rank " + std::to_string(gone[0]) + " has"
                                : "ranks " + format_ranks(gone) + " have") +
              " closed the mkrun connection (exited, crashed or timed out)" +
              (missing.empty() ? "" : "; not joined: " + mk::detail::format_rank_list(missing)));
    }
    if (waiting.size() < links_.size()) return;

    ++round_;  // everyone joined: the next request starts the next allgather
    const std::size_t bytes = links_[0].request->size();
    for (int r = 1; r < static_cast<int>(links_.size()); ++r) {
      if (links_[r].request->size() != bytes) {
        return refuse(waiting, name + ": rank 0 passed " + std::to_string(bytes) +
                                   " bytes but rank " + std::to_string(r) + " passed " +
                                   std::to_string(links_[r].request->size()) +
                                   "; every rank must pass the same count");
      }
    }
    const launcher::Header header{launcher::kMagic, launcher::MessageKind::kResult,
                                  bytes * links_.size()};
    auto reply =
        std::make_shared<std::string>(reinterpret_cast<const char*>(&header), sizeof(header));
    reply->reserve(sizeof(header) + header.bytes);
    for (const Link& link : links_) reply->append(*link.request);
    for (Link& link : links_) {
      link.outbox.push_back(reply);
      link.request.reset();
    }
  }

  void refuse(const std::vector<int>& ranks, std::string why) {
    why.resize(std::min<std::size_t>(why.size(), launcher::kMaxErrorBytes));
    const launcher::Header header{launcher::kMagic, launcher::MessageKind::kError, why.size()};
    auto reply =
        std::make_shared<std::string>(reinterpret_cast<const char*>(&header), sizeof(header));
    reply->append(why);
    for (int r : ranks) {
      links_[r].outbox.push_back(reply);
      links_[r].request.reset();
    }
  }

  void flush(int rank) {
    Link& link = links_[rank];
    while (link.socket && !link.outbox.empty()) {
      const std::string& message = *link.outbox.front();
      const ssize_t n = send(link.socket.get(), message.data() + link.sent,
                             message.size() - link.sent, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (n > 0) {
        link.sent += static_cast<std::size_t>(n);
        if (link.sent == message.size()) {
          link.outbox.pop_front();
          link.sent = 0;
        }
      } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
        return;
      } else if (errno != EINTR) {
        return disconnect(rank);  // EPIPE / ECONNRESET: the rank is gone
      }
    }
  }

  std::vector<Link> links_;  // [world]
  uint64_t round_ = 0;       // allgathers every rank has joined so far
};

// ---- ranks --------------------------------------------------------------------------------------

struct Rank {
  explicit Rank(int r) : rank(r), out_lines(r, STDOUT_FILENO), err_lines(r, STDERR_FILENO) {}
  int rank;
  pid_t pid = -1;  // also the id of the rank's process group
  UniqueFd out;    // read end of the rank's stdout pipe; closed at EOF
  UniqueFd err;    // read end of its stderr pipe
  LineForwarder out_lines;
  LineForwarder err_lines;
  bool running = false;
  int status = 0;       // from waitpid(), once it has exited
  int signal_sent = 0;  // last signal mkrun sent it, 0 = none

  bool succeeded() const { return !running && WIFEXITED(status) && WEXITSTATUS(status) == 0; }
  std::string how_it_ended() const {
    if (WIFEXITED(status)) return "exit code " + std::to_string(WEXITSTATUS(status));
    const int signo = WTERMSIG(status);
    return "killed by " + signal_name(signo) + (signo == signal_sent ? " from mkrun" : "") +
           (WCOREDUMP(status) ? ", core dumped" : "");
  }
};

// mkrun's environment without launcher variables it may itself have inherited, plus rank r's.
std::vector<std::string> rank_environment(int rank, int world, int launcher_fd) {
  const char* ours[] = {launcher::kRankEnv, launcher::kWorldSizeEnv, launcher::kLocalRankEnv,
                        launcher::kFdEnv};
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    const bool replaced = std::any_of(std::begin(ours), std::end(ours), [&](const char* name) {
      return entry.compare(0, std::strlen(name) + 1, std::string(name) + "=") == 0;
    });
    if (!replaced) env.push_back(entry);
  }
  env.push_back(std::string(launcher::kRankEnv) + "=" + std::to_string(rank));
  env.push_back(std::string(launcher::kWorldSizeEnv) + "=" + std::to_string(world));
  env.push_back(std::string(launcher::kLocalRankEnv) + "=" + std::to_string(rank));
  env.push_back(std::string(launcher::kFdEnv) + "=" + std::to_string(launcher_fd));
  return env;
}

std::vector<char*> pointers_to(std::vector<std::string>& strings) {
  std::vector<char*> p;
  for (std::string& s : strings) p.push_back(s.data());
  p.push_back(nullptr);
  return p;
}

// In the forked child: wires up stdio and the launcher socket, then runs the program. (mkrun is
// single-threaded, so the child may call anything; it keeps to plain system calls regardless.)
// `mask` is the signal mask to restore once mkrun's handlers are gone (spawn() blocks the signals
// it handles across fork(), lest a signal meant for the rank run mkrun's handler in the child).
[[noreturn]] void exec_rank(char* const* argv, char* const* envp, int stdin_fd, int stdout_fd,
                            int stderr_fd, int launcher_fd, const sigset_t* mask) {
  for (int signo : kHandledSignals) signal(signo, SIG_DFL);
  signal(SIGPIPE, SIG_DFL);
  sigprocmask(SIG_SETMASK, mask, nullptr);
  setpgid(0, 0);
  dup2(stdin_fd, STDIN_FILENO);
  dup2(stdout_fd, STDOUT_FILENO);
  dup2(stderr_fd, STDERR_FILENO);
  fcntl(launcher_fd, F_SETFD, 0);  // the one descriptor the program inherits besides stdio
#ifdef SYS_close_range
  // Whatever else is open (descriptors mkrun itself inherited included) stays out of the program.
  constexpr unsigned kCloexec = 1U << 2;  // CLOSE_RANGE_CLOEXEC
  if (launcher_fd > 3) syscall(SYS_close_range, 3U, launcher_fd - 1U, kCloexec);
  syscall(SYS_close_range, launcher_fd + 1U, ~0U, kCloexec);
#endif
  execvpe(argv[0], argv, envp);
  const int err = errno;
  const char* parts[] = {"mkrun: cannot execute '", argv[0], "': ", strerror(err), "\n"};
  for (const char* part : parts) {
    [[maybe_unused]] const ssize_t n = write(STDERR_FILENO, part, std::strlen(part));
  }
  _exit(err == ENOENT ? kExitNotFound : kExitNotExecutable);
}

// Starts rank `r.rank`; returns mkrun's end of its launcher socket.
UniqueFd spawn(const std::vector<std::string>& command, int world, int devnull, Rank& r) {
  int pair[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) {
    mk::detail::throw_system_error("mkrun: socketpair for rank " + std::to_string(r.rank), errno);
  }
  UniqueFd ours(pair[0]), theirs(pair[1]);
  int out[2], err[2];
  if (pipe2(out, O_CLOEXEC) != 0) mk::detail::throw_system_error("mkrun: pipe2", errno);
  UniqueFd out_read(out[0]), out_write(out[1]);
  if (pipe2(err, O_CLOEXEC) != 0) mk::detail::throw_system_error("mkrun: pipe2", errno);
  UniqueFd err_read(err[0]), err_write(err[1]);

  std::vector<std::string> args = command;
  std::vector<std::string> env = rank_environment(r.rank, world, theirs.get());
  const std::vector<char*> argv = pointers_to(args);
  const std::vector<char*> envp = pointers_to(env);

  sigset_t handled, previous;
  sigemptyset(&handled);
  for (int signo : kHandledSignals) sigaddset(&handled, signo);
  sigprocmask(SIG_BLOCK, &handled, &previous);
  const pid_t pid = fork();
  if (pid == 0) {
    exec_rank(argv.data(), envp.data(), devnull, out_write.get(), err_write.get(), theirs.get(),
              &previous);
  }
  const int fork_errno = errno;
  sigprocmask(SIG_SETMASK, &previous, nullptr);
  if (pid < 0) {
    mk::detail::throw_system_error("mkrun: fork for rank " + std::to_string(r.rank), fork_errno);
  }
  setpgid(pid, pid);  // the child does the same; whichever runs first wins
  mk::detail::set_nonblocking(ours.get());
  mk::detail::set_nonblocking(out_read.get());
  mk::detail::set_nonblocking(err_read.get());
  r.pid = pid;
  r.running = true;
  r.out = std::move(out_read);
  r.err = std::move(err_read);
  return ours;  // the child's ends close here
}

// ---- the job ------------------------------------------------------------------------------------

int min_timeout_ms(int a, int b) { return a < 0 ? b : b < 0 ? a : std::min(a, b); }

class Job {
 public:
  explicit Job(Options options)
      : options_(std::move(options)),
        server_(options_.ranks),
        job_deadline_(options_.timeout_seconds > 0 ? Deadline::after(options_.timeout_seconds)
                                                   : Deadline::never()) {
    for (int r = 0; r < options_.ranks; ++r) ranks_.emplace_back(r);
  }

  // Starts the ranks, serves them until all have exited, and returns mkrun's exit status.
  int run() {
    signals_ = install_signal_handlers();
    UniqueFd devnull(open("/dev/null", O_RDONLY | O_CLOEXEC));
    if (!devnull) mk::detail::throw_system_error("mkrun: open /dev/null", errno);
    try {
      for (Rank& r : ranks_) {
        server_.attach(r.rank, spawn(options_.command, options_.ranks, devnull.get(), r));
      }
    } catch (...) {
      send_signal(SIGKILL, running_ranks());
      while (!running_ranks().empty()) reap(/*block=*/true);
      throw;
    }
    while (!running_ranks().empty()) {
      poll_once();
      reap(/*block=*/false);
      check_timers();
    }
    for (Rank& r : ranks_) drain_output(r);
    return report();
  }

 private:
  enum class Source { kSignals, kStdout, kStderr, kSocket };

  void poll_once() {
    std::vector<pollfd> fds;
    std::vector<std::pair<Source, int>> sources;  // what fds[i] is, and whose
    auto watch = [&](int fd, short events, Source source, int rank) {
      if (fd < 0 || events == 0) return;
      fds.push_back({fd, events, 0});
      sources.emplace_back(source, rank);
    };
    watch(signals_.get(), POLLIN, Source::kSignals, -1);
    for (Rank& r : ranks_) {
      watch(r.out.get(), POLLIN, Source::kStdout, r.rank);
      watch(r.err.get(), POLLIN, Source::kStderr, r.rank);
      watch(server_.fd(r.rank), server_.events(r.rank), Source::kSocket, r.rank);
    }
    int timeout =
        min_timeout_ms(job_deadline_.poll_timeout_ms(), grace_deadline_.poll_timeout_ms());
    timeout = min_timeout_ms(timeout, kill_deadline_.poll_timeout_ms());
    if (poll(fds.data(), fds.size(), timeout) < 0) {
      if (errno == EINTR) return;
      mk::detail::throw_system_error("mkrun: poll", errno);
    }
    for (std::size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      const auto [source, rank] = sources[i];
      switch (source) {
        case Source::kSignals:
          read_signals();
          break;
        case Source::kStdout:
          forward(ranks_[rank].out, ranks_[rank].out_lines);
          break;
        case Source::kStderr:
          forward(ranks_[rank].err, ranks_[rank].err_lines);
          break;
        case Source::kSocket:
          server_.on_ready(rank, fds[i].revents);
          break;
      }
    }
  }

  // Copies what a rank has written so far; closes the pipe at EOF.
  static void forward(UniqueFd& pipe, LineForwarder& lines) {
    char chunk[kReadChunk];
    while (pipe) {
      const ssize_t n = read(pipe.get(), chunk, sizeof(chunk));
      if (n > 0) {
        lines.feed(chunk, static_cast<std::size_t>(n));
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        return;
      } else {  // EOF (or a broken pipe): nothing more will come
        lines.finish();
        pipe.reset();
      }
    }
  }

  // Takes what is left in a rank's pipes without waiting for EOF: a process the rank started may
  // keep them open.
  static void drain_output(Rank& r) {
    forward(r.out, r.out_lines);
    forward(r.err, r.err_lines);
    r.out_lines.finish();
    r.err_lines.finish();
  }

  void read_signals() {
    unsigned char signo = 0;
    while (read(signals_.get(), &signo, 1) == 1) {
      if (signo == SIGCHLD) continue;  // reap() runs after every poll anyway
      if (interrupted_by_ == 0) {
        interrupted_by_ = signo;
        note("received " + signal_name(signo) + "; passing it on to the ranks");
        send_signal(signo, running_ranks());
        kill_deadline_ = Deadline::after(kTermToKillSeconds);
      } else {
        note("received " + signal_name(signo) + " again; killing the ranks");
        send_signal(SIGKILL, running_ranks());
      }
    }
  }

  void reap(bool block) {
    int status = 0;
    pid_t pid;
    while ((pid = waitpid(-1, &status, block ? 0 : WNOHANG)) > 0) {
      const auto it =
          std::find_if(ranks_.begin(), ranks_.end(), [&](const Rank& r) { return r.pid == pid; });
      if (it == ranks_.end()) continue;
      Rank& r = *it;
      r.running = false;
      r.status = status;
      drain_output(r);  // the rank's last words before mkrun's note about it
      server_.on_exit(r.rank);
      if (!r.succeeded() && first_failure_ < 0) on_first_failure(r);
      if (block) return;
    }
  }

  void on_first_failure(const Rank& r) {
    first_failure_ = r.rank;
    const std::vector<int> others = running_ranks();
    if (others.empty() || terminating_ || interrupted_by_ != 0) return;  // already stopping
    note("rank " + std::to_string(r.rank) + " failed (" + r.how_it_ended() + "); ranks " +
         format_ranks(others) + " get " + format_seconds(options_.grace_seconds) +
         " s (--grace) to finish");
    grace_deadline_ = Deadline::after(options_.grace_seconds);
  }

  void check_timers() {
    if (running_ranks().empty()) return;
    if (!terminating_ && job_deadline_.expired()) {
      timed_out_ = true;
      terminate("time limit of " + format_seconds(options_.timeout_seconds) +
                " s (--timeout) reached");
    } else if (!terminating_ && grace_deadline_.expired()) {
      terminate("rank " + std::to_string(first_failure_) + " failed " +
                format_seconds(options_.grace_seconds) + " s ago (--grace)");
    } else if (kill_deadline_.expired()) {
      const std::vector<int> left = running_ranks();
      note("ranks " + format_ranks(left) + " still running " + format_seconds(kTermToKillSeconds) +
           " s after being told to stop; sending SIGKILL");
      send_signal(SIGKILL, left);
      kill_deadline_ = Deadline::never();
    }
  }

  void terminate(const std::string& why) {
    terminating_ = true;
    const std::vector<int> left = running_ranks();
    note(why + "; sending SIGTERM to ranks " + format_ranks(left));
    send_signal(SIGTERM, left);
    grace_deadline_ = Deadline::never();
    kill_deadline_ = Deadline::after(kTermToKillSeconds);
  }

  // Signals the process group of each rank, so that the processes it started go too.
  void send_signal(int signo, const std::vector<int>& ranks) {
    for (int r : ranks) {
      ranks_[r].signal_sent = signo;
      kill(-ranks_[r].pid, signo);
    }
  }

  std::vector<int> running_ranks() const {
    std::vector<int> running;
    for (const Rank& r : ranks_) {
      if (r.running) running.push_back(r.rank);
    }
    return running;
  }

  int report() const {
    std::string failures;
    int failed = 0;
    for (const Rank& r : ranks_) {
      if (r.succeeded()) continue;
      failures +=
          (failed++ ? ", rank " : "rank ") + std::to_string(r.rank) + " (" + r.how_it_ended() + ")";
    }
    if (failed > 0) {
      note(std::to_string(failed) + " of " + std::to_string(ranks_.size()) +
           " ranks failed: " + failures);
    }
    if (timed_out_) return kExitTimeout;
    if (interrupted_by_ != 0) return 128 + interrupted_by_;
    return failed > 0 ? kExitRankFailed : kExitOk;
  }

  Options options_;
  std::vector<Rank> ranks_;
  AllgatherServer server_;
  UniqueFd signals_;                             // read end of the signal self-pipe
  Deadline job_deadline_;                        // --timeout
  Deadline grace_deadline_ = Deadline::never();  // set by the first failure
  Deadline kill_deadline_ = Deadline::never();   // set by the SIGTERM
  int first_failure_ = -1;                       // rank that failed first
  bool terminating_ = false;                     // SIGTERM sent by mkrun's own decision
  bool timed_out_ = false;
  int interrupted_by_ = 0;  // first signal received from outside
};

// Descriptors 0-2 must exist, or the first pipe would become a rank's stdin or stdout.
void ensure_stdio_open() {
  for (int fd = 0; fd <= 2; ++fd) {
    if (fcntl(fd, F_GETFD) < 0) open("/dev/null", O_RDWR);  // takes the lowest free number: fd
  }
}

}  // namespace

int main(int argc, char** argv) {
  ensure_stdio_open();
  Options options = parse_options(argc, argv);
  try {
    return Job(std::move(options)).run();
  } catch (const std::exception& e) {
    note(e.what());
    return kExitRankFailed;
  }
}
