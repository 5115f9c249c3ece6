// mkernel/bootstrap.h - the out-of-band exchange a Communicator is built on.
//
// mkernel never opens its own rendezvous port: it borrows an allgather from an engine the user
// already runs (torch.distributed, MPI, NCCL, a launcher). Three ways to get one:
//   - make_callback_bootstrap(): wrap any user allgather (MPI_Allgather, a torch store, ...).
//   - InProcessGroup: several ranks driven by threads of one process (tests, examples; several
//     ranks may share one GPU).
//   - bootstrap_from_launcher(): the processes started by tools/mkrun (see mkrun --help).
//
// Time limits: a communicator runs every host-side collective step (creation, symmetric
// allocation, the inter-node setup) through allgather_within() with its time limit, so a rank
// that never arrives, or dies, is an mk::Error(kTimeout) on the others within the limit - naming
// the step, this rank and, where the bootstrap can tell (InProcessGroup, a timed callback, the
// Python package's store), the ranks that did not arrive. A bootstrap that cannot give up on its
// own - a plain AllgatherFn, a subclass that keeps the default allgather_within - is bounded only
// by itself: mkernel runs no user code on threads of its own.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "mkernel/error.h"

namespace mk {

class Bootstrap {
 public:
  virtual ~Bootstrap() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Collective over all ranks. Each rank passes `bytes` bytes at `send`; `recv` receives
  // size() * bytes bytes, rank r's contribution at offset r * bytes. Blocks until done.
  // Throws mk::Error(kBootstrap) when the exchange fails or times out.
  virtual void allgather(const void* send, void* recv, std::size_t bytes) = 0;

  // Collective, bounded where the bootstrap can be: allgather, giving up after `seconds` (<= 0:
  // no limit) with mk::Error(kTimeout) that names this rank and, where this bootstrap can tell, the
  // ranks that did not arrive. After a time-out the bootstrap may be out of step with its peers:
  // use it no more. The default runs allgather() on the calling thread, unbounded: a bootstrap that
  // can give up overrides it.
  virtual void allgather_within(const void* send, void* recv, std::size_t bytes, double seconds);

  // Collective barrier built on allgather.
  void barrier();
};

// Signature of a user-supplied allgather; same contract as Bootstrap::allgather. It runs on the
// calling thread and is bounded only by itself (a dead peer blocks it as long as MPI_Allgather
// would block): the timed form below gets the communicator's limit.
using AllgatherFn = std::function<void(const void* send, void* recv, std::size_t bytes)>;
// A timed allgather: the same, but it returns within `seconds` (<= 0: no limit) or throws -
// mk::Error(kTimeout) naming the ranks that did not arrive, if it can tell (an MPI program can
// poll MPI_Iallgather with MPI_Test until the deadline; a key-value store can see whose keys are
// missing: bootstrap_timeout() builds the error). It runs on the calling thread.
using TimedAllgatherFn =
    std::function<void(const void* send, void* recv, std::size_t bytes, double seconds)>;

std::unique_ptr<Bootstrap> make_callback_bootstrap(int rank, int size, AllgatherFn allgather);
std::unique_ptr<Bootstrap> make_callback_bootstrap(int rank, int size, TimedAllgatherFn allgather);

// The error a bounded allgather of `rank` throws when `missing` (ascending; empty: not known) had
// not arrived after `seconds`: "rank 0: allgather gave up after 2 s; ranks [1, 3] did not
// arrive". `what` names the exchange ("in-process allgather", ...).
Error bootstrap_timeout(int rank, const std::string& what, double seconds,
                        const std::vector<int>& missing);

// A group of `size` ranks inside this process. bootstrap(r) may be called once per rank, and
// each returned Bootstrap is then used by one thread. The group must outlive its bootstraps.
class InProcessGroup {
 public:
  explicit InProcessGroup(int size);
  ~InProcessGroup();
  InProcessGroup(const InProcessGroup&) = delete;
  InProcessGroup& operator=(const InProcessGroup&) = delete;

  int size() const;
  std::unique_ptr<Bootstrap> bootstrap(int rank);

  struct State;  // shared with the bootstraps it hands out

 private:
  std::shared_ptr<State> state_;
};

// A non-owning view of `inner`, so one connection (e.g. the mkrun launcher's, of which a process
// has one) can serve several communicators in turn. `inner` must outlive the view.
std::unique_ptr<Bootstrap> borrow_bootstrap(Bootstrap& inner);

// True when this process was started by tools/mkrun (MKERNEL_LAUNCHER_FD is set).
bool launched_by_mkrun();
// The bootstrap of a process started by tools/mkrun. Throws mk::Error(kBootstrap) otherwise.
std::unique_ptr<Bootstrap> bootstrap_from_launcher();

}  // namespace mk
