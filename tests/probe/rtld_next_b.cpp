// See rtld_next_a.cpp.
extern "C" __attribute__((visibility("default"))) int rtld_next_who() { return 2; }
