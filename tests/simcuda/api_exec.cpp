// Modules, functions, launches, graphs, streams and events: the simulated
// timeline. A kernel's duration comes from its name ("sleep_<N>us", else
// 10 us) or simcuda_set_function_duration_ns; fracgpu_spin's from its first
// parameter (kSpinIterationsPerUs).
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "sim_internal.h"

using namespace simcuda;

namespace {

// ---------------------------------------------------------------------------
// Modules and functions
// ---------------------------------------------------------------------------

CUresult new_module(CUmodule* out, Ctx* ctx, bool library) {
  auto m = std::make_unique<Module>();
  m->ctx = ctx;
  m->library = library;
  *out = reinterpret_cast<CUmodule>(m.get());
  proc().modules[m.get()] = std::move(m);
  return CUDA_SUCCESS;
}

CUresult load_module(CUmodule* out, const void* image) {
  if (out == nullptr || image == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Ctx* c = nullptr;
  if (CUresult r = require_ctx(c)) return r;
  return new_module(out, c, false);  // any image is accepted
}

Module* find_module(const void* h, bool library) {
  auto& t = proc().modules;
  auto it = t.find(h);
  if (it == t.end() || it->second->library != library) return nullptr;
  return it->second.get();
}

CUresult unload(const void* h, bool library) {
  Process& P = proc();
  Module* m = find_module(h, library);
  if (m == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  for (auto& [name, fn] : m->functions) P.functions.erase(key(fn.get()));
  P.modules.erase(h);
  return CUDA_SUCCESS;
}

// Same name, same handle (as the driver). Names starting with
// "simcuda_missing" are reported absent so not-found paths can be tested.
CUresult get_function(void** out, const void* h, const char* name, bool library) {
  Process& P = proc();
  if (out == nullptr || name == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Module* m = find_module(h, library);
  if (m == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if (std::strncmp(name, "simcuda_missing", 15) == 0) return CUDA_ERROR_NOT_FOUND;
  auto it = m->functions.find(std::string_view(name));
  if (it == m->functions.end()) {
    auto fn = std::make_shared<Function>();
    fn->name = name;
    fn->duration_ns.store(function_duration_from_name(name), std::memory_order_relaxed);
    it = m->functions.emplace(fn->name, fn).first;
    P.functions[fn.get()] = fn;
  }
  *out = it->second.get();
  return CUDA_SUCCESS;
}

std::shared_ptr<Function> find_function(const void* f) {
  auto& t = proc().functions;
  auto it = t.find(f);
  return it == t.end() ? nullptr : it->second;
}

// ---------------------------------------------------------------------------
// Launches
// ---------------------------------------------------------------------------

CUresult check_dims(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz) {
  if (gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0) return CUDA_ERROR_INVALID_VALUE;
  if (bx > 1024 || by > 1024 || bz > 64 || static_cast<uint64_t>(bx) * by * bz > 1024) return CUDA_ERROR_INVALID_VALUE;
  if (gy > 65535 || gz > 65535) return CUDA_ERROR_INVALID_VALUE;
  return CUDA_SUCCESS;
}

CUresult launch(Guard& guard, CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                unsigned bz, CUstream stream, void** params, void** extra, bool ptds) {
  auto fn = find_function(f);
  if (fn == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if (CUresult r = check_dims(gx, gy, gz, bx, by, bz)) return r;
  if (params != nullptr && extra != nullptr) return CUDA_ERROR_INVALID_VALUE;
  StreamTarget t;
  if (CUresult r = resolve_stream(stream, ptds, t)) return r;
  if (t.hold != nullptr && t.hold->capture != nullptr) {
    // Captured, not run: the kernel becomes a node of the stream's graph.
    auto n = std::make_unique<GraphNode>();
    n->fn = fn;
    t.hold->capture->nodes.push_back(std::move(n));
    return CUDA_SUCCESS;
  }
  uint64_t d = fn->duration_ns.load(std::memory_order_relaxed);
  if (fn->name == "fracgpu_spin" && params != nullptr && params[0] != nullptr)
    d = *static_cast<const uint64_t*>(params[0]) * 1000 / kSpinIterationsPerUs;
  guard.unlock();  // the timeline is lock-free
  enqueue_kernel(t, d, 1);
  return CUDA_SUCCESS;
}

CUresult launch_ex(Guard& guard, const CUlaunchConfig* config, CUfunction f, void** params, void** extra,
                   bool ptds) {
  if (config == nullptr || (config->numAttrs > 0 && config->attrs == nullptr)) return CUDA_ERROR_INVALID_VALUE;
  return launch(guard, f, config->gridDimX, config->gridDimY, config->gridDimZ, config->blockDimX,
                config->blockDimY, config->blockDimZ, config->hStream, params, extra, ptds);
}

// ---------------------------------------------------------------------------
// Graphs
// ---------------------------------------------------------------------------

Graph* find_graph(CUgraph g) {
  auto& t = proc().graphs;
  auto it = t.find(key(g));
  return it == t.end() ? nullptr : it->second.get();
}

// The node behind a handle, if it belongs to a live graph.
GraphNode* find_node(CUgraphNode h) {
  for (auto& [gh, graph] : proc().graphs)
    for (auto& n : graph->nodes)
      if (reinterpret_cast<CUgraphNode>(n.get()) == h) return n.get();
  return nullptr;
}

// What every node adder checks first: an out-parameter, a live graph, and
// dependencies that are nodes of that graph. (Dependencies are not kept: the
// sim runs a graph's kernels back to back whatever their order.)
CUresult graph_for_new_node(CUgraphNode* node, CUgraph g, const CUgraphNode* deps, size_t ndeps, Graph*& out) {
  if (node == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Graph* graph = find_graph(g);
  if (graph == nullptr || (ndeps > 0 && deps == nullptr)) return CUDA_ERROR_INVALID_VALUE;
  for (size_t i = 0; i < ndeps; ++i) {
    bool found = std::any_of(graph->nodes.begin(), graph->nodes.end(),
                             [&](const auto& n) { return reinterpret_cast<CUgraphNode>(n.get()) == deps[i]; });
    if (!found) return CUDA_ERROR_INVALID_VALUE;
  }
  out = graph;
  return CUDA_SUCCESS;
}

CUresult add_kernel_node(CUgraphNode* node, CUgraph g, const CUgraphNode* deps, size_t ndeps, CUfunction f,
                         unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz) {
  Graph* graph = nullptr;
  if (CUresult r = graph_for_new_node(node, g, deps, ndeps, graph)) return r;
  auto fn = find_function(f);
  if (fn == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (CUresult r = check_dims(gx, gy, gz, bx, by, bz)) return r;
  auto n = std::make_unique<GraphNode>();
  n->fn = fn;
  *node = reinterpret_cast<CUgraphNode>(n.get());
  graph->nodes.push_back(std::move(n));
  return CUDA_SUCCESS;
}

CUresult instantiate(CUgraphExec* exec, CUgraph graph) {
  if (exec == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Graph* g = find_graph(graph);
  if (g == nullptr) return CUDA_ERROR_INVALID_VALUE;
  auto e = std::make_unique<GraphExec>();
  for (const auto& n : g->nodes) {
    if (n->kind == NodeKind::Kernel) e->kernels.push_back(n->fn);
    // Graph memory is virtual until the exec is launched or uploaded; here
    // it is only counted.
    if (n->kind == NodeKind::MemAlloc)
      e->graph_mem[n->alloc.poolProps.location.id] += round_up(n->alloc.bytesize, kChunk);
  }
  *exec = reinterpret_cast<CUgraphExec>(e.get());
  proc().graph_execs[e.get()] = std::move(e);
  return CUDA_SUCCESS;
}

GraphExec* find_exec(CUgraphExec exec) {
  auto& t = proc().graph_execs;
  auto it = t.find(key(exec));
  return it == t.end() ? nullptr : it->second.get();
}

CUresult graph_launch(Guard& guard, CUgraphExec exec, CUstream stream, bool ptds) {
  GraphExec* e = find_exec(exec);
  if (e == nullptr) return CUDA_ERROR_INVALID_VALUE;
  StreamTarget t;
  if (CUresult r = resolve_stream(stream, ptds, t)) return r;
  if (t.hold != nullptr && t.hold->capture != nullptr) {
    // Captured: the graph's kernels become nodes of the capturing graph.
    for (const auto& fn : e->kernels) {
      auto n = std::make_unique<GraphNode>();
      n->fn = fn;
      t.hold->capture->nodes.push_back(std::move(n));
    }
    return CUDA_SUCCESS;
  }
  // Without its memory the graph cannot run: nothing is enqueued.
  if (CUresult r = back_graph_exec(e)) return r;
  // One interval on the timeline: the sum of its kernels' durations (nodes
  // run back to back; dependencies cannot shorten a serialized device).
  uint64_t total = 0;
  for (const auto& fn : e->kernels) total += fn->duration_ns.load(std::memory_order_relaxed);
  uint64_t kernels = e->kernels.size();
  guard.unlock();
  enqueue_kernel(t, total, kernels);
  return CUDA_SUCCESS;
}

// Upload does what a first launch does before running anything: it gives the
// exec its graph memory. It takes no device time. The sim does not capture
// uploads, so a capturing stream refuses one.
CUresult graph_upload(CUgraphExec exec, CUstream stream, bool ptds) {
  GraphExec* e = find_exec(exec);
  if (e == nullptr) return CUDA_ERROR_INVALID_VALUE;
  StreamTarget t;
  if (CUresult r = resolve_stream(stream, ptds, t)) return r;
  if (t.capture_graph() != nullptr) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  return back_graph_exec(e);
}

CUresult instantiate_with_params(CUgraphExec* exec, CUgraph graph, CUDA_GRAPH_INSTANTIATE_PARAMS* params, bool ptds) {
  if (params == nullptr) return CUDA_ERROR_INVALID_VALUE;
  // CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD uploads the exec on hUploadStream
  // at once, as the real driver does: its graph memory is taken then (an
  // upload that cannot have it fails the call, and no exec is left). The
  // other flags change nothing here.
  CUresult r = instantiate(exec, graph);
  if (r == CUDA_SUCCESS && (params->flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD) != 0) {
    r = graph_upload(*exec, params->hUploadStream, ptds);
    if (r != CUDA_SUCCESS) {
      if (GraphExec* e = find_exec(*exec)) unback_graph_exec(e);
      proc().graph_execs.erase(key(*exec));
      *exec = nullptr;
    }
  }
  params->hErrNode_out = nullptr;
  params->result_out = r == CUDA_SUCCESS ? CUDA_GRAPH_INSTANTIATE_SUCCESS : CUDA_GRAPH_INSTANTIATE_ERROR;
  return r;
}

// The CUDA 10/11 form: an error node and a log buffer, both left empty.
CUresult instantiate_with_log(CUgraphExec* exec, CUgraph graph, CUgraphNode* error_node, char* log,
                              size_t log_size) {
  if (error_node != nullptr) *error_node = nullptr;
  if (log != nullptr && log_size > 0) log[0] = '\0';
  return instantiate(exec, graph);
}

// ---------------------------------------------------------------------------
// Streams and events
// ---------------------------------------------------------------------------

CUresult stream_create(CUstream* out, unsigned flags, int priority) {
  Process& P = proc();
  if (out == nullptr || (flags & ~static_cast<unsigned>(CU_STREAM_NON_BLOCKING)) != 0) return CUDA_ERROR_INVALID_VALUE;
  Ctx* c = nullptr;
  if (CUresult r = require_ctx(c)) return r;
  auto s = std::make_shared<Stream>();
  s->dev = c->dev;
  s->ctx = c;
  s->flags = flags;
  s->priority = std::clamp(priority, -5, 0);  // the range cuCtxGetStreamPriorityRange reports on H100
  *out = reinterpret_cast<CUstream>(s.get());
  P.streams[s.get()] = std::move(s);
  return CUDA_SUCCESS;
}

CUresult stream_destroy(CUstream s) {
  Process& P = proc();
  auto it = P.streams.find(key(s));
  if (it == P.streams.end()) return CUDA_ERROR_INVALID_HANDLE;
  P.streams.erase(it);  // pending work still completes on the timeline
  return CUDA_SUCCESS;
}

CUresult stream_synchronize(Guard& guard, CUstream s, bool ptds) {
  StreamTarget t;
  if (CUresult r = resolve_stream(s, ptds, t)) return r;
  const Mark until = t.tail->load();
  guard.unlock();
  wait_mark(t.dev, until);
  guard.lock();
  pools_release_at_sync(t.dev);
  return CUDA_SUCCESS;
}

CUresult stream_query(CUstream s, bool ptds) {
  StreamTarget t;
  if (CUresult r = resolve_stream(s, ptds, t)) return r;
  return mark_done(t.dev, t.tail->load()) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

std::shared_ptr<Event> find_event(CUevent e) {
  auto& t = proc().events;
  auto it = t.find(key(e));
  return it == t.end() ? nullptr : it->second;
}

CUresult stream_wait_event(CUstream s, CUevent e, unsigned flags, bool ptds) {
  if ((flags & ~static_cast<unsigned>(CU_EVENT_WAIT_EXTERNAL)) != 0) return CUDA_ERROR_INVALID_VALUE;
  StreamTarget t;
  if (CUresult r = resolve_stream(s, ptds, t)) return r;
  auto ev = find_event(e);
  if (ev == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if (!ev->recorded.load(std::memory_order_acquire)) return CUDA_SUCCESS;  // nothing to wait for
  // Under the time-slice model this process's work runs in launch order, so
  // work it enqueued before the event is done before anything enqueued now.
  t.tail->advance_to(ev->mark.load());
  return CUDA_SUCCESS;
}

CUresult event_record(CUevent e, CUstream s, bool ptds) {
  auto ev = find_event(e);
  if (ev == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  StreamTarget t;
  if (CUresult r = resolve_stream(s, ptds, t)) return r;
  // Completes when the stream's earlier work does (now, if it is idle).
  const uint64_t now = now_ns();
  const Mark m = t.tail->load();
  ev->record_ns.store(now, std::memory_order_relaxed);
  ev->mark.time.store(std::max(now, m.time), std::memory_order_relaxed);
  ev->mark.work.store(m.work, std::memory_order_release);
  ev->dev = t.dev;
  ev->recorded.store(true, std::memory_order_release);
  return CUDA_SUCCESS;
}

CUresult elapsed_time(float* ms, CUevent start, CUevent end) {
  if (ms == nullptr) return CUDA_ERROR_INVALID_VALUE;
  auto a = find_event(start), b = find_event(end);
  if (a == nullptr || b == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if (((a->flags | b->flags) & CU_EVENT_DISABLE_TIMING) != 0) return CUDA_ERROR_INVALID_HANDLE;
  if (!a->recorded.load() || !b->recorded.load()) return CUDA_ERROR_INVALID_HANDLE;
  const Mark ma = a->mark.load(), mb = b->mark.load();
  if (!mark_done(a->dev, ma) || !mark_done(b->dev, mb)) return CUDA_ERROR_NOT_READY;
  // When each was done: after the later of its recording and its work.
  const uint64_t ta = std::max(a->record_ns.load(), mark_done_at(a->dev, ma));
  const uint64_t tb = std::max(b->record_ns.load(), mark_done_at(b->dev, mb));
  *ms = static_cast<float>(static_cast<double>(static_cast<int64_t>(tb - ta)) / 1e6);
  return CUDA_SUCCESS;
}

CUresult event_destroy(CUevent e) {
  auto& t = proc().events;
  auto it = t.find(key(e));
  if (it == t.end()) return CUDA_ERROR_INVALID_HANDLE;
  t.erase(it);
  return CUDA_SUCCESS;
}

}  // namespace

namespace simcuda {

GraphNode* add_mem_alloc_node(Graph* graph, const CUmemPoolProps& props, uint64_t bytesize) {
  if (bytesize > UINT64_MAX - kChunk) return nullptr;
  CUdeviceptr p = reserve_va(round_up(bytesize, kChunk), kChunk);
  if (p == 0) return nullptr;
  auto n = std::make_unique<GraphNode>();
  n->kind = NodeKind::MemAlloc;
  n->alloc.poolProps = props;
  n->alloc.bytesize = bytesize;
  n->alloc.dptr = p;
  proc().graph_allocs.insert(p);
  GraphNode* raw = n.get();
  graph->nodes.push_back(std::move(n));
  return raw;
}

GraphNode* add_mem_free_node(Graph* graph, CUdeviceptr dptr) {
  auto n = std::make_unique<GraphNode>();
  n->kind = NodeKind::MemFree;
  n->freed = dptr;
  GraphNode* raw = n.get();
  graph->nodes.push_back(std::move(n));
  return raw;
}

bool is_graph_allocation(CUdeviceptr p) { return proc().graph_allocs.count(p) != 0; }

}  // namespace simcuda

extern "C" {

// ---------------------------------------------------------------------------
// Modules, libraries, functions
// ---------------------------------------------------------------------------

CUresult cuModuleLoad(CUmodule* module, const char* fname) {
  SIMCUDA_LOCKED_ENTRY(cuModuleLoad);
  if (module == nullptr || fname == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Ctx* c = nullptr;
  if (CUresult r = require_ctx(c)) return r;
  if (access(fname, R_OK) != 0) return CUDA_ERROR_FILE_NOT_FOUND;
  return new_module(module, c, false);
}

CUresult cuModuleLoadData(CUmodule* module, const void* image) {
  SIMCUDA_LOCKED_ENTRY(cuModuleLoadData);
  return load_module(module, image);
}

CUresult cuModuleLoadDataEx(CUmodule* module, const void* image, unsigned int num_options, CUjit_option* options,
                            void** values) {
  SIMCUDA_LOCKED_ENTRY(cuModuleLoadDataEx);
  if (num_options > 0 && (options == nullptr || values == nullptr)) return CUDA_ERROR_INVALID_VALUE;
  return load_module(module, image);
}

CUresult cuModuleUnload(CUmodule module) {
  SIMCUDA_LOCKED_ENTRY(cuModuleUnload);
  return unload(key(module), false);
}

CUresult cuModuleGetFunction(CUfunction* f, CUmodule module, const char* name) {
  SIMCUDA_LOCKED_ENTRY(cuModuleGetFunction);
  if (f == nullptr) return CUDA_ERROR_INVALID_VALUE;
  void* out = nullptr;
  CUresult r = get_function(&out, key(module), name, false);
  if (r == CUDA_SUCCESS) *f = static_cast<CUfunction>(out);
  return r;
}

CUresult cuLibraryLoadData(CUlibrary* library, const void* code, CUjit_option* jit_options, void** jit_values,
                           unsigned int num_jit, CUlibraryOption* lib_options, void** lib_values,
                           unsigned int num_lib) {
  SIMCUDA_LOCKED_ENTRY(cuLibraryLoadData);
  if (library == nullptr || code == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if ((num_jit > 0 && (jit_options == nullptr || jit_values == nullptr)) ||
      (num_lib > 0 && (lib_options == nullptr || lib_values == nullptr)))
    return CUDA_ERROR_INVALID_VALUE;
  CUmodule m = nullptr;
  new_module(&m, nullptr, true);  // libraries are context-independent
  *library = reinterpret_cast<CUlibrary>(m);
  return CUDA_SUCCESS;
}

CUresult cuLibraryUnload(CUlibrary library) {
  SIMCUDA_LOCKED_ENTRY(cuLibraryUnload);
  return unload(key(library), true);
}

CUresult cuLibraryGetKernel(CUkernel* kernel, CUlibrary library, const char* name) {
  SIMCUDA_LOCKED_ENTRY(cuLibraryGetKernel);
  if (kernel == nullptr) return CUDA_ERROR_INVALID_VALUE;
  void* out = nullptr;
  CUresult r = get_function(&out, key(library), name, true);
  if (r == CUDA_SUCCESS) *kernel = static_cast<CUkernel>(out);
  return r;
}

// A CUkernel is usable wherever a CUfunction is (the driver allows the
// cast); the sim hands out the very same handle.
CUresult cuKernelGetFunction(CUfunction* f, CUkernel kernel) {
  SIMCUDA_LOCKED_ENTRY(cuKernelGetFunction);
  if (f == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Ctx* c = nullptr;
  if (CUresult r = require_ctx(c)) return r;
  if (find_function(kernel) == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  *f = reinterpret_cast<CUfunction>(kernel);
  return CUDA_SUCCESS;
}

// ---------------------------------------------------------------------------
// Launches
// ---------------------------------------------------------------------------

CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                        unsigned int by, unsigned int bz, unsigned int shared_bytes, CUstream stream, void** params,
                        void** extra) {
  SIMCUDA_LOCKED_ENTRY(cuLaunchKernel);
  (void)shared_bytes;
  return launch(guard_, f, gx, gy, gz, bx, by, bz, stream, params, extra, false);
}

CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                             unsigned int by, unsigned int bz, unsigned int shared_bytes, CUstream stream,
                             void** params, void** extra) {
  SIMCUDA_LOCKED_ENTRY(cuLaunchKernel_ptsz);
  (void)shared_bytes;
  return launch(guard_, f, gx, gy, gz, bx, by, bz, stream, params, extra, true);
}

// The legacy launches take their block shape from cuFuncSetBlockShape,
// which the sim does not model: one thread per block is as good as any for
// a timeline that only counts the function's duration. (No pragma for
// cuda.h's deprecation attributes: __CUDA_API_VERSION_INTERNAL, set for
// every user of the CUDA headers here, defines them away.)
CUresult cuLaunch(CUfunction f) {
  SIMCUDA_LOCKED_ENTRY(cuLaunch);
  return launch(guard_, f, 1, 1, 1, 1, 1, 1, nullptr, nullptr, nullptr, false);
}

CUresult cuLaunchGrid(CUfunction f, int grid_width, int grid_height) {
  SIMCUDA_LOCKED_ENTRY(cuLaunchGrid);
  if (grid_width <= 0 || grid_height <= 0) return CUDA_ERROR_INVALID_VALUE;
  return launch(guard_, f, static_cast<unsigned>(grid_width), static_cast<unsigned>(grid_height), 1, 1, 1, 1, nullptr,
                nullptr, nullptr, false);
}

CUresult cuLaunchGridAsync(CUfunction f, int grid_width, int grid_height, CUstream stream) {
  SIMCUDA_LOCKED_ENTRY(cuLaunchGridAsync);
  if (grid_width <= 0 || grid_height <= 0) return CUDA_ERROR_INVALID_VALUE;
  return launch(guard_, f, static_cast<unsigned>(grid_width), static_cast<unsigned>(grid_height), 1, 1, 1, 1, stream,
                nullptr, nullptr, false);
}

// The setters the legacy launches read their shape and parameters from.
// Nothing is stored (a launch takes only its function's duration), so they
// only check the handle, and a program written against the old API runs.
CUresult cuFuncSetBlockShape(CUfunction f, int /*x*/, int /*y*/, int /*z*/) {
  SIMCUDA_LOCKED_ENTRY(cuFuncSetBlockShape);
  return find_function(f) == nullptr ? CUDA_ERROR_INVALID_HANDLE : CUDA_SUCCESS;
}

CUresult cuFuncSetSharedSize(CUfunction f, unsigned int /*bytes*/) {
  SIMCUDA_LOCKED_ENTRY(cuFuncSetSharedSize);
  return find_function(f) == nullptr ? CUDA_ERROR_INVALID_HANDLE : CUDA_SUCCESS;
}

CUresult cuParamSetSize(CUfunction f, unsigned int /*numbytes*/) {
  SIMCUDA_LOCKED_ENTRY(cuParamSetSize);
  return find_function(f) == nullptr ? CUDA_ERROR_INVALID_HANDLE : CUDA_SUCCESS;
}

CUresult cuParamSeti(CUfunction f, int /*offset*/, unsigned int /*value*/) {
  SIMCUDA_LOCKED_ENTRY(cuParamSeti);
  return find_function(f) == nullptr ? CUDA_ERROR_INVALID_HANDLE : CUDA_SUCCESS;
}

CUresult cuParamSetf(CUfunction f, int /*offset*/, float /*value*/) {
  SIMCUDA_LOCKED_ENTRY(cuParamSetf);
  return find_function(f) == nullptr ? CUDA_ERROR_INVALID_HANDLE : CUDA_SUCCESS;
}

CUresult cuParamSetv(CUfunction f, int /*offset*/, void* /*ptr*/, unsigned int /*numbytes*/) {
  SIMCUDA_LOCKED_ENTRY(cuParamSetv);
  return find_function(f) == nullptr ? CUDA_ERROR_INVALID_HANDLE : CUDA_SUCCESS;
}

// Minimal stream capture: a user stream between cuStreamBeginCapture and
// cuStreamEndCapture records the kernels and graphs launched into it as the
// nodes of a new graph (nothing runs); other work on it (copies, events,
// synchronization) is not captured, and the legacy stream cannot capture.
static CUresult stream_is_capturing(CUstream s, CUstreamCaptureStatus* status, bool ptds) {
  if (status == nullptr) return CUDA_ERROR_INVALID_VALUE;
  StreamTarget t;
  if (CUresult r = resolve_stream(s, ptds, t)) return r;
  *status = t.hold != nullptr && t.hold->capture != nullptr ? CU_STREAM_CAPTURE_STATUS_ACTIVE
                                                            : CU_STREAM_CAPTURE_STATUS_NONE;
  return CUDA_SUCCESS;
}

static CUresult begin_capture(CUstream s, CUstreamCaptureMode mode) {
  if (mode != CU_STREAM_CAPTURE_MODE_GLOBAL && mode != CU_STREAM_CAPTURE_MODE_THREAD_LOCAL &&
      mode != CU_STREAM_CAPTURE_MODE_RELAXED)
    return CUDA_ERROR_INVALID_VALUE;
  StreamTarget t;
  if (CUresult r = resolve_stream(s, false, t)) return r;
  if (t.hold == nullptr) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  if (t.hold->capture != nullptr) return CUDA_ERROR_ILLEGAL_STATE;
  auto g = std::make_unique<Graph>();
  t.hold->capture = g.get();
  proc().graphs[g.get()] = std::move(g);
  return CUDA_SUCCESS;
}

CUresult cuStreamBeginCapture(CUstream stream) {
  SIMCUDA_LOCKED_ENTRY(cuStreamBeginCapture);
  return begin_capture(stream, CU_STREAM_CAPTURE_MODE_GLOBAL);
}

CUresult cuStreamBeginCapture_v2(CUstream stream, CUstreamCaptureMode mode) {
  SIMCUDA_LOCKED_ENTRY(cuStreamBeginCapture_v2);
  return begin_capture(stream, mode);
}

CUresult cuStreamEndCapture(CUstream stream, CUgraph* graph) {
  SIMCUDA_LOCKED_ENTRY(cuStreamEndCapture);
  if (graph == nullptr) return CUDA_ERROR_INVALID_VALUE;
  StreamTarget t;
  if (CUresult r = resolve_stream(stream, false, t)) return r;
  if (t.hold == nullptr || t.hold->capture == nullptr) return CUDA_ERROR_ILLEGAL_STATE;
  *graph = reinterpret_cast<CUgraph>(t.hold->capture);
  t.hold->capture = nullptr;
  return CUDA_SUCCESS;
}

CUresult cuStreamIsCapturing(CUstream stream, CUstreamCaptureStatus* status) {
  SIMCUDA_LOCKED_ENTRY(cuStreamIsCapturing);
  return stream_is_capturing(stream, status, false);
}

CUresult cuStreamIsCapturing_ptsz(CUstream stream, CUstreamCaptureStatus* status) {
  SIMCUDA_LOCKED_ENTRY(cuStreamIsCapturing_ptsz);
  return stream_is_capturing(stream, status, true);
}

// Per thread, as in the driver. With no capture to restrict the mode changes
// nothing else, but code that sets a mode and later restores the previous
// one gets back what it stored.
CUresult cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode* mode) {
  SIMCUDA_LOCKED_ENTRY(cuThreadExchangeStreamCaptureMode);
  if (mode == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (*mode != CU_STREAM_CAPTURE_MODE_GLOBAL && *mode != CU_STREAM_CAPTURE_MODE_THREAD_LOCAL &&
      *mode != CU_STREAM_CAPTURE_MODE_RELAXED)
    return CUDA_ERROR_INVALID_VALUE;
  std::swap(*mode, thread_capture_mode());
  return CUDA_SUCCESS;
}

CUresult cuLaunchKernelEx(const CUlaunchConfig* config, CUfunction f, void** params, void** extra) {
  SIMCUDA_LOCKED_ENTRY(cuLaunchKernelEx);
  return launch_ex(guard_, config, f, params, extra, false);
}

CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig* config, CUfunction f, void** params, void** extra) {
  SIMCUDA_LOCKED_ENTRY(cuLaunchKernelEx_ptsz);
  return launch_ex(guard_, config, f, params, extra, true);
}

CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                   unsigned int bx, unsigned int by, unsigned int bz, unsigned int shared_bytes,
                                   CUstream stream, void** params) {
  SIMCUDA_LOCKED_ENTRY(cuLaunchCooperativeKernel);
  (void)shared_bytes;
  return launch(guard_, f, gx, gy, gz, bx, by, bz, stream, params, nullptr, false);
}

CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                        unsigned int bx, unsigned int by, unsigned int bz,
                                        unsigned int shared_bytes, CUstream stream, void** params) {
  SIMCUDA_LOCKED_ENTRY(cuLaunchCooperativeKernel_ptsz);
  (void)shared_bytes;
  return launch(guard_, f, gx, gy, gz, bx, by, bz, stream, params, nullptr, true);
}

CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS* list, unsigned int count, unsigned int flags) {
  SIMCUDA_LOCKED_ENTRY(cuLaunchCooperativeKernelMultiDevice);
  (void)flags;
  if (list == nullptr || count == 0) return CUDA_ERROR_INVALID_VALUE;
  // Validate everything first: the launch is all or nothing.
  std::vector<std::pair<StreamTarget, uint64_t>> work;
  for (unsigned i = 0; i < count; ++i) {
    const CUDA_LAUNCH_PARAMS& p = list[i];
    auto fn = find_function(p.function);
    if (fn == nullptr) return CUDA_ERROR_INVALID_HANDLE;
    if (CUresult r = check_dims(p.gridDimX, p.gridDimY, p.gridDimZ, p.blockDimX, p.blockDimY, p.blockDimZ))
      return r;
    StreamTarget t;
    if (CUresult r = resolve_stream(p.hStream, false, t)) return r;
    work.emplace_back(t, fn->duration_ns.load(std::memory_order_relaxed));
  }
  guard_.unlock();
  for (auto& [t, d] : work) enqueue_kernel(t, d, 1);
  return CUDA_SUCCESS;
}

// ---------------------------------------------------------------------------
// Graphs
// ---------------------------------------------------------------------------

CUresult cuGraphCreate(CUgraph* graph, unsigned int flags) {
  SIMCUDA_LOCKED_ENTRY(cuGraphCreate);
  if (graph == nullptr || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  auto g = std::make_unique<Graph>();
  *graph = reinterpret_cast<CUgraph>(g.get());
  proc().graphs[g.get()] = std::move(g);
  return CUDA_SUCCESS;
}

CUresult cuGraphAddKernelNode(CUgraphNode* node, CUgraph graph, const CUgraphNode* deps, size_t ndeps,
                              const CUDA_KERNEL_NODE_PARAMS_v1* p) {
  SIMCUDA_LOCKED_ENTRY(cuGraphAddKernelNode);
  if (p == nullptr) return CUDA_ERROR_INVALID_VALUE;
  return add_kernel_node(node, graph, deps, ndeps, p->func, p->gridDimX, p->gridDimY, p->gridDimZ, p->blockDimX,
                         p->blockDimY, p->blockDimZ);
}

CUresult cuGraphAddKernelNode_v2(CUgraphNode* node, CUgraph graph, const CUgraphNode* deps, size_t ndeps,
                                 const CUDA_KERNEL_NODE_PARAMS* p) {
  SIMCUDA_LOCKED_ENTRY(cuGraphAddKernelNode_v2);
  if (p == nullptr) return CUDA_ERROR_INVALID_VALUE;
  CUfunction f = p->func != nullptr ? p->func : reinterpret_cast<CUfunction>(p->kern);
  return add_kernel_node(node, graph, deps, ndeps, f, p->gridDimX, p->gridDimY, p->gridDimZ, p->blockDimX,
                         p->blockDimY, p->blockDimZ);
}

// Graph allocations: the node reserves an address now; memory comes only
// when an exec of the graph is launched or uploaded.
CUresult cuGraphAddMemAllocNode(CUgraphNode* node, CUgraph graph, const CUgraphNode* deps, size_t ndeps,
                                CUDA_MEM_ALLOC_NODE_PARAMS* p) {
  SIMCUDA_LOCKED_ENTRY(cuGraphAddMemAllocNode);
  Graph* g = nullptr;
  if (CUresult r = graph_for_new_node(node, graph, deps, ndeps, g)) return r;
  if (p == nullptr || p->bytesize == 0 || (p->accessDescCount > 0 && p->accessDescs == nullptr))
    return CUDA_ERROR_INVALID_VALUE;
  CUmemPoolProps props = p->poolProps;  // kept with the state's device
  if (props.allocType != CU_MEM_ALLOCATION_TYPE_PINNED || props.location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
      !take_ordinal(props.location.id))
    return CUDA_ERROR_INVALID_VALUE;
  GraphNode* n = add_mem_alloc_node(g, props, p->bytesize);
  if (n == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
  p->dptr = n->alloc.dptr;
  *node = reinterpret_cast<CUgraphNode>(n);
  return CUDA_SUCCESS;
}

CUresult cuGraphAddMemFreeNode(CUgraphNode* node, CUgraph graph, const CUgraphNode* deps, size_t ndeps,
                               CUdeviceptr dptr) {
  SIMCUDA_LOCKED_ENTRY(cuGraphAddMemFreeNode);
  Graph* g = nullptr;
  if (CUresult r = graph_for_new_node(node, graph, deps, ndeps, g)) return r;
  if (!is_graph_allocation(dptr)) return CUDA_ERROR_INVALID_VALUE;
  *node = reinterpret_cast<CUgraphNode>(add_mem_free_node(g, dptr));
  return CUDA_SUCCESS;
}

CUresult cuGraphMemAllocNodeGetParams(CUgraphNode node, CUDA_MEM_ALLOC_NODE_PARAMS* params_out) {
  SIMCUDA_LOCKED_ENTRY(cuGraphMemAllocNodeGetParams);
  const GraphNode* n = find_node(node);
  if (n == nullptr || n->kind != NodeKind::MemAlloc || params_out == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *params_out = n->alloc;
  params_out->poolProps.location.id = ordinal_of(n->alloc.poolProps.location.id);
  return CUDA_SUCCESS;
}

CUresult cuGraphMemFreeNodeGetParams(CUgraphNode node, CUdeviceptr* dptr_out) {
  SIMCUDA_LOCKED_ENTRY(cuGraphMemFreeNodeGetParams);
  const GraphNode* n = find_node(node);
  if (n == nullptr || n->kind != NodeKind::MemFree || dptr_out == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *dptr_out = n->freed;
  return CUDA_SUCCESS;
}

CUresult cuGraphGetNodes(CUgraph graph, CUgraphNode* nodes, size_t* count) {
  SIMCUDA_LOCKED_ENTRY(cuGraphGetNodes);
  Graph* g = find_graph(graph);
  if (g == nullptr || count == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (nodes != nullptr) {
    size_t n = std::min(*count, g->nodes.size());
    for (size_t i = 0; i < n; ++i) nodes[i] = reinterpret_cast<CUgraphNode>(g->nodes[i].get());
  }
  *count = g->nodes.size();
  return CUDA_SUCCESS;
}

CUresult cuGraphNodeGetType(CUgraphNode node, CUgraphNodeType* type) {
  SIMCUDA_LOCKED_ENTRY(cuGraphNodeGetType);
  const GraphNode* n = find_node(node);
  if (n == nullptr || type == nullptr) return CUDA_ERROR_INVALID_VALUE;
  switch (n->kind) {
    case NodeKind::Kernel: *type = CU_GRAPH_NODE_TYPE_KERNEL; break;
    case NodeKind::MemAlloc: *type = CU_GRAPH_NODE_TYPE_MEM_ALLOC; break;
    case NodeKind::MemFree: *type = CU_GRAPH_NODE_TYPE_MEM_FREE; break;
  }
  return CUDA_SUCCESS;
}

CUresult cuGraphInstantiate(CUgraphExec* exec, CUgraph graph, CUgraphNode* error_node, char* log, size_t log_size) {
  SIMCUDA_LOCKED_ENTRY(cuGraphInstantiate);
  return instantiate_with_log(exec, graph, error_node, log, log_size);
}

CUresult cuGraphInstantiate_v2(CUgraphExec* exec, CUgraph graph, CUgraphNode* error_node, char* log,
                               size_t log_size) {
  SIMCUDA_LOCKED_ENTRY(cuGraphInstantiate_v2);
  return instantiate_with_log(exec, graph, error_node, log, log_size);
}

CUresult cuGraphInstantiateWithFlags(CUgraphExec* exec, CUgraph graph, unsigned long long flags) {
  SIMCUDA_LOCKED_ENTRY(cuGraphInstantiateWithFlags);
  (void)flags;
  return instantiate(exec, graph);
}

CUresult cuGraphInstantiateWithParams(CUgraphExec* exec, CUgraph graph, CUDA_GRAPH_INSTANTIATE_PARAMS* params) {
  SIMCUDA_LOCKED_ENTRY(cuGraphInstantiateWithParams);
  return instantiate_with_params(exec, graph, params, false);
}

CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec* exec, CUgraph graph, CUDA_GRAPH_INSTANTIATE_PARAMS* params) {
  SIMCUDA_LOCKED_ENTRY(cuGraphInstantiateWithParams_ptsz);
  return instantiate_with_params(exec, graph, params, true);
}

CUresult cuGraphUpload(CUgraphExec exec, CUstream stream) {
  SIMCUDA_LOCKED_ENTRY(cuGraphUpload);
  return graph_upload(exec, stream, false);
}

CUresult cuGraphUpload_ptsz(CUgraphExec exec, CUstream stream) {
  SIMCUDA_LOCKED_ENTRY(cuGraphUpload_ptsz);
  return graph_upload(exec, stream, true);
}

CUresult cuGraphLaunch(CUgraphExec exec, CUstream stream) {
  SIMCUDA_LOCKED_ENTRY(cuGraphLaunch);
  return graph_launch(guard_, exec, stream, false);
}

CUresult cuGraphLaunch_ptsz(CUgraphExec exec, CUstream stream) {
  SIMCUDA_LOCKED_ENTRY(cuGraphLaunch_ptsz);
  return graph_launch(guard_, exec, stream, true);
}

CUresult cuGraphExecDestroy(CUgraphExec exec) {
  SIMCUDA_LOCKED_ENTRY(cuGraphExecDestroy);
  GraphExec* e = find_exec(exec);
  if (e == nullptr) return CUDA_ERROR_INVALID_VALUE;
  unback_graph_exec(e);  // its memory stays reserved for the next exec
  proc().graph_execs.erase(key(exec));
  return CUDA_SUCCESS;
}

CUresult cuGraphDestroy(CUgraph graph) {
  SIMCUDA_LOCKED_ENTRY(cuGraphDestroy);
  return proc().graphs.erase(key(graph)) == 1 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

// ---------------------------------------------------------------------------
// Streams
// ---------------------------------------------------------------------------

CUresult cuStreamCreate(CUstream* stream, unsigned int flags) {
  SIMCUDA_LOCKED_ENTRY(cuStreamCreate);
  return stream_create(stream, flags, 0);
}

CUresult cuStreamCreateWithPriority(CUstream* stream, unsigned int flags, int priority) {
  SIMCUDA_LOCKED_ENTRY(cuStreamCreateWithPriority);
  return stream_create(stream, flags, priority);
}

CUresult cuStreamDestroy(CUstream stream) {
  SIMCUDA_LOCKED_ENTRY(cuStreamDestroy);
  return stream_destroy(stream);
}

CUresult cuStreamDestroy_v2(CUstream stream) {
  SIMCUDA_LOCKED_ENTRY(cuStreamDestroy_v2);
  return stream_destroy(stream);
}

CUresult cuStreamSynchronize(CUstream stream) {
  SIMCUDA_LOCKED_ENTRY(cuStreamSynchronize);
  return stream_synchronize(guard_, stream, false);
}

CUresult cuStreamSynchronize_ptsz(CUstream stream) {
  SIMCUDA_LOCKED_ENTRY(cuStreamSynchronize_ptsz);
  return stream_synchronize(guard_, stream, true);
}

CUresult cuStreamQuery(CUstream stream) {
  SIMCUDA_LOCKED_ENTRY(cuStreamQuery);
  return stream_query(stream, false);
}

CUresult cuStreamQuery_ptsz(CUstream stream) {
  SIMCUDA_LOCKED_ENTRY(cuStreamQuery_ptsz);
  return stream_query(stream, true);
}

// The context a stream belongs to; the default streams belong to the
// current context.
static CUresult stream_get_ctx(CUstream stream, CUcontext* pctx) {
  if (pctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (stream == nullptr || stream == CU_STREAM_LEGACY || stream == CU_STREAM_PER_THREAD) {
    Ctx* c = nullptr;
    if (CUresult r = require_ctx(c)) return r;
    *pctx = reinterpret_cast<CUcontext>(c);
    return CUDA_SUCCESS;
  }
  auto it = proc().streams.find(key(stream));
  if (it == proc().streams.end()) return CUDA_ERROR_INVALID_HANDLE;
  *pctx = reinterpret_cast<CUcontext>(it->second->ctx);
  return CUDA_SUCCESS;
}

CUresult cuStreamGetCtx(CUstream stream, CUcontext* pctx) {
  SIMCUDA_LOCKED_ENTRY(cuStreamGetCtx);
  return stream_get_ctx(stream, pctx);
}

CUresult cuStreamGetCtx_ptsz(CUstream stream, CUcontext* pctx) {
  SIMCUDA_LOCKED_ENTRY(cuStreamGetCtx_ptsz);
  return stream_get_ctx(stream, pctx);
}

CUresult cuStreamWaitEvent(CUstream stream, CUevent event, unsigned int flags) {
  SIMCUDA_LOCKED_ENTRY(cuStreamWaitEvent);
  return stream_wait_event(stream, event, flags, false);
}

CUresult cuStreamWaitEvent_ptsz(CUstream stream, CUevent event, unsigned int flags) {
  SIMCUDA_LOCKED_ENTRY(cuStreamWaitEvent_ptsz);
  return stream_wait_event(stream, event, flags, true);
}

// ---------------------------------------------------------------------------
// Events
// ---------------------------------------------------------------------------

CUresult cuEventCreate(CUevent* event, unsigned int flags) {
  SIMCUDA_LOCKED_ENTRY(cuEventCreate);
  constexpr unsigned kKnown = CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS;
  if (event == nullptr || (flags & ~kKnown) != 0) return CUDA_ERROR_INVALID_VALUE;
  if ((flags & CU_EVENT_INTERPROCESS) != 0 && (flags & CU_EVENT_DISABLE_TIMING) == 0) return CUDA_ERROR_INVALID_VALUE;
  Ctx* c = nullptr;
  if (CUresult r = require_ctx(c)) return r;
  auto e = std::make_shared<Event>();
  e->dev = c->dev;
  e->flags = flags;
  *event = reinterpret_cast<CUevent>(e.get());
  proc().events[e.get()] = std::move(e);
  return CUDA_SUCCESS;
}

CUresult cuEventRecord(CUevent event, CUstream stream) {
  SIMCUDA_LOCKED_ENTRY(cuEventRecord);
  return event_record(event, stream, false);
}

CUresult cuEventRecord_ptsz(CUevent event, CUstream stream) {
  SIMCUDA_LOCKED_ENTRY(cuEventRecord_ptsz);
  return event_record(event, stream, true);
}

CUresult cuEventQuery(CUevent event) {
  SIMCUDA_LOCKED_ENTRY(cuEventQuery);
  auto ev = find_event(event);
  if (ev == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if (!ev->recorded.load(std::memory_order_acquire)) return CUDA_SUCCESS;
  return mark_done(ev->dev, ev->mark.load()) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

CUresult cuEventSynchronize(CUevent event) {
  SIMCUDA_LOCKED_ENTRY(cuEventSynchronize);
  auto ev = find_event(event);
  if (ev == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if (!ev->recorded.load(std::memory_order_acquire)) return CUDA_SUCCESS;
  const Mark until = ev->mark.load();
  int dev = ev->dev;
  guard_.unlock();
  wait_mark(dev, until);
  guard_.lock();
  pools_release_at_sync(dev);
  return CUDA_SUCCESS;
}

CUresult cuEventElapsedTime(float* ms, CUevent start, CUevent end) {
  SIMCUDA_LOCKED_ENTRY(cuEventElapsedTime);
  return elapsed_time(ms, start, end);
}

CUresult cuEventElapsedTime_v2(float* ms, CUevent start, CUevent end) {
  SIMCUDA_LOCKED_ENTRY(cuEventElapsedTime_v2);
  return elapsed_time(ms, start, end);
}

CUresult cuEventDestroy(CUevent event) {
  SIMCUDA_LOCKED_ENTRY(cuEventDestroy);
  return event_destroy(event);
}

CUresult cuEventDestroy_v2(CUevent event) {
  SIMCUDA_LOCKED_ENTRY(cuEventDestroy_v2);
  return event_destroy(event);
}

// ---------------------------------------------------------------------------
// Control API: function durations
// ---------------------------------------------------------------------------

void simcuda_set_function_duration_ns(CUfunction f, uint64_t ns) {
  Guard guard;
  if (auto fn = find_function(f)) fn->duration_ns.store(ns, std::memory_order_relaxed);
}

uint64_t simcuda_function_duration_ns(CUfunction f) {
  Guard guard;
  auto fn = find_function(f);
  return fn == nullptr ? 0 : fn->duration_ns.load(std::memory_order_relaxed);
}

}  // extern "C"
