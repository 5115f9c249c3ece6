// A small rank program that tests/cpu/test_mkrun.cpp starts through mkrun.
//
//   mkrun_test_helper <mode> [args]
//     allgather <rounds>       rank-encoded allgathers of varying sizes, checked byte by byte
//     exit-code <rank> <code>  one allgather, then rank <rank> exits with <code>
//     signal <rank>            one allgather, then rank <rank> dies of SIGUSR1
//     leave-early <rank>       one allgather, then rank <rank> exits 0 and the others try another
//     hang <rank>              rank <rank> sleeps until killed; the others try an allgather
//     mismatch <rank>          rank <rank> passes 16 bytes to an allgather, the others 8
//     env                      checks the environment mkrun set and the descriptors it passed
//     output                   writes lines to stdout and stderr, the last without a newline
//     sleep                    prints "ready", then sleeps until killed
//     fd-exchange              passes memfds between all ranks with FdExchange
//
// Exit code: 0 when all went as it should, 3 when an allgather failed as the mode expects it to
// (the error is printed), 1 on anything unexpected (printed on stderr).
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "mkernel/bootstrap.h"
#include "mkernel/error.h"
#include "runtime/fd_exchange.h"

namespace {

constexpr int kExpectedFailure = 3;

[[noreturn]] void fail(const std::string& why) { throw std::runtime_error(why); }

int arg_int(int argc, char** argv, int i) {
  if (i >= argc) fail("missing argument " + std::to_string(i));
  return std::atoi(argv[i]);
}

uint8_t pattern(int rank, int round, std::size_t i) {
  return static_cast<uint8_t>(rank * 131 + round * 17 + i * 7 + (i >> 8));
}

void checked_allgather(mk::Bootstrap& b, int round, std::size_t bytes) {
  std::vector<uint8_t> send(bytes);
  for (std::size_t i = 0; i < bytes; ++i) send[i] = pattern(b.rank(), round, i);
  std::vector<uint8_t> recv(bytes * b.size() + 1, 0xee);
  b.allgather(send.data(), recv.data(), bytes);
  for (int r = 0; r < b.size(); ++r) {
    for (std::size_t i = 0; i < bytes; ++i) {
      if (recv[r * bytes + i] != pattern(r, round, i)) {
        fail("round " + std::to_string(round) + ": byte " + std::to_string(i) + " from rank " +
             std::to_string(r) + " is wrong");
      }
    }
  }
  if (recv.back() != 0xee) fail("allgather wrote past its end");
}

// Runs an allgather the mode expects to fail; returns kExpectedFailure when it did.
int expect_allgather_failure(mk::Bootstrap& b, std::size_t bytes) {
  std::vector<char> send(bytes, 1), recv(bytes * b.size());
  try {
    b.allgather(send.data(), recv.data(), bytes);
  } catch (const mk::Error& e) {
    std::printf("expected failure: %s\n", e.what());
    return kExpectedFailure;
  }
  fail("the allgather succeeded");
}

int run_allgather(int rounds) {
  const std::size_t sizes[] = {8, 0, 1, 4096, 3, 100000, 17};
  {
    auto b = mk::bootstrap_from_launcher();
    for (int round = 0; round < rounds; ++round) checked_allgather(*b, round, sizes[round % 7]);
    b->barrier();
  }
  // The connection serves a second Bootstrap once the first is gone.
  auto again = mk::bootstrap_from_launcher();
  checked_allgather(*again, rounds, 5);
  std::printf("rank %d: %d allgathers ok\n", again->rank(), rounds + 1);
  return 0;
}

int run_env() {
  const int rank = std::atoi(std::getenv("MKERNEL_RANK"));
  const int world = std::atoi(std::getenv("MKERNEL_WORLD_SIZE"));
  if (rank < 0 || rank >= world) fail("MKERNEL_RANK out of range");
  if (std::atoi(std::getenv("MKERNEL_LOCAL_RANK")) != rank)
    fail("MKERNEL_LOCAL_RANK != MKERNEL_RANK");
  if (!mk::launched_by_mkrun()) fail("launched_by_mkrun() is false");
  const int launcher_fd = std::atoi(std::getenv("MKERNEL_LAUNCHER_FD"));

  struct stat in {
  }, null{};
  if (fstat(0, &in) != 0 || stat("/dev/null", &null) != 0 || in.st_rdev != null.st_rdev) {
    fail("stdin is not /dev/null");
  }
  // Exactly stdio and the launcher socket are open.
  std::set<int> open_fds;
  DIR* dir = opendir("/proc/self/fd");
  while (const dirent* e = readdir(dir)) {
    if (e->d_name[0] != '.' && std::atoi(e->d_name) != dirfd(dir))
      open_fds.insert(std::atoi(e->d_name));
  }
  closedir(dir);
  const std::set<int> expected = {0, 1, 2, launcher_fd};
  if (open_fds != expected) {
    std::string list;
    for (int fd : open_fds) list += std::to_string(fd) + " ";
    fail("open descriptors are " + list + "; expected 0 1 2 " + std::to_string(launcher_fd));
  }
  auto b = mk::bootstrap_from_launcher();
  if (b->rank() != rank || b->size() != world) fail("bootstrap rank/size differ from the env");
  if ((fcntl(launcher_fd, F_GETFD) & FD_CLOEXEC) == 0) fail("launcher socket is inheritable");
  b->barrier();
  std::printf("rank %d of %d: environment ok\n", rank, world);
  return 0;
}

int run_output(int rank) {
  std::printf("line one\nline two\n");
  std::fflush(stdout);
  std::fprintf(stderr, "error line of rank %d\n", rank);
  std::printf("no newline at the end");
  return 0;
}

int run_fd_exchange() {
  auto b = mk::bootstrap_from_launcher();
  mk::detail::FdExchange exchange(*b, 10);
  const int me = b->rank();
  std::vector<int> others;
  for (int r = 0; r < b->size(); ++r) {
    if (r != me) others.push_back(r);
  }
  const int memfd = memfd_create("helper", MFD_CLOEXEC);
  const std::string text = "memfd of rank " + std::to_string(me);
  if (memfd < 0 ||
      pwrite(memfd, text.data(), text.size(), 0) != static_cast<ssize_t>(text.size())) {
    fail("memfd");
  }
  for (uint64_t tag = 1; tag <= 3; ++tag) {
    const std::vector<int> got = exchange.exchange(memfd, others, others, tag);
    for (std::size_t i = 0; i < got.size(); ++i) {
      char buf[64] = {};
      if (pread(got[i], buf, sizeof(buf) - 1, 0) < 0 ||
          std::string(buf) != "memfd of rank " + std::to_string(others[i])) {
        fail("wrong memfd from rank " + std::to_string(others[i]) + ": '" + buf + "'");
      }
      const char mark = static_cast<char>('A' + me);
      if (pwrite(got[i], &mark, 1, 64 + me) != 1) fail("pwrite");
      close(got[i]);
    }
  }
  b->barrier();
  for (int r : others) {
    char mark = 0;
    if (pread(memfd, &mark, 1, 64 + r) != 1 || mark != 'A' + r) {
      fail("rank " + std::to_string(r) + " did not write into my memfd");
    }
  }
  close(memfd);
  std::printf("rank %d: fd exchange ok\n", me);
  return 0;
}

int run(int argc, char** argv) {
  if (argc < 2) fail("usage: mkrun_test_helper <mode> [args]");
  const std::string mode = argv[1];
  if (mode == "allgather") return run_allgather(arg_int(argc, argv, 2));
  if (mode == "env") return run_env();
  if (mode == "fd-exchange") return run_fd_exchange();
  const int rank = std::atoi(std::getenv("MKERNEL_RANK"));
  if (mode == "output") return run_output(rank);
  if (mode == "sleep") {
    std::printf("ready\n");
    std::fflush(stdout);
    while (true) pause();
  }
  const int chosen = arg_int(argc, argv, 2);
  auto b = mk::bootstrap_from_launcher();
  if (mode == "exit-code") {
    b->barrier();
    return rank == chosen ? arg_int(argc, argv, 3) : 0;
  }
  if (mode == "signal") {
    b->barrier();
    if (rank == chosen) raise(SIGUSR1);
    return 0;
  }
  if (mode == "leave-early") {
    b->barrier();
    if (rank == chosen) return 0;
    return expect_allgather_failure(*b, 4);
  }
  if (mode == "hang") {
    if (rank == chosen) {
      while (true) pause();
    }
    return expect_allgather_failure(*b, 4);
  }
  if (mode == "mismatch") return expect_allgather_failure(*b, rank == chosen ? 16 : 8);
  fail("unknown mode '" + mode + "'");
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mkrun_test_helper: %s\n", e.what());
    return 1;
  }
}
