// The side channel of SyncBatchNorm's sums (dist_gluon/sidechannel.py): one TCP
// connection between every pair of a job's workers, over which each worker sends its
// array of a key to every peer and sums everyone's in rank order, as an asynchronous
// operation of MXNet's engine.
//
// dg_side_open(rank, size, fds, names, timeout) -> channel
//     takes the connected sockets (fds[r] for peer r, -1 for this rank) and starts the
//     receiver thread
// dg_side_run(run_context, on_complete, task)       (MXEnginePushAsyncND's function)
//     sends the task's array to every peer and waits, off the engine's threads, for
//     theirs: the receiver thread (or this call, when they came first) writes
//     a_0 + a_1 + ... + a_{size-1} (in that order, in the array's dtype: the same bits
//     on every rank) into the array and completes the operation; a closed connection, a
//     size that differs or a peer silent for `timeout` seconds completes it with an
//     error that names the peer and the key (the engine raises it where the array is
//     read)
// dg_side_close(channel)
//     fails what still waits, closes the sockets and joins the receiver thread
//
// A key's messages from one peer arrive in the order the peer sent them (one TCP
// stream), and a key's next sum cannot start on a rank before its previous one ended
// there (the engine orders the writes of one array): each key keeps a queue per peer.
#include <dmlc/logging.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace {

// MXNet 1.9's engine::CallbackOnComplete (include/mxnet/engine.h): copied by value, it
// outlives the call that hands it over
struct OnComplete {
  void (*callback)(void*, void*, const dmlc::Error*);
  void* engine;
  void* param;
};

typedef int (*GetData)(void*, void**);
typedef int (*FreeHandle)(void*);

using Clock = std::chrono::steady_clock;

struct Header {
  uint64_t key;
  uint32_t bytes;
  uint32_t dtype;
};

struct Waiting {
  OnComplete done;
  void* handle;          // the task's own handle on the array (freed at completion)
  void* data;
  std::vector<char> own; // this rank's contribution
  uint32_t dtype;
  Clock::time_point deadline;
  bool active = false;
};

struct Key {
  std::string name;
  std::vector<std::deque<std::vector<char>>> received;   // by peer rank
  Waiting waiting;
};

struct Channel;

struct Task {
  Channel* channel;
  uint64_t key;
  void* handle;
  uint32_t dtype;        // 0 float32, 1 float64 (MXNet's codes)
  int64_t size;
  GetData get_data;
  FreeHandle free_handle;
};

std::string peer_name(const Channel* ch, int rank);

struct Channel {
  int rank = 0, size = 1;
  std::vector<int> fds;
  std::vector<std::string> names;          // "rank r (address)"
  std::vector<std::string> closed;         // why peer r's connection ended ("" open)
  std::vector<std::unique_ptr<std::mutex>> send_locks;
  double timeout = 300;
  std::mutex mu;
  std::unordered_map<uint64_t, Key> keys;
  std::string broken;                      // set once: every later sum fails with it
  int wake[2] = {-1, -1};
  bool stopping = false;
  std::thread receiver;

  Key& key(uint64_t id) {
    Key& k = keys[id];
    if (k.received.empty()) k.received.resize(size);
    return k;
  }

  std::string key_name(uint64_t id) {
    auto it = keys.find(id);
    if (it != keys.end() && !it->second.name.empty()) return it->second.name;
    char text[32];
    snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(id));
    return text;
  }
};

std::string peer_name(const Channel* ch, int rank) { return ch->names[rank]; }

void finish(Waiting* w, const std::string& error, FreeHandle free_handle) {
  OnComplete done = w->done;
  void* handle = w->handle;
  w->active = false;
  w->own.clear();
  w->own.shrink_to_fit();
  free_handle(handle);
  if (error.empty()) {
    done.callback(done.engine, done.param, nullptr);
  } else {
    dmlc::Error err(error);
    done.callback(done.engine, done.param, &err);
  }
}

FreeHandle g_free = nullptr;   // MXNDArrayFree, set by dg_side_open

template <typename T>
void add_in_order(Channel* ch, Key& k, T* out, const T* own, int64_t n) {
  // a_0 + a_1 + ... in rank order, whoever this rank is: the same bits everywhere
  std::vector<T> total(n);
  for (int r = 0; r < ch->size; ++r) {
    const T* a = r == ch->rank ? own : reinterpret_cast<const T*>(k.received[r].front().data());
    if (r == 0) {
      for (int64_t i = 0; i < n; ++i) total[i] = a[i];
    } else {
      for (int64_t i = 0; i < n; ++i) total[i] = total[i] + a[i];
    }
  }
  std::memcpy(out, total.data(), n * sizeof(T));
}

// Under ch->mu: the error that stops key `id`'s sum, or "" if it can go on.
std::string missing_peer(Channel* ch, uint64_t id, Key& k) {
  if (!ch->broken.empty()) return ch->broken;
  for (int r = 0; r < ch->size; ++r) {
    if (r != ch->rank && k.received[r].empty() && !ch->closed[r].empty()) {
      return "SyncBatchNorm side channel: " + peer_name(ch, r) + " " + ch->closed[r] +
             " before sending its part of " + ch->key_name(id) + " (rank " +
             std::to_string(ch->rank) + " waits for it)";
    }
  }
  return "";
}

// Under ch->mu: whether key k's waiting sum has every peer's part.
bool ready(Channel* ch, Key& k) {
  if (!k.waiting.active) return false;
  for (int r = 0; r < ch->size; ++r) {
    if (r != ch->rank && k.received[r].empty()) return false;
  }
  return true;
}

// Under ch->mu: write the sum of key `id` into the waiting array; "" or the error.
std::string sum_into(Channel* ch, uint64_t id, Key& k) {
  Waiting& w = k.waiting;
  for (int r = 0; r < ch->size; ++r) {
    if (r != ch->rank && k.received[r].front().size() != w.own.size()) {
      std::string error = "SyncBatchNorm side channel: " + peer_name(ch, r) + " sent " +
          std::to_string(k.received[r].front().size()) + " bytes for " + ch->key_name(id) +
          ", rank " + std::to_string(ch->rank) + " has " + std::to_string(w.own.size()) +
          " (the ranks' layers differ)";
      return error;
    }
  }
  int64_t bytes = static_cast<int64_t>(w.own.size());
  if (w.dtype == 0) {
    add_in_order(ch, k, static_cast<float*>(w.data), reinterpret_cast<float*>(w.own.data()),
                 bytes / 4);
  } else {
    add_in_order(ch, k, static_cast<double*>(w.data), reinterpret_cast<double*>(w.own.data()),
                 bytes / 8);
  }
  for (int r = 0; r < ch->size; ++r) {
    if (r != ch->rank) k.received[r].pop_front();
  }
  return "";
}

struct Completion {
  Waiting waiting;
  std::string error;
};

// Under ch->mu: take key k's waiting sum out for completion outside the lock.
Completion take(Key& k, const std::string& error) {
  Completion c{std::move(k.waiting), error};
  k.waiting.active = false;
  k.waiting.own.clear();
  return c;
}

void run_completions(std::vector<Completion>& done) {
  for (Completion& c : done) finish(&c.waiting, c.error, g_free);
  done.clear();
}

bool read_all(int fd, void* buffer, size_t bytes) {
  char* p = static_cast<char*>(buffer);
  while (bytes > 0) {
    ssize_t got = recv(fd, p, bytes, 0);
    if (got == 0) {
      errno = 0;
      return false;
    }
    if (got < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += got;
    bytes -= static_cast<size_t>(got);
  }
  return true;
}

bool write_all(int fd, const void* buffer, size_t bytes) {
  const char* p = static_cast<const char*>(buffer);
  while (bytes > 0) {
    ssize_t sent = send(fd, p, bytes, MSG_NOSIGNAL);
    if (sent < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += sent;
    bytes -= static_cast<size_t>(sent);
  }
  return true;
}

std::string closed_reason(int err, double timeout) {
  if (err == 0 || err == ECONNRESET || err == EPIPE) {
    return "closed its side channel (it exited or failed)";
  }
  if (err == EAGAIN || err == EWOULDBLOCK) {
    return "sent nothing for " + std::to_string(static_cast<int>(timeout)) +
           " s in the middle of a message";
  }
  return std::string("lost its side channel (") + strerror(err) + ")";
}

// Under ch->mu: peer r's connection ended; fail the sums that wait for it.
void peer_closed(Channel* ch, int r, const std::string& why, std::vector<Completion>& done) {
  if (!ch->closed[r].empty()) return;
  ch->closed[r] = why;
  for (auto& item : ch->keys) {
    Key& k = item.second;
    if (k.waiting.active && k.received[r].empty()) {
      done.push_back(take(k, missing_peer(ch, item.first, k)));
    }
  }
}

void receive_loop(Channel* ch) {
  std::vector<pollfd> polled;
  std::vector<int> ranks;
  for (int r = 0; r < ch->size; ++r) {
    if (r == ch->rank) continue;
    polled.push_back({ch->fds[r], POLLIN, 0});
    ranks.push_back(r);
  }
  polled.push_back({ch->wake[0], POLLIN, 0});
  std::vector<Completion> done;
  for (;;) {
    int ready_count = poll(polled.data(), polled.size(), 200);
    {
      std::lock_guard<std::mutex> lock(ch->mu);
      if (ch->stopping) break;
    }
    if (ready_count < 0 && errno != EINTR) break;
    for (size_t i = 0; i + 1 < polled.size(); ++i) {
      if (polled[i].fd < 0 || !(polled[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      int r = ranks[i];
      Header header;
      std::vector<char> body;
      bool ok = read_all(polled[i].fd, &header, sizeof(header));
      if (ok) {
        body.resize(header.bytes);
        ok = read_all(polled[i].fd, body.data(), header.bytes);
      }
      int err = errno;
      std::lock_guard<std::mutex> lock(ch->mu);
      if (!ok) {
        peer_closed(ch, r, closed_reason(err, ch->timeout), done);
        polled[i].fd = -1;
        continue;
      }
      Key& k = ch->key(header.key);
      k.received[r].push_back(std::move(body));
      if (ready(ch, k)) {
        std::string error = sum_into(ch, header.key, k);
        if (!error.empty() && ch->broken.empty()) ch->broken = error;
        done.push_back(take(k, error));
      }
    }
    {
      // the sums whose peers stayed silent past the timeout
      std::lock_guard<std::mutex> lock(ch->mu);
      Clock::time_point now = Clock::now();
      for (auto& item : ch->keys) {
        Key& k = item.second;
        if (!k.waiting.active || now < k.waiting.deadline) continue;
        std::string silent;
        for (int r = 0; r < ch->size; ++r) {
          if (r != ch->rank && k.received[r].empty()) {
            silent += (silent.empty() ? "" : ", ") + peer_name(ch, r);
          }
        }
        std::string error = "SyncBatchNorm side channel: rank " + std::to_string(ch->rank) +
                            " waited " + std::to_string(static_cast<int>(ch->timeout)) +
                            " s for the part of " + ch->key_name(item.first) + " from " +
                            silent + " (it stopped, or runs other layers: every rank must "
                            "run the same training forward and backward passes)";
        // a part that comes later would pair with the key's next sum: the ranks are out
        // of step, and every later sum fails too
        if (ch->broken.empty()) ch->broken = error;
        done.push_back(take(k, error));
      }
    }
    run_completions(done);
  }
  run_completions(done);
}

}  // namespace

extern "C" {

void* dg_side_open(int rank, int size, const int* fds, const char* const* names,
                   double timeout, void* free_handle) {
  g_free = reinterpret_cast<FreeHandle>(free_handle);
  Channel* ch = new Channel;
  ch->rank = rank;
  ch->size = size;
  ch->timeout = timeout;
  for (int r = 0; r < size; ++r) {
    ch->fds.push_back(fds[r]);
    ch->names.push_back(names[r]);
    ch->closed.push_back("");
    ch->send_locks.emplace_back(new std::mutex);
    if (fds[r] >= 0) {
      // a send blocks only on a full socket buffer (a peer that stopped reading)
      timeval tv{static_cast<time_t>(timeout), 0};
      setsockopt(fds[r], SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
      setsockopt(fds[r], SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
      int one = 1;
      setsockopt(fds[r], IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    }
  }
  if (pipe(ch->wake) != 0) {
    delete ch;
    return nullptr;
  }
  ch->receiver = std::thread(receive_loop, ch);
  return ch;
}

void dg_side_name_key(void* channel, uint64_t key, const char* name) {
  Channel* ch = static_cast<Channel*>(channel);
  std::lock_guard<std::mutex> lock(ch->mu);
  ch->key(key).name = name;
}

void* dg_side_task(void* channel, uint64_t key, void* handle, int dtype, int64_t size,
                   void* get_data, void* free_handle) {
  return new Task{static_cast<Channel*>(channel), key, handle, static_cast<uint32_t>(dtype),
                  size, reinterpret_cast<GetData>(get_data),
                  reinterpret_cast<FreeHandle>(free_handle)};
}

void dg_side_free_task(void* param) {
  Task* task = static_cast<Task*>(param);
  if (task->handle != nullptr) task->free_handle(task->handle);   // never ran
  delete task;
}

void dg_side_run(void* run_context, void* on_complete, void* param) {
  (void)run_context;
  Task* task = static_cast<Task*>(param);
  Channel* ch = task->channel;
  Waiting w;
  w.done = *static_cast<OnComplete*>(on_complete);
  w.handle = task->handle;
  task->handle = nullptr;   // the completion frees it
  w.dtype = task->dtype;
  w.data = nullptr;
  task->get_data(w.handle, &w.data);
  size_t bytes = static_cast<size_t>(task->size) * (task->dtype == 0 ? 4 : 8);
  w.own.assign(static_cast<char*>(w.data), static_cast<char*>(w.data) + bytes);
  w.deadline = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(ch->timeout * 1000));
  w.active = true;

  std::string error;
  {
    std::lock_guard<std::mutex> lock(ch->mu);
    error = ch->broken;
    if (error.empty() && ch->key(task->key).waiting.active) {
      error = "SyncBatchNorm side channel: " + ch->key_name(task->key) +
              " started again before its previous sum ended";
    }
  }
  Header header{task->key, static_cast<uint32_t>(bytes), task->dtype};
  std::vector<Completion> others;   // sums of other keys that waited for a lost peer
  for (int r = 0; r < ch->size && error.empty(); ++r) {
    if (r == ch->rank) continue;
    bool sent;
    {
      std::lock_guard<std::mutex> send_lock(*ch->send_locks[r]);
      sent = write_all(ch->fds[r], &header, sizeof(header)) &&
             write_all(ch->fds[r], w.own.data(), bytes);
    }
    if (!sent) {
      int err = errno;
      std::lock_guard<std::mutex> lock(ch->mu);
      if (err == EAGAIN || err == EWOULDBLOCK) {
        peer_closed(ch, r, "read nothing for " + std::to_string(static_cast<int>(ch->timeout)) +
                               " s", others);
      } else {
        peer_closed(ch, r, closed_reason(err, ch->timeout), others);
      }
      error = "SyncBatchNorm side channel: " + peer_name(ch, r) + " " + ch->closed[r] +
              " (rank " + std::to_string(ch->rank) + " could not send it its part of " +
              ch->key_name(task->key) + ")";
    }
  }
  run_completions(others);
  if (!error.empty()) {
    finish(&w, error, g_free);
    return;
  }
  Completion completion;
  bool now = false;
  {
    std::lock_guard<std::mutex> lock(ch->mu);
    Key& k = ch->key(task->key);
    k.waiting = std::move(w);
    std::string missing = missing_peer(ch, task->key, k);
    if (!missing.empty()) {
      completion = take(k, missing);
      now = true;
    } else if (ready(ch, k)) {
      std::string failed = sum_into(ch, task->key, k);
      if (!failed.empty() && ch->broken.empty()) ch->broken = failed;
      completion = take(k, failed);
      now = true;
    }
  }
  if (now) finish(&completion.waiting, completion.error, g_free);
}

void dg_side_close(void* channel) {
  Channel* ch = static_cast<Channel*>(channel);
  std::vector<Completion> done;
  {
    std::lock_guard<std::mutex> lock(ch->mu);
    ch->stopping = true;
    ch->broken = "SyncBatchNorm side channel: closed (the process is exiting)";
    for (auto& item : ch->keys) {
      if (item.second.waiting.active) done.push_back(take(item.second, ch->broken));
    }
  }
  if (write(ch->wake[1], "x", 1) < 0) {
    // the receiver wakes within its poll period anyway
  }
  if (ch->receiver.joinable()) ch->receiver.join();
  run_completions(done);
  for (int fd : ch->fds) {
    if (fd >= 0) close(fd);
  }
  close(ch->wake[0]);
  close(ch->wake[1]);
}

}  // extern "C"

// ---------------------------------------------------------------------------------------
// SyncBatchNorm's backward function, in C++ (dist_gluon/syncbn.py, _GlobalAffine).
//
// MXNet runs an autograd Function's backward by calling the function's callback in one
// of its custom-operator threads. A Python callback costs the layer about a millisecond
// a step there (the GIL, Python wrappers of the arrays, every operator invoked from
// Python), on the backward pass's critical path. This callback queues the same
// operators as the Python one, with the same arrays, through MXNet's C API:
//
//   mine  = graph "mine"(dscale, dshift, scale, invstd)      into the layer's grads array
//   the side channel's sum of grads (dg_side_run, as SideChannel.sum queues it)
//   dx_scale, dx_shift, dgb = graph "back"(grads, own_mean, mean, share, dscale, dshift,
//                                          invstd)
//   dx = BatchNorm(x, dx_scale, dx_shift, own_mean, unit variance, use_global_stats)
//   x's and [gamma, beta]'s gradients written (or added) from dx and dgb
//
// and returns: nothing waits in the callback, the engine orders the operators.
//
// dg_syncbn_api(functions, creators)        MXNet's C API functions and operators, once
// dg_syncbn_plan(...) -> plan               a layer's arrays and graphs, once
// dg_syncbn_forward(plan, ...)              a layer's forward pass, and its backward's state
// dg_syncbn_record(state, x, gb, scale, shift)   MXCustomFunctionRecord of the state
//                                           dg_syncbn_forward made, with the callbacks
//                                           below (state freed by MXNet)
// dg_syncbn_error() -> text                 the last failure of a callback, "" if none
// dg_syncbn_calls() -> n                    callbacks run so far in this process

namespace {

typedef int (*InvokeEx)(void*, int, void**, int*, void***, int, const char**, const char**,
                        const int**);
typedef int (*InvokeCached)(void*, int, void**, int*, void***, const int**);
typedef int (*PushAsync)(void*, void*, void*, void*, void**, int, void**, int, void*, int,
                         const char*, bool);
typedef int (*ShallowCopy)(void*, void**);
typedef const char* (*LastError)();
typedef int (*RecordFunction)(int, void**, int, void**, void*);

struct Api {
  InvokeEx invoke = nullptr;
  InvokeCached invoke_cached = nullptr;
  PushAsync push_async = nullptr;
  ShallowCopy shallow_copy = nullptr;
  FreeHandle free_handle = nullptr;
  GetData get_data = nullptr;
  LastError last_error = nullptr;
  RecordFunction record = nullptr;
  void* batchnorm = nullptr;   // operator handles (NNGetOpHandle)
  void* copyto = nullptr;
  void* add = nullptr;
};

Api g_api;
std::atomic<int64_t> g_calls(0);   // backward callbacks run (tests read it)
std::mutex g_error_mu;
std::string g_error;

// MXNet 1.9's MXCallbackList (include/mxnet/c_api.h)
struct CallbackList {
  int num_callbacks;
  int (**callbacks)(void);
  void** contexts;
};

// the arrays a graph reads, by slot: where the callback finds each
enum Slot { kDScale, kDShift, kScale, kInvstd, kGrads, kOwnMean, kMean, kShare, kSlots };

struct Saved {
  Channel* channel;
  uint64_t key;
  int dtype;
  int64_t grads_size;
  void* saved[kSlots];          // own handles (kDScale and kDShift unused)
  void* x;
  void* unit_var;
  void* mine_op;                // CachedOp handles of the layer's graphs
  void* back_op;
  std::vector<int> mine_order;  // the graphs' inputs, as slots
  std::vector<int> back_order;
  int context[2];               // mxnet::Context of the layer's device
  std::string axis;
  int (*callbacks[2])(void);
  void* contexts[2];
  CallbackList list;
};

void remember_error(const std::string& what) {
  std::string text = "SyncBatchNorm (compiled): " + what + ": " +
                     (g_api.last_error != nullptr ? g_api.last_error() : "");
  fprintf(stderr, "%s\n", text.c_str());
  std::lock_guard<std::mutex> lock(g_error_mu);
  g_error = text;
}

// A layer's forward pass, as _GlobalAffine.forward queues it (one call from Python
// instead of seven operator calls, and the record): the arrays that stay the layer's
// from step to step, borrowed from its _Channel (which outlives the plan), and its
// graphs' inputs as slots of the forward.
enum ForwardSlot { kFX, kFOnes, kFZeros, kFScratch0, kFScratch1, kFGB, kFOwnMean, kFOwnInvstd,
                   kFPacked, kFCount, kFOwnRow, kFSums, kFRunningMean, kFRunningVar,
                   kFSlots };

struct Plan {
  Channel* channel;
  uint64_t forward_key;
  int sums_dtype;
  int64_t sums_size;
  int grads_dtype;
  int64_t grads_size;
  void* fixed[kFSlots];        // kFOnes, kFZeros, kFScratch*, kFOwnRow, kFSums (borrowed)
  void* backward_unit_var;     // (borrowed)
  void* local_op;
  void* sums_op;
  void* affine_op;
  void* mine_op;
  void* back_op;
  std::vector<int> local_order, sums_order, affine_order, mine_order, back_order;
  int context[2];
  std::string axis;
};

bool push_side_sum(Channel* channel, uint64_t key, void* array, int dtype, int64_t size,
                   const int* context) {
  void* own = nullptr;
  if (g_api.shallow_copy(array, &own) != 0) return false;
  Task* task = new Task{channel, key, own, static_cast<uint32_t>(dtype), size,
                        g_api.get_data, g_api.free_handle};
  int prop = 3;   // FnProperty::kCPUPrioritized, as SideChannel.sum
  return g_api.push_async(reinterpret_cast<void*>(&dg_side_run), task,
                          reinterpret_cast<void*>(&dg_side_free_task),
                          const_cast<int*>(context), nullptr, 0, &array, 1, &prop, 1,
                          "dg_side_sum", false) == 0;
}

int invoke_graph(void* op, const std::vector<int>& order, void* const* slots, int* count,
                 void*** outputs) {
  std::vector<void*> inputs;
  for (int slot : order) inputs.push_back(slots[slot]);
  const int* stypes = nullptr;
  return g_api.invoke_cached(op, static_cast<int>(inputs.size()), inputs.data(), count,
                             outputs, &stypes);
}

// MXNet's BatchNorm operator on `inputs` (data, gamma, beta, moving mean, moving var),
// its parameter `flag` set (use_global_stats or output_mean_var); new outputs
bool invoke_batchnorm(void* const* inputs, const std::string& axis, const char* eps,
                      const char* flag, int* count, void*** outputs) {
  const char* keys[4] = {"axis", "eps", "fix_gamma", flag};
  const char* values[4] = {axis.c_str(), eps, "False", "True"};
  const int* stypes = nullptr;
  *count = 0;
  *outputs = nullptr;
  return g_api.invoke(g_api.batchnorm, 5, const_cast<void**>(inputs), count, outputs, 4,
                      keys, values, &stypes) == 0;
}

// Operator `op` (_copyto, elemwise_add) on `inputs`, written into `target`
bool invoke_into(void* op, void** inputs, int num_inputs, void* target) {
  void** outputs = &target;
  int count = 1;
  const int* stypes = nullptr;
  return g_api.invoke(op, num_inputs, inputs, &count, &outputs, 0, nullptr, nullptr,
                      &stypes) == 0;
}

int backward_callback(int num_ograds, int num_igrads, void** ptrs, const int* reqs,
                      const int is_train, void* state) {
  (void)is_train;
  Saved* s = static_cast<Saved*>(state);
  ++g_calls;
  std::vector<void*> made;      // handles this call creates, freed at its end
  bool ok = num_ograds == 2 && num_igrads == 2;
  void* slots[kSlots];
  for (int i = 0; i < kSlots; ++i) slots[i] = s->saved[i];
  if (ok) {
    slots[kDScale] = ptrs[0];
    slots[kDShift] = ptrs[1];
  }
  // mine, into the grads array
  if (ok) {
    void* grads = s->saved[kGrads];
    void** outputs = &grads;
    int count = 1;
    ok = invoke_graph(s->mine_op, s->mine_order, slots, &count, &outputs) == 0;
    if (!ok) remember_error("graph mine");
  }
  // its sum over the workers, on the side channel
  if (ok) {
    ok = push_side_sum(s->channel, s->key, s->saved[kGrads], s->dtype, s->grads_size,
                       s->context);
    if (!ok) remember_error("side channel sum");
  }
  // back: the scale and shift of dx, and [dgamma, dbeta]
  void* dx_scale = nullptr;
  void* dx_shift = nullptr;
  void* dgb = nullptr;
  if (ok) {
    void** outputs = nullptr;
    int count = 0;
    ok = invoke_graph(s->back_op, s->back_order, slots, &count, &outputs) == 0 && count == 3;
    if (ok) {
      dx_scale = outputs[0];
      dx_shift = outputs[1];
      dgb = outputs[2];
      made.insert(made.end(), {dx_scale, dx_shift, dgb});
    } else {
      remember_error("graph back");
    }
  }
  // dx, by the BatchNorm operator, into an array of its own: written straight into the
  // array the custom-function thread hands over, MKLDNN leaves it in its blocked layout
  // where autograd's own array (the same memory) is read as plain (measured: wrong)
  void* dx = nullptr;
  if (ok) {
    void* inputs[5] = {s->x, dx_scale, dx_shift, s->saved[kOwnMean], s->unit_var};
    void** outputs = nullptr;
    int count = 0;
    ok = invoke_batchnorm(inputs, s->axis, "1e-12", "use_global_stats", &count, &outputs) &&
         count >= 1;
    if (ok) {
      dx = outputs[0];
      for (int i = 0; i < count; ++i) made.push_back(outputs[i]);
    } else {
      remember_error("BatchNorm");
    }
  }
  // the input gradients: written, or added where autograd asks (grad_req 'add')
  void* values[2] = {dx, dgb};
  for (int i = 0; i < 2 && ok; ++i) {
    void* grad = ptrs[num_ograds + i];
    if (reqs[i] == 1 || reqs[i] == 2) {        // write, inplace
      ok = invoke_into(g_api.copyto, &values[i], 1, grad);
    } else if (reqs[i] == 3) {                 // add
      void* both[2] = {grad, values[i]};
      ok = invoke_into(g_api.add, both, 2, grad);
    }
    if (!ok) remember_error("writing the input gradients");
  }
  for (void* handle : made) g_api.free_handle(handle);
  for (int i = 0; i < num_ograds + num_igrads; ++i) g_api.free_handle(ptrs[i]);
  return ok ? 1 : 0;
}

int delete_callback(void* state);

// The backward's state of a recorded forward of plan `p`: `own` holds own handles of the
// slots kScale..kShare, then of x and of the backward's unit variance (all freed with the
// state); the rest is copied from the plan, which the state may outlive.
Saved* make_state(const Plan& p, uint64_t key, void* const* own) {
  Saved* s = new Saved;
  s->channel = p.channel;
  s->key = key;
  s->dtype = p.grads_dtype;
  s->grads_size = p.grads_size;
  s->saved[kDScale] = s->saved[kDShift] = nullptr;
  for (int i = kScale; i < kSlots; ++i) s->saved[i] = own[i - kScale];
  s->x = own[kSlots - kScale];
  s->unit_var = own[kSlots - kScale + 1];
  s->mine_op = p.mine_op;
  s->back_op = p.back_op;
  s->mine_order = p.mine_order;
  s->back_order = p.back_order;
  s->context[0] = p.context[0];
  s->context[1] = p.context[1];
  s->axis = p.axis;
  s->callbacks[0] = reinterpret_cast<int (*)(void)>(&backward_callback);
  s->callbacks[1] = reinterpret_cast<int (*)(void)>(&delete_callback);
  s->contexts[0] = s->contexts[1] = s;
  s->list.num_callbacks = 2;
  s->list.callbacks = s->callbacks;
  s->list.contexts = s->contexts;
  return s;
}

int delete_callback(void* state) {
  Saved* s = static_cast<Saved*>(state);
  for (int i = 0; i < kSlots; ++i) {
    if (s->saved[i] != nullptr) g_api.free_handle(s->saved[i]);
  }
  g_api.free_handle(s->x);
  g_api.free_handle(s->unit_var);
  delete s;
  return 1;
}


}  // namespace

extern "C" {

void dg_syncbn_api(void* const* functions, void* const* creators) {
  g_api.invoke = reinterpret_cast<InvokeEx>(functions[0]);
  g_api.invoke_cached = reinterpret_cast<InvokeCached>(functions[1]);
  g_api.push_async = reinterpret_cast<PushAsync>(functions[2]);
  g_api.shallow_copy = reinterpret_cast<ShallowCopy>(functions[3]);
  g_api.free_handle = reinterpret_cast<FreeHandle>(functions[4]);
  g_api.get_data = reinterpret_cast<GetData>(functions[5]);
  g_api.last_error = reinterpret_cast<LastError>(functions[6]);
  g_api.record = reinterpret_cast<RecordFunction>(functions[7]);
  g_api.batchnorm = creators[0];
  g_api.copyto = creators[1];
  g_api.add = creators[2];
}

// Record the function (x, gb) -> (scale, shift) for autograd, with `state`'s callbacks;
// 0 on success. MXNet frees the state (the delete callback) with the recorded graph.
int dg_syncbn_record(void* state, void* x, void* gb, void* scale, void* shift) {
  Saved* s = static_cast<Saved*>(state);
  void* inputs[2] = {x, gb};
  void* outputs[2] = {scale, shift};
  int failed = g_api.record(2, inputs, 2, outputs, &s->list);
  if (failed != 0) delete_callback(s);
  return failed;
}

// A layer's forward plan: `fixed` holds the handles of kFOnes, kFZeros, kFScratch0,
// kFScratch1, kFOwnRow (or null) and kFSums, borrowed; `orders` the five graphs' inputs
// as slots (local, sums and affine: ForwardSlot; mine and back: Slot), `sizes` their
// lengths.
void* dg_syncbn_plan(void* channel, uint64_t forward_key, int sums_dtype, int64_t sums_size,
                     int grads_dtype, int64_t grads_size, void* const* fixed,
                     void* backward_unit_var, void* const* ops, const int* orders,
                     const int* sizes, int dev_type, int dev_id, int axis) {
  Plan* p = new Plan;
  p->channel = static_cast<Channel*>(channel);
  p->forward_key = forward_key;
  p->sums_dtype = sums_dtype;
  p->sums_size = sums_size;
  p->grads_dtype = grads_dtype;
  p->grads_size = grads_size;
  for (int i = 0; i < kFSlots; ++i) p->fixed[i] = nullptr;
  const int fixed_slots[6] = {kFOnes, kFZeros, kFScratch0, kFScratch1, kFOwnRow, kFSums};
  for (int i = 0; i < 6; ++i) p->fixed[fixed_slots[i]] = fixed[i];
  p->backward_unit_var = backward_unit_var;
  p->local_op = ops[0];
  p->sums_op = ops[1];
  p->affine_op = ops[2];
  p->mine_op = ops[3];
  p->back_op = ops[4];
  std::vector<int>* lists[5] = {&p->local_order, &p->sums_order, &p->affine_order,
                                &p->mine_order, &p->back_order};
  for (int g = 0, at = 0; g < 5; at += sizes[g], ++g) {
    lists[g]->assign(orders + at, orders + at + sizes[g]);
  }
  p->context[0] = dev_type;
  p->context[1] = dev_id;
  p->axis = std::to_string(axis);
  return p;
}

void dg_syncbn_plan_free(void* plan) { delete static_cast<Plan*>(plan); }

// The forward pass of a layer with plan `plan` on x and gb (recording off): queues the
// local moments, the sums and their side-channel sum, the affine graph and (update) the
// running statistics' copies; out[0..2] get new handles of scale, shift and the global
// mean, and out[3], where `grads` is given (a recorded forward, its micro-batch's
// gradient array and backward key), the state that dg_syncbn_record records. 0 on
// success, else -1 (dg_syncbn_error says why).
int dg_syncbn_forward(void* plan, void* x, void* gb, void* count, void* running_mean,
                      void* running_var, int update, void* grads, uint64_t backward_key,
                      void** out) {
  Plan* p = static_cast<Plan*>(plan);
  void* slots[kFSlots];
  for (int i = 0; i < kFSlots; ++i) slots[i] = p->fixed[i];
  slots[kFX] = x;
  slots[kFGB] = gb;
  slots[kFCount] = count;
  slots[kFRunningMean] = running_mean;
  slots[kFRunningVar] = running_var;
  std::vector<void*> made;
  out[0] = out[1] = out[2] = out[3] = nullptr;
  bool ok = true;
  {
    void* inputs[5] = {x, p->fixed[kFOnes], p->fixed[kFZeros], p->fixed[kFScratch0],
                       p->fixed[kFScratch1]};
    void** outputs = nullptr;
    int n = 0;
    ok = invoke_batchnorm(inputs, p->axis, "1e-10", "output_mean_var", &n, &outputs) &&
         n == 3;
    if (ok) {
      made.insert(made.end(), outputs, outputs + n);
      slots[kFOwnMean] = outputs[1];
      slots[kFOwnInvstd] = outputs[2];
    } else {
      remember_error("BatchNorm (moments)");
    }
  }
  if (ok) {
    void** outputs = nullptr;
    int n = 0;
    ok = invoke_graph(p->local_op, p->local_order, slots, &n, &outputs) == 0 && n == 1;
    if (ok) {
      made.push_back(outputs[0]);
      slots[kFPacked] = outputs[0];
    } else {
      remember_error("graph local");
    }
  }
  if (ok) {
    void* sums = p->fixed[kFSums];
    void** outputs = &sums;
    int n = 1;
    ok = invoke_graph(p->sums_op, p->sums_order, slots, &n, &outputs) == 0 &&
         push_side_sum(p->channel, p->forward_key, sums, p->sums_dtype, p->sums_size,
                       p->context);
    if (!ok) remember_error("graph sums, or its side-channel sum");
  }
  void* affine[7] = {nullptr};
  if (ok) {
    void** outputs = nullptr;
    int n = 0;
    ok = invoke_graph(p->affine_op, p->affine_order, slots, &n, &outputs) == 0 && n == 7;
    if (ok) {
      for (int i = 0; i < 7; ++i) affine[i] = outputs[i];
    } else {
      remember_error("graph affine");
    }
  }
  // affine: scale, shift, mean, invstd, share, new running mean, new running variance
  for (int i = 0; i < 2 && ok && update; ++i) {
    ok = invoke_into(g_api.copyto, &affine[5 + i], 1, i == 0 ? running_mean : running_var);
    if (!ok) remember_error("the running statistics' copy");
  }
  if (ok && grads != nullptr) {
    // the backward's state: own handles of what it reads
    void* saved[6] = {affine[0], affine[3], grads, slots[kFOwnMean], affine[2], affine[4]};
    void* own[8] = {nullptr};
    void* sources[8] = {saved[0], saved[1], saved[2], saved[3], saved[4], saved[5], x,
                        p->backward_unit_var};
    for (int i = 0; i < 8 && ok; ++i) ok = g_api.shallow_copy(sources[i], &own[i]) == 0;
    if (ok) {
      out[3] = make_state(*p, backward_key, own);
    } else {
      for (void* handle : own) {
        if (handle != nullptr) g_api.free_handle(handle);
      }
      remember_error("the backward's state");
    }
  }
  for (void* handle : made) g_api.free_handle(handle);
  for (int i = 0; i < 7; ++i) {
    if (affine[i] == nullptr) continue;
    if (ok && i < 3) {
      out[i] = affine[i];      // scale, shift, mean: the caller's
    } else {
      g_api.free_handle(affine[i]);
    }
  }
  return ok ? 0 : -1;
}

int64_t dg_syncbn_calls() { return g_calls.load(); }

const char* dg_syncbn_error() {
  static thread_local std::string copy;
  std::lock_guard<std::mutex> lock(g_error_mu);
  copy = g_error;
  return copy.c_str();
}

}  // extern "C"
