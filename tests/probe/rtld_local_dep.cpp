// See rtld_local_user.cpp.
extern "C" __attribute__((visibility("default"))) int rtld_local_only() { return 7; }
