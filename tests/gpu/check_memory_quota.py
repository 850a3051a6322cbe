"""Real-GPU checks of fracgpu's memory quota, run by run_memory_checks.sh
under LD_PRELOAD=libfracgpu.so as a tenant holding a fraction of GPU 0.

  check_memory_quota.py torch QUOTA_BYTES      mem_get_info shows the quota; OOM past it; the process goes on
  check_memory_quota.py hold BYTES SECONDS     allocate BYTES and hold them (for the sharing check)
  check_memory_quota.py fit BYTES              exit 0 if BYTES can be allocated, 3 if refused with OOM
  check_memory_quota.py jax QUOTA_BYTES        JAX's default preallocation stays inside the quota
  check_memory_quota.py graph QUOTA_BYTES      CUDA graph allocation nodes (driver API through ctypes) are charged

Prints one line per finding; exits non-zero on the first failed check.
"""
import os
import sys
import time

MIB = 1 << 20
GIB = 1 << 30


def fail(msg):
    print(f"FAIL: {msg}", flush=True)
    sys.exit(1)


def ok(msg):
    print(f"ok: {msg}", flush=True)


def expandable_requested():
    """Whether the environment asks PyTorch for expandable segments. PyTorch
    2.8+ reads PYTORCH_ALLOC_CONF first and PYTORCH_CUDA_ALLOC_CONF as a
    deprecated alias; run_memory_checks.sh sets both."""
    conf = ",".join(os.environ.get(k, "") for k in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"))
    return "expandable_segments:true" in conf.replace(" ", "").lower()


def expandable_in_use(torch):
    """True/False: whether PyTorch's segments are expandable (cuMemCreate and
    cuMemMap, the VMM path); None where the snapshot does not say. An env
    var PyTorch ignores (a renamed one, as in 2.9.1 for PYTORCH_ALLOC_CONF)
    would otherwise leave the "expandable segments" step testing the plain
    caching allocator a second time, and passing."""
    try:
        flags = [s["is_expandable"] for s in torch.cuda.memory_snapshot() if "is_expandable" in s]
    except Exception as e:  # a private-ish API: never fail the check on its shape
        print(f"note: torch.cuda.memory_snapshot() failed: {e}")
        return None
    return any(flags) if flags else None


def check_torch(quota):
    import torch

    free, total = torch.cuda.mem_get_info()
    print(f"mem_get_info: free={free / MIB:.0f} MiB total={total / MIB:.0f} MiB quota={quota / MIB:.0f} MiB")
    if total != quota:
        fail(f"total {total} is not the quota {quota}")
    if free > quota:
        fail("free exceeds the quota")
    ok("mem_get_info shows the quota")
    held = []
    try:
        while True:
            held.append(torch.empty(GIB, dtype=torch.uint8, device="cuda"))
    except torch.cuda.OutOfMemoryError as e:
        ok(f"OutOfMemoryError after {len(held)} GiB: {str(e).splitlines()[0][:120]}")
    if len(held) * GIB > quota:
        fail(f"allocated {len(held)} GiB, past the quota")
    if expandable_requested():
        used = expandable_in_use(torch)
        if used is False:
            fail("expandable segments were asked for (PYTORCH_ALLOC_CONF, PYTORCH_CUDA_ALLOC_CONF) but PyTorch's "
                 "segments are not expandable: the VMM path (cuMemCreate/cuMemMap) was not exercised")
        if used is None:
            print("note: could not confirm that PyTorch used expandable segments (no segment says)")
        else:
            ok("PyTorch's segments are expandable (the VMM path: cuMemCreate/cuMemMap)")
    del held[-1:]
    torch.cuda.empty_cache()
    x = torch.ones(256 * MIB, dtype=torch.uint8, device="cuda")
    if int(x.sum().item()) != 256 * MIB:
        fail("computation after OOM gave a wrong result")
    ok("the process went on after the OOM (allocated and computed again)")


def hold(nbytes, seconds):
    import torch

    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    print(f"holding {nbytes / MIB:.0f} MiB", flush=True)
    time.sleep(seconds)
    del x


def fit(nbytes):
    import torch

    try:
        torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    except torch.cuda.OutOfMemoryError:
        print(f"refused {nbytes / MIB:.0f} MiB", flush=True)
        sys.exit(3)
    print(f"allocated {nbytes / MIB:.0f} MiB", flush=True)


def check_jax(quota):
    import jax
    import jax.numpy as jnp

    # The GPU backend by name: where the CUDA plugin fails to start (under the
    # interposer, say) JAX falls back to the CPU with a warning, and
    # jax.devices()[0] would be a CPU device without memory stats, which read
    # as "not inside the quota". "gpu" names the CUDA (and ROCm) backend.
    try:
        dev = jax.devices("gpu")[0]
    except RuntimeError as e:
        fail(f"JAX has no GPU backend here (jax {jax.__version__}; its CUDA plugin did not start?): "
             f"{str(e).splitlines()[0][:200]}")
    env = {k: os.environ[k] for k in ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                                      "XLA_PYTHON_CLIENT_ALLOCATOR") if k in os.environ}
    stats = dev.memory_stats() or {}
    limit = stats.get("bytes_limit", 0)
    print(f"jax {jax.__version__}: device={dev} bytes_limit={limit / MIB:.0f} MiB quota={quota / MIB:.0f} MiB"
          f"{' env ' + str(env) if env else ''}")
    if not stats:
        fail("JAX's device gave no memory_stats(): its allocator's limit cannot be read")
    if limit == 0 or limit > quota:
        fail("JAX's allocator limit is not inside the quota")
    ok("JAX preallocated inside the quota")
    x = jnp.ones((limit // 8,), dtype=jnp.uint8)
    x.block_until_ready()
    ok("JAX computes inside its preallocation")
    try:
        y = jnp.ones((quota,), dtype=jnp.uint8)
        y.block_until_ready()
        fail("an array the size of the whole quota fitted next to the preallocation")
    except Exception as e:  # XlaRuntimeError: RESOURCE_EXHAUSTED
        ok(f"over-allocation refused: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        # Any error counts as refused; say so where it is not an out-of-memory
        # one (a shape JAX or XLA rejects, say), which proves less.
        if not any(w in str(e).lower() for w in ("resource_exhausted", "out of memory")):
            print("note: that error is not an out-of-memory one: the refusal may have another cause")


def check_graph_memory(quota):
    """Graphs captured from a stream that allocate 60% of the quota each (cuMemAllocAsync
    into a capturing stream makes allocation nodes): the first launches, the second is
    refused while the first holds its memory, and is served once the first is destroyed.
    Driver API through ctypes: ctypes resolves it with dlsym, which the interposer hooks."""
    import ctypes

    cu = ctypes.CDLL("libcuda.so.1")
    vp, u64 = ctypes.c_void_p, ctypes.c_uint64

    def call(name, *args):
        return getattr(cu, name)(*args)

    def must(name, *args):
        r = call(name, *args)
        if r != 0:
            fail(f"{name} returned {r}")

    must("cuInit", 0)
    ctx = vp()
    must("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), 0)
    must("cuCtxSetCurrent", ctx)
    stream = vp()
    must("cuStreamCreate", ctypes.byref(stream), 1)  # CU_STREAM_NON_BLOCKING
    nbytes = quota * 6 // 10

    def captured_graph():
        graph, exec_, ptr = vp(), vp(), u64()
        must("cuStreamBeginCapture_v2", stream, 0)  # CU_STREAM_CAPTURE_MODE_GLOBAL
        must("cuMemAllocAsync", ctypes.byref(ptr), ctypes.c_size_t(nbytes), stream)
        must("cuMemFreeAsync", ptr, stream)
        must("cuStreamEndCapture", stream, ctypes.byref(graph))
        must("cuGraphInstantiateWithFlags", ctypes.byref(exec_), graph, ctypes.c_ulonglong(0))
        return exec_

    def reserved():
        value = u64()
        must("cuDeviceGetGraphMemAttribute", 0, 2, ctypes.byref(value))  # RESERVED_MEM_CURRENT
        return value.value

    def free_bytes():
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        must("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
        return free.value

    a, b = captured_graph(), captured_graph()
    free_before = free_bytes()
    must("cuGraphLaunch", a, stream)
    must("cuStreamSynchronize", stream)
    print(f"graph A launched: driver's graph memory {reserved() / MIB:.0f} MiB, "
          f"free {free_before / MIB:.0f} -> {free_bytes() / MIB:.0f} MiB")
    if free_before - free_bytes() < nbytes:
        fail("graph A's memory was not charged")
    ok("graph A's allocation is charged at launch")
    r = call("cuGraphLaunch", b, stream)
    if r != 2:  # CUDA_ERROR_OUT_OF_MEMORY
        fail(f"graph B launched past the quota (result {r})")
    ok("graph B refused with CUDA_ERROR_OUT_OF_MEMORY while A holds its memory")
    must("cuGraphExecDestroy", a)
    must("cuGraphLaunch", b, stream)
    must("cuStreamSynchronize", stream)
    ok(f"graph B runs once A is destroyed (driver's graph memory {reserved() / MIB:.0f} MiB)")
    must("cuGraphExecDestroy", b)
    must("cuDeviceGraphMemTrim", 0)
    print(f"after trim: driver's graph memory {reserved() / MIB:.0f} MiB, free {free_bytes() / MIB:.0f} MiB")
    if free_bytes() < free_before:
        fail("the charge did not come back after the trim")
    ok("trim gives the charge back")


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "torch":
        check_torch(int(sys.argv[2]))
    elif mode == "hold":
        hold(int(sys.argv[2]), float(sys.argv[3]))
    elif mode == "fit":
        fit(int(sys.argv[2]))
    elif mode == "jax":
        check_jax(int(sys.argv[2]))
    elif mode == "graph":
        check_graph_memory(int(sys.argv[2]))
    else:
        fail(f"unknown mode {mode}")
