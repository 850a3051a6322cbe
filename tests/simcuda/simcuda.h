/*
 * simcuda.h - control API of the simulated CUDA driver (tests/simcuda).
 *
 * The simulated driver is a TEST DOUBLE: a libcuda.so.1 that implements part
 * of the CUDA driver API without a GPU so fracgpu's interposer can be tested
 * on any machine. It is never installed. See README.md in this directory.
 *
 * These functions are the tests' ground truth. They are exported by
 * libcuda.so.1 next to the cu* entry points; call them by linking the
 * `simcuda` target, or through
 *   dlsym(dlopen("libcuda.so.1", RTLD_NOW), "simcuda_...")
 * (the *_fn typedefs below give the pointer types). None of them needs cuInit;
 * they attach to the device state (SIMCUDA_STATE) on first use. They never
 * abort: on a bad ordinal or handle they return 0 (or -1 where noted).
 *
 * Reads of the shared state first drop the memory of processes that died, so
 * a value read after waitpid() of a killed process no longer includes it.
 */
#ifndef FRACGPU_TESTS_SIMCUDA_H
#define FRACGPU_TESTS_SIMCUDA_H

#include <stddef.h>
#include <stdint.h>

#include <cuda.h>

#if defined(__GNUC__)
#define SIMCUDA_API __attribute__((visibility("default")))
#else
#define SIMCUDA_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Devices ---------------------------------------------------------- */

/* Number of simulated devices (from the shared state; -1 if it cannot be
 * attached, e.g. a malformed SIMCUDA_DEVICES). */
SIMCUDA_API int simcuda_device_count(void);
/* Capacity in bytes (the `mem` field of SIMCUDA_DEVICES). */
SIMCUDA_API uint64_t simcuda_device_capacity(int ordinal);
/* Per-context footprint in bytes (the `ctx` field). */
SIMCUDA_API uint64_t simcuda_device_ctx_bytes(int ordinal);

/* ---- Device memory (all processes sharing the state) ------------------- */

/* Bytes in use on the device now: every live process's allocations, pool
 * reservations, VMM physical memory, arrays and context footprints. */
SIMCUDA_API uint64_t simcuda_device_used(int ordinal);
/* High-water mark of simcuda_device_used since the state was created or the
 * last simcuda_reset_peak. */
SIMCUDA_API uint64_t simcuda_device_peak(int ordinal);
/* Sets the high-water mark to the current use. */
SIMCUDA_API void simcuda_reset_peak(int ordinal);
/* Bytes the live process `pid` has on the device (0 if it is not a live
 * simulated-CUDA process). pid 0 means the calling process. */
SIMCUDA_API uint64_t simcuda_process_used(int ordinal, int pid);
/* Number of live processes that called cuInit on this state. */
SIMCUDA_API int simcuda_live_process_count(void);

/* ---- Calling-process breakdown (process-local bookkeeping) ------------- */

/* Bytes this process has reserved in all its memory pools on the device. */
SIMCUDA_API uint64_t simcuda_pool_reserved_bytes(int ordinal);
/* Reserved / used bytes of one pool of this process (as the
 * CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT / USED_MEM_CURRENT attributes). */
SIMCUDA_API uint64_t simcuda_pool_reserved(CUmemoryPool pool);
SIMCUDA_API uint64_t simcuda_pool_used(CUmemoryPool pool);
/* Size of a live array / mipmapped array by the sim's array size rule: what
 * cu*ArrayGetMemoryRequirements reports and what the device is charged
 * (sparse and deferred-mapping arrays are charged 0: they own no memory). */
SIMCUDA_API uint64_t simcuda_array_bytes(CUarray array);
SIMCUDA_API uint64_t simcuda_mipmapped_array_bytes(CUmipmappedArray array);
/* Bytes of device memory this process holds as VMM physical allocations
 * (cuMemCreate, not yet freed). */
SIMCUDA_API uint64_t simcuda_vmm_bytes(int ordinal);

/* ---- Simulated time ----------------------------------------------------- */

/* CLOCK_MONOTONIC in nanoseconds: the clock of the simulated timeline. */
SIMCUDA_API uint64_t simcuda_now_ns(void);
/* Device time (ns) consumed by kernels and graphs launched by `pid` (0 =
 * caller) on the device, credited as it runs (time-slice model) or at launch
 * (queue model; README.md, "Time"). Still answered after the
 * process exited, until its record is recycled (after 256 newer processes). */
SIMCUDA_API uint64_t simcuda_busy_ns(int ordinal, int pid);
/* Kernel + graph launches of `pid` on the device (same rules as above). */
SIMCUDA_API uint64_t simcuda_launch_count(int ordinal, int pid);
/* Device time consumed by all kernels ever launched on the device. */
SIMCUDA_API uint64_t simcuda_device_busy_ns(int ordinal);
/* Instant (simcuda_now_ns clock) at which the device finishes the work
 * enqueued so far if nobody launches more; <= now when idle. */
SIMCUDA_API uint64_t simcuda_device_busy_until_ns(int ordinal);
/* Time-slice model: the slice of this process's contexts from now on, in us
 * (0: the device's), as a real process may set it at any time through the
 * driver's channel-group control (README.md, "Time"); what ran before ran
 * under the old one. SIMCUDA_OWN_TIMESLICE_US sets it when the process first
 * calls the driver. Returns 0, or -1 above 1,000,000 us or before cuInit. */
SIMCUDA_API int simcuda_set_own_timeslice_us(uint64_t us);
/* Simulated duration of a function (default: from its name, see README). */
SIMCUDA_API void simcuda_set_function_duration_ns(CUfunction f, uint64_t ns);
SIMCUDA_API uint64_t simcuda_function_duration_ns(CUfunction f);

/* Kernel log: who ran on the device when, as [start, end) on the
 * simcuda_now_ns clock and the pid. Time-slice model: stretches of one
 * process's residency, recorded as the scheduler runs forward (a stretch may
 * be split over several records). Queue model: every kernel or graph launch
 * as placed on the timeline when enqueued. A ring of the last 16384 records
 * per device: older records are gone.
 * simcuda_kernel_log_next is the index the next record will get;
 * simcuda_kernel_log copies the records with index >= `first` still kept
 * (at most `max`) into `out` and returns how many it copied. */
typedef struct simcuda_kernel_record {
  uint64_t index;
  uint64_t start_ns;
  uint64_t end_ns;
  int32_t pid;
  uint32_t reserved;
} simcuda_kernel_record;
SIMCUDA_API uint64_t simcuda_kernel_log_next(int ordinal);
SIMCUDA_API size_t simcuda_kernel_log(int ordinal, uint64_t first, simcuda_kernel_record* out, size_t max);

/* ---- Entry points --------------------------------------------------------- */

/* Calls this process made to the exported entry point `exported_name`
 * ("cuMemAlloc_v2", "cuLaunchKernel_ptsz", ...), counted on entry whether
 * the call succeeded or not; 0 for names the sim does not export. Counters
 * start at 0 in a forked child. */
SIMCUDA_API uint64_t simcuda_call_count(const char* exported_name);
/* Zeroes all call counters of this process. */
SIMCUDA_API void simcuda_reset_call_counts(void);

/* The cuGetProcAddress table, one row per (base name, version, variant):
 * rows 0 .. simcuda_proc_table_size()-1. Returns 0 and fills the non-NULL
 * out-parameters, or -1 for an index out of range. */
SIMCUDA_API size_t simcuda_proc_table_size(void);
SIMCUDA_API int simcuda_proc_table_entry(size_t index, const char** base, int* version,
                                         int* per_thread_stream, const char** exported);

/* ---- State -------------------------------------------------------------- */

/* Path of the shared state file, or "" for a private (unshared) state. */
SIMCUDA_API const char* simcuda_state_path(void);

/* 1 when process `pid` holds one of the state's critical sections (the
 * global one, or a device's scheduler) through the state file, 0 when not,
 * -1 when that cannot be read (no such process, no shared state). A real
 * driver's critical sections are in the kernel, where SIGSTOP does not land;
 * here they are in user space, so a test that stops a process checks this
 * and lets it run on when it stopped inside one. */
SIMCUDA_API int simcuda_process_in_critical_section(int pid);

/* Function pointer types, for dlsym users. */
typedef int (*simcuda_device_count_fn)(void);
typedef uint64_t (*simcuda_device_u64_fn)(int ordinal);               /* used, peak, capacity, ... */
typedef void (*simcuda_reset_peak_fn)(int ordinal);
typedef uint64_t (*simcuda_device_pid_u64_fn)(int ordinal, int pid);  /* process_used, busy_ns */
typedef uint64_t (*simcuda_call_count_fn)(const char* exported_name);
typedef void (*simcuda_set_function_duration_ns_fn)(CUfunction f, uint64_t ns);
typedef uint64_t (*simcuda_kernel_log_next_fn)(int ordinal);
typedef size_t (*simcuda_kernel_log_fn)(int ordinal, uint64_t first, simcuda_kernel_record* out, size_t max);
typedef int (*simcuda_process_in_critical_section_fn)(int pid);

#ifdef __cplusplus
}
#endif

#endif /* FRACGPU_TESTS_SIMCUDA_H */
