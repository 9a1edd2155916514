/*
 * gpusnap: the CUDA driver types the plugin and the fake driver use.
 *
 * CMake decides where they come from: the toolkit's <cuda.h> when it is found
 * and declares the checkpoint API (GPUSNAP_HAVE_CUDA_H), otherwise the small
 * gs_cuda_min.h in this directory. Nothing here is linked against libcuda:
 * the plugin opens the driver at run time.
 */
#ifndef GPUSNAP_GS_CUDA_H
#define GPUSNAP_GS_CUDA_H

#ifdef GPUSNAP_HAVE_CUDA_H
#include <cuda.h>
#else
#include "gs_cuda_min.h"
#endif

/* Layouts the plugin relies on, whichever header supplied them. */
_Static_assert(sizeof(CUuuid) == 16, "CUuuid must be 16 bytes");
_Static_assert(sizeof(CUcheckpointGpuPair) == 32, "CUcheckpointGpuPair must be 32 bytes");
_Static_assert(sizeof(CUcheckpointLockArgs) == 64, "CUcheckpointLockArgs must be 64 bytes");
_Static_assert(sizeof(CUcheckpointCheckpointArgs) == 64, "CUcheckpointCheckpointArgs must be 64 bytes");
_Static_assert(sizeof(CUcheckpointRestoreArgs) == 64, "CUcheckpointRestoreArgs must be 64 bytes");
_Static_assert(sizeof(CUcheckpointUnlockArgs) == 64, "CUcheckpointUnlockArgs must be 64 bytes");

/* Function pointer types for everything resolved at run time. */
typedef CUresult (*gs_cuInit_t)(unsigned int flags);
typedef CUresult (*gs_cuDriverGetVersion_t)(int *version);
typedef CUresult (*gs_cuGetErrorString_t)(CUresult err, const char **str);
typedef CUresult (*gs_cuGetErrorName_t)(CUresult err, const char **str);
typedef CUresult (*gs_cuGetProcAddress_v2_t)(const char *symbol, void **pfn, int cuda_version,
					     cuuint64_t flags, CUdriverProcAddressQueryResult *status);
typedef CUresult (*gs_cuGetRestoreThreadId_t)(int pid, int *tid);
typedef CUresult (*gs_cuGetState_t)(int pid, CUprocessState *state);
typedef CUresult (*gs_cuLock_t)(int pid, CUcheckpointLockArgs *args);
typedef CUresult (*gs_cuCheckpoint_t)(int pid, CUcheckpointCheckpointArgs *args);
typedef CUresult (*gs_cuRestore_t)(int pid, CUcheckpointRestoreArgs *args);
typedef CUresult (*gs_cuUnlock_t)(int pid, CUcheckpointUnlockArgs *args);

#endif
