// Two libraries defining the same function, linked into the probe in this
// order, to check that dlsym(RTLD_NEXT) through the interposer still starts
// its search after the caller (here: this library), as glibc's does.
#include <dlfcn.h>

extern "C" __attribute__((visibility("default"))) int rtld_next_who() { return 1; }

extern "C" __attribute__((visibility("default"))) void* rtld_next_from_a() {
  // Not a tail call: the lookup must be made from this library.
  void* volatile found = dlsym(RTLD_NEXT, "rtld_next_who");
  return found;
}
