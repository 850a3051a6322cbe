// Which GPUs a tenant's process sees: only those its tenants grant.
//
// The CUDA driver reads CUDA_VISIBLE_DEVICES once, at its first successful
// cuInit, and from then on knows only the devices it names, numbered in its
// order: device count, ordinals, UUIDs, peer queries, contexts and every
// other call agree, and the other GPUs cannot be reached at all. So before
// the real cuInit (every path to cuInit: linked, dlsym, cuGetProcAddress
// reach the one hook), a tenant's process gets the variable rewritten to the
// UUIDs of its tenants' GPUs (with several tenants, the union):
//
//   - numbered in NVML's order (PCI bus order, as nvidia-smi numbers them;
//     NVML's hooks number them the same way), then any GPU NVML does not
//     list, in the order of the grants; without NVML, all in that order;
//   - a value the user set selects among those GPUs as the driver would on
//     a node that had only them: indices number the tenant's GPUs from 0,
//     UUIDs (or unique prefixes) must be theirs, the list ends at the first
//     entry that names none of them (select_visible in visible_devices.cpp);
//   - no GPU left (none granted, or the user's value selects none): cuInit
//     answers CUDA_ERROR_NO_DEVICE without reaching the driver, after one
//     log line (none for an empty value: the user asked for no GPU), so a
//     later cuInit may still succeed once a GPU is granted.
//
// Not a tenant's process (no tenant, FRACGPU_UNMANAGED=passthrough, or a
// refused ledger): the variable is left as it is. Once the driver has read
// it (a cuInit succeeded), it is not touched again: the driver would not
// read it anew, and the process's children inherit it as set.
#pragma once

#include <cuda.h>

namespace fracgpu::interpose {

// Managed mode, in the cuInit hook before the real cuInit: CUDA_SUCCESS (the
// variable set), or the answer cuInit gives instead of calling the driver.
CUresult choose_visible_devices();

// After a real cuInit succeeded: the driver has read the variable.
void note_driver_initialized();

}  // namespace fracgpu::interpose
