// mkernel._C - nanobind bindings of the public C++ API (include/mkernel/*.h).
//
// Thin on purpose: device pointers and CUDA streams cross as Python ints, dtypes as the names
// "bf16" / "f16" / "f32", and torch appears only in mkernel/__init__.py, which validates tensors
// before calling in here (the C++ layer validates again). mk::Error becomes mkernel.MkernelError
// (a RuntimeError) whose `code` is the ErrorCode's name ("timeout", "invalid_argument", ...).
//
// GIL: Communicator.create() and alloc() keep it (their allgathers call back into Python); the
// collectives and synchronize() release it. The allgather wrapper acquires it either way, so a
// future op that allocates collectively from a released-GIL path stays safe.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "mkernel/attention.h"
#include "mkernel/fused.h"
#include "mkernel/gemm.h"
#include "mkernel/mkernel.h"
#include "mkernel/moe.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

// ---- errors ---------------------------------------------------------------------------------

struct CodeName {
  mk::ErrorCode code;
  const char* name;
};
// The Python names of mk::ErrorCode: the enumerator without its k, in snake case.
constexpr CodeName kCodeNames[] = {
    {mk::ErrorCode::kInvalidArgument, "invalid_argument"},
    {mk::ErrorCode::kNotInitialized, "not_initialized"},
    {mk::ErrorCode::kOutOfMemory, "out_of_memory"},
    {mk::ErrorCode::kUnsupported, "unsupported"},
    {mk::ErrorCode::kTimeout, "timeout"},
    {mk::ErrorCode::kBootstrap, "bootstrap"},
    {mk::ErrorCode::kCuda, "cuda"},
    {mk::ErrorCode::kSystem, "system"},
    {mk::ErrorCode::kInternal, "internal"},
};

const char* code_name(mk::ErrorCode code) {
  for (const CodeName& c : kCodeNames) {
    if (c.code == code) return c.name;
  }
  return "internal";
}

// mkernel.MkernelError; owned by the module (its attribute), which outlives every translation.
PyObject* g_error_type = nullptr;

// Raises MkernelError(e.what()) with .code set; on failure leaves the Python error that occurred.
void raise_mkernel_error(const mk::Error& e) {
  PyObject* message = PyUnicode_DecodeUTF8(e.what(), std::strlen(e.what()), "replace");
  if (message == nullptr) return;
  PyObject* exc = PyObject_CallOneArg(g_error_type, message);
  Py_DECREF(message);
  if (exc == nullptr) return;
  PyObject* code = PyUnicode_FromString(code_name(e.code()));
  if (code == nullptr || PyObject_SetAttrString(exc, "code", code) != 0) {
    Py_XDECREF(code);
    Py_DECREF(exc);
    return;
  }
  Py_DECREF(code);
  PyErr_SetObject(g_error_type, exc);
  Py_DECREF(exc);
}

// ---- dtypes, pointers -----------------------------------------------------------------------

mk::DType parse_dtype(std::string_view name) {
  if (name == "bf16") return mk::DType::kBF16;
  if (name == "f16") return mk::DType::kF16;
  if (name == "f32") return mk::DType::kF32;
  throw nb::value_error(
      ("dtype '" + std::string(name) + "' is not supported; expected one of 'bf16', 'f16', 'f32'")
          .c_str());
}

template <typename T = void>
T* as_pointer(std::uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

cudaStream_t as_stream(std::uintptr_t handle) { return reinterpret_cast<cudaStream_t>(handle); }

// A [batch, seq, heads, D] tensor from its address and element strides (batch, seq, head).
mk::AttentionTensor attention_tensor(std::uintptr_t data, const nb::tuple& strides) {
  if (strides.size() != 3) throw nb::value_error("attention strides are (batch, seq, head)");
  return mk::AttentionTensor{as_pointer<const void>(data), nb::cast<int64_t>(strides[0]),
                             nb::cast<int64_t>(strides[1]), nb::cast<int64_t>(strides[2])};
}

// The attention problem from the Python arguments (ring attention: seq_q = seq_kv = S_local).
mk::AttentionProblem attention_problem(int64_t batch, int64_t seq_q, int64_t seq_kv, int64_t heads,
                                       int64_t kv_heads, int64_t head_dim, bool causal,
                                       double softmax_scale) {
  mk::AttentionProblem p;
  p.batch = batch;
  p.seq_q = seq_q;
  p.seq_kv = seq_kv;
  p.heads = heads;
  p.kv_heads = kv_heads;
  p.head_dim = head_dim;
  p.causal = causal;
  p.softmax_scale = static_cast<float>(softmax_scale);
  return p;
}

mk::BLayout parse_layout(std::string_view name, const char* op) {
  if (name == "nk") return mk::BLayout::kNK;
  if (name == "kn") return mk::BLayout::kKN;
  throw nb::value_error(
      (std::string(op) + ": b_layout must be 'nk' (B is [N, K]) or 'kn' (B is [K, N])").c_str());
}

// The MoE problem from the Python arguments (layout "padded" or "masked").
mk::MoeProblem moe_problem(int64_t tokens, int64_t max_tokens, int64_t hidden, int top_k,
                           int num_experts, std::string_view layout, int64_t capacity,
                           const char* op) {
  mk::MoeProblem p;
  p.tokens = tokens;
  p.max_tokens = max_tokens;
  p.hidden = hidden;
  p.top_k = top_k;
  p.num_experts = num_experts;
  p.capacity = capacity;
  if (layout == "padded") {
    p.layout = mk::MoeLayout::kPadded;
  } else if (layout == "masked") {
    p.layout = mk::MoeLayout::kMasked;
  } else {
    throw nb::value_error((std::string(op) + ": layout must be 'padded' or 'masked'").c_str());
  }
  return p;
}

mk::FusedGemmConfig fused_config(int block_n, int comm_ctas, int piece_rows,
                                 bool bf16_partials = false, bool tma_sends = true) {
  mk::FusedGemmConfig config;
  config.bf16_partials = bf16_partials;
  config.tma_sends = tma_sends;
  config.block_n = block_n;
  config.comm_ctas = comm_ctas;
  config.piece_rows = piece_rows;
  return config;
}

// ---- bootstrap through a Python callable ----------------------------------------------------

// allgather(data: bytes, timeout: float) -> bytes: receives this rank's bytes and the time limit
// (0: none), returns every rank's bytes in rank order. A TimeoutError (naming the ranks that did
// not arrive) becomes mk::Error(kTimeout); other Python exceptions and wrong results become
// mk::Error(kBootstrap) - on every rank a failed create() / alloc(), never a hang.
mk::TimedAllgatherFn python_allgather(nb::callable fn, int rank, int world_size) {
  // The callable is released with the GIL held, wherever the last copy of the std::function dies.
  std::shared_ptr<nb::object> holder(new nb::object(std::move(fn)), [](nb::object* p) {
    nb::gil_scoped_acquire gil;
    delete p;
  });
  return [holder, rank, world_size](const void* send, void* recv, std::size_t bytes,
                                    double seconds) {
    const std::size_t expected = bytes * static_cast<std::size_t>(world_size);
    std::string problem, timed_out;
    {
      nb::gil_scoped_acquire gil;
      try {
        nb::object result = (*holder)(nb::bytes(static_cast<const char*>(send), bytes),
                                      seconds > 0 ? seconds : 0.0);
        if (!nb::isinstance<nb::bytes>(result)) {
          problem = "returned a " + std::string(nb::type_name(result.type()).c_str()) +
                    "; expected bytes";
        } else {
          nb::bytes all = nb::borrow<nb::bytes>(result);
          if (all.size() != expected) {
            problem = "returned " + std::to_string(all.size()) + " bytes; expected " +
                      std::to_string(expected) + " (" + std::to_string(world_size) + " ranks x " +
                      std::to_string(bytes) + " bytes, in rank order)";
          } else if (expected > 0) {
            std::memcpy(recv, all.c_str(), expected);
          }
        }
      } catch (nb::python_error& e) {
        if (e.matches(PyExc_TimeoutError)) {
          timed_out = nb::cast<std::string>(nb::str(e.value()));
        } else {
          problem = std::string("raised ") + e.what();
        }
      }
    }
    if (!timed_out.empty()) throw mk::Error(mk::ErrorCode::kTimeout, timed_out);
    if (!problem.empty()) {
      throw mk::Error(mk::ErrorCode::kBootstrap, "rank " + std::to_string(rank) +
                                                     ": the Python allgather callback " + problem);
    }
  };
}

// ---- symmetric buffers ----------------------------------------------------------------------

// A symmetric buffer and the GPU it lives on (for DLPack).
struct PyBuffer {
  mk::SymmetricBuffer buffer;
  int device = 0;
};

// DLPack view of a buffer's bytes: uint8 [size] on its GPU. Exported without a framework it is a
// plain "dltensor" capsule; its deleter drops the reference to `owner`, the Python PyBuffer, so
// the memory stays mapped for as long as the consumer (e.g. a torch tensor) lives.
using ByteView = nb::ndarray<std::uint8_t, nb::ndim<1>, nb::device::cuda>;

ByteView dlpack_bytes(nb::handle owner) {
  const PyBuffer& b = nb::cast<const PyBuffer&>(owner);
  if (!b.buffer) throw nb::value_error("SymmetricBuffer.dlpack_bytes: the buffer is empty");
  const std::size_t shape[1] = {b.buffer.size()};
  return ByteView(b.buffer.data(), 1, shape, owner, /*strides=*/nullptr, nb::dtype<std::uint8_t>(),
                  nb::device::cuda::value, b.device);
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "mkernel C++ bindings (use the mkernel package; this module takes raw pointers)";

  // ---- errors ----
  {
    nb::dict attrs;
    attrs["code"] = nb::none();
    g_error_type = PyErr_NewExceptionWithDoc(
        "mkernel.MkernelError",
        "An error reported by mkernel's C++ layer. `code` names its kind: one of ERROR_CODES\n"
        "('timeout' when a peer never arrived within the communicator's time limit, ...);\n"
        "str(error) is the C++ message, naming the op, the argument or rank, and what was\n"
        "expected.",
        PyExc_RuntimeError, attrs.ptr());
    if (g_error_type == nullptr) throw nb::python_error();
    m.attr("MkernelError") = nb::steal(g_error_type);
  }
  nb::list codes;
  for (const CodeName& c : kCodeNames) codes.append(c.name);
  m.attr("ERROR_CODES") = nb::tuple(codes);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const mk::Error& e) {
      raise_mkernel_error(e);
    }
  });
  m.def(
      "_raise_error",
      [](std::string_view code, const std::string& message) {
        for (const CodeName& c : kCodeNames) {
          if (code == c.name) throw mk::Error(c.code, message);
        }
        throw nb::value_error(("unknown error code '" + std::string(code) + "'").c_str());
      },
      "code"_a, "message"_a, "Test hook: raises MkernelError(code, message) through C++.");

  m.def(
      "_callback_allgather",
      [](int rank, int world_size, nb::callable allgather, nb::bytes data, double timeout) {
        auto bootstrap = mk::make_callback_bootstrap(
            rank, world_size, python_allgather(std::move(allgather), rank, world_size));
        std::string send(data.c_str(), data.size());
        std::string recv(send.size() * static_cast<std::size_t>(world_size), '\0');
        {
          nb::gil_scoped_release nogil;  // as inside an op: the wrapper must take the GIL back
          bootstrap->allgather_within(send.data(), recv.data(), send.size(), timeout);
        }
        return nb::bytes(recv.data(), recv.size());
      },
      "rank"_a, "world_size"_a, "allgather"_a, "data"_a, "timeout"_a = 0.0,
      "Test hook: one allgather of `data` through the callback bootstrap (bounded by `timeout` "
      "seconds, 0: none), GIL released.");

  // ---- dtypes ----
  m.attr("DTYPES") = nb::make_tuple("bf16", "f16", "f32");
  m.def(
      "dtype_size", [](std::string_view dtype) { return mk::dtype_size(parse_dtype(dtype)); },
      "dtype"_a, "Bytes per element of 'bf16', 'f16' or 'f32'; ValueError for other names.");

  // ---- SymmetricBuffer ----
  nb::class_<PyBuffer>(m, "SymmetricBuffer",
                       "A buffer of the same size on every rank, mapped into every rank of the "
                       "node. Released when the last reference (this object or a DLPack view) "
                       "goes away.")
      .def_prop_ro(
          "data_ptr",
          [](const PyBuffer& b) { return reinterpret_cast<std::uintptr_t>(b.buffer.data()); },
          "This rank's copy (device pointer, int).")
      .def_prop_ro(
          "size", [](const PyBuffer& b) { return b.buffer.size(); }, "Bytes, equal on every rank.")
      .def_prop_ro(
          "device", [](const PyBuffer& b) { return b.device; }, "CUDA device ordinal.")
      .def(
          "peer",
          [](const PyBuffer& b, int local_rank) {
            return reinterpret_cast<std::uintptr_t>(b.buffer.peer(local_rank));
          },
          "local_rank"_a,
          "Local rank `local_rank`'s copy as mapped into this process (device pointer, int).")
      .def("dlpack_bytes", &dlpack_bytes,
           "A DLPack capsule viewing the buffer's bytes (uint8, shape [size], on its GPU) that "
           "keeps the buffer alive; consume it once, e.g. torch.from_dlpack(capsule).");

  // ---- Communicator ----
  nb::class_<mk::Communicator>(m, "Communicator",
                               "A communicator over `world_size` ranks (C++ mk::Communicator). "
                               "Operations must be issued in the same order on every rank.")
      .def_static(
          "create",
          [](int rank, int world_size, nb::callable allgather, int device, double timeout_seconds,
             int ranks_per_node) {
            mk::CommOptions options;
            options.device = device;
            options.timeout_seconds = timeout_seconds;
            options.ranks_per_node = ranks_per_node;
            auto bootstrap = mk::make_callback_bootstrap(
                rank, world_size, python_allgather(std::move(allgather), rank, world_size));
            return mk::Communicator::create(std::move(bootstrap), options);
          },
          "rank"_a, "world_size"_a, "allgather"_a, "device"_a, "timeout_seconds"_a = -1.0,
          "ranks_per_node"_a = -1,
          "Collective over all ranks. allgather(data: bytes, timeout: float) -> bytes must return "
          "every rank's data concatenated in rank order within `timeout` seconds (0: no limit), "
          "or raise TimeoutError naming the ranks that did not arrive (it is also called later, "
          "by alloc()). timeout_seconds: limit of every wait on a peer (-1: "
          "MKERNEL_TIMEOUT_S or 60 s; 0: none). ranks_per_node: virtual nodes (-1: "
          "MKERNEL_GPUS_PER_NODE or by host).")
      .def_prop_ro("rank", &mk::Communicator::rank)
      .def_prop_ro("world_size", &mk::Communicator::world_size)
      .def_prop_ro("local_rank", [](const mk::Communicator& c) { return c.topology().local_rank; })
      .def_prop_ro("local_size", [](const mk::Communicator& c) { return c.topology().local_size; })
      .def_prop_ro("node", [](const mk::Communicator& c) { return c.topology().node; })
      .def_prop_ro("num_nodes", [](const mk::Communicator& c) { return c.topology().num_nodes; })
      .def_prop_ro("device", &mk::Communicator::device)
      .def_prop_ro("timeout_seconds", &mk::Communicator::timeout_seconds)
      .def(
          "alloc",
          [](mk::Communicator& c, std::size_t bytes) {
            return PyBuffer{c.alloc(bytes), c.device()};
          },
          "bytes"_a, "Collective: a symmetric buffer of `bytes` (> 0, equal on every rank).")
      .def("check", &mk::Communicator::check,
           "Non-blocking: raises the error a kernel recorded (code 'timeout' naming the ranks "
           "and the signal); the communicator then refuses new work.")
      .def(
          "synchronize",
          [](mk::Communicator& c, std::uintptr_t stream) { c.synchronize(as_stream(stream)); },
          "stream"_a, nb::call_guard<nb::gil_scoped_release>(),
          "Waits for the stream (cudaStream_t as int), then check().");

  // ---- collectives ----
  // One binding shape for all three. The dtype is parsed before the GIL is released, so a bad
  // name raises ValueError.
  using Collective = void (*)(mk::Communicator&, const void*, void*, std::size_t, mk::DType,
                              cudaStream_t, const mk::CollectiveConfig&);
  auto bind_collective = [&m](const char* name, Collective op, const char* doc) {
    m.def(
        name,
        [op](mk::Communicator& comm, std::uintptr_t input, std::uintptr_t output, std::size_t count,
             std::string_view dtype, std::uintptr_t stream, int channels) {
          const mk::DType t = parse_dtype(dtype);
          mk::CollectiveConfig config;
          config.channels = channels;
          nb::gil_scoped_release nogil;
          op(comm, as_pointer<const void>(input), as_pointer(output), count, t, as_stream(stream),
             config);
        },
        "comm"_a, "input"_a, "output"_a, "count"_a, "dtype"_a, "stream"_a, "channels"_a = 0, doc);
  };
  bind_collective("all_gather", &mk::all_gather,
                  "output[r * count + i] = input of rank r [i]; output lies in a symmetric buffer. "
                  "Stream-ordered; no host synchronisation.");
  bind_collective("reduce_scatter", &mk::reduce_scatter,
                  "output[i] = sum over ranks r of input of rank r [rank * count + i] (fp32 "
                  "accumulation); input lies in a symmetric buffer. Stream-ordered; no host "
                  "synchronisation.");
  bind_collective("all_reduce", &mk::all_reduce,
                  "output[i] = sum over ranks of input[i], bitwise equal on every rank; input and "
                  "output lie in symmetric buffers (may be equal). Stream-ordered; no host "
                  "synchronisation.");

  // ---- GEMM engine ----
  m.def(
      "gemm",
      [](std::uintptr_t a, std::uintptr_t b, std::uintptr_t c, int64_t m_rows, int64_t n, int64_t k,
         std::string_view b_layout, std::uintptr_t stream, int block_n, int split_k,
         int block_m) {
        const mk::BLayout layout = parse_layout(b_layout, "gemm");
        mk::GemmConfig config;
        config.block_m = block_m;
        config.block_n = block_n;
        config.split_k = split_k;
        nb::gil_scoped_release nogil;
        mk::gemm(as_pointer<const void>(a), as_pointer<const void>(b), as_pointer(c), m_rows, n, k,
                 layout, as_stream(stream), config);
      },
      "a"_a, "b"_a, "c"_a, "m"_a, "n"_a, "k"_a, "b_layout"_a, "stream"_a, "block_n"_a = 0,
      "split_k"_a = 0, "block_m"_a = 0,
      "C[M, N] = A[M, K] @ op(B) in bf16 with fp32 accumulation on the current device; B is [N, K] "
      "('nk') or [K, N] ('kn'). Stream-ordered; no host synchronisation. block_n, split_k, "
      "block_m: GemmConfig's (0: the library's choice; split_k 1: K whole).");

  m.def(
      "grouped_gemm",
      [](std::uintptr_t a, std::uintptr_t b, std::uintptr_t c, std::uintptr_t group_rows,
         int groups, int64_t rows, int64_t n, int64_t k, std::string_view b_layout,
         std::uintptr_t stream, int block_n, bool masked, bool padded) {
        const mk::BLayout layout = parse_layout(b_layout, "grouped_gemm");
        mk::GemmConfig config;
        config.block_n = block_n;
        const mk::GroupedLayout groups_layout = masked   ? mk::GroupedLayout::kMasked
                                                : padded ? mk::GroupedLayout::kPadded
                                                         : mk::GroupedLayout::kContiguous;
        nb::gil_scoped_release nogil;
        mk::grouped_gemm(as_pointer<const void>(a), as_pointer<const void>(b), as_pointer(c),
                         as_pointer<const int32_t>(group_rows), groups, rows, n, k, layout,
                         as_stream(stream), config, groups_layout);
      },
      "a"_a, "b"_a, "c"_a, "group_rows"_a, "groups"_a, "rows"_a, "n"_a, "k"_a, "b_layout"_a,
      "stream"_a, "block_n"_a = 0, "masked"_a = false, "padded"_a = false,
      "C_g = A_g @ op(B_g) for every group g; the groups' rows back to back in A and C (rows = "
      "max_rows; padded: each group from a multiple of 128 rows), or each group in a block of "
      "`rows` rows (masked), their counts (int32) in device memory. Stream-ordered; no host "
      "synchronisation.");

  // ---- attention engine ----
  m.def(
      "attention",
      [](std::uintptr_t q, std::uintptr_t k, std::uintptr_t v, std::uintptr_t o, std::uintptr_t lse,
         nb::tuple q_strides, nb::tuple k_strides, nb::tuple v_strides, int64_t batch,
         int64_t seq_q, int64_t seq_kv, int64_t heads, int64_t kv_heads, int64_t head_dim,
         bool causal, double softmax_scale, std::uintptr_t stream) {
        const mk::AttentionTensor tq = attention_tensor(q, q_strides),
                                  tk = attention_tensor(k, k_strides),
                                  tv = attention_tensor(v, v_strides);
        const mk::AttentionProblem problem = attention_problem(
            batch, seq_q, seq_kv, heads, kv_heads, head_dim, causal, softmax_scale);
        nb::gil_scoped_release nogil;
        mk::attention(problem, tq, tk, tv, as_pointer(o), as_pointer<float>(lse),
                      as_stream(stream));
      },
      "q"_a, "k"_a, "v"_a, "o"_a, "lse"_a, "q_strides"_a, "k_strides"_a, "v_strides"_a, "batch"_a,
      "seq_q"_a, "seq_kv"_a, "heads"_a, "kv_heads"_a, "head_dim"_a, "causal"_a, "softmax_scale"_a,
      "stream"_a,
      "O[B, S_q, H, D] = softmax(scale Q K^T [causal, bottom-right]) V, bf16, fp32 softmax; "
      "q [B, S_q, H, D], k and v [B, S_kv, H_kv, D] with element strides (batch, seq, head) "
      "(last dimension contiguous); o contiguous; lse [B, H, S_q] fp32 or 0. softmax_scale 0: "
      "1 / sqrt(D). Stream-ordered; no host synchronisation.");

  m.def(
      "ring_attention_workspace_bytes",
      [](const mk::Communicator& comm, int64_t batch, int64_t seq_local, int64_t heads,
         int64_t kv_heads, int64_t head_dim, bool causal) {
        return mk::ring_attention_workspace_bytes(
            comm,
            attention_problem(batch, seq_local, seq_local, heads, kv_heads, head_dim, causal, 0.0));
      },
      "comm"_a, "batch"_a, "seq_local"_a, "heads"_a, "kv_heads"_a, "head_dim"_a, "causal"_a);
  m.def(
      "ring_attention",
      [](mk::Communicator& comm, std::uintptr_t q, std::uintptr_t k, std::uintptr_t v,
         std::uintptr_t o, std::uintptr_t lse, nb::tuple q_strides, nb::tuple kv_strides,
         int64_t batch, int64_t seq_local, int64_t heads, int64_t kv_heads, int64_t head_dim,
         bool causal, double softmax_scale, std::uintptr_t workspace, std::uintptr_t stream) {
        const mk::AttentionTensor tq = attention_tensor(q, q_strides),
                                  tk = attention_tensor(k, kv_strides),
                                  tv = attention_tensor(v, kv_strides);
        const mk::AttentionProblem p = attention_problem(batch, seq_local, seq_local, heads,
                                                         kv_heads, head_dim, causal, softmax_scale);
        nb::gil_scoped_release nogil;
        mk::ring_attention(comm, p, tq, tk, tv, as_pointer(o), as_pointer<float>(lse),
                           as_pointer(workspace), as_stream(stream));
      },
      "comm"_a, "q"_a, "k"_a, "v"_a, "o"_a, "lse"_a, "q_strides"_a, "kv_strides"_a, "batch"_a,
      "seq_local"_a, "heads"_a, "kv_heads"_a, "head_dim"_a, "causal"_a, "softmax_scale"_a,
      "workspace"_a, "stream"_a,
      "Attention of this rank's S_local queries over the whole sequence (the ranks' shares: "
      "contiguous, or causal: zigzag chunks r and 2w - 1 - r) in one launch; k and v with the "
      "same strides; o contiguous; lse [B, H, S_local] fp32 or 0; workspace symmetric "
      "(ring_attention_workspace_bytes). Stream-ordered; no host synchronisation.");

  // ---- fused GEMMs ----
  m.def(
      "ag_gemm",
      [](mk::Communicator& comm, std::uintptr_t a_shard, std::uintptr_t b, std::uintptr_t c,
         int64_t m_rows, int64_t n, int64_t k, std::string_view b_layout, std::uintptr_t workspace,
         std::uintptr_t stream, std::uintptr_t gathered, int block_n, int comm_ctas,
         int piece_rows) {
        const mk::BLayout layout = parse_layout(b_layout, "ag_gemm");
        const mk::FusedGemmConfig config = fused_config(block_n, comm_ctas, piece_rows);
        nb::gil_scoped_release nogil;
        mk::ag_gemm(comm, as_pointer<const void>(a_shard), as_pointer<const void>(b), as_pointer(c),
                    m_rows, n, k, layout, as_pointer(workspace), as_stream(stream), config,
                    as_pointer(gathered));
      },
      "comm"_a, "a_shard"_a, "b"_a, "c"_a, "m"_a, "n"_a, "k"_a, "b_layout"_a, "workspace"_a,
      "stream"_a, "gathered"_a = 0, "block_n"_a = 0, "comm_ctas"_a = 0, "piece_rows"_a = 0,
      "C[M, N] = concat over ranks of A_shard @ op(B); workspace: ag_gemm_workspace_bytes(M, K) "
      "bytes in a symmetric buffer; gathered (optional, 0 = none): [M, K] output of the gathered "
      "A. Stream-ordered; no host synchronisation.");
  m.def("ag_gemm_workspace_bytes", &mk::ag_gemm_workspace_bytes, "m"_a, "k"_a);
  m.def(
      "gemm_rs",
      [](mk::Communicator& comm, std::uintptr_t a, std::uintptr_t b, std::uintptr_t out,
         int64_t m_rows, int64_t n, int64_t k_local, std::string_view b_layout,
         std::uintptr_t workspace, std::uintptr_t stream, int block_n, bool bf16_partials,
         bool tma_sends) {
        const mk::BLayout layout = parse_layout(b_layout, "gemm_rs");
        const mk::FusedGemmConfig config = fused_config(block_n, 0, 0, bf16_partials, tma_sends);
        nb::gil_scoped_release nogil;
        mk::gemm_rs(comm, as_pointer<const void>(a), as_pointer<const void>(b), as_pointer(out),
                    m_rows, n, k_local, layout, as_pointer(workspace), as_stream(stream), config);
      },
      "comm"_a, "a"_a, "b"_a, "out"_a, "m"_a, "n"_a, "k_local"_a, "b_layout"_a, "workspace"_a,
      "stream"_a, "block_n"_a = 0, "bf16_partials"_a = false, "tma_sends"_a = true,
      "out[M / world, N] = this rank's rows of sum over ranks of A_r @ op(B_r); workspace: "
      "gemm_rs_workspace_bytes(comm, M, N) zeroed bytes in a symmetric buffer. "
      "Stream-ordered; no host synchronisation.");
  m.def("gemm_rs_workspace_bytes",
        nb::overload_cast<int64_t, int64_t, int>(&mk::gemm_rs_workspace_bytes), "m"_a, "n"_a,
        "world_size"_a);
  m.def("gemm_rs_workspace_bytes",
        nb::overload_cast<const mk::Communicator&, int64_t, int64_t>(&mk::gemm_rs_workspace_bytes),
        "comm"_a, "m"_a, "n"_a,
        "bytes for this communicator (across nodes: 3 x nodes - 2 times more)");
  m.def(
      "gemm_ar",
      [](mk::Communicator& comm, std::uintptr_t a, std::uintptr_t b, std::uintptr_t out,
         int64_t m_rows, int64_t n, int64_t k_local, std::string_view b_layout,
         std::uintptr_t workspace, std::uintptr_t stream, int block_n, bool bf16_partials,
         bool tma_sends) {
        const mk::BLayout layout = parse_layout(b_layout, "gemm_ar");
        const mk::FusedGemmConfig config = fused_config(block_n, 0, 0, bf16_partials, tma_sends);
        nb::gil_scoped_release nogil;
        mk::gemm_ar(comm, as_pointer<const void>(a), as_pointer<const void>(b), as_pointer(out),
                    m_rows, n, k_local, layout, as_pointer(workspace), as_stream(stream), config);
      },
      "comm"_a, "a"_a, "b"_a, "out"_a, "m"_a, "n"_a, "k_local"_a, "b_layout"_a, "workspace"_a,
      "stream"_a, "block_n"_a = 0, "bf16_partials"_a = false, "tma_sends"_a = true,
      "out[M, N] (symmetric) = sum over ranks of A_r @ op(B_r), the same bits on every rank; "
      "workspace: gemm_ar_workspace_bytes zeroed bytes in a symmetric buffer (left zero). "
      "Stream-ordered; no host synchronisation.");
  m.def(
      "gemm_ar_workspace_bytes",
      [](const mk::Communicator& comm, int64_t m_rows, int64_t n, int64_t k_local, int block_n) {
        return mk::gemm_ar_workspace_bytes(comm, m_rows, n, k_local, fused_config(block_n, 0, 0));
      },
      "comm"_a, "m"_a, "n"_a, "k_local"_a, "block_n"_a = 0);
  m.def(
      "gemm_ar_plan",
      [](const mk::Communicator& comm, int64_t m_rows, int64_t n, int64_t k_local, int block_n,
         bool bf16_partials) {
        return mk::gemm_ar_plan(comm, m_rows, n, k_local,
                                fused_config(block_n, 0, 0, bf16_partials))
            .describe();
      },
      "comm"_a, "m"_a, "n"_a, "k_local"_a, "block_n"_a = 0, "bf16_partials"_a = false,
      "The configuration gemm_ar picks for these arguments, as one line.");
  m.def(
      "gemm_rs_plan",
      [](const mk::Communicator& comm, int64_t m_rows, int64_t n, int64_t k_local, int block_n,
         bool bf16_partials) {
        return mk::gemm_rs_plan(comm, m_rows, n, k_local,
                                fused_config(block_n, 0, 0, bf16_partials))
            .describe();
      },
      "comm"_a, "m"_a, "n"_a, "k_local"_a, "block_n"_a = 0, "bf16_partials"_a = false,
      "The configuration gemm_rs picks for these arguments, as one line.");
  m.def(
      "ag_gemm_plan",
      [](const mk::Communicator& comm, int64_t m_rows, int64_t n, int64_t k, int block_n,
         int comm_ctas, int piece_rows) {
        return mk::ag_gemm_plan(comm, m_rows, n, k, fused_config(block_n, comm_ctas, piece_rows))
            .describe();
      },
      "comm"_a, "m"_a, "n"_a, "k"_a, "block_n"_a = 0, "comm_ctas"_a = 0, "piece_rows"_a = 0,
      "The configuration ag_gemm picks for these arguments, as one line.");

  // ---- MoE dispatch / combine ----
  m.def(
      "moe_plan",
      [](const mk::Communicator& comm, int64_t tokens, int64_t max_tokens, int64_t hidden,
         int top_k, int num_experts, std::string_view layout, int64_t capacity, int sms) {
        const mk::MoePlan p = mk::moe_plan(comm,
                                           moe_problem(tokens, max_tokens, hidden, top_k,
                                                       num_experts, layout, capacity, "moe_plan"),
                                           mk::MoeConfig{sms});
        return nb::make_tuple(p.rows, p.capacity, p.experts_local, p.ctas, p.workspace_bytes,
                              p.describe());
      },
      "comm"_a, "tokens"_a, "max_tokens"_a, "hidden"_a, "top_k"_a, "num_experts"_a, "layout"_a,
      "capacity"_a = 0, "sms"_a = 0,
      "(rows, capacity, experts_local, ctas, workspace_bytes, description) of a MoE problem.");
  m.def(
      "moe_dispatch",
      [](mk::Communicator& comm, int64_t tokens, int64_t max_tokens, int64_t hidden, int top_k,
         int num_experts, std::string_view layout, int64_t capacity, std::uintptr_t x,
         std::uintptr_t topk_idx, bool int64_index, std::uintptr_t recv_x,
         std::uintptr_t expert_rows, std::uintptr_t handle, std::uintptr_t workspace,
         std::uintptr_t stream, int sms) {
        const mk::MoeProblem p = moe_problem(tokens, max_tokens, hidden, top_k, num_experts, layout,
                                             capacity, "moe_dispatch");
        nb::gil_scoped_release nogil;
        mk::moe_dispatch(comm, p, as_pointer<const void>(x), as_pointer<const void>(topk_idx),
                         int64_index ? mk::IndexType::kInt64 : mk::IndexType::kInt32,
                         as_pointer(recv_x), as_pointer<int32_t>(expert_rows),
                         as_pointer<int32_t>(handle), as_pointer(workspace), as_stream(stream),
                         mk::MoeConfig{sms});
      },
      "comm"_a, "tokens"_a, "max_tokens"_a, "hidden"_a, "top_k"_a, "num_experts"_a, "layout"_a,
      "capacity"_a, "x"_a, "topk_idx"_a, "int64_index"_a, "recv_x"_a, "expert_rows"_a, "handle"_a,
      "workspace"_a, "stream"_a, "sms"_a = 0,
      "Routed rows of every rank to their local experts (mkernel/moe.h). Stream-ordered.");
  m.def(
      "moe_dispatch_gemm",
      [](mk::Communicator& comm, int64_t tokens, int64_t max_tokens, int64_t hidden, int top_k,
         int num_experts, std::string_view layout, int64_t capacity, std::uintptr_t x,
         std::uintptr_t topk_idx, bool int64_index, std::uintptr_t w, std::string_view w_layout,
         int64_t n, std::uintptr_t y, std::uintptr_t recv_x, std::uintptr_t expert_rows,
         std::uintptr_t handle, std::uintptr_t workspace, std::uintptr_t stream, int sms,
         int block_n) {
        const mk::MoeProblem p = moe_problem(tokens, max_tokens, hidden, top_k, num_experts, layout,
                                             capacity, "moe_dispatch_gemm");
        const mk::BLayout wl = parse_layout(w_layout, "moe_dispatch_gemm");
        nb::gil_scoped_release nogil;
        mk::moe_dispatch_gemm(comm, p, as_pointer<const void>(x), as_pointer<const void>(topk_idx),
                              int64_index ? mk::IndexType::kInt64 : mk::IndexType::kInt32,
                              as_pointer<const void>(w), wl, n, as_pointer(y), as_pointer(recv_x),
                              as_pointer<int32_t>(expert_rows), as_pointer<int32_t>(handle),
                              as_pointer(workspace), as_stream(stream),
                              mk::MoeConfig{sms, block_n});
      },
      "comm"_a, "tokens"_a, "max_tokens"_a, "hidden"_a, "top_k"_a, "num_experts"_a, "layout"_a,
      "capacity"_a, "x"_a, "topk_idx"_a, "int64_index"_a, "w"_a, "w_layout"_a, "n"_a, "y"_a,
      "recv_x"_a, "expert_rows"_a, "handle"_a, "workspace"_a, "stream"_a, "sms"_a = 0,
      "block_n"_a = 0,
      "moe_dispatch and the local experts' GEMM in one launch (mkernel/moe.h). Stream-ordered.");
  m.def(
      "moe_combine",
      [](mk::Communicator& comm, int64_t tokens, int64_t max_tokens, int64_t hidden, int top_k,
         int num_experts, std::string_view layout, int64_t capacity, std::uintptr_t y,
         std::uintptr_t topk_weights, std::uintptr_t handle, std::uintptr_t out,
         std::uintptr_t workspace, std::uintptr_t stream, int sms) {
        const mk::MoeProblem p = moe_problem(tokens, max_tokens, hidden, top_k, num_experts, layout,
                                             capacity, "moe_combine");
        nb::gil_scoped_release nogil;
        mk::moe_combine(comm, p, as_pointer<const void>(y), as_pointer<const float>(topk_weights),
                        as_pointer<const int32_t>(handle), as_pointer(out), as_pointer(workspace),
                        as_stream(stream), mk::MoeConfig{sms});
      },
      "comm"_a, "tokens"_a, "max_tokens"_a, "hidden"_a, "top_k"_a, "num_experts"_a, "layout"_a,
      "capacity"_a, "y"_a, "topk_weights"_a, "handle"_a, "out"_a, "workspace"_a, "stream"_a,
      "sms"_a = 0,
      "out[T, H] = per token, the sum over its slots of weight x the expert's row (fp32, slot "
      "order). Stream-ordered.");

  // ---- the MoE layer ----
  m.def(
      "moe_layer_plan",
      [](const mk::Communicator& comm, int64_t tokens, int64_t max_tokens, int64_t hidden,
         int top_k, int num_experts, std::string_view layout, int64_t capacity,
         int64_t intermediate, int sms, int block_n) {
        const mk::MoeLayerPlan p =
            mk::moe_layer_plan(comm,
                               moe_problem(tokens, max_tokens, hidden, top_k, num_experts, layout,
                                           capacity, "moe_layer_plan"),
                               intermediate, mk::MoeConfig{sms, block_n});
        return nb::make_tuple(p.dispatch.rows, p.dispatch.capacity, p.dispatch.experts_local,
                              p.dispatch.ctas, p.dispatch.workspace_bytes, p.scratch_bytes,
                              p.describe());
      },
      "comm"_a, "tokens"_a, "max_tokens"_a, "hidden"_a, "top_k"_a, "num_experts"_a, "layout"_a,
      "capacity"_a, "intermediate"_a, "sms"_a = 0, "block_n"_a = 0,
      "(rows, capacity, experts_local, ctas, workspace_bytes, scratch_bytes, description) of a "
      "MoE layer.");
  m.def(
      "moe_layer",
      [](mk::Communicator& comm, int64_t tokens, int64_t max_tokens, int64_t hidden, int top_k,
         int num_experts, std::string_view layout, int64_t capacity, int64_t intermediate,
         std::uintptr_t x, std::uintptr_t topk_idx, bool int64_index, std::uintptr_t topk_weights,
         std::uintptr_t w13, std::uintptr_t w2, std::uintptr_t out, std::uintptr_t workspace,
         std::uintptr_t scratch, std::uintptr_t stream, int sms, int block_n) {
        const mk::MoeProblem p = moe_problem(tokens, max_tokens, hidden, top_k, num_experts, layout,
                                             capacity, "moe_layer");
        nb::gil_scoped_release nogil;
        mk::moe_layer(comm, p, intermediate, as_pointer<const void>(x),
                      as_pointer<const void>(topk_idx),
                      int64_index ? mk::IndexType::kInt64 : mk::IndexType::kInt32,
                      as_pointer<const float>(topk_weights), as_pointer<const void>(w13),
                      as_pointer<const void>(w2), as_pointer(out), as_pointer(workspace),
                      as_pointer(scratch), as_stream(stream), mk::MoeConfig{sms, block_n});
      },
      "comm"_a, "tokens"_a, "max_tokens"_a, "hidden"_a, "top_k"_a, "num_experts"_a, "layout"_a,
      "capacity"_a, "intermediate"_a, "x"_a, "topk_idx"_a, "int64_index"_a, "topk_weights"_a,
      "w13"_a, "w2"_a, "out"_a, "workspace"_a, "scratch"_a, "stream"_a, "sms"_a = 0,
      "block_n"_a = 0,
      "The whole MoE layer: dispatch, gate / up + SwiGLU, down, weighted combine "
      "(mkernel/moe.h). Stream-ordered.");
}
