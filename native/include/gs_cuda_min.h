/*
 * gpusnap: minimal declarations of the CUDA driver API subset gpusnap uses,
 * for machines without the CUDA toolkit headers. Written from the public
 * driver API documentation (types, enum values and struct layouts are ABI).
 * Selected by CMake only when <cuda.h> with the checkpoint API is missing.
 */
#ifndef GPUSNAP_GS_CUDA_MIN_H
#define GPUSNAP_GS_CUDA_MIN_H

#include <stdint.h>

typedef uint64_t cuuint64_t;

typedef enum {
	CUDA_SUCCESS = 0,
	CUDA_ERROR_INVALID_VALUE = 1,
	CUDA_ERROR_OUT_OF_MEMORY = 2,
	CUDA_ERROR_NOT_INITIALIZED = 3,
	CUDA_ERROR_NO_DEVICE = 100,
	CUDA_ERROR_OPERATING_SYSTEM = 304,
	CUDA_ERROR_ILLEGAL_STATE = 401,
	CUDA_ERROR_NOT_FOUND = 500,
	CUDA_ERROR_NOT_READY = 600,
	CUDA_ERROR_NOT_SUPPORTED = 801,
	CUDA_ERROR_TIMEOUT = 909,
	CUDA_ERROR_UNKNOWN = 999,
} CUresult;

typedef enum {
	CU_GET_PROC_ADDRESS_SUCCESS = 0,
	CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND = 1,
	CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT = 2,
} CUdriverProcAddressQueryResult;

typedef enum {
	CU_PROCESS_STATE_RUNNING = 0,
	CU_PROCESS_STATE_LOCKED = 1,
	CU_PROCESS_STATE_CHECKPOINTED = 2,
	CU_PROCESS_STATE_FAILED = 3,
} CUprocessState;

typedef int CUdevice;

typedef struct {
	char bytes[16];
} CUuuid;

typedef struct {
	unsigned int timeoutMs;
	unsigned int reserved0;
	cuuint64_t reserved1[7];
} CUcheckpointLockArgs;

typedef struct {
	cuuint64_t reserved[8];
} CUcheckpointCheckpointArgs;

typedef struct {
	CUuuid oldUuid;
	CUuuid newUuid;
} CUcheckpointGpuPair;

typedef struct {
	CUcheckpointGpuPair *gpuPairs;
	unsigned int gpuPairsCount;
	char reserved[52 - sizeof(CUcheckpointGpuPair *)];
	cuuint64_t reserved1;
} CUcheckpointRestoreArgs;

typedef struct {
	cuuint64_t reserved[8];
} CUcheckpointUnlockArgs;

/* Prototypes, for the fake driver (the plugin only uses pointers). */
CUresult cuInit(unsigned int flags);
CUresult cuDriverGetVersion(int *version);
CUresult cuGetErrorString(CUresult err, const char **str);
CUresult cuGetErrorName(CUresult err, const char **str);
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cuda_version, cuuint64_t flags,
			     CUdriverProcAddressQueryResult *status);
CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid);
CUresult cuCheckpointProcessGetState(int pid, CUprocessState *state);
CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args);
CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args);
CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args);
CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args);

#endif
