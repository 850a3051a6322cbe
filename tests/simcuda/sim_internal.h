// Internals of the simulated CUDA driver (test double, see README.md).
//
// Two kinds of state:
//   * SharedState: one "GPU" seen by every process that names the same
//     SIMCUDA_STATE file (mmap'ed, MAP_SHARED). It holds the device
//     descriptions, each process's device-memory use (one "slot" per
//     process), the per-device high-water marks and the kernel timelines.
//   * Process: everything handle-shaped (contexts, streams, allocations,
//     pools, ...). Handles are per process on a real driver too.
//
// Concurrency rules (a process may be SIGKILLed at any instruction):
//   * Memory accounting is changed only under Process::mu plus an OFD lock
//     on byte 0 of the state file (StateLock). The kernel drops OFD locks
//     when the holder dies, so a killed process never leaves it locked.
//   * Each number that matters is stored once: device use is the sum of the
//     live slots' counters, never a second running total, so a process dying
//     between two stores cannot make the books disagree. A dead process's
//     slot simply stops being counted.
//   * A slot's owner holds an OFD lock on byte 1+slot for its whole life;
//     a slot whose lock is free belongs to a dead process ("sweep").
//   * Queue-model timelines are lock-free (CAS on std::atomic<uint64_t> in
//     the mapping). The time-slice model (timeslice.cpp) changes a device's
//     scheduler under an OFD lock on byte kSchedLockByte+device, and writes a
//     whole new copy of it before switching to that copy, so a process killed
//     half-way leaves the last complete one in force.
//   * No process-shared pthread mutexes or semaphores anywhere: those stay
//     locked forever when their owner is killed.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

// The CUDA declarations (and the control API) are the library's exports; the
// library is built with -fvisibility=hidden so everything else stays hidden.
#pragma GCC visibility push(default)
#include <cuda.h>
#include <cudaTypedefs.h>
#include "simcuda.h"
#pragma GCC visibility pop

namespace simcuda {

inline constexpr int kDriverVersion = 13000;
inline constexpr int kMaxDevices = 16;
inline constexpr int kMaxSlots = 256;
inline constexpr uint64_t kMiB = 1ull << 20;
inline constexpr uint64_t kGiB = 1ull << 30;
// A kernel named "fracgpu_spin" does fixed work: its first parameter, a
// count of iterations (tests/probe/gputime_load kernels=ptx), at this many a
// microsecond of device time.
inline constexpr uint64_t kSpinIterationsPerUs = 100;
// Pool chunk, VMM granularity and array rounding: the real driver's 2 MiB.
inline constexpr uint64_t kChunk = 2 * kMiB;
inline constexpr uint64_t kPitchAlign = 512;
inline constexpr uint64_t kPtrAlign = 512;

constexpr uint64_t round_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }
constexpr uint64_t round_down(uint64_t v, uint64_t a) { return v / a * a; }

// ---------------------------------------------------------------------------
// Shared layout (the state file). Plain data plus lock-free atomics only.
// ---------------------------------------------------------------------------

using U64 = std::atomic<uint64_t>;
static_assert(U64::is_always_lock_free, "shared counters must be lock-free");
static_assert(std::atomic<uint32_t>::is_always_lock_free);
static_assert(std::atomic<int32_t>::is_always_lock_free);
static_assert(sizeof(U64) == sizeof(uint64_t), "atomics must have the plain layout in the mapping");

inline constexpr uint64_t kMagic = 0x3130414455434d53ull;  // "SMCUDA01"
inline constexpr uint32_t kLayoutVersion = 8;
// Kernel log entries kept per device (a ring: older ones are overwritten).
inline constexpr uint64_t kKernelLogEntries = 16384;
// Busy-time bins per device for the stand-in NVML's sampling (a ring of 1 ms
// bins of CLOCK_MONOTONIC: about 16 s of history).
inline constexpr uint64_t kSampleBins = 16384;
inline constexpr uint64_t kBinNs = 1000000;  // 1 ms

// How the device shares its time between processes (SIMCUDA_SCHED).
//   kModelTimeslice (default): one process's context on the device at a
//     time, as on a GPU without MPS. The resident context keeps the device
//     until its work runs out, or until its time slice ends while another
//     context has work; a kernel cut at the slice's end resumes later; each
//     switch idles the device for the switch cost.
//   kModelQueue: every process's kernels in one first-come queue, each placed
//     on the timeline when launched (the sim's first model).
enum : uint32_t { kModelTimeslice = 0, kModelQueue = 1 };
// OFD lock bytes of the state file: 0 the global section, 1+slot the slots'
// owners, kSchedLockByte+device each device's time-slice scheduler.
inline constexpr off_t kSchedLockByte = 1024;

// One consistent copy of a device's time-slice scheduler (see DevSched).
// Work is counted per process slot in ns of kernel time: `queued` is all the
// kernel time the slot ever enqueued on the device, `served` what the device
// has run of it, so the slot's pending work is queued - served and a point in
// its work (a stream's tail, an event) is a value of `queued`.
struct SchedState {
  uint64_t now;           // simulated up to this instant
  int32_t resident;       // slot whose context is on the device (or being switched in); -1: none yet
  uint32_t reserved;
  uint64_t slice_start;   // when the resident's current slice began
  uint64_t switch_until;  // the device is switching to `resident` until then
  uint64_t last_end;      // when the last stretch of work that ran ended
  uint64_t queued[kMaxSlots];
  uint64_t served[kMaxSlots];
};

struct DevSched {
  std::atomic<uint32_t> current;  // index of the copy in force (0 or 1)
  uint32_t reserved;
  SchedState copies[2];
};

struct SharedDevice {
  unsigned char uuid[16];
  char name[128];
  uint64_t capacity;       // bytes
  uint64_t ctx_bytes;      // footprint of one context
  uint32_t sms;
  uint32_t pci_bus;
  uint32_t cc_major;       // compute capability
  uint32_t cc_minor;
  U64 peak;                // high-water mark of the device's use (under StateLock)
  U64 busy_until;          // queue model: end of the last kernel enqueued (timeline, CAS)
  U64 busy_ns;             // device time of every kernel ever launched
  U64 launches;
};

enum : uint32_t { kSlotFree = 0, kSlotLive = 1, kSlotRetired = 2 };

struct SharedSlot {
  std::atomic<uint32_t> state;  // kSlotFree / kSlotLive / kSlotRetired
  std::atomic<int32_t> pid;
  U64 start_time;               // /proc/<pid>/stat starttime: (pid, start) names a process
  U64 seq;                      // claim order: the oldest retired slot is recycled first
  U64 used[kMaxDevices];        // device bytes held by the process (counted while live)
  U64 busy_ns[kMaxDevices];     // device time of its kernels (kept after death)
  U64 launches[kMaxDevices];
  // Time-slice model: the slice this process set on its own contexts (0: the
  // device's). A real process can, through the driver's channel-group control
  // (README.md, "Time"); the stand-in takes it from SIMCUDA_OWN_TIMESLICE_US.
  U64 own_slice_ns;
};

// Who ran on a device when. Queue model: one kernel (or graph launch) as it
// was placed on the timeline, written by the launching process. Time-slice
// model: one stretch of a process's residency as it ran, written by whichever
// process advanced the scheduler over it, with `pos0`, the point of the
// process's work (SchedState::served) at `start`. Written lock-free: `seq`
// (index + 1) is stored last, so a reader can tell a complete record from one
// being overwritten.
struct KernelRecord {
  U64 seq;
  U64 start;
  U64 end;
  std::atomic<int32_t> pid;
  int32_t slot;
  U64 pos0;
};

struct KernelLog {
  U64 next;  // index of the next record
  KernelRecord records[kKernelLogEntries];
};

// What the device did in each 1 ms of CLOCK_MONOTONIC: bin m covers
// [m ms, m+1 ms) and lives at index m % kSampleBins. Written lock-free by
// enqueue_kernel (when a kernel is placed on the timeline, i.e. possibly
// ahead of time) for every bin the kernel overlaps, except bins more than
// kSampleBins/2 ms ahead of the launch (far-future queued work is not
// recorded: it would overwrite bins still being read). Each word carries the
// bin's number (its low bits) as a tag, so a reader tells the bin's own
// value from an older bin's (the bin is idle) or a newer one's (the slot was
// reused: the bin is gone). Read by the stand-in NVML (tests/simnvml), which
// builds its sampling from them; the kernel log stays the ground truth.
struct SampleBins {
  // tag(44 bits: m) << 20 | busy ns in the bin (<= 1,000,000 < 2^20).
  U64 busy[kSampleBins];
  // (uint32_t)m << 32 | pid: the kernel resident at the bin's first instant
  // (m ms); the timeline is serial, so at most one covers an instant.
  U64 instant[kSampleBins];
  // tag(22 bits: m) << 42 | end offset(20 bits) << 22 | pid(22 bits): the
  // kernel that ended last in the bin, its end offset = min(end, (m+1) ms) -
  // m ms in ns (a kernel running past the bin has the full 1,000,000).
  U64 last[kSampleBins];
};

// Bit layouts of the SampleBins words (shared by writer and reader).
inline constexpr unsigned kBusyNsBits = 20;
inline constexpr uint64_t kBusyTagMask = (1ull << 44) - 1;
inline constexpr unsigned kLastPidBits = 22;
inline constexpr unsigned kLastOffsetBits = 20;
inline constexpr uint64_t kLastTagMask = (1ull << 22) - 1;
static_assert(kBinNs < (1ull << kBusyNsBits) && kBinNs < (1ull << kLastOffsetBits));

struct SharedState {
  U64 magic;                    // written last when the file is (re)initialized
  uint32_t layout_version;
  uint32_t device_count;
  U64 next_seq;
  // CLOCK_REALTIME - CLOCK_MONOTONIC in microseconds, taken once when the
  // state was created: every reader converts monotonic instants to the same
  // CPU time stamps.
  U64 realtime_offset_us;
  char spec[4096];              // canonical device spec it was created from
  uint32_t model;               // kModelTimeslice / kModelQueue
  uint32_t reserved;
  uint64_t timeslice_ns;        // time-slice model: slice length
  uint64_t switch_ns;           // time-slice model: cost of one context switch
  SharedDevice devices[kMaxDevices];
  SharedSlot slots[kMaxSlots];
  KernelLog kernel_logs[kMaxDevices];
  SampleBins sample_bins[kMaxDevices];
  DevSched sched[kMaxDevices];
};

// ---------------------------------------------------------------------------
// Process-local objects behind the opaque CUDA handles.
// ---------------------------------------------------------------------------

struct Ctx {
  int dev = 0;
  bool primary = false;
  bool active = false;  // created: until destroyed; primary: while retained
  unsigned flags = 0;
  unsigned refcount = 0;  // primary only
  unsigned attaches = 0;  // regular only: cuCtxAttach's usage count beyond the creation's
  bool green = false;     // the CUcontext of a green context (no footprint, not cuCtxDestroy'ed)
};

// A green context (cuGreenCtxCreate): its CUcontext (cuCtxFromGreenCtx) is a
// Ctx with `green` set. Records are never freed, so a stale handle stays
// recognizable; the Ctx record may be reused once the green context is gone.
struct GreenCtx {
  Ctx* ctx = nullptr;
  bool active = false;
  unsigned sms = 0;
};

// A resource descriptor (cuDevResourceGenerateDesc): only SMs are modelled.
struct ResourceDesc {
  unsigned sms = 0;
};

struct Graph;

// Where some work ends: done once the clock has passed `time` and the device
// has served the process's kernel work up to `work` (time-slice model; see
// SchedState). Under the queue model a kernel's end is known when it is
// enqueued, so `work` stays 0; copies always end at a time.
struct Mark {
  uint64_t time = 0;
  uint64_t work = 0;
};

// A Mark that several threads push forward (stream tails).
struct Tail {
  U64 time{0};
  U64 work{0};
  Mark load() const {
    return {time.load(std::memory_order_acquire), work.load(std::memory_order_acquire)};
  }
  void advance_to(const Mark& m);  // componentwise maximum
  void reset() {
    time.store(0, std::memory_order_relaxed);
    work.store(0, std::memory_order_relaxed);
  }
};

struct Stream {
  int dev = 0;
  Ctx* ctx = nullptr;
  unsigned flags = 0;
  int priority = 0;
  Tail tail;  // where the last work enqueued on it ends
  Graph* capture = nullptr;  // capturing into this graph (owned by Process::graphs), or null
};

struct Event {
  int dev = 0;
  unsigned flags = 0;
  U64 record_ns{0};                // when it was recorded
  Tail mark;                       // the end of the work it waits for
  std::atomic<bool> recorded{false};
};

struct Function {
  std::string name;
  U64 duration_ns{0};
};

// A module (cuModuleLoad*) or a library (cuLibraryLoadData): a name -> function map.
struct Module {
  Ctx* ctx = nullptr;
  bool library = false;
  std::map<std::string, std::shared_ptr<Function>, std::less<>> functions;
};

struct Pool {
  int dev = 0;
  bool is_default = false;
  bool destroyed = false;  // destroyed with blocks outstanding: kept until they are freed
  uint64_t reserved = 0;   // bytes charged to the device (multiple of kChunk)
  uint64_t used = 0;       // bytes of live blocks
  uint64_t reserved_high = 0;
  uint64_t used_high = 0;
  uint64_t release_threshold = 0;
  uint64_t max_size = 0;   // 0: unlimited
  int reuse[3] = {1, 1, 1};
};

enum class AllocKind { Linear, Pitch, Managed, PoolBlock, Linear32 };

struct Alloc {
  uint64_t size = 0;     // what cuMemGetAddressRange reports
  uint64_t charged = 0;  // bytes charged to the device (0 for pool blocks)
  uint64_t block = 0;    // pool blocks: bytes taken from the pool (size rounded up to 512)
  int dev = 0;
  AllocKind kind = AllocKind::Linear;
  Ctx* ctx = nullptr;    // freed with its context (not pool blocks)
  Pool* pool = nullptr;  // pool blocks
};

struct Array {
  CUDA_ARRAY3D_DESCRIPTOR desc{};
  bool is3d = false;        // created by cuArray3DCreate*
  unsigned levels = 0;      // mipmapped arrays
  uint64_t bytes = 0;       // reported size
  uint64_t charged = 0;     // bytes charged (0 for sparse/deferred mapping)
  int dev = 0;
  Ctx* ctx = nullptr;
};

struct PhysAlloc {
  CUmemAllocationProp prop{};
  uint64_t size = 0;
  uint64_t charged = 0;
  int dev = -1;           // -1: host memory, not charged
  bool released = false;  // every handle reference released; freed when the last mapping goes
  unsigned retains = 0;   // cuMemRetainAllocationHandle's references, each released on its own
  unsigned maps = 0;
};

struct Mapping {
  uint64_t size = 0;
  CUmemGenericAllocationHandle handle = 0;
};

enum class NodeKind { Kernel, MemAlloc, MemFree };

struct GraphNode {
  NodeKind kind = NodeKind::Kernel;
  std::shared_ptr<Function> fn;        // Kernel
  CUDA_MEM_ALLOC_NODE_PARAMS alloc{};  // MemAlloc: as given, dptr filled in, access descriptors not kept
  CUdeviceptr freed = 0;               // MemFree: the graph allocation it frees
};

struct Graph {
  std::vector<std::unique_ptr<GraphNode>> nodes;
};

struct GraphExec {
  std::vector<std::shared_ptr<Function>> kernels;
  // Graph memory its alloc nodes need on each device (each allocation
  // rounded up to kChunk), and whether it holds that memory now: from its
  // first launch or upload until it is destroyed or the device is trimmed.
  uint64_t graph_mem[kMaxDevices] = {};
  bool backed = false;
};

// The physical memory behind graph allocations, per process and device (the
// driver's graph memory pool). `reserved` is charged to the device; `used`
// is the part backed execs hold. What execs give back stays reserved, for
// the next exec, until cuDeviceGraphMemTrim.
struct GraphMemPool {
  uint64_t reserved = 0;
  uint64_t used = 0;
  uint64_t reserved_high = 0;
  uint64_t used_high = 0;
};

struct DevLocal {
  Tail proc_tail;  // end of this process's last work on the device (legacy stream)
  Ctx* primary = nullptr;
  Pool* default_pool = nullptr;
  Pool* current_pool = nullptr;
  uint64_t vmm_bytes = 0;
  GraphMemPool graph_mem;
};

struct Process {
  std::mutex mu;  // guards everything below except the atomics
  // Taken with the OFD lock of a device's scheduler (SchedLock): the OFD
  // lock excludes other processes, this the other threads of this one.
  std::mutex sched_mu;

  pid_t pid = 0;
  U64 gen{1};  // bumped in a forked child: invalidates every thread-local cache

  // Attachment to the device state.
  bool attached = false;
  bool shared = false;  // false: private state (SIMCUDA_STATE unset)
  std::string path;
  int fd = -1;
  SharedState* S = nullptr;
  bool initialized = false;  // cuInit succeeded
  int slot = -1;
  // The devices the driver API shows (CUDA_VISIBLE_DEVICES, read at the
  // first cuInit that succeeds): ordinal i is state device visible[i].
  int visible[kMaxDevices] = {};
  int visible_count = 0;

  // Fake device addresses.
  uint64_t va_next = 0, va_end = 0;
  uint64_t va32_next = 0, va32_end = 0;

  std::vector<std::unique_ptr<Ctx>> contexts;  // never freed: a stale handle stays recognizable
  std::unordered_set<const void*> ctx_set;
  std::vector<std::unique_ptr<GreenCtx>> greens;  // never freed, like contexts
  std::unordered_set<const void*> green_set;
  std::vector<std::unique_ptr<ResourceDesc>> descs;  // the driver has no call that frees one
  std::unordered_set<const void*> desc_set;
  std::unordered_map<const void*, std::shared_ptr<Stream>> streams;
  std::unordered_map<const void*, std::shared_ptr<Event>> events;
  std::unordered_map<const void*, std::unique_ptr<Module>> modules;
  std::unordered_map<const void*, std::shared_ptr<Function>> functions;  // CUfunction and CUkernel
  std::unordered_map<const void*, std::unique_ptr<Pool>> pools;
  std::unordered_map<const void*, std::unique_ptr<Array>> arrays;
  std::unordered_map<const void*, std::unique_ptr<Array>> mipmaps;
  std::unordered_map<const void*, std::unique_ptr<Graph>> graphs;
  std::unordered_map<const void*, std::unique_ptr<GraphExec>> graph_execs;
  // Addresses handed out by alloc nodes (explicit or captured), kept for the
  // process's life: free nodes may name any graph's allocation.
  std::unordered_set<CUdeviceptr> graph_allocs;
  std::map<CUdeviceptr, Alloc> allocs;
  std::map<CUmemGenericAllocationHandle, PhysAlloc> phys;
  CUmemGenericAllocationHandle next_handle = 0x5100000000ull;
  std::map<CUdeviceptr, uint64_t> reservations;  // base -> size
  std::map<CUdeviceptr, Mapping> mappings;       // va -> mapping
  DevLocal dev[kMaxDevices];
};

Process& proc();

// Holds Process::mu. On the first lock in a forked child it resets the
// process-local state (a child starts with no handles, like a new process)
// and re-attaches to the shared state with its own slot.
class Guard {
 public:
  Guard();
  ~Guard();
  Guard(const Guard&) = delete;
  Guard& operator=(const Guard&) = delete;
  void unlock();
  void lock();

 private:
  bool locked_ = false;
};

// Cross-process critical section for the memory books (Guard must be held).
// Acquiring it drops dead processes' slots.
class StateLock {
 public:
  StateLock();
  ~StateLock();
  StateLock(const StateLock&) = delete;
  StateLock& operator=(const StateLock&) = delete;
};

// ---- Attachment and accounting (Guard held) ----
bool attach();                                 // maps the state; false if impossible
CUresult initialize();                         // cuInit: attach + claim a slot
inline SharedState* S() { return proc().S; }
int device_count();                            // 0 when not attached
bool valid_device(int dev);
// The driver API numbers devices by ordinal, after CUDA_VISIBLE_DEVICES;
// everything else here (state, control API, the stand-in NVML) by the state's
// device index. At the API's edge: an ordinal a caller gave becomes the
// state's device (false: no such ordinal), and a device goes out as its
// ordinal. cuInit succeeded (SIMCUDA_LOCKED_ENTRY) before either is used.
int visible_count();
bool take_ordinal(int& dev);
int ordinal_of(int dev);
uint64_t sum_live_locked(int dev);             // StateLock held
CUresult charge(int dev, uint64_t bytes);      // CUDA_ERROR_OUT_OF_MEMORY if over capacity
void uncharge(int dev, uint64_t bytes);
CUdeviceptr reserve_va(uint64_t size, uint64_t align);  // 0 when the range is exhausted
CUdeviceptr reserve_va32(uint64_t size);

// ---- Contexts (Guard held) ----
Ctx* current_ctx();                             // top of this thread's stack, or null
CUresult require_ctx(Ctx*& out);                // INVALID_CONTEXT / CONTEXT_IS_DESTROYED
CUresult resolve_ctx(CUcontext c, Ctx*& out);   // null -> current
void teardown_ctx(Ctx* c);                      // frees what the context owns
std::vector<Ctx*>& ctx_stack();
CUstreamCaptureMode& thread_capture_mode();    // cuThreadExchangeStreamCaptureMode's, per thread

// ---- Pools (Guard held) ----
Pool* default_pool(int dev);
Pool* current_pool(int dev);
void pools_release_at_sync(int dev);            // release above the release threshold
void pool_free_block(Pool* pool, uint64_t bytes);
Pool* find_pool(CUmemoryPool h);

// ---- Graphs and graph memory (Guard held) ----
// A memory-alloc node for `bytesize` bytes on props.location.id (validated by
// the caller), appended to `graph`; its address is a new graph allocation.
// Null when the address range is exhausted.
GraphNode* add_mem_alloc_node(Graph* graph, const CUmemPoolProps& props, uint64_t bytesize);
GraphNode* add_mem_free_node(Graph* graph, CUdeviceptr dptr);
bool is_graph_allocation(CUdeviceptr p);
// Gives an exec the graph memory it needs (no-op if it has none or is
// backed): from what its process's graph memory pools have free, charging
// the rest. CUDA_ERROR_OUT_OF_MEMORY leaves everything as it was.
CUresult back_graph_exec(GraphExec* e);
// Returns a backed exec's memory to the pools (it stays reserved).
void unback_graph_exec(GraphExec* e);

// ---- Time ----
uint64_t now_ns();
void sleep_until(uint64_t t_ns);

struct StreamTarget {
  int dev = 0;
  Tail* tail = nullptr;
  std::shared_ptr<Stream> hold;  // keeps a user stream alive during the operation
  // The graph a capturing user stream records into, or null.
  Graph* capture_graph() const { return hold != nullptr ? hold->capture : nullptr; }
};
// Guard held. ptds: the entry point is a _ptsz/_ptds variant (NULL = per-thread stream).
CUresult resolve_stream(CUstream s, bool ptds, StreamTarget& out);
// Kernels: placed by the model in force (queue: on the device timeline,
// lock-free; time slice: into the process's work, under the device's
// scheduler lock). Returns where the kernel ends.
Mark enqueue_kernel(const StreamTarget& t, uint64_t duration_ns, uint64_t launches);
// Lock-free. Copies and memsets: take stream time only (copy engines). A copy
// ordered after kernels still in the time-slice model's queue is not held
// back by them (it ends at its own time or theirs, whichever is later).
Mark enqueue_copy(const StreamTarget& t, uint64_t duration_ns);
uint64_t copy_duration_ns(uint64_t bytes);
uint64_t function_duration_from_name(std::string_view name);

// ---- Time-slice model (timeslice.cpp); no Guard needed ----
bool timeslice_model();
// The time-slice model's enqueue: the kernel joins this process's work on
// `dev`; returns the point of that work where it ends.
uint64_t timeslice_enqueue(int dev, uint64_t duration_ns);
// Runs the device's scheduler up to now (records who ran, and busy time).
void advance_device(int dev);
// Whether the work up to `m` of this process on `dev` is done; waiting for it.
bool mark_done(int dev, const Mark& m);
void wait_mark(int dev, const Mark& m);
// When the work up to `m` was done (the mark's time if it is not known).
uint64_t mark_done_at(int dev, const Mark& m);
// When the device would run out of work if nobody launched more.
uint64_t projected_idle_ns(int dev);
// Drops what a slot's earlier owner left queued (StateLock held, at claim).
void timeslice_forget_slot(int slot);
// Model and knobs from SIMCUDA_SCHED, SIMCUDA_TIMESLICE_US, SIMCUDA_SWITCH_US.
struct SchedParams {
  uint32_t model = kModelTimeslice;
  uint64_t timeslice_ns = 1024000;
  uint64_t switch_ns = 40000;
};
SchedParams sched_params_from_env();
// The slice this process sets on its own contexts (SIMCUDA_OWN_TIMESLICE_US;
// 0: the device's).
uint64_t own_slice_from_env();
// Shared with state.cpp's bins and kernel log.
void record_residency(int dev, int32_t pid, int32_t slot, uint64_t start, uint64_t end, uint64_t pos0, uint64_t now);
bool state_file_lock(off_t byte);
void state_file_unlock(off_t byte);

// ---- Entry-point table (generated from proc_table.def, the only list) ----
struct ProcRow {
  std::string_view base;      // literals: .data() is NUL-terminated
  int version;
  bool per_thread;            // _ptsz / _ptds variant
  std::string_view exported;
};

inline constexpr ProcRow kProcTable[] = {
#define SIMCUDA_PROC(base, version, variant, exported) {#base, version, sizeof(#variant) > 1, #exported},
#include "proc_table.def"
#undef SIMCUDA_PROC
};
inline constexpr size_t kProcRows = sizeof(kProcTable) / sizeof(kProcTable[0]);

consteval int proc_row(std::string_view exported) {
  for (size_t i = 0; i < kProcRows; ++i)
    if (kProcTable[i].exported == exported) return static_cast<int>(i);
  return -1;
}

extern U64 g_calls[kProcRows];
inline void count_call(int row) { g_calls[row].fetch_add(1, std::memory_order_relaxed); }
// Entry points named in SIMCUDA_FAIL (comma-separated exported names): they
// answer CUDA_ERROR_NOT_SUPPORTED and do nothing, so that tests can see what
// a caller does when the driver refuses a query.
bool failing(int row);

// Every exported entry point starts with this: it counts the call and does
// not compile for a function missing from proc_table.def.
#define SIMCUDA_ENTRY(name)                                                        \
  do {                                                                             \
    constexpr int simcuda_row_ = ::simcuda::proc_row(#name);                       \
    static_assert(simcuda_row_ >= 0, #name " is not listed in proc_table.def");    \
    ::simcuda::count_call(simcuda_row_);                                           \
    if (::simcuda::failing(simcuda_row_)) return CUDA_ERROR_NOT_SUPPORTED;        \
  } while (0)

// Entry prologue for everything that needs cuInit: locks the process and
// returns CUDA_ERROR_NOT_INITIALIZED before cuInit.
#define SIMCUDA_LOCKED_ENTRY(name)                                   \
  SIMCUDA_ENTRY(name);                                               \
  ::simcuda::Guard guard_;                                           \
  if (!::simcuda::proc().initialized) return CUDA_ERROR_NOT_INITIALIZED

template <class T>
inline const void* key(T h) {
  return reinterpret_cast<const void*>(h);
}

}  // namespace simcuda
