/*
 * gpusnap_cuda: CRIU plugin that checkpoints and restores the GPU state of
 * CUDA processes by calling the driver's checkpoint API directly.
 *
 * Dump:    PAUSE_DEVICES      first call (the root): lock every CUDA process
 *                             of the tree, before CRIU freezes any of them
 *          CHECKPOINT_DEVICES let its restore thread run, checkpoint, stop it
 *          exit               job keeps running or dump failed: restore what
 *                             we checkpointed (all), then unlock (all)
 * Restore: RESUME_DEVICES_LATE first call (the root): wake the restore threads
 *                             of the tree, cuInit, restore all (GPU pairs),
 *                             then unlock all
 *
 * Every driver call runs in a thread of its own and is waited for with a
 * deadline (a hung driver must not hang CRIU and the job with it): on
 * timeout the call is abandoned and counts as failed.
 *
 * See docs/plugin.md for the environment variables and the report format.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
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
#include "gs_tree.h"

#define GS_NAME		       "gpusnap_cuda"
#define GS_PREFIX	       GS_NAME ": "
#define GS_DEFAULT_LOCK_TIMEOUT_MS 5000u
/* checkpoint / restore / unlock: they copy GPU memory (80 GB at ~1 GB/s) */
#define GS_DEFAULT_CALL_TIMEOUT_MS 600000u
/* a lock may take its own timeout and this much more before we give up */
#define GS_LOCK_GRACE_MS	   5000u
/* get-state, get-restore-thread-id: answers, no work */
#define GS_QUICK_TIMEOUT_MS	   10000u
#define GS_INIT_TIMEOUT_MS	   60000u
#define GS_TREE_MAX		   4096
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
static unsigned int call_timeout_ms = GS_DEFAULT_CALL_TIMEOUT_MS;
/* the tree was walked by the first hook call of this stage */
static bool tree_done;
/* driver calls abandoned after their deadline and still running */
static int calls_abandoned;
static pthread_mutex_t abandoned_mu = PTHREAD_MUTEX_INITIALIZER;
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

/* ---- bounded driver calls ---------------------------------------------------- */

enum gs_op { OP_INIT, OP_TID, OP_STATE, OP_LOCK, OP_CHECKPOINT, OP_RESTORE, OP_UNLOCK };

static const char *op_name(enum gs_op op)
{
	static const char *names[] = { "cuInit", "cuCheckpointProcessGetRestoreThreadId",
				       "cuCheckpointProcessGetState", "cuCheckpointProcessLock",
				       "cuCheckpointProcessCheckpoint", "cuCheckpointProcessRestore",
				       "cuCheckpointProcessUnlock" };
	return names[op];
}

/* One call, owned by the caller and the thread that runs it (refs). */
struct gs_job {
	pthread_mutex_t mu;
	pthread_cond_t cv;
	int refs;
	bool done;
	bool abandoned; /* the caller gave up waiting */
	enum gs_op op;
	void *fn; /* copied: the caller may reset drv while an abandoned call runs */
	int pid;
	CUresult r;
	int tid;
	CUprocessState st;
	CUcheckpointLockArgs lock;
	CUcheckpointCheckpointArgs ckpt;
	CUcheckpointRestoreArgs rest;
	CUcheckpointUnlockArgs unl;
	CUcheckpointGpuPair pairs[GS_GPU_MAP_MAX];
};

static void job_run(struct gs_job *j)
{
	switch (j->op) {
	case OP_INIT:
		j->r = ((gs_cuInit_t)j->fn)(0);
		break;
	case OP_TID:
		j->r = ((gs_cuGetRestoreThreadId_t)j->fn)(j->pid, &j->tid);
		break;
	case OP_STATE:
		j->r = ((gs_cuGetState_t)j->fn)(j->pid, &j->st);
		break;
	case OP_LOCK:
		j->r = ((gs_cuLock_t)j->fn)(j->pid, &j->lock);
		break;
	case OP_CHECKPOINT:
		j->r = ((gs_cuCheckpoint_t)j->fn)(j->pid, &j->ckpt);
		break;
	case OP_RESTORE:
		if (j->rest.gpuPairsCount)
			j->rest.gpuPairs = j->pairs;
		j->r = ((gs_cuRestore_t)j->fn)(j->pid, &j->rest);
		break;
	case OP_UNLOCK:
		j->r = ((gs_cuUnlock_t)j->fn)(j->pid, &j->unl);
		break;
	}
}

static void job_put(struct gs_job *j)
{
	bool last;

	pthread_mutex_lock(&j->mu);
	last = --j->refs == 0;
	pthread_mutex_unlock(&j->mu);
	if (last) {
		pthread_cond_destroy(&j->cv);
		pthread_mutex_destroy(&j->mu);
		free(j);
	}
}

static void *job_thread(void *arg)
{
	struct gs_job *j = arg;
	bool abandoned;

	job_run(j);
	pthread_mutex_lock(&j->mu);
	j->done = true;
	abandoned = j->abandoned;
	pthread_cond_signal(&j->cv);
	pthread_mutex_unlock(&j->mu);
	if (abandoned) {
		pthread_mutex_lock(&abandoned_mu);
		calls_abandoned--;
		pthread_mutex_unlock(&abandoned_mu);
	}
	job_put(j);
	return NULL;
}

/* Keeps this plugin loaded for good (an abandoned call will return into it). */
static void pin_self(void)
{
	static bool pinned;
	Dl_info info;

	if (pinned || !dladdr((void *)pin_self, &info) || info.dli_fname == NULL)
		return;
	if (dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD | RTLD_NODELETE))
		pinned = true;
}

/*
 * Runs j in a thread of its own and waits at most timeout_ms. On timeout the
 * call is left to finish (or hang) alone and CUDA_ERROR_TIMEOUT is returned.
 * The caller keeps its reference (job_put) and may read the results unless
 * the call timed out.
 */
static CUresult job_call(struct gs_job *j, unsigned int timeout_ms, bool *timed_out)
{
	pthread_condattr_t ca;
	pthread_attr_t ta;
	pthread_t th;
	struct timespec dl;
	uint64_t t0 = now_ns(), end;
	CUresult r;
	int rc = 0;

	*timed_out = false;
	pthread_mutex_init(&j->mu, NULL);
	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
	pthread_cond_init(&j->cv, &ca);
	pthread_condattr_destroy(&ca);
	j->refs = 2;
	pthread_attr_init(&ta);
	if (pthread_create(&th, &ta, job_thread, j)) {
		/* No thread to spare: call it here, unbounded, rather than not at all. */
		pthread_attr_destroy(&ta);
		job_run(j);
		j->done = true;
		j->refs = 1;
		goto out;
	}
	pthread_attr_destroy(&ta);
	end = t0 + (uint64_t)timeout_ms * 1000000ull;
	dl.tv_sec = (time_t)(end / 1000000000ull);
	dl.tv_nsec = (long)(end % 1000000000ull);
	pthread_mutex_lock(&j->mu);
	while (!j->done && rc != ETIMEDOUT)
		rc = pthread_cond_timedwait(&j->cv, &j->mu, &dl);
	if (!j->done) {
		*timed_out = true;
		j->abandoned = true;
		pthread_mutex_lock(&abandoned_mu);
		calls_abandoned++;
		pthread_mutex_unlock(&abandoned_mu);
	}
	pthread_mutex_unlock(&j->mu);
	if (*timed_out) {
		/* it returns into our code whenever it returns: never unload us */
		pthread_detach(th);
		pin_self();
	} else {
		/* wait until it has left our code (CRIU unloads plugins at exit) */
		pthread_join(th, NULL);
	}
out:
	r = *timed_out ? CUDA_ERROR_TIMEOUT : j->r;
	driver_ns += now_ns() - t0;
	if (*timed_out)
		gs_err("%s pid=%d did not return within %u ms; abandoned (the driver may be hung)", op_name(j->op), j->pid,
		       timeout_ms);
	return r;
}

static struct gs_job *job_new(enum gs_op op, void *fn, int pid)
{
	struct gs_job *j = calloc(1, sizeof(*j));

	if (j) {
		j->op = op;
		j->fn = fn;
		j->pid = pid;
	}
	return j;
}

static unsigned int op_timeout(enum gs_op op)
{
	switch (op) {
	case OP_INIT:
		return GS_INIT_TIMEOUT_MS;
	case OP_TID:
	case OP_STATE:
		return GS_QUICK_TIMEOUT_MS < call_timeout_ms ? GS_QUICK_TIMEOUT_MS : call_timeout_ms;
	case OP_LOCK:
		/* 0 = the driver waits for ever; we do not */
		return lock_timeout_ms ? lock_timeout_ms + GS_LOCK_GRACE_MS : call_timeout_ms;
	default:
		return call_timeout_ms;
	}
}

static CUresult drv_cuinit(void)
{
	struct gs_job *j;
	bool to;
	CUresult r = CUDA_SUCCESS;

	if (drv.inited)
		goto out;
	j = job_new(OP_INIT, (void *)drv.init, 0);
	if (j == NULL) {
		r = CUDA_ERROR_OUT_OF_MEMORY;
		goto out;
	}
	r = job_call(j, op_timeout(OP_INIT), &to);
	job_put(j);
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
 * One bounded driver call built by fill(); when the driver wants cuInit
 * first, does it once and retries. The job's results are copied to out.
 */
static CUresult drv_call(enum gs_op op, void *fn, int pid, const struct gs_job *in, struct gs_job *out)
{
	struct gs_job *j;
	CUresult r;
	bool to;
	int attempt;

	for (attempt = 0;; attempt++) {
		j = job_new(op, fn, pid);
		if (j == NULL)
			return CUDA_ERROR_OUT_OF_MEMORY;
		if (in) {
			j->lock = in->lock;
			j->ckpt = in->ckpt;
			j->rest = in->rest;
			j->unl = in->unl;
			memcpy(j->pairs, in->pairs, sizeof(j->pairs));
		}
		r = job_call(j, op_timeout(op), &to);
		if (!to && out) {
			out->tid = j->tid;
			out->st = j->st;
		}
		job_put(j);
		if (r == CUDA_ERROR_NOT_INITIALIZED && !drv.inited && attempt == 0 && drv_cuinit() == CUDA_SUCCESS)
			continue;
		return r;
	}
}

static CUresult cu_get_state(int pid, enum gs_state *out)
{
	struct gs_job res;
	CUresult r;

	memset(&res, 0, sizeof(res));
	r = drv_call(OP_STATE, (void *)drv.get_state, pid, NULL, &res);
	*out = r == CUDA_SUCCESS ? gs_state_from_int((int)res.st) : GS_UNKNOWN;
	return r;
}

static CUresult cu_lock(int pid)
{
	struct gs_job in;

	memset(&in, 0, sizeof(in));
	in.lock.timeoutMs = lock_timeout_ms;
	return drv_call(OP_LOCK, (void *)drv.lock, pid, &in, NULL);
}

static CUresult cu_checkpoint(int pid)
{
	struct gs_job in;

	memset(&in, 0, sizeof(in));
	return drv_call(OP_CHECKPOINT, (void *)drv.checkpoint, pid, &in, NULL);
}

/* GPUSNAP_GPU_MAP_<pid> when set (this process's own pairs), else GPUSNAP_GPU_MAP. */
static int pairs_for(int pid, struct gs_gpu_pair *out)
{
	char name[64], err[256];
	const char *v;
	int n;

	snprintf(name, sizeof(name), "GPUSNAP_GPU_MAP_%d", pid);
	v = getenv(name);
	if (v == NULL) {
		memcpy(out, gpu_map, sizeof(gpu_map[0]) * (size_t)gpu_map_n);
		return gpu_map_n;
	}
	n = gs_parse_gpu_map(v, out, GS_GPU_MAP_MAX, err, sizeof(err));
	if (n < 0)
		gs_err("%s: %s", name, err);
	return n;
}

static CUresult cu_restore(int pid, bool with_map)
{
	struct gs_gpu_pair mine[GS_GPU_MAP_MAX];
	struct gs_job in;
	CUresult r;
	int i, n = 0;

	/* The documented restore needs cuInit (or persistence mode) first. */
	r = drv_cuinit();
	if (r != CUDA_SUCCESS)
		goto out;
	memset(&in, 0, sizeof(in));
	if (with_map) {
		n = pairs_for(pid, mine);
		if (n < 0) {
			r = CUDA_ERROR_INVALID_VALUE;
			goto out;
		}
	}
	for (i = 0; i < n; i++) {
		memcpy(in.pairs[i].oldUuid.bytes, mine[i].old_uuid, GS_UUID_LEN);
		memcpy(in.pairs[i].newUuid.bytes, mine[i].new_uuid, GS_UUID_LEN);
	}
	in.rest.gpuPairsCount = (unsigned int)n;
	r = drv_call(OP_RESTORE, (void *)drv.restore, pid, &in, NULL);
out:
	return r;
}

static CUresult cu_unlock(int pid)
{
	struct gs_job in;

	memset(&in, 0, sizeof(in));
	return drv_call(OP_UNLOCK, (void *)drv.unlock, pid, &in, NULL);
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
	struct gs_job res;
	CUresult r;
	int ret = 0;

	*tid = -1;
	memset(&res, 0, sizeof(res));
	res.tid = -1;
	r = drv_call(OP_TID, (void *)drv.get_tid, pid, NULL, &res);
	*why = r;
	if (r == CUDA_SUCCESS && res.tid > 0) {
		*tid = res.tid;
		ret = 1;
	}
	return ret;
}

/* ---- settling many processes: restore all, then unlock all ----------------- */

struct gs_step {
	int pid;
	struct gs_proc *p;
	struct gs_plan plan;
	struct gs_thaw th;
	enum gs_state image; /* state before the steps */
	bool ok;
};

static void thaw_all(struct gs_step *s, size_t n, const char *what)
{
	char msg[256];
	size_t i;

	for (i = 0; i < n; i++) {
		memset(&s[i].th, 0, sizeof(s[i].th));
		if (!s[i].ok || (!s[i].plan.restore && !s[i].plan.unlock))
			continue;
		msg[0] = '\0';
		if (gs_thaw_thread(s[i].p->tid, &s[i].th, msg, sizeof(msg))) {
			gs_err("%s pid=%d: cannot let restore thread %d run: %s", what, s[i].p->pid, s[i].p->tid, msg);
			s[i].ok = false;
		}
	}
}

static void refreeze_all(struct gs_step *s, size_t n, const char *what)
{
	char msg[256];
	size_t i;

	for (i = 0; i < n; i++) {
		msg[0] = '\0';
		if (gs_refreeze_thread(&s[i].th, msg, sizeof(msg))) {
			gs_err("%s pid=%d: cannot stop restore thread %d again: %s", what, s[i].p->pid, s[i].p->tid, msg);
			s[i].ok = false;
		}
	}
}

/*
 * Runs the plans of n processes whose restore threads run: every restore
 * first, then every unlock, so that ranks that wait for each other find all
 * their peers restored before any resumes (vLLM does the same).
 */
static void run_plans(struct gs_step *s, size_t n, bool with_map, const char *what)
{
	CUresult r;
	size_t i;

	for (i = 0; i < n; i++) {
		if (!s[i].ok || !s[i].plan.restore)
			continue;
		r = cu_restore(s[i].p->pid, with_map);
		if (r != CUDA_SUCCESS) {
			gs_err("%s pid=%d: cuCheckpointProcessRestore failed: %s", what, s[i].p->pid, cu_err(r));
			cu_get_state(s[i].p->pid, &s[i].p->current);
			s[i].ok = false;
			continue;
		}
		s[i].p->current = GS_LOCKED;
	}
	for (i = 0; i < n; i++) {
		if (!s[i].ok || !s[i].plan.unlock)
			continue;
		r = cu_unlock(s[i].p->pid);
		if (r != CUDA_SUCCESS) {
			gs_err("%s pid=%d: cuCheckpointProcessUnlock failed: %s", what, s[i].p->pid, cu_err(r));
			cu_get_state(s[i].p->pid, &s[i].p->current);
			s[i].ok = false;
			continue;
		}
		s[i].p->current = GS_RUNNING;
	}
}

/* ---- dump ---------------------------------------------------------------- */

/* Finds out whether pid is a CUDA process and locks it. 0, or -1: dump fails. */
static int pause_one(int pid)
{
	struct gs_clock clk;
	struct gs_proc *p;
	enum gs_state st;
	CUresult r;
	int tid = -1, ret = 0;

	clock_start(&clk);
	if (!restore_thread_of(pid, &tid, &r)) {
		if (r == CUDA_ERROR_TIMEOUT) {
			gs_err("pause pid=%d: the driver did not say whether it is a CUDA process", pid);
			ret = -1;
		} else {
			gs_debug("pause pid=%d: not a CUDA process (%s)", pid, cu_err(r));
		}
		goto out;
	}
	/* Its threads still run: CRIU freezes it after this hook. */
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
	return ret;
}

static int gs_pause_devices(int pid)
{
	static int tree[GS_TREE_MAX];
	int i, n, ret = 0;

	if (disabled || cur_stage != CR_PLUGIN_STAGE__DUMP)
		goto out;
	/* CRIU may ask again for a task it failed to seize the first time. */
	if (gs_table_find(&procs, pid))
		goto out;
	if (tree_done) {
		/* forked after the walk */
		ret = pause_one(pid);
		goto out;
	}
	/*
	 * First call, for the root, before CRIU freezes anything: lock every
	 * CUDA process of the tree now. A lock waits for the GPU work in flight,
	 * which may need another process of the job (an NCCL peer, a proxy
	 * thread) to run; CRIU freezes each process right after its own hook.
	 */
	tree_done = true;
	n = gs_tree_pids(pid, tree, GS_TREE_MAX);
	if (n <= 0) {
		n = 1;
		tree[0] = pid;
	}
	gs_info("pause: tree of pid %d has %d process(es)", pid, n);
	for (i = 0; i < n && ret == 0; i++)
		ret = pause_one(tree[i]);
out:
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
		/*
		 * Not seen as CUDA when paused; make sure it did not become one
		 * since. The driver answers this one from a frozen process.
		 */
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
		/* asked while the restore thread still runs */
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
	struct gs_step *s;
	size_t i;

	gs_info("dump %s, job %s: %zu CUDA process(es) to settle", ret ? "failed" : "succeeded",
		leave_running ? "keeps running" : "exits", procs.n);
	if (procs.n == 0)
		return;
	s = calloc(procs.n, sizeof(*s));
	if (s == NULL) {
		gs_err("resume: out of memory; CUDA processes left as they are");
		for (i = 0; i < procs.n; i++)
			report("dump pid=%d tid=%d initial=%s image=%s final=%s result=fail", procs.v[i].pid,
			       procs.v[i].tid, gs_state_name(procs.v[i].initial), gs_state_name(procs.v[i].current),
			       gs_state_name(procs.v[i].current));
		return;
	}
	clock_start(&clk);
	for (i = 0; i < procs.n; i++) {
		s[i].p = &procs.v[i];
		s[i].plan = gs_dump_end_plan(s[i].p, ret != 0, leave_running);
		s[i].image = s[i].p->current;
		/* a state we do not know (a call timed out) cannot be settled */
		s[i].ok = s[i].p->current != GS_UNKNOWN;
	}
	thaw_all(s, procs.n, "resume");
	run_plans(s, procs.n, false, "resume");
	refreeze_all(s, procs.n, "resume");
	for (i = 0; i < procs.n; i++) {
		struct gs_proc *p = s[i].p;

		if (s[i].ok)
			gs_info("resume pid=%d: state %s -> %s", p->pid, gs_state_name(s[i].image),
				gs_state_name(p->current));
		else
			gs_err("resume pid=%d: left in state %s; the job may hang on its next CUDA call", p->pid,
			       gs_state_name(p->current));
		report("dump pid=%d tid=%d initial=%s image=%s final=%s result=%s", p->pid, p->tid,
		       gs_state_name(p->initial), gs_state_name(s[i].image), gs_state_name(p->current),
		       s[i].ok ? "ok" : "fail");
	}
	clock_log(&clk, true, "resume", s[0].p->pid);
	free(s);
}

/* ---- restore ------------------------------------------------------------- */

/*
 * Restores the CUDA processes among pids[0..n). Every restore thread is
 * woken before anything is asked of the driver (a get-state on a fully
 * frozen process may block), then all are restored, then all unlocked.
 * Returns 0, or -1 when any failed.
 */
static int restore_many(const int *pids, int n)
{
	struct gs_clock clk;
	struct gs_step *s;
	CUresult r;
	int i, m = 0, tid, ret = 0;

	s = calloc((size_t)n, sizeof(*s));
	if (s == NULL) {
		gs_err("restore: out of memory");
		return -1;
	}
	clock_start(&clk);
	for (i = 0; i < n; i++) {
		struct gs_proc *p;

		if (!restore_thread_of(pids[i], &tid, &r)) {
			gs_debug("restore pid=%d: not a CUDA process (%s)", pids[i], cu_err(r));
			continue;
		}
		p = gs_table_add(&procs, pids[i], tid, GS_UNKNOWN);
		if (p == NULL) {
			gs_err("restore pid=%d: out of memory", pids[i]);
			report("restore pid=%d tid=%d initial=unknown final=unknown result=fail", pids[i], tid);
			ret = -1;
			continue;
		}
		s[m].pid = pids[i];
		s[m].ok = true;
		s[m].plan.restore = s[m].plan.unlock = true; /* thaw it */
		m++;
	}
	/* table entries may have moved while it grew */
	for (i = 0; i < m; i++)
		s[i].p = gs_table_find(&procs, s[i].pid);
	thaw_all(s, (size_t)m, "restore");
	for (i = 0; i < m; i++) {
		struct gs_proc *p = s[i].p;

		if (!s[i].ok)
			continue;
		r = cu_get_state(p->pid, &p->initial);
		p->current = p->initial;
		s[i].image = p->initial;
		if (r != CUDA_SUCCESS) {
			gs_err("restore pid=%d: cuCheckpointProcessGetState failed: %s", p->pid, cu_err(r));
			s[i].ok = false;
			continue;
		}
		gs_info("restore pid=%d: CUDA process, restore thread %d, state %s", p->pid, p->tid,
			gs_state_name(p->initial));
		if (gs_restore_plan(p->initial, &s[i].plan)) {
			gs_err("restore pid=%d: CUDA process in state %s cannot be resumed", p->pid,
			       gs_state_name(p->initial));
			s[i].ok = false;
		}
	}
	run_plans(s, (size_t)m, true, "restore");
	refreeze_all(s, (size_t)m, "restore");
	for (i = 0; i < m; i++) {
		struct gs_proc *p = s[i].p;

		if (!s[i].ok) {
			gs_err("restore pid=%d: left in state %s; its next CUDA call will hang", p->pid,
			       gs_state_name(p->current));
			ret = -1;
		}
		/* checkpointed_by_us marks the failed ones for later hook calls */
		p->checkpointed_by_us = !s[i].ok;
		report("restore pid=%d tid=%d initial=%s final=%s result=%s", p->pid, p->tid, gs_state_name(s[i].image),
		       gs_state_name(p->current), s[i].ok ? "ok" : "fail");
		clock_log(&clk, true, "restore", p->pid);
	}
	free(s);
	return ret;
}

static int gs_resume_devices_late(int pid)
{
	static int tree[GS_TREE_MAX];
	struct gs_proc *p;
	int n, ret = 0;

	if (disabled || cur_stage != CR_PLUGIN_STAGE__RESTORE)
		goto out;
	p = gs_table_find(&procs, pid);
	if (p) {
		ret = p->checkpointed_by_us ? -1 : 0;
		goto out;
	}
	if (tree_done) {
		ret = restore_many(&pid, 1);
		goto out;
	}
	/* First call, for the root: the whole restored tree at once. */
	tree_done = true;
	n = gs_tree_pids(pid, tree, GS_TREE_MAX);
	if (n <= 0) {
		n = 1;
		tree[0] = pid;
	}
	ret = restore_many(tree, n);
	if (ret == 0 || !gs_table_find(&procs, pid))
		goto out;
	/* CRIU ignores this hook's errors: gpusnap reads the report. */
	ret = gs_table_find(&procs, pid)->checkpointed_by_us ? -1 : 0;
out:
	return ret;
}
CR_PLUGIN_REGISTER_HOOK(CR_PLUGIN_HOOK__RESUME_DEVICES_LATE, gs_resume_devices_late)

/* ---- init / exit ---------------------------------------------------------- */

/*
 * Every entry point through cuGetProcAddress_v2 (CUDA 12.0, r525): each driver with the checkpoint
 * API (12.8, r570) has it, so a driver without it is one that cannot checkpoint either.
 */
static void *resolve(gs_cuGetProcAddress_v2_t gpa, const char *name)
{
	CUdriverProcAddressQueryResult qr = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
	void *fn = NULL;

	if (gpa == NULL || gpa(name, &fn, GS_CUDA_API_VERSION, 0, &qr) != CUDA_SUCCESS ||
	    qr != CU_GET_PROC_ADDRESS_SUCCESS)
		fn = NULL;
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

	call_timeout_ms = GS_DEFAULT_CALL_TIMEOUT_MS;
	v = getenv("GPUSNAP_CALL_TIMEOUT_MS");
	if (v && v[0]) {
		char *end;
		unsigned long ms;

		errno = 0;
		ms = strtoul(v, &end, 10);
		if (errno || *end || v[0] == '-' || ms == 0 || ms > 24ul * 3600 * 1000) {
			gs_err("GPUSNAP_CALL_TIMEOUT_MS=%s: expected milliseconds (> 0)", v);
			goto out;
		}
		call_timeout_ms = (unsigned int)ms;
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

/*
 * A process frozen through the cgroup freezer cannot be locked or
 * checkpointed (its restore thread cannot run). CRIU 4.0+ exports a switch
 * that makes --freeze-cgroup seize with ptrace interrupts instead; look it
 * up rather than link against it, so that an older CRIU still loads us.
 */
static void interrupt_only_mode(void)
{
	void (*set_mode)(void) = (void (*)(void))dlsym(RTLD_DEFAULT, "set_compel_interrupt_only_mode");

	if (set_mode) {
		set_mode();
		gs_debug("CRIU seizes with ptrace interrupts only (set_compel_interrupt_only_mode)");
	} else {
		gs_info("this CRIU lacks set_compel_interrupt_only_mode: do not use --freeze-cgroup with CUDA jobs");
	}
}

static int gs_init(int stage)
{
	int i, ret = 0;

	disabled = true;
	cur_stage = stage;
	driver_ns = 0;
	tree_done = false;
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
	if (stage == CR_PLUGIN_STAGE__DUMP)
		interrupt_only_mode();
	gs_info("CUDA driver %d.%d loaded; stage %s, leave running %s, lock timeout %u ms, call timeout %u ms, "
		"%d GPU pair(s)",
		drv.version / 1000, (drv.version % 1000) / 10, stage == CR_PLUGIN_STAGE__DUMP ? "dump" : "restore",
		leave_running ? "yes" : "no", lock_timeout_ms, call_timeout_ms, gpu_map_n);
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
	/*
	 * A driver that ran cuInit may own threads in this process, and an
	 * abandoned call still runs its code: keep it loaded then.
	 */
	pthread_mutex_lock(&abandoned_mu);
	if (calls_abandoned)
		gs_warn("%d driver call(s) abandoned and still running", calls_abandoned);
	if (drv.handle && !drv.inited && calls_abandoned == 0)
		dlclose(drv.handle);
	pthread_mutex_unlock(&abandoned_mu);
	memset(&drv, 0, sizeof(drv));
	disabled = true;
}

/* Built with hidden visibility: only the descriptor is exported. */
extern __attribute__((visibility("default"))) cr_plugin_desc_t CR_PLUGIN_DESC;
CR_PLUGIN_REGISTER(GS_NAME, gs_init, gs_exit)
