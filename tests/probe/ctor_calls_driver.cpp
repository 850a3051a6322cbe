// A library whose constructor calls the CUDA driver, as a framework's
// extension module may when it is loaded. glibc runs constructors with its
// loader lock held, so while this constructor runs, any other thread's
// dlopen or dlsym waits for it. The probe's `load-race` loads this library on
// one thread while its main thread makes the process's first driver call:
// the interposer's first load of libcuda (a dlopen) then waits for this
// constructor, which must not wait for that load in turn.
#include <cuda.h>
#include <unistd.h>

#include <cstdlib>

extern "C" {

__attribute__((visibility("default"))) int ctor_driver_result = -1;

__attribute__((constructor)) static void call_the_driver_from_a_constructor() {
  // Tell the probe this constructor runs (it cannot dlsym us before we return).
  const char* signal_fd = getenv("CTOR_DRIVER_SIGNAL_FD");
  if (signal_fd != nullptr) {
    const char byte = 1;
    (void)!write(atoi(signal_fd), &byte, 1);
  }
  // Long enough for the main thread to start the interposer's load of
  // libcuda and block in it on the loader lock this thread holds.
  const char* delay = getenv("CTOR_DRIVER_DELAY_MS");
  usleep(static_cast<useconds_t>(delay != nullptr ? atoi(delay) : 300) * 1000);
  ctor_driver_result = cuInit(0);
}

}  // extern "C"
