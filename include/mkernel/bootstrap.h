// mkernel/bootstrap.h - the out-of-band exchange a Communicator is built on.
//
// mkernel never opens its own rendezvous port: it borrows an allgather from an engine the user
// already runs (torch.distributed, MPI, NCCL, a launcher). Three ways to get one:
//   - make_callback_bootstrap(): wrap any user allgather (MPI_Allgather, a torch store, ...).
//   - InProcessGroup: several ranks driven by threads of one process (tests, examples; several
//     ranks may share one GPU).
//   - bootstrap_from_launcher(): the processes started by tools/mkrun (see mkrun --help).
#pragma once

#include <cstddef>
#include <functional>
#include <memory>

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

  // Collective barrier built on allgather.
  void barrier();
};

// Signature of a user-supplied allgather; same contract as Bootstrap::allgather.
using AllgatherFn = std::function<void(const void* send, void* recv, std::size_t bytes)>;

std::unique_ptr<Bootstrap> make_callback_bootstrap(int rank, int size, AllgatherFn allgather);

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
