/* A minimal libcuda.so.1 for tests/test_gpu_driver.py: just enough driver for gpusnap's GPU
 * inventory (two fake H200s) and cuCheckpointProcessGetState, loadable by cuda-python
 * (cuGetProcAddress_v2) and by ctypes. The full fake driver of the plugin tests lives in
 * native/; this one only serves the Python wrapper's tests.
 * MINI_CUDA_CUDA_PID=<pid> makes that pid a CUDA process in state MINI_CUDA_STATE (0..3). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef struct { char bytes[16]; } CUuuid;
#define OK 0
#define ERR_INVALID_VALUE 1
#define ERR_NOT_INITIALIZED 3
#define ERR_INVALID_DEVICE 101
#define ERR_NOT_FOUND 500

static int inited;

CUresult cuInit(unsigned int flags) { (void)flags; inited = 1; return OK; }
CUresult cuDriverGetVersion(int *v) { if (!v) return ERR_INVALID_VALUE; *v = 13000; return OK; }
CUresult cuDeviceGetCount(int *n) { if (!inited) return ERR_NOT_INITIALIZED; *n = 2; return OK; }
CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    if (!inited) return ERR_NOT_INITIALIZED;
    if (ordinal < 0 || ordinal > 1) return ERR_INVALID_DEVICE;
    *d = ordinal; return OK;
}
CUresult cuDeviceGetName(char *name, int len, CUdevice d) {
    if (d < 0 || d > 1) return ERR_INVALID_DEVICE;
    snprintf(name, (size_t)len, "NVIDIA H200"); return OK;
}
CUresult cuDeviceGetUuid_v2(CUuuid *u, CUdevice d) {
    if (d < 0 || d > 1) return ERR_INVALID_DEVICE;
    for (int i = 0; i < 16; i++) u->bytes[i] = (char)(0xa0 + i + 16 * d);
    return OK;
}
CUresult cuDeviceGetUuid(CUuuid *u, CUdevice d) { return cuDeviceGetUuid_v2(u, d); }
CUresult cuDeviceTotalMem_v2(size_t *b, CUdevice d) {
    if (d < 0 || d > 1) return ERR_INVALID_DEVICE;
    *b = (size_t)150754820096ULL; return OK;
}
CUresult cuDeviceGetPCIBusId(char *bus, int len, CUdevice d) {
    if (d < 0 || d > 1) return ERR_INVALID_DEVICE;
    /* device 0 sits on the higher bus: gpusnap must order by bus id */
    snprintf(bus, (size_t)len, d == 0 ? "00000000:9A:00.0" : "00000000:19:00.0"); return OK;
}
CUresult cuGetErrorName(CUresult e, const char **s) {
    switch (e) {
    case OK: *s = "CUDA_SUCCESS"; return OK;
    case ERR_INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; return OK;
    case ERR_NOT_INITIALIZED: *s = "CUDA_ERROR_NOT_INITIALIZED"; return OK;
    case ERR_NOT_FOUND: *s = "CUDA_ERROR_NOT_FOUND"; return OK;
    default: *s = "CUDA_ERROR_UNKNOWN"; return OK;
    }
}
CUresult cuGetErrorString(CUresult e, const char **s) { return cuGetErrorName(e, s); }

#ifndef MINI_CUDA_NO_CHECKPOINT /* -D it for a pre-r570 driver without the checkpoint API */
CUresult cuCheckpointProcessGetState(int pid, int *state) {
    const char *p = getenv("MINI_CUDA_CUDA_PID");
    if (!state) return ERR_INVALID_VALUE;
    if (!p || atoi(p) != pid) return ERR_NOT_INITIALIZED; /* not a CUDA process */
    const char *s = getenv("MINI_CUDA_STATE");
    *state = s ? atoi(s) : 0;
    return OK;
}
#define UNSUPPORTED(name, ...) CUresult name(__VA_ARGS__) { return ERR_NOT_FOUND; }
UNSUPPORTED(cuCheckpointProcessGetRestoreThreadId, int pid, int *tid)
UNSUPPORTED(cuCheckpointProcessLock, int pid, void *args)
UNSUPPORTED(cuCheckpointProcessCheckpoint, int pid, void *args)
UNSUPPORTED(cuCheckpointProcessRestore, int pid, void *args)
UNSUPPORTED(cuCheckpointProcessUnlock, int pid, void *args)
#endif

/* cuda-python resolves everything through cuGetProcAddress: try "<name>_v2", then "<name>" */
static CUresult lookup(const char *sym, void **pfn) {
    char buf[256];
    static void *self;
    if (!self) self = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    snprintf(buf, sizeof buf, "%s_v2", sym);
    *pfn = self ? dlsym(self, buf) : NULL;
    if (!*pfn && self) *pfn = dlsym(self, sym);
    return *pfn ? OK : ERR_NOT_FOUND;
}
CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, unsigned long long flags, int *status) {
    (void)ver; (void)flags;
    CUresult r = lookup(sym, pfn);
    if (status) *status = r == OK ? 0 : 1; /* CU_GET_PROC_ADDRESS_SUCCESS / SYMBOL_NOT_FOUND */
    return r;
}
CUresult cuGetProcAddress(const char *sym, void **pfn, int ver, unsigned long long flags) {
    return cuGetProcAddress_v2(sym, pfn, ver, flags, NULL);
}
