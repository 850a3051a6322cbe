// GPU-time shares in the interposer: the launch gate and its pacer thread.
//
// Every launch hook asks launch_may_pass() first: one atomic load and one
// compare against this thread's pass. The pass is valid until the process
// gate word changes, and the gate word is 0 (always pass) in a process with
// no GPU whose time is shared. Where time is shared, the pacer thread bumps
// the gate at every tick while the process holds or asks for a GPU, and at
// every change of grant, so each launching thread takes the slow path
// (wait_for_gpu) about once per millisecond, and a thread that must not
// launch finds out on its next launch.
// The policy and the protocol: docs/sm-time.md, shm/gputime.h; the pacer is
// in launch_gate.cpp.
#pragma once

#include <cuda.h>

#include <atomic>
#include <cstdint>

namespace fracgpu::interpose {

// 0: no GPU of this process is metered, every launch passes. Otherwise an
// epoch, changed whenever a thread's pass may have become stale.
extern std::atomic<uint64_t> g_launch_gate;
extern constinit thread_local uint64_t t_launch_pass;
// Threads inside a stream, event or context synchronization right now.
extern std::atomic<int> g_threads_in_sync;
// True while this process holds a latency tenant's grant: a synchronization
// that returns then tells the pacer (kick_pacer), which gives the grant
// back as soon as the process stays idle (docs/sm-time.md, "Latency tenants").
extern std::atomic<bool> g_latency_held;
void kick_pacer();
// A latency tenant's process launched since one of its synchronizations
// last returned (set on the launch gate's slow path, cleared at a
// synchronization's return): it may have work queued, and keeps its grant
// a little longer (kUnsyncedHoldNs). Process-wide, as g_threads_in_sync.
extern std::atomic<bool> g_unsynced;

inline bool launch_may_pass() {
  return g_launch_gate.load(std::memory_order_acquire) == t_launch_pass;
}

// Slow path: returns CUDA_SUCCESS once this thread may launch into `stream`
// of the current context (its process holds that context's GPU, or the GPU
// is not metered, or the stream is capturing a graph and nothing will run).
// CUDA_ERROR_NOT_PERMITTED, for the launch to return, where the GPU's time
// is scheduled but not for this tenant (the daemon gave it no row in the
// GPU's arbiter, or the arbiter was refused), or two tenants of the process
// grant the GPU. Never blocks forever.
// With `paced`: while a latency tenant is active on the GPU and ours is not
// one, it also waits until little of our work is queued there, and sets
// *paced: the caller then reports the launch (paced_launch_done) once made.
CUresult wait_for_gpu(CUstream stream, bool* paced = nullptr, const void* kernel = nullptr);
// After a launch that wait_for_gpu paced succeeded: tracks it (an event
// behind it on `stream`).
void paced_launch_done(CUstream stream);

// Like wait_for_gpu, for a stream of any context (multi-device launches).
CUresult wait_for_gpu_of_stream(CUstream stream);

// A context is about to be destroyed (or a device's primary context
// released or reset): the pacer must stop draining it.
void gputime_forget_context(CUcontext ctx);
void gputime_forget_device(CUdevice device);

// Ends a pass held across a change of current context (cuCtxSetCurrent and
// friends), so the next launch re-checks which GPU it goes to.
inline void invalidate_launch_pass() { t_launch_pass = ~0ull; }

}  // namespace fracgpu::interpose
