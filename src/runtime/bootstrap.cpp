// The three Bootstraps of mkernel/bootstrap.h: a user callback, threads of one process
// (InProcessGroup) and the processes started by tools/mkrun.
#include "mkernel/bootstrap.h"

#include <sys/socket.h>
#include <sys/stat.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mkernel/error.h"
#include "runtime/launcher_protocol.h"
#include "runtime/overrides.h"
#include "runtime/socket_util.h"
#include "runtime/text_util.h"

namespace mk {
namespace {

constexpr const char* kTimeoutEnv = "MKERNEL_BOOTSTRAP_TIMEOUT_S";
constexpr double kDefaultTimeoutSeconds = 300;

// Time limit of one allgather of the in-process and launcher bootstraps.
double bootstrap_timeout_seconds() {
  return detail::env_seconds(detail::process_environment(), kTimeoutEnv, kDefaultTimeoutSeconds,
                             /*positive=*/true);
}

std::string rank_prefix(int rank) { return "rank " + std::to_string(rank) + ": "; }

void check_buffers(int rank, const void* send, const void* recv, std::size_t bytes) {
  if (bytes > 0 && (send == nullptr || recv == nullptr)) {
    throw Error(ErrorCode::kInvalidArgument, rank_prefix(rank) + "allgather of " +
                                                 std::to_string(bytes) + " bytes got a null " +
                                                 (send == nullptr ? "send" : "recv") +
                                                 " buffer; both must be valid when bytes > 0");
  }
}

// ---- callback ---------------------------------------------------------------------------------

class CallbackBootstrap final : public Bootstrap {
 public:
  CallbackBootstrap(int rank, int size, TimedAllgatherFn fn)
      : rank_(rank), size_(size), fn_(std::move(fn)) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void allgather(const void* send, void* recv, std::size_t bytes) override {
    allgather_within(send, recv, bytes, 0);
  }

  // On the calling thread (an MPI program may call MPI from one thread only, a CUDA-using one has
  // the rank's device set there); a plain callback, wrapped, ignores the limit.
  void allgather_within(const void* send, void* recv, std::size_t bytes, double seconds) override {
    check_buffers(rank_, send, recv, bytes);
    try {
      fn_(send, recv, bytes, seconds);
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      throw Error(ErrorCode::kBootstrap,
                  rank_prefix(rank_) + "the user-supplied allgather failed: " + e.what());
    }
  }

 private:
  int rank_;
  int size_;
  TimedAllgatherFn fn_;
};

}  // namespace

// The default: unbounded, on the calling thread (a bootstrap that can give up overrides it).
void Bootstrap::allgather_within(const void* send, void* recv, std::size_t bytes, double) {
  allgather(send, recv, bytes);
}

Error bootstrap_timeout(int rank, const std::string& what, double seconds,
                        const std::vector<int>& missing) {
  std::string text =
      rank_prefix(rank) + what + " gave up after " + detail::format_seconds(seconds) + " s; ";
  if (missing.empty()) {
    text += "which ranks did not arrive is not known to this bootstrap";
  } else {
    text += detail::format_rank_list(missing) + " did not arrive";
  }
  return Error(ErrorCode::kTimeout, text);
}

void Bootstrap::barrier() {
  const char token = 1;
  std::vector<char> all(static_cast<std::size_t>(size()));
  allgather(&token, all.data(), 1);
}

std::unique_ptr<Bootstrap> make_callback_bootstrap(int rank, int size, TimedAllgatherFn allgather) {
  if (size < 1 || rank < 0 || rank >= size) {
    throw Error(ErrorCode::kInvalidArgument,
                "make_callback_bootstrap: rank " + std::to_string(rank) + " and size " +
                    std::to_string(size) +
                    " are not valid; expected size >= 1 and 0 <= rank < size");
  }
  if (!allgather) {
    throw Error(ErrorCode::kInvalidArgument,
                "make_callback_bootstrap: the allgather function is empty; pass a callable");
  }
  return std::make_unique<CallbackBootstrap>(rank, size, std::move(allgather));
}

std::unique_ptr<Bootstrap> make_callback_bootstrap(int rank, int size, AllgatherFn allgather) {
  // An empty callable: the timed overload throws its (and a bad rank's) error.
  if (!allgather) return make_callback_bootstrap(rank, size, TimedAllgatherFn{});
  return make_callback_bootstrap(
      rank, size,
      TimedAllgatherFn([fn = std::move(allgather)](const void* send, void* recv, std::size_t bytes,
                                                   double) { fn(send, recv, bytes); }));
}

// ---- InProcessGroup ---------------------------------------------------------------------------
//
// The ranks meet in a generation-counted rendezvous: each allgather call registers its buffers in
// the current generation's slots; the last rank to arrive copies every contribution into every
// receive buffer, records the outcome, bumps the generation and wakes the others. A rank that
// times out breaks the group for good (the buffers it registered may be gone by the time the
// others arrive), and so does a rank whose Bootstrap is destroyed (it can never join again).

struct InProcessGroup::State {
  struct Slot {
    const void* send = nullptr;
    void* recv = nullptr;
    std::size_t bytes = 0;
    bool arrived = false;
  };

  State(int size, double timeout)
      : size(size), timeout_seconds(timeout), slots(size), handed_out(size), left(size) {}

  const int size;
  const double timeout_seconds;
  std::mutex mutex;
  std::condition_variable cv;
  // Everything below is guarded by `mutex`.
  uint64_t generation = 0;  // allgathers completed so far; the one in progress has this number
  std::vector<Slot> slots;  // [size] the allgather in progress
  int arrived = 0;
  std::string last_error;          // why allgather `generation - 1` failed; empty if it succeeded
  std::string broken;              // non-empty once no allgather can complete any more
  bool broken_by_timeout = false;  // ... because a rank gave up waiting
  std::vector<char> staging;       // [size * bytes] all contributions, so that buffers may overlap
  std::vector<bool> handed_out;    // [size] bootstrap(r) was called
  std::vector<bool> left;          // [size] rank r's Bootstrap was destroyed

  std::vector<int> missing_ranks() const {
    std::vector<int> missing;
    for (int r = 0; r < size; ++r) {
      if (!slots[r].arrived) missing.push_back(r);
    }
    return missing;
  }

  // Called by the last rank to arrive, with the mutex held.
  void complete() {
    const std::size_t bytes = slots[0].bytes;
    last_error.clear();
    for (int r = 1; r < size; ++r) {
      if (slots[r].bytes != bytes) {
        last_error = "in-process allgather #" + std::to_string(generation) + ": rank 0 passed " +
                     std::to_string(bytes) + " bytes but rank " + std::to_string(r) + " passed " +
                     std::to_string(slots[r].bytes) + "; every rank must pass the same count";
        break;
      }
    }
    if (last_error.empty() && bytes > 0) {
      staging.resize(bytes * size);
      for (int r = 0; r < size; ++r) std::memcpy(&staging[bytes * r], slots[r].send, bytes);
      for (int r = 0; r < size; ++r) std::memcpy(slots[r].recv, staging.data(), staging.size());
    }
    for (Slot& slot : slots) slot = Slot{};
    arrived = 0;
    ++generation;
    cv.notify_all();
  }

  void break_group(std::string why) {
    if (broken.empty()) broken = std::move(why);
    cv.notify_all();
  }
};

namespace {

class InProcessBootstrap final : public Bootstrap {
 public:
  InProcessBootstrap(std::shared_ptr<InProcessGroup::State> state, int rank)
      : state_(std::move(state)), rank_(rank) {}

  ~InProcessBootstrap() override {
    InProcessGroup::State& s = *state_;
    std::lock_guard<std::mutex> lock(s.mutex);
    s.left[rank_] = true;
    if (s.arrived > 0) {
      s.break_group("rank " + std::to_string(rank_) +
                    " left the group (its Bootstrap was destroyed) while ranks waited in "
                    "allgather #" +
                    std::to_string(s.generation));
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return state_->size; }

  void allgather(const void* send, void* recv, std::size_t bytes) override {
    allgather_within(send, recv, bytes, 0);
  }

  // Waits at most `seconds` (<= 0: the group's MKERNEL_BOOTSTRAP_TIMEOUT_S), and at most the
  // group's limit either way.
  void allgather_within(const void* send, void* recv, std::size_t bytes, double seconds) override {
    check_buffers(rank_, send, recv, bytes);
    InProcessGroup::State& s = *state_;
    std::unique_lock<std::mutex> lock(s.mutex);
    for (int r = 0; r < s.size && s.broken.empty(); ++r) {
      if (s.left[r]) {
        s.break_group("rank " + std::to_string(r) +
                      " left the group (its Bootstrap was destroyed) before allgather #" +
                      std::to_string(s.generation));
      }
    }
    if (!s.broken.empty()) throw Error(ErrorCode::kBootstrap, rank_prefix(rank_) + s.broken);

    const uint64_t generation = s.generation;
    s.slots[rank_] = {send, recv, bytes, true};
    if (++s.arrived == s.size) {
      s.complete();
    } else {
      const bool own_limit = seconds > 0 && seconds < s.timeout_seconds;
      const double limit = own_limit ? seconds : s.timeout_seconds;
      const auto done = [&] { return s.generation != generation || !s.broken.empty(); };
      // Beyond detail::kForeverSeconds (as Deadline::after): no limit - the steady clock's
      // nanoseconds would overflow, and the wait would end at once.
      bool woken = true;
      if (limit < detail::kForeverSeconds) {
        woken = s.cv.wait_for(lock, std::chrono::duration<double>(limit), done);
      } else {
        s.cv.wait(lock, done);
      }
      if (s.generation == generation) {  // not completed: timed out, or the group broke
        if (!woken) {
          const Error e =
              bootstrap_timeout(rank_, "in-process allgather", limit, s.missing_ranks());
          if (s.broken.empty()) s.broken_by_timeout = true;
          s.break_group(std::string(e.what()).substr(std::string("timeout: ").size()) +
                        (own_limit ? "" : std::string(" (") + kTimeoutEnv + ")"));
          throw Error(ErrorCode::kTimeout, s.broken);
        }
        throw Error(s.broken_by_timeout ? ErrorCode::kTimeout : ErrorCode::kBootstrap,
                    rank_prefix(rank_) + "allgather #" + std::to_string(generation) +
                        " cannot complete: " + s.broken);
      }
    }
    if (!s.last_error.empty()) {
      throw Error(ErrorCode::kBootstrap, rank_prefix(rank_) + s.last_error);
    }
  }

 private:
  std::shared_ptr<InProcessGroup::State> state_;
  int rank_;
};

}  // namespace

InProcessGroup::InProcessGroup(int size) {
  if (size < 1) {
    throw Error(ErrorCode::kInvalidArgument,
                "InProcessGroup: size " + std::to_string(size) + " is not valid; expected >= 1");
  }
  state_ = std::make_shared<State>(size, bootstrap_timeout_seconds());
}

InProcessGroup::~InProcessGroup() = default;

int InProcessGroup::size() const { return state_->size; }

std::unique_ptr<Bootstrap> InProcessGroup::bootstrap(int rank) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (rank < 0 || rank >= state_->size) {
    throw Error(ErrorCode::kInvalidArgument,
                "InProcessGroup::bootstrap: rank " + std::to_string(rank) +
                    " is out of range; expected 0 <= rank < " + std::to_string(state_->size));
  }
  if (state_->handed_out[rank]) {
    throw Error(ErrorCode::kInvalidArgument, "InProcessGroup::bootstrap: rank " +
                                                 std::to_string(rank) +
                                                 " was already handed out; call it once per rank");
  }
  state_->handed_out[rank] = true;
  return std::make_unique<InProcessBootstrap>(state_, rank);
}

// ---- launched by tools/mkrun ------------------------------------------------------------------

namespace {

namespace launcher = detail::launcher;

// The connection to mkrun belongs to the process: at most one Bootstrap uses it at a time.
std::atomic<bool> g_launcher_in_use{false};

class LauncherBootstrap final : public Bootstrap {
 public:
  LauncherBootstrap(int rank, int size, int fd, double timeout)
      : rank_(rank), size_(size), fd_(fd), timeout_seconds_(timeout) {}
  ~LauncherBootstrap() override { g_launcher_in_use = false; }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void allgather(const void* send, void* recv, std::size_t bytes) override {
    allgather_within(send, recv, bytes, 0);
  }

  // Waits at most `seconds` (<= 0: MKERNEL_BOOTSTRAP_TIMEOUT_S), and at most that either way. On
  // a time-out this rank shuts its connection: mkrun then fails the others' allgathers at once,
  // naming this rank (it alone knows who had joined).
  void allgather_within(const void* send, void* recv, std::size_t bytes, double seconds) override {
    check_buffers(rank_, send, recv, bytes);
    limit_ = seconds > 0 && seconds < timeout_seconds_ ? seconds : timeout_seconds_;
    if (!broken_.empty()) {
      throw Error(ErrorCode::kBootstrap,
                  rank_prefix(rank_) +
                      "the mkrun launcher connection is unusable after an earlier failure (" +
                      broken_ + ")");
    }
    if (bytes > launcher::kMaxRankBytes) {
      throw Error(ErrorCode::kInvalidArgument,
                  rank_prefix(rank_) + "allgather of " + std::to_string(bytes) +
                      " bytes through mkrun; at most " + std::to_string(launcher::kMaxRankBytes) +
                      " bytes per rank");
    }
    std::optional<std::string> refusal;
    try {
      refusal = exchange(send, recv, bytes);
    } catch (const Error& e) {
      // Failed half-way: the stream is out of step for good. Shutting it down also tells mkrun at
      // once, which then fails the allgathers of the other ranks instead of letting them wait.
      broken_ = e.what();
      shutdown(fd_, SHUT_RDWR);
      throw;
    }
    // A refusal leaves the stream in step: later allgathers may still be tried.
    if (refusal)
      throw Error(ErrorCode::kBootstrap, rank_prefix(rank_) + "allgather failed: " + *refusal);
  }

 private:
  // One round trip (see launcher_protocol.h). Returns mkrun's reason when it refused the allgather.
  std::optional<std::string> exchange(const void* send, void* recv, std::size_t bytes) {
    const detail::Deadline deadline = detail::Deadline::after(limit_);
    const launcher::Header request{launcher::kMagic, launcher::MessageKind::kAllgather, bytes};
    expect(detail::send_all(fd_, &request, sizeof(request), deadline, what()));
    expect(detail::send_all(fd_, send, bytes, deadline, what()));

    launcher::Header reply;
    expect(detail::recv_all(fd_, &reply, sizeof(reply), deadline, what()));
    if (reply.magic == launcher::kMagic && reply.kind == launcher::MessageKind::kError &&
        reply.bytes <= launcher::kMaxErrorBytes) {
      std::string text(reply.bytes, '\0');
      expect(detail::recv_all(fd_, text.data(), text.size(), deadline, what()));
      return text;
    }
    const uint64_t expected = static_cast<uint64_t>(bytes) * size_;
    if (reply.magic != launcher::kMagic || reply.kind != launcher::MessageKind::kResult ||
        reply.bytes != expected) {
      throw Error(ErrorCode::kBootstrap,
                  rank_prefix(rank_) + "malformed reply from the mkrun launcher (magic " +
                      std::to_string(reply.magic) + ", kind " +
                      std::to_string(static_cast<uint32_t>(reply.kind)) + ", " +
                      std::to_string(reply.bytes) + " bytes); expected a result of " +
                      std::to_string(expected) + " bytes");
    }
    expect(detail::recv_all(fd_, recv, expected, deadline, what()));
    return std::nullopt;
  }

  std::string what() const { return rank_prefix(rank_) + "mkrun launcher socket"; }

  void expect(detail::IoStatus status) const {
    if (status == detail::IoStatus::kClosed) {
      throw Error(ErrorCode::kBootstrap,
                  rank_prefix(rank_) + "mkrun launcher closed the connection (did mkrun exit?)");
    }
    if (status == detail::IoStatus::kTimedOut) {
      throw Error(
          ErrorCode::kTimeout,
          rank_prefix(rank_) + "allgather through mkrun gave up after " +
              detail::format_seconds(limit_) + " s; some rank did not join it" +
              (limit_ < timeout_seconds_ ? std::string() : std::string(" (") + kTimeoutEnv + ")"));
    }
  }

  int rank_;
  int size_;
  int fd_;
  double timeout_seconds_;
  double limit_ = 0;    // this exchange's
  std::string broken_;  // why the connection became unusable; empty while it is fine
};

// Reads an integer environment variable set by mkrun; throws kBootstrap naming it otherwise.
int launcher_env(const char* name, long long min, long long max) {
  const char* text = std::getenv(name);
  long long value = 0;
  if (text == nullptr || !detail::parse_int(text, min, max, &value)) {
    throw Error(ErrorCode::kBootstrap,
                std::string("bootstrap_from_launcher: ") + name + "=" +
                    (text ? "'" + std::string(text) + "'" : std::string("(unset)")) +
                    " is not valid; expected an integer in [" + std::to_string(min) + ", " +
                    std::to_string(max) + "] as set by mkrun");
  }
  return static_cast<int>(value);
}

}  // namespace

bool launched_by_mkrun() {
  const char* fd = std::getenv(launcher::kFdEnv);
  return fd != nullptr && *fd != '\0';
}

std::unique_ptr<Bootstrap> bootstrap_from_launcher() {
  if (!launched_by_mkrun()) {
    throw Error(ErrorCode::kBootstrap,
                std::string("bootstrap_from_launcher: ") + launcher::kFdEnv +
                    " is not set; start the program with `mkrun -n <ranks> -- <program>` "
                    "(see mkrun --help)");
  }
  const int size = launcher_env(launcher::kWorldSizeEnv, 1, INT_MAX);
  const int rank = launcher_env(launcher::kRankEnv, 0, size - 1);
  const int fd = launcher_env(launcher::kFdEnv, 0, INT_MAX);
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) {
    throw Error(ErrorCode::kBootstrap,
                std::string("bootstrap_from_launcher: ") + launcher::kFdEnv + "=" +
                    std::to_string(fd) +
                    " is not an open socket; was the variable inherited from an mkrun rank "
                    "by another program?");
  }
  const double timeout = bootstrap_timeout_seconds();
  if (g_launcher_in_use.exchange(true)) {
    throw Error(ErrorCode::kBootstrap,
                "bootstrap_from_launcher: this process already holds the launcher Bootstrap; "
                "destroy it before asking for another (one per launcher connection)");
  }
  try {
    // Programs this rank starts must not keep the connection open after the rank exits.
    detail::set_cloexec(fd, true);
  } catch (...) {
    g_launcher_in_use = false;
    throw;
  }
  return std::make_unique<LauncherBootstrap>(rank, size, fd, timeout);
}

namespace {

class BorrowedBootstrap final : public Bootstrap {
 public:
  explicit BorrowedBootstrap(Bootstrap& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  void allgather(const void* send, void* recv, std::size_t bytes) override {
    inner_.allgather(send, recv, bytes);
  }
  void allgather_within(const void* send, void* recv, std::size_t bytes, double seconds) override {
    inner_.allgather_within(send, recv, bytes, seconds);
  }

 private:
  Bootstrap& inner_;
};

}  // namespace

std::unique_ptr<Bootstrap> borrow_bootstrap(Bootstrap& inner) {
  return std::make_unique<BorrowedBootstrap>(inner);
}

}  // namespace mk
