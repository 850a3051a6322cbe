// A library the probe loads with RTLD_LOCAL, linked against
// rtld_local_dep.cpp: dlsym(RTLD_DEFAULT) called from here must find the
// dependency's function, which is in this library's scope and in no global
// one. glibc searches the calling object's scope for RTLD_DEFAULT, so the
// interposer's dlsym must leave the caller as it is (see rtld_next_a.cpp).
#include <dlfcn.h>

extern "C" __attribute__((visibility("default"))) void* rtld_default_from_local() {
  // Not a tail call: the lookup must be made from this library.
  void* volatile found = dlsym(RTLD_DEFAULT, "rtld_local_only");
  return found;
}
