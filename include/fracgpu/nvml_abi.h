/*
 * nvml_abi.h - the part of NVIDIA's NVML ABI (libnvidia-ml.so.1) that fracgpu
 * calls or provides, declared here because the CUDA toolkit image fracgpu
 * builds against does not ship nvml.h and Debian main has no package for it.
 *
 * Every name, value and signature below is NVML's public ABI as documented in
 * the NVML API reference (docs.nvidia.com/deploy/nvml-api); nothing else is
 * declared. The daemon calls these through typed pointers (decltype(&fn)) on a
 * dlopen()ed library, never by linking; the stand-in NVML of the tests
 * (tests/simnvml) defines them.
 *
 * Do not include this together with NVIDIA's own nvml.h: the names collide on
 * purpose (same types, same values).
 */
#ifndef FRACGPU_NVML_ABI_H
#define FRACGPU_NVML_ABI_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum nvmlReturn_enum {
  NVML_SUCCESS = 0,
  NVML_ERROR_UNINITIALIZED = 1,
  NVML_ERROR_INVALID_ARGUMENT = 2,
  NVML_ERROR_NOT_SUPPORTED = 3,
  NVML_ERROR_NO_PERMISSION = 4,
  NVML_ERROR_ALREADY_INITIALIZED = 5,
  NVML_ERROR_NOT_FOUND = 6,
  NVML_ERROR_INSUFFICIENT_SIZE = 7,
  NVML_ERROR_INSUFFICIENT_POWER = 8,
  NVML_ERROR_DRIVER_NOT_LOADED = 9,
  NVML_ERROR_TIMEOUT = 10,
  NVML_ERROR_IRQ_ISSUE = 11,
  NVML_ERROR_LIBRARY_NOT_FOUND = 12,
  NVML_ERROR_FUNCTION_NOT_FOUND = 13,
  NVML_ERROR_CORRUPTED_INFOROM = 14,
  NVML_ERROR_GPU_IS_LOST = 15,
  NVML_ERROR_RESET_REQUIRED = 16,
  NVML_ERROR_OPERATING_SYSTEM = 17,
  NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18,
  NVML_ERROR_IN_USE = 19,
  NVML_ERROR_MEMORY = 20,
  NVML_ERROR_NO_DATA = 21,
  NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
  NVML_ERROR_UNKNOWN = 999
} nvmlReturn_t;

typedef struct nvmlDevice_st* nvmlDevice_t;
typedef struct nvmlEventSet_st* nvmlEventSet_t;

#define NVML_DEVICE_UUID_V2_BUFFER_SIZE 96
#define NVML_DEVICE_NAME_V2_BUFFER_SIZE 96
#define NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE 80

typedef struct nvmlMemory_st {
  unsigned long long total;
  unsigned long long free;
  unsigned long long used;
} nvmlMemory_t;

typedef struct nvmlMemory_v2_st {
  unsigned int version; /* nvmlMemory_v2 */
  unsigned long long total;
  unsigned long long reserved;
  unsigned long long free;
  unsigned long long used;
} nvmlMemory_v2_t;
#define NVML_STRUCT_VERSION(data, ver) (unsigned int)(sizeof(nvml##data##_v##ver##_t) | (ver << 24U))
#define nvmlMemory_v2 NVML_STRUCT_VERSION(Memory, 2)

/* nvmlDeviceGetComputeRunningProcesses (v1) fills this shorter record. */
typedef struct nvmlProcessInfo_v1_st {
  unsigned int pid;
  unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

/* _v2 and _v3 fill this one. */
typedef struct nvmlProcessInfo_st {
  unsigned int pid;
  unsigned long long usedGpuMemory; /* NVML_VALUE_NOT_AVAILABLE when unknown */
  unsigned int gpuInstanceId;
  unsigned int computeInstanceId;
} nvmlProcessInfo_t;
typedef nvmlProcessInfo_t nvmlProcessInfo_v2_t;

#define NVML_VALUE_NOT_AVAILABLE (~0ULL)

/* nvmlDeviceGetRunningProcessDetailList (driver R550 and later). This and the
 * utilization records below follow NVIDIA's nvml.h of the R550 drivers (NVML
 * API 12), as public copies of that header and NVIDIA's pynvml declare them. */
typedef enum nvmlProcessMode_enum {
  NVML_PROCESS_MODE_COMPUTE = 0,
  NVML_PROCESS_MODE_GRAPHICS = 1,
  NVML_PROCESS_MODE_MPS = 2
} nvmlProcessMode_t;

typedef struct nvmlProcessDetail_v1_st {
  unsigned int pid;
  unsigned long long usedGpuMemory;
  unsigned int gpuInstanceId;
  unsigned int computeInstanceId;
  unsigned long long usedGpuCcProtectedMemory;
} nvmlProcessDetail_v1_t;

typedef struct nvmlProcessDetailList_v1_st {
  unsigned int version; /* nvmlProcessDetailList_v1 */
  unsigned int mode;    /* nvmlProcessMode_t */
  unsigned int numProcArrayEntries; /* in: procArray's capacity; out: the count */
  nvmlProcessDetail_v1_t* procArray;
} nvmlProcessDetailList_v1_t;
typedef nvmlProcessDetailList_v1_t nvmlProcessDetailList_t;
#define nvmlProcessDetailList_v1 NVML_STRUCT_VERSION(ProcessDetailList, 1)

/* nvmlDeviceGetProcessUtilization: one sample per process (host PIDs). */
typedef struct nvmlProcessUtilizationSample_st {
  unsigned int pid;
  unsigned long long timeStamp; /* CPU time, microseconds */
  unsigned int smUtil;
  unsigned int memUtil;
  unsigned int encUtil;
  unsigned int decUtil;
} nvmlProcessUtilizationSample_t;

/* nvmlDeviceGetProcessesUtilizationInfo (driver R550 and later). */
typedef struct nvmlProcessUtilizationInfo_v1_st {
  unsigned long long timeStamp; /* CPU time, microseconds */
  unsigned int pid;
  unsigned int smUtil;
  unsigned int memUtil;
  unsigned int encUtil;
  unsigned int decUtil;
  unsigned int jpgUtil;
  unsigned int ofaUtil;
} nvmlProcessUtilizationInfo_v1_t;

typedef struct nvmlProcessesUtilizationInfo_v1_st {
  unsigned int version; /* nvmlProcessesUtilizationInfo_v1 */
  unsigned int processSamplesCount; /* in: procUtilArray's capacity; out: the count */
  unsigned long long lastSeenTimeStamp; /* only samples newer than this */
  nvmlProcessUtilizationInfo_v1_t* procUtilArray;
} nvmlProcessesUtilizationInfo_v1_t;
typedef nvmlProcessesUtilizationInfo_v1_t nvmlProcessesUtilizationInfo_t;
#define nvmlProcessesUtilizationInfo_v1 NVML_STRUCT_VERSION(ProcessesUtilizationInfo, 1)

/* Accounting (per-process statistics kept by the driver while accounting
 * mode is on): nvmlDeviceGetAccountingPids / nvmlDeviceGetAccountingStats. */
typedef struct nvmlAccountingStats_st {
  unsigned int gpuUtilization;   /* percent of the process's life with a kernel running */
  unsigned int memoryUtilization;
  unsigned long long maxMemoryUsage; /* bytes */
  unsigned long long time;           /* ms the process's context was active */
  unsigned long long startTime;      /* CPU time, microseconds */
  unsigned int isRunning;
  unsigned int reserved[5];
} nvmlAccountingStats_t;

#ifdef __cplusplus
/* The layouts NVML's 64-bit Linux ABI has; the version values NVIDIA's header
 * spells out (both 0x1000018). */
static_assert(sizeof(nvmlProcessDetail_v1_t) == 32, "nvmlProcessDetail_v1_t layout");
static_assert(sizeof(nvmlAccountingStats_t) == 56, "nvmlAccountingStats_t layout");
static_assert(__builtin_offsetof(nvmlAccountingStats_t, isRunning) == 32, "nvmlAccountingStats_t layout");
static_assert(__builtin_offsetof(nvmlProcessDetail_v1_t, usedGpuCcProtectedMemory) == 24, "nvmlProcessDetail_v1_t layout");
static_assert(sizeof(nvmlProcessDetailList_v1_t) == 24, "nvmlProcessDetailList_v1_t layout");
static_assert(__builtin_offsetof(nvmlProcessDetailList_v1_t, procArray) == 16, "nvmlProcessDetailList_v1_t layout");
static_assert(nvmlProcessDetailList_v1 == 0x1000018u, "nvmlProcessDetailList_v1 value");
static_assert(sizeof(nvmlProcessUtilizationSample_t) == 32, "nvmlProcessUtilizationSample_t layout");
static_assert(__builtin_offsetof(nvmlProcessUtilizationSample_t, smUtil) == 16, "nvmlProcessUtilizationSample_t layout");
static_assert(sizeof(nvmlProcessUtilizationInfo_v1_t) == 40, "nvmlProcessUtilizationInfo_v1_t layout");
static_assert(__builtin_offsetof(nvmlProcessUtilizationInfo_v1_t, pid) == 8, "nvmlProcessUtilizationInfo_v1_t layout");
static_assert(sizeof(nvmlProcessesUtilizationInfo_v1_t) == 24, "nvmlProcessesUtilizationInfo_v1_t layout");
static_assert(__builtin_offsetof(nvmlProcessesUtilizationInfo_v1_t, procUtilArray) == 16,
              "nvmlProcessesUtilizationInfo_v1_t layout");
static_assert(nvmlProcessesUtilizationInfo_v1 == 0x1000018u, "nvmlProcessesUtilizationInfo_v1 value");
#endif

/* nvmlDeviceGetUtilizationRates: percent of the last sampling period (1/6 s
 * to 1 s by product) in which a kernel ran (gpu), and in which device memory
 * was read or written (memory). */
typedef struct nvmlUtilization_st {
  unsigned int gpu;
  unsigned int memory;
} nvmlUtilization_t;

/* nvmlDeviceGetSamples: a device's ring buffers of sampled values. */
typedef enum nvmlSamplingType_enum {
  NVML_TOTAL_POWER_SAMPLES = 0,
  NVML_GPU_UTILIZATION_SAMPLES = 1, /* percent of time one or more kernels was executing */
  NVML_MEMORY_UTILIZATION_SAMPLES = 2,
  NVML_ENC_UTILIZATION_SAMPLES = 3,
  NVML_DEC_UTILIZATION_SAMPLES = 4,
  NVML_PROCESSOR_CLK_SAMPLES = 5,
  NVML_MEMORY_CLK_SAMPLES = 6,
  NVML_MODULE_POWER_SAMPLES = 7,
  NVML_JPG_UTILIZATION_SAMPLES = 8,
  NVML_OFA_UTILIZATION_SAMPLES = 9,
  NVML_SAMPLINGTYPE_COUNT
} nvmlSamplingType_t;

typedef enum nvmlValueType_enum {
  NVML_VALUE_TYPE_DOUBLE = 0,
  NVML_VALUE_TYPE_UNSIGNED_INT = 1,
  NVML_VALUE_TYPE_UNSIGNED_LONG = 2,
  NVML_VALUE_TYPE_UNSIGNED_LONG_LONG = 3,
  NVML_VALUE_TYPE_SIGNED_LONG_LONG = 4,
  NVML_VALUE_TYPE_SIGNED_INT = 5,
  NVML_VALUE_TYPE_UNSIGNED_SHORT = 6,
  NVML_VALUE_TYPE_COUNT
} nvmlValueType_t;

typedef union nvmlValue_st {
  double dVal;
  int siVal;
  unsigned int uiVal;
  unsigned long ulVal;
  unsigned long long ullVal;
  signed long long sllVal;
  unsigned short usVal;
} nvmlValue_t;

typedef struct nvmlSample_st {
  unsigned long long timeStamp; /* CPU time, microseconds */
  nvmlValue_t sampleValue;
} nvmlSample_t;

#ifdef __cplusplus
static_assert(sizeof(nvmlValue_t) == 8, "nvmlValue_t layout");
static_assert(sizeof(nvmlSample_t) == 16, "nvmlSample_t layout");
static_assert(sizeof(nvmlUtilization_t) == 8, "nvmlUtilization_t layout");
#endif

typedef enum nvmlTemperatureSensors_enum { NVML_TEMPERATURE_GPU = 0 } nvmlTemperatureSensors_t;

typedef enum nvmlMemoryErrorType_enum {
  NVML_MEMORY_ERROR_TYPE_CORRECTED = 0,
  NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
} nvmlMemoryErrorType_t;

typedef enum nvmlEccCounterType_enum {
  NVML_VOLATILE_ECC = 0,  /* since the last driver load */
  NVML_AGGREGATE_ECC = 1  /* over the GPU's life */
} nvmlEccCounterType_t;

/* Event types (a bit mask). */
#define nvmlEventTypeXidCriticalError 0x0000000000000008LL

typedef struct nvmlEventData_st {
  nvmlDevice_t device;
  unsigned long long eventType;
  unsigned long long eventData; /* the Xid for nvmlEventTypeXidCriticalError */
  unsigned int gpuInstanceId;
  unsigned int computeInstanceId;
} nvmlEventData_t;

nvmlReturn_t nvmlInit_v2(void);
nvmlReturn_t nvmlShutdown(void);
const char* nvmlErrorString(nvmlReturn_t result);
nvmlReturn_t nvmlSystemGetDriverVersion(char* version, unsigned int length);

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int* deviceCount);
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t* device);
nvmlReturn_t nvmlDeviceGetHandleByUUID(const char* uuid, nvmlDevice_t* device);
nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char* pciBusId, nvmlDevice_t* device);
nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int* index);
nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char* uuid, unsigned int length);
nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char* name, unsigned int length);
nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int* major, int* minor);
nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t* memory);
nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t* memory);

/* Topology: the GPUs near a GPU, or near a CPU. With *count 0, the number
 * there is; else deviceArray is filled with up to *count handles. */
typedef enum nvmlGpuLevel_enum {
  NVML_TOPOLOGY_INTERNAL = 0,
  NVML_TOPOLOGY_SINGLE = 10,
  NVML_TOPOLOGY_MULTIPLE = 20,
  NVML_TOPOLOGY_HOSTBRIDGE = 30,
  NVML_TOPOLOGY_NODE = 40,
  NVML_TOPOLOGY_SYSTEM = 50
} nvmlGpuTopologyLevel_t;
nvmlReturn_t nvmlDeviceGetTopologyNearestGpus(nvmlDevice_t device, nvmlGpuTopologyLevel_t level, unsigned int* count,
                                              nvmlDevice_t* deviceArray);
nvmlReturn_t nvmlSystemGetTopologyGpuSet(unsigned int cpuNumber, unsigned int* count, nvmlDevice_t* deviceArray);

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int* infoCount,
                                                  nvmlProcessInfo_v1_t* infos);
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int* infoCount,
                                                     nvmlProcessInfo_v2_t* infos);
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int* infoCount,
                                                     nvmlProcessInfo_t* infos);

nvmlReturn_t nvmlDeviceGetRunningProcessDetailList(nvmlDevice_t device, nvmlProcessDetailList_t* plist);
nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device, nvmlProcessUtilizationSample_t* utilization,
                                             unsigned int* processSamplesCount, unsigned long long lastSeenTimeStamp);
nvmlReturn_t nvmlDeviceGetProcessesUtilizationInfo(nvmlDevice_t device,
                                                   nvmlProcessesUtilizationInfo_t* procesesUtilInfo);
nvmlReturn_t nvmlDeviceGetSamples(nvmlDevice_t device, nvmlSamplingType_t type, unsigned long long lastSeenTimeStamp,
                                  nvmlValueType_t* sampleValType, unsigned int* sampleCount, nvmlSample_t* samples);
nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t* utilization);
nvmlReturn_t nvmlDeviceGetAccountingPids(nvmlDevice_t device, unsigned int* count, unsigned int* pids);
nvmlReturn_t nvmlDeviceGetAccountingStats(nvmlDevice_t device, unsigned int pid, nvmlAccountingStats_t* stats);

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, nvmlTemperatureSensors_t sensorType, unsigned int* temp);
nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int* power); /* milliwatts */
nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, nvmlMemoryErrorType_t errorType,
                                         nvmlEccCounterType_t counterType, unsigned long long* eccCounts);

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t* set);
nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes, nvmlEventSet_t set);
nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t* data, unsigned int timeoutms);
nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set);

#ifdef __cplusplus
}
#endif

#endif /* FRACGPU_NVML_ABI_H */
