// fedagg plan runner: replays a compiled all-reduce Plan (fedagg/collectives/executor.py) over a
// torch.distributed ProcessGroup, in C++, with the GIL released.
//
// It sends exactly the messages of the Python replay (`executor._replay` with the header of
// `api._exchange_header_messages`), in the same order, so ranks on either path interoperate.
// Built on first use with torch.utils.cpp_extension (fedagg/collectives/plan_runner.py).
//
// Why: on gloo, every message of a pipelined schedule is a hand-off between the rank's calling
// thread and gloo's I/O thread; with the Python replay each hand-off also pays the
// interpreter (torch.distributed wrappers, request objects, tensor views, the header's build
// and check): 0.2-0.6 ms per call on the 2-core VM (docs/benchmarks.md), as much as a whole
// 1 MB all-reduce. Here the same calls cost microseconds.

#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

using WorkPtr = c10::intrusive_ptr<c10d::Work>;
using PGPtr = c10::intrusive_ptr<c10d::ProcessGroup>;

constexpr int64_t kSend = 0;    // executor.SEND
constexpr int64_t kDirect = 0;  // executor.DIRECT
constexpr int64_t kReduce = 1;  // executor.REDUCE
constexpr int kTag = 0;         // the tag of dist.isend / dist.irecv

struct Recv {
  int64_t slot, src;
  bool direct;
  int64_t offset, length;
};

struct Op {
  int64_t code, a, offset, length, b;
  std::vector<int64_t> readers;
};

struct RideOut {
  int64_t dst, offset, length;
};

struct RideIn {
  int64_t slot, src, length;
};

// One rank's compiled plan (see executor.Plan for the meaning of every field).
class PlanRunner {
 public:
  PlanRunner(
      std::vector<std::tuple<int64_t, int64_t, int64_t>> ride_out,
      std::vector<std::tuple<int64_t, int64_t, int64_t>> ride_in,
      std::vector<std::tuple<int64_t, int64_t, bool, int64_t, int64_t>> recvs,
      std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, std::vector<int64_t>>>
          ops,
      int64_t slots,
      int64_t readers)
      : slots_(slots), readers_(readers) {
    for (auto& [d, o, l] : ride_out) ride_out_.push_back({d, o, l});
    for (auto& [s, src, l] : ride_in) ride_in_.push_back({s, src, l});
    for (auto& [s, src, d, o, l] : recvs) recvs_.push_back({s, src, d, o, l});
    for (auto& [c, a, o, l, b, r] : ops) ops_.push_back({c, a, o, l, b, r});
  }

  // Runs the plan. With a header (`head`: this rank's 72 header bytes), first the header round
  // of api._exchange_header_messages: post one receive of `cap` bytes per peer (peers in rank
  // order, region i of `rbuf`), post the data receives, send every peer the header followed by
  // the step-0 data that rides with it (built in `sbuf`), wait for the peers' headers and
  // compare them with `head` byte for byte. On a difference, return at once with
  // (false, data receives, their sources, pending sends): Python decodes the headers, fills
  // the peers' posted receives and raises. Otherwise (and without a header) replay the ops
  // and wait for every send; return (true, {}, {}, {}).
  std::tuple<bool, std::vector<WorkPtr>, std::vector<int64_t>, std::vector<WorkPtr>> run(
      const PGPtr& up,
      const PGPtr& down,
      int64_t rank,
      int64_t world,
      at::Tensor work,
      at::Tensor scratch,
      std::optional<at::Tensor> head,
      std::optional<at::Tensor> rbuf,
      std::optional<at::Tensor> sbuf,
      int64_t cap,
      int64_t timeout_ms) {
    py::gil_scoped_release nogil;
    const auto timeout = std::chrono::milliseconds(timeout_ms);
    const auto wire = scratch.scalar_type();
    const bool convert = wire != work.scalar_type();
    std::vector<at::Tensor> got(slots_);
    std::vector<WorkPtr> reqs(slots_);
    std::vector<WorkPtr> readers(readers_);
    std::vector<WorkPtr> sends;
    std::vector<at::Tensor> keep;  // send buffers that must outlive their sends

    // Messages to a higher rank travel on `up`, to a lower rank on `down` (the same group
    // when the communicator does not split directions): see TorchDistCommunicator.
    auto send = [&](const at::Tensor& t, int64_t dst) {
      std::vector<at::Tensor> v{t};
      sends.push_back((rank < dst ? up : down)->send(v, static_cast<int>(dst), kTag));
      return sends.back();
    };
    auto recv = [&](const at::Tensor& t, int64_t src) {
      std::vector<at::Tensor> v{t};
      return (src < rank ? up : down)->recv(v, static_cast<int>(src), kTag);
    };
    auto post = [&]() {
      for (const auto& r : recvs_) {
        at::Tensor buf = (r.direct ? work : scratch).narrow(0, r.offset, r.length);
        got[r.slot] = buf;
        reqs[r.slot] = recv(buf, r.src);
      }
    };

    if (head.has_value()) {
      const int64_t hbytes = head->numel();
      const uint8_t* mine = head->data_ptr<uint8_t>();
      std::vector<int64_t> peers;
      for (int64_t p = 0; p < world; ++p) {
        if (p != rank) peers.push_back(p);
      }
      std::vector<WorkPtr> hrecv;
      for (size_t i = 0; i < peers.size(); ++i) {
        hrecv.push_back(recv(rbuf->narrow(0, static_cast<int64_t>(i) * cap, cap), peers[i]));
      }
      post();
      int64_t pos = 0;
      for (int64_t p : peers) {
        const RideOut* ride = nullptr;
        for (const auto& r : ride_out_) {
          if (r.dst == p) ride = &r;
        }
        int64_t size = hbytes;
        at::Tensor payload;
        if (ride != nullptr) {
          payload = work.narrow(0, ride->offset, ride->length);
          if (convert) payload = payload.to(wire);
          size += payload.numel() * payload.element_size();
        }
        at::Tensor msg = sbuf->narrow(0, pos, size);
        pos += size;
        std::memcpy(msg.data_ptr<uint8_t>(), mine, hbytes);
        if (ride != nullptr) {
          std::memcpy(
              msg.data_ptr<uint8_t>() + hbytes, payload.data_ptr(), size - hbytes);
        }
        send(msg, p);
      }
      bool agree = true;
      for (auto& w : hrecv) w->wait(timeout);
      for (size_t i = 0; i < peers.size(); ++i) {
        const uint8_t* theirs = rbuf->data_ptr<uint8_t>() + static_cast<int64_t>(i) * cap;
        if (std::memcmp(theirs, mine, hbytes) != 0) agree = false;
      }
      if (!agree) {
        std::vector<WorkPtr> posted;
        std::vector<int64_t> sources;
        for (const auto& r : recvs_) {
          posted.push_back(reqs[r.slot]);
          sources.push_back(r.src);
        }
        return {false, posted, sources, sends};
      }
      for (const auto& r : ride_in_) {
        int64_t i = r.src < rank ? r.src : r.src - 1;
        got[r.slot] = rbuf->narrow(0, i * cap + hbytes, r.length * scratch.element_size())
                          .view(wire);
      }
    } else {
      post();
    }

    for (const auto& op : ops_) {
      if (op.code == kSend) {
        at::Tensor data = work.narrow(0, op.offset, op.length);
        if (convert) {
          at::Tensor out = data.to(wire);
          if (op.b != 0) data.copy_(out);  // round our own copy too: ranks end bit-identical
          data = out;
          keep.push_back(data);
        }
        auto req = send(data, op.a);
        if (!op.readers.empty() && op.readers[0] >= 0) readers[op.readers[0]] = req;
        continue;
      }
      if (reqs[op.a]) reqs[op.a]->wait(timeout);
      if (op.b == kDirect) continue;
      for (int64_t r : op.readers) {
        if (readers[r]) readers[r]->wait(timeout);  // a pending send still reads this segment
      }
      at::Tensor view = work.narrow(0, op.offset, op.length);
      if (op.b == kReduce) {
        view.add_(got[op.a]);
      } else {
        view.copy_(got[op.a]);
      }
    }
    for (auto& w : sends) w->wait(timeout);
    return {true, {}, {}, {}};
  }

 private:
  std::vector<RideOut> ride_out_;
  std::vector<RideIn> ride_in_;
  std::vector<Recv> recvs_;
  std::vector<Op> ops_;
  int64_t slots_;
  int64_t readers_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<PlanRunner>(m, "PlanRunner")
      .def(py::init<
           std::vector<std::tuple<int64_t, int64_t, int64_t>>,
           std::vector<std::tuple<int64_t, int64_t, int64_t>>,
           std::vector<std::tuple<int64_t, int64_t, bool, int64_t, int64_t>>,
           std::vector<
               std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, std::vector<int64_t>>>,
           int64_t,
           int64_t>())
      .def("run", &PlanRunner::run);
}
