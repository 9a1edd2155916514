/*
 * gpusnap_cuda: CRIU plugin that checkpoints and restores the GPU state of
 * CUDA processes by calling the driver's checkpoint API directly.
 *
 * Dump:    PAUSE_DEVICES      lock every CUDA process (remember its state)
 *          CHECKPOINT_DEVICES let its restore thread run, checkpoint, stop it
 *          exit               job keeps running or dump failed: restore what
 *                             we checkpointed, unlock what we locked
 * Restore: RESUME_DEVICES_LATE cuInit, restore (GPU pairs), unlock
 *
 * See docs/plugin.md for the environment variables and the report format.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include <criu/criu-plugin.h>
#include <criu/criu-log.h>

#include "gs_cuda.h"
#include "gs_gpumap.h"
#include "gs_thaw.h"
#include "gs_track.h"

#define GS_NAME		       "gpusnap_cuda"
#define GS_PREFIX	       GS_NAME ": "
#define GS_DEFAULT_LOCK_TIMEOUT_MS 5000u
/* API version asked of cuGetProcAddress: the checkpoint API is in 12.8+. */
#define GS_CUDA_API_VERSION    12080

/* Errors and warnings carry CRIU's own "Error (file:line): " marker. */
#define gs_err(fmt, ...) \
	print_on_level(LOG_ERROR, "Error (gpusnap_cuda.c:%d): " GS_PREFIX fmt "\n", __LINE__, ##__VA_ARGS__)
#define gs_warn(fmt, ...) \
	print_on_level(LOG_WARN, "Warn  (gpusnap_cuda.c:%d): " GS_PREFIX fmt "\n", __LINE__, ##__VA_ARGS__)
#define gs_info(fmt, ...)  print_on_level(LOG_INFO, GS_PREFIX fmt "\n", ##__VA_ARGS__)
#define gs_debug(fmt, ...) print_on_level(LOG_DEBUG, GS_PREFIX fmt "\n", ##__VA_ARGS__)

struct gs_driver {
	void *handle;
	bool inited; /* cuInit done in this (criu) process */
	int version;
	gs_cuInit_t init;
	gs_cuDriverGetVersion_t get_version;
	gs_cuGetErrorString_t err_string;
	gs_cuGetErrorName_t err_name;
	gs_cuGetRestoreThreadId_t get_tid;
	gs_cuGetState_t get_state;
	gs_cuLock_t lock;
	gs_cuCheckpoint_t checkpoint;
	gs_cuRestore_t restore;
	gs_cuUnlock_t unlock;
};

static struct gs_driver drv;
static bool disabled = true;
static int cur_stage = -1;
static bool leave_running = true;
static unsigned int lock_timeout_ms = GS_DEFAULT_LOCK_TIMEOUT_MS;
static const char *report_path;
static struct gs_gpu_pair gpu_map[GS_GPU_MAP_MAX];
static int gpu_map_n;
static struct gs_table procs;
/* nanoseconds spent inside driver calls, to split hook time */
static uint64_t driver_ns;

static uint64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Per-hook timing: total, driver, and the plugin's own share. */
struct gs_clock {
	uint64_t start, driver_start;
};

static void clock_start(struct gs_clock *c)
{
	c->start = now_ns();
	c->driver_start = driver_ns;
}

static void clock_log(const struct gs_clock *c, bool cuda, const char *what, int pid)
{
	uint64_t total = now_ns() - c->start;
	uint64_t drv_part = driver_ns - c->driver_start;

	print_on_level(cuda ? LOG_INFO : LOG_DEBUG, GS_PREFIX "%s pid=%d took %.3f ms (driver %.3f ms, plugin %.3f ms)\n",
		       what, pid, total / 1e6, drv_part / 1e6, (total - drv_part) / 1e6);
}

static const char *cu_err(CUresult r)
{
	static char buf[256];
	const char *name = NULL, *str = NULL;

	if (drv.err_name)
		drv.err_name(r, &name);
	if (drv.err_string)
		drv.err_string(r, &str);
	snprintf(buf, sizeof(buf), "%s (%d: %s)", name ? name : "CUDA error", (int)r, str ? str : "no description");
	return buf;
}

static CUresult drv_cuinit(void)
{
	CUresult r = CUDA_SUCCESS;

	if (drv.inited)
		goto out;
	r = drv.init(0);
	if (r != CUDA_SUCCESS) {
		gs_err("cuInit failed: %s", cu_err(r));
		goto out;
	}
	drv.inited = true;
	gs_debug("cuInit done");
out:
	return r;
}

/*
 * Runs one driver call, timed; when the driver wants cuInit first, does it
 * once and retries.
 */
#define DRV_CALL(res, expr)                                                                    \
	do {                                                                                   \
		uint64_t t0_ = now_ns();                                                       \
		(res) = (expr);                                                                \
		if ((res) == CUDA_ERROR_NOT_INITIALIZED && !drv.inited && drv_cuinit() == CUDA_SUCCESS) \
			(res) = (expr);                                                        \
		driver_ns += now_ns() - t0_;                                                   \
	} while (0)

static CUresult cu_get_state(int pid, enum gs_state *out)
{
	CUprocessState st = CU_PROCESS_STATE_FAILED;
	CUresult r;

	DRV_CALL(r, drv.get_state(pid, &st));
	*out = r == CUDA_SUCCESS ? gs_state_from_int((int)st) : GS_UNKNOWN;
	return r;
}

static CUresult cu_lock(int pid)
{
	CUcheckpointLockArgs args;
	CUresult r;

	memset(&args, 0, sizeof(args));
	args.timeoutMs = lock_timeout_ms;
	DRV_CALL(r, drv.lock(pid, &args));
	return r;
}

static CUresult cu_checkpoint(int pid)
{
	CUcheckpointCheckpointArgs args;
	CUresult r;

	memset(&args, 0, sizeof(args));
	DRV_CALL(r, drv.checkpoint(pid, &args));
	return r;
}

static CUresult cu_restore(int pid, bool with_map)
{
	CUcheckpointGpuPair pairs[GS_GPU_MAP_MAX];
	CUcheckpointRestoreArgs args;
	CUresult r;
	int i;

	/* The documented restore needs cuInit (or persistence mode) first. */
	r = CUDA_SUCCESS;
	if (!drv.inited) {
		uint64_t t0 = now_ns();

		r = drv_cuinit();
		driver_ns += now_ns() - t0;
		if (r != CUDA_SUCCESS)
			goto out;
	}
	memset(&args, 0, sizeof(args));
	if (with_map && gpu_map_n > 0) {
		for (i = 0; i < gpu_map_n; i++) {
			memcpy(pairs[i].oldUuid.bytes, gpu_map[i].old_uuid, GS_UUID_LEN);
			memcpy(pairs[i].newUuid.bytes, gpu_map[i].new_uuid, GS_UUID_LEN);
		}
		args.gpuPairs = pairs;
		args.gpuPairsCount = (unsigned int)gpu_map_n;
	}
	DRV_CALL(r, drv.restore(pid, &args));
out:
	return r;
}

static CUresult cu_unlock(int pid)
{
	CUcheckpointUnlockArgs args;
	CUresult r;

	memset(&args, 0, sizeof(args));
	DRV_CALL(r, drv.unlock(pid, &args));
	return r;
}

/* Appends one line to $GPUSNAP_CUDA_REPORT, when set. */
static void report(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void report(const char *fmt, ...)
{
	char line[512];
	va_list ap;
	int fd = -1, len;

	if (report_path == NULL || report_path[0] == '\0')
		goto out;
	va_start(ap, fmt);
	len = vsnprintf(line, sizeof(line) - 1, fmt, ap);
	va_end(ap);
	if (len < 0)
		goto out;
	if ((size_t)len > sizeof(line) - 2)
		len = sizeof(line) - 2;
	line[len++] = '\n';
	fd = open(report_path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
	if (fd < 0) {
		gs_err("cannot open report file %s: %s", report_path, strerror(errno));
		goto out;
	}
	if (write(fd, line, (size_t)len) != len)
		gs_err("cannot write report file %s: %s", report_path, strerror(errno));
out:
	if (fd >= 0)
		close(fd);
}

/* Is pid a CUDA process? 1 yes (tid set), 0 no. */
static int restore_thread_of(int pid, int *tid, CUresult *why)
{
	CUresult r;
	int ret = 0;

	*tid = -1;
	DRV_CALL(r, drv.get_tid(pid, tid));
	*why = r;
	if (r == CUDA_SUCCESS && *tid > 0)
		ret = 1;
	return ret;
}

/*
 * Brings one tracked process through the steps of a plan while its restore
 * thread is allowed to run. Updates p->current. Returns 0 or -1.
 */
static int run_plan(struct gs_proc *p, struct gs_plan plan, bool with_map, const char *what)
{
	struct gs_thaw th;
	char msg[256] = "";
	CUresult r;
	int ret = -1;

	if (!plan.restore && !plan.unlock) {
		ret = 0;
		goto out;
	}
	if (gs_thaw_thread(p->tid, &th, msg, sizeof(msg))) {
		gs_err("%s pid=%d: cannot let restore thread %d run: %s", what, p->pid, p->tid, msg);
		goto out;
	}
	if (plan.restore) {
		r = cu_restore(p->pid, with_map);
		if (r != CUDA_SUCCESS) {
			gs_err("%s pid=%d: cuCheckpointProcessRestore failed: %s", what, p->pid, cu_err(r));
			cu_get_state(p->pid, &p->current);
			goto refreeze;
		}
		p->current = GS_LOCKED;
	}
	if (plan.unlock) {
		r = cu_unlock(p->pid);
		if (r != CUDA_SUCCESS) {
			gs_err("%s pid=%d: cuCheckpointProcessUnlock failed: %s", what, p->pid, cu_err(r));
			cu_get_state(p->pid, &p->current);
			goto refreeze;
		}
		p->current = GS_RUNNING;
	}
	ret = 0;
refreeze:
	if (gs_refreeze_thread(&th, msg, sizeof(msg))) {
		gs_err("%s pid=%d: cannot stop restore thread %d again: %s", what, p->pid, p->tid, msg);
		ret = -1;
	}
out:
	return ret;
}

/* ---- dump ---------------------------------------------------------------- */

static int gs_pause_devices(int pid)
{
	struct gs_clock clk;
	struct gs_proc *p;
	enum gs_state st;
	CUresult r;
	int tid = -1, ret = 0;

	if (disabled || cur_stage != CR_PLUGIN_STAGE__DUMP)
		goto out_quiet;
	clock_start(&clk);

	/* CRIU may ask again for a task it failed to seize the first time. */
	if (gs_table_find(&procs, pid))
		goto out;
	if (!restore_thread_of(pid, &tid, &r)) {
		gs_debug("pause pid=%d: not a CUDA process (%s)", pid, cu_err(r));
		goto out;
	}
	r = cu_get_state(pid, &st);
	if (r != CUDA_SUCCESS) {
		gs_err("pause pid=%d: cuCheckpointProcessGetState failed: %s", pid, cu_err(r));
		ret = -1;
		goto out;
	}
	p = gs_table_add(&procs, pid, tid, st);
	if (p == NULL) {
		gs_err("pause pid=%d: out of memory", pid);
		ret = -1;
		goto out;
	}
	gs_info("pause pid=%d: CUDA process, restore thread %d, state %s", pid, tid, gs_state_name(st));

	switch (st) {
	case GS_RUNNING:
		r = cu_lock(pid);
		if (r != CUDA_SUCCESS) {
			gs_err("pause pid=%d: cuCheckpointProcessLock (timeout %u ms) failed: %s", pid, lock_timeout_ms,
			       cu_err(r));
			/* A timed-out lock leaves it running; check, in case not. */
			if (cu_get_state(pid, &p->current) == CUDA_SUCCESS && p->current == GS_LOCKED)
				p->locked_by_us = true;
			ret = -1;
			goto out;
		}
		p->locked_by_us = true;
		p->current = GS_LOCKED;
		break;
	case GS_LOCKED:
		gs_info("pause pid=%d: already locked by someone else; it will be left locked", pid);
		break;
	case GS_CHECKPOINTED:
		gs_info("pause pid=%d: already checkpointed; it will be left so", pid);
		break;
	default:
		gs_err("pause pid=%d: CUDA process in state %s cannot be dumped", pid, gs_state_name(st));
		ret = -1;
		goto out;
	}
out:
	clock_log(&clk, gs_table_find(&procs, pid) != NULL, "pause", pid);
out_quiet:
	return ret;
}
CR_PLUGIN_REGISTER_HOOK(CR_PLUGIN_HOOK__PAUSE_DEVICES, gs_pause_devices)

static int gs_checkpoint_devices(int pid)
{
	struct gs_clock clk;
	struct gs_thaw th;
	struct gs_proc *p;
	char msg[256] = "";
	CUresult r;
	int tid = -1, ret = -1;

	if (disabled || cur_stage != CR_PLUGIN_STAGE__DUMP) {
		ret = 0;
		goto out_quiet;
	}
	clock_start(&clk);

	p = gs_table_find(&procs, pid);
	if (p == NULL) {
		/* Not seen as CUDA when paused; make sure it did not become one since. */
		if (restore_thread_of(pid, &tid, &r)) {
			gs_err("checkpoint pid=%d: became a CUDA process after it was paused; retry the dump", pid);
			goto out;
		}
		ret = 0;
		goto out;
	}
	if (p->current == GS_CHECKPOINTED) {
		gs_info("checkpoint pid=%d: already checkpointed", pid);
		p->image_checkpointed = true;
		ret = 0;
		goto out;
	}
	if (p->current != GS_LOCKED) {
		gs_err("checkpoint pid=%d: expected state locked, have %s", pid, gs_state_name(p->current));
		goto out;
	}

	if (gs_thaw_thread(p->tid, &th, msg, sizeof(msg))) {
		gs_err("checkpoint pid=%d: cannot let restore thread %d run: %s", pid, p->tid, msg);
		goto out;
	}
	r = cu_checkpoint(pid);
	if (r == CUDA_SUCCESS) {
		p->current = GS_CHECKPOINTED;
		p->checkpointed_by_us = true;
		p->image_checkpointed = true;
		ret = 0;
	} else {
		gs_err("checkpoint pid=%d: cuCheckpointProcessCheckpoint failed: %s", pid, cu_err(r));
		cu_get_state(pid, &p->current);
		/* If it got there anyway, the undo must restore it. */
		if (p->current == GS_CHECKPOINTED)
			p->checkpointed_by_us = true;
	}
	if (gs_refreeze_thread(&th, msg, sizeof(msg))) {
		gs_err("checkpoint pid=%d: cannot stop restore thread %d again: %s", pid, p->tid, msg);
		ret = -1;
	}
out:
	clock_log(&clk, p != NULL, "checkpoint", pid);
out_quiet:
	return ret;
}
CR_PLUGIN_REGISTER_HOOK(CR_PLUGIN_HOOK__CHECKPOINT_DEVICES, gs_checkpoint_devices)

static void dump_end(int ret)
{
	struct gs_clock clk;
	size_t i;

	gs_info("dump %s, job %s: %zu CUDA process(es) to settle", ret ? "failed" : "succeeded",
		leave_running ? "keeps running" : "exits", procs.n);
	for (i = 0; i < procs.n; i++) {
		struct gs_proc *p = &procs.v[i];
		struct gs_plan plan = gs_dump_end_plan(p, ret != 0, leave_running);
		enum gs_state image = p->current;
		int ok;

		clock_start(&clk);
		ok = run_plan(p, plan, false, "resume") == 0;
		if (ok)
			gs_info("resume pid=%d: state %s -> %s", p->pid, gs_state_name(image), gs_state_name(p->current));
		else
			gs_err("resume pid=%d: left in state %s; the job may hang on its next CUDA call", p->pid,
			       gs_state_name(p->current));
		report("dump pid=%d tid=%d initial=%s image=%s final=%s result=%s", p->pid, p->tid,
		       gs_state_name(p->initial), gs_state_name(image), gs_state_name(p->current), ok ? "ok" : "fail");
		clock_log(&clk, true, "resume", p->pid);
	}
}

/* ---- restore ------------------------------------------------------------- */

static int gs_resume_devices_late(int pid)
{
	struct gs_clock clk;
	struct gs_plan plan;
	struct gs_proc p;
	enum gs_state st;
	CUresult r;
	int tid = -1, ret = 0;

	if (disabled || cur_stage != CR_PLUGIN_STAGE__RESTORE)
		goto out_quiet;
	clock_start(&clk);

	if (!restore_thread_of(pid, &tid, &r)) {
		gs_debug("restore pid=%d: not a CUDA process (%s)", pid, cu_err(r));
		goto out;
	}
	r = cu_get_state(pid, &st);
	if (r != CUDA_SUCCESS) {
		gs_err("restore pid=%d: cuCheckpointProcessGetState failed: %s", pid, cu_err(r));
		report("restore pid=%d tid=%d initial=unknown final=unknown result=fail", pid, tid);
		ret = -1;
		goto out;
	}
	memset(&p, 0, sizeof(p));
	p.pid = pid;
	p.tid = tid;
	p.initial = p.current = st;
	gs_info("restore pid=%d: CUDA process, restore thread %d, state %s", pid, tid, gs_state_name(st));
	if (gs_restore_plan(st, &plan)) {
		gs_err("restore pid=%d: CUDA process in state %s cannot be resumed", pid, gs_state_name(st));
		ret = -1;
	} else if (run_plan(&p, plan, true, "restore")) {
		ret = -1;
	}
	if (ret)
		gs_err("restore pid=%d: left in state %s; its next CUDA call will hang", pid, gs_state_name(p.current));
	report("restore pid=%d tid=%d initial=%s final=%s result=%s", pid, tid, gs_state_name(p.initial),
	       gs_state_name(p.current), ret ? "fail" : "ok");
out:
	clock_log(&clk, tid > 0, "restore", pid);
out_quiet:
	return ret;
}
CR_PLUGIN_REGISTER_HOOK(CR_PLUGIN_HOOK__RESUME_DEVICES_LATE, gs_resume_devices_late)

/* ---- init / exit ---------------------------------------------------------- */

static void *resolve(gs_cuGetProcAddress_v2_t gpa, const char *name)
{
	CUdriverProcAddressQueryResult qr = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
	void *fn = NULL;

	if (gpa && gpa(name, &fn, GS_CUDA_API_VERSION, 0, &qr) == CUDA_SUCCESS && qr == CU_GET_PROC_ADDRESS_SUCCESS &&
	    fn)
		goto out;
	fn = dlsym(drv.handle, name);
out:
	return fn;
}

/* Loads the driver. 0: ready; 1: no usable driver (plugin disables itself). */
static int load_driver(void)
{
	gs_cuGetProcAddress_v2_t gpa;
	CUresult r;
	int ret = 1;

	memset(&drv, 0, sizeof(drv));
	drv.handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	if (drv.handle == NULL) {
		gs_info("no CUDA driver (%s); CUDA checkpointing disabled, CPU-only dump/restore", dlerror());
		goto out;
	}
	gpa = (gs_cuGetProcAddress_v2_t)dlsym(drv.handle, "cuGetProcAddress_v2");
	drv.init = (gs_cuInit_t)resolve(gpa, "cuInit");
	drv.get_version = (gs_cuDriverGetVersion_t)resolve(gpa, "cuDriverGetVersion");
	drv.err_string = (gs_cuGetErrorString_t)resolve(gpa, "cuGetErrorString");
	drv.err_name = (gs_cuGetErrorName_t)resolve(gpa, "cuGetErrorName");
	drv.get_tid = (gs_cuGetRestoreThreadId_t)resolve(gpa, "cuCheckpointProcessGetRestoreThreadId");
	drv.get_state = (gs_cuGetState_t)resolve(gpa, "cuCheckpointProcessGetState");
	drv.lock = (gs_cuLock_t)resolve(gpa, "cuCheckpointProcessLock");
	drv.checkpoint = (gs_cuCheckpoint_t)resolve(gpa, "cuCheckpointProcessCheckpoint");
	drv.restore = (gs_cuRestore_t)resolve(gpa, "cuCheckpointProcessRestore");
	drv.unlock = (gs_cuUnlock_t)resolve(gpa, "cuCheckpointProcessUnlock");
	if (!drv.init || !drv.get_version || !drv.get_tid || !drv.get_state || !drv.lock || !drv.checkpoint ||
	    !drv.restore || !drv.unlock) {
		gs_info("CUDA driver lacks the checkpoint API (needs r570 or newer); CUDA checkpointing disabled, "
			"CPU-only dump/restore");
		dlclose(drv.handle);
		memset(&drv, 0, sizeof(drv));
		goto out;
	}
	r = drv.get_version(&drv.version);
	if (r != CUDA_SUCCESS)
		drv.version = 0;
	ret = 0;
out:
	return ret;
}

static int parse_bool_env(const char *name, bool dflt, bool *out)
{
	const char *v = getenv(name);
	int ret = 0;

	*out = dflt;
	if (v == NULL || v[0] == '\0')
		goto out;
	if (!strcmp(v, "1") || !strcasecmp(v, "true") || !strcasecmp(v, "yes"))
		*out = true;
	else if (!strcmp(v, "0") || !strcasecmp(v, "false") || !strcasecmp(v, "no"))
		*out = false;
	else {
		gs_err("%s=%s: expected 1 or 0", name, v);
		ret = -1;
	}
out:
	return ret;
}

static int read_env(int stage)
{
	const char *v;
	char err[256];
	int ret = -1;

	if (parse_bool_env("GPUSNAP_LEAVE_RUNNING", true, &leave_running))
		goto out;

	lock_timeout_ms = GS_DEFAULT_LOCK_TIMEOUT_MS;
	v = getenv("GPUSNAP_LOCK_TIMEOUT_MS");
	if (v && v[0]) {
		char *end;
		unsigned long ms;

		errno = 0;
		ms = strtoul(v, &end, 10);
		if (errno || *end || v[0] == '-' || ms > 24ul * 3600 * 1000) {
			gs_err("GPUSNAP_LOCK_TIMEOUT_MS=%s: expected milliseconds (0 = no timeout)", v);
			goto out;
		}
		lock_timeout_ms = (unsigned int)ms;
	}

	gpu_map_n = 0;
	if (stage == CR_PLUGIN_STAGE__RESTORE) {
		gpu_map_n = gs_parse_gpu_map(getenv("GPUSNAP_GPU_MAP"), gpu_map, GS_GPU_MAP_MAX, err, sizeof(err));
		if (gpu_map_n < 0) {
			gs_err("GPUSNAP_GPU_MAP: %s", err);
			gpu_map_n = 0;
			goto out;
		}
	}
	report_path = getenv("GPUSNAP_CUDA_REPORT");
	ret = 0;
out:
	return ret;
}

static int gs_init(int stage)
{
	int i, ret = 0;

	disabled = true;
	cur_stage = stage;
	driver_ns = 0;
	gs_table_init(&procs);

	if (stage == CR_PLUGIN_STAGE__PRE_DUMP) {
		gs_info("pre-dump: CUDA checkpointing not supported there; disabled");
		goto out;
	}
	if (read_env(stage)) {
		ret = -1;
		goto out;
	}
	if (load_driver())
		goto out;

	disabled = false;
	gs_info("CUDA driver %d.%d loaded; stage %s, leave running %s, lock timeout %u ms, %d GPU pair(s)",
		drv.version / 1000, (drv.version % 1000) / 10, stage == CR_PLUGIN_STAGE__DUMP ? "dump" : "restore",
		leave_running ? "yes" : "no", lock_timeout_ms, gpu_map_n);
	for (i = 0; i < gpu_map_n; i++) {
		char o[GS_UUID_STR_SIZE], n[GS_UUID_STR_SIZE];

		gs_format_uuid(gpu_map[i].old_uuid, o);
		gs_format_uuid(gpu_map[i].new_uuid, n);
		gs_info("GPU pair %s -> %s", o, n);
	}
out:
	return ret;
}

static void gs_exit(int stage, int ret)
{
	if (disabled)
		goto out;
	if (stage == CR_PLUGIN_STAGE__DUMP)
		dump_end(ret);
	gs_info("finished stage %d (criu ret %d); driver time %.3f ms", stage, ret, driver_ns / 1e6);
out:
	gs_table_free(&procs);
	/* A driver that ran cuInit may own threads in this process: keep it. */
	if (drv.handle && !drv.inited)
		dlclose(drv.handle);
	memset(&drv, 0, sizeof(drv));
	disabled = true;
}

/* Built with hidden visibility: only the descriptor is exported. */
extern __attribute__((visibility("default"))) cr_plugin_desc_t CR_PLUGIN_DESC;
CR_PLUGIN_REGISTER(GS_NAME, gs_init, gs_exit)
