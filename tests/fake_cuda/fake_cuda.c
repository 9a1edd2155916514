/*
 * gpusnap test double: a fake libcuda.so.1 implementing the driver's process
 * checkpoint API on a machine without a GPU.
 *
 * (One file of ~1000 lines on purpose: it is one small shared library, and its
 * parts, the state files, the failure injection, the state machine and the
 * entry points, are read together whenever a test needs the driver to behave
 * in a new way.)
 *
 * All state lives in files under $FAKE_CUDA_DIR, so that the test, `criu dump`
 * and a later `criu restore` share it:
 *
 *   procs/<pid>       declares a CUDA process: "tid=<tid> state=<state>
 *                     [peer=<pid>]" (state: running|locked|checkpointed|
 *                     failed; without state= running). <tid> must be a
 *                     real thread of <pid>: it stands for the CUDA restore
 *                     thread. With a peer (an NCCL rank of the same job):
 *                     its lock fails (CUDA_ERROR_TIMEOUT, note=peer-frozen)
 *                     while the peer is stopped (its GPU work in flight needs
 *                     the peer's CPU side), and its unlock fails
 *                     (CUDA_ERROR_ILLEGAL_STATE, note=peer-checkpointed)
 *                     while the peer is still checkpointed.
 *   calls.log         one line per call: "<call> pid=<pid> rc=<rc> [k=v...]"
 *   fail/<call>       make <call> return the CUresult written in the file;
 *                     "hang [<s>]" instead makes it block for <s> seconds
 *                     (default 60; removing the file ends it) and then do
 *                     its work; a "times=<n>" token limits it to n calls
 *   fail/<call>.<pid> the same, for one process only
 *   gpus              the GPUs cuDeviceGet* report, one per line:
 *                     "<GPU-uuid> <memory bytes> [bus=<hex>] <name...>" (bus:
 *                     the PCI bus, default 0x19 + line number); without the
 *                     file one GPU, GPU-fa4ec0da-0000-4000-8000-000000000001,
 *                     16 GiB, "Fake CUDA GPU". Devices are numbered in the
 *                     file's order, or by PCI bus with CUDA_DEVICE_ORDER=
 *                     PCI_BUS_ID (as the real driver does)
 *   persistence       if present, cuCheckpointProcessRestore works without
 *                     cuInit (like persistence mode); otherwise it needs it
 *
 * State machine (wrong state: CUDA_ERROR_ILLEGAL_STATE):
 *   RUNNING -lock-> LOCKED -checkpoint-> CHECKPOINTED -restore-> LOCKED
 *   -unlock-> RUNNING
 * Lock, checkpoint, restore and unlock need the restore thread to run: when it
 * is stopped (ptrace or job control, /proc state t/T) they fail with
 * CUDA_ERROR_OPERATING_SYSTEM, note=restore-thread-stopped.
 * Inside `criu restore`, a declared process is CHECKPOINTED when first met:
 * its memory came from an image taken while it was checkpointed.
 * cuCheckpointProcessGetState blocks while the restore thread is stopped (as
 * the real one may on a frozen process), up to $FAKE_CUDA_BLOCK_S seconds
 * (default 20), and logs note=blocked-while-frozen.
 *
 * Which driver it is: CUDA 13.0 (FAKE_CUDA_VERSION). Built with
 * -DFAKE_CUDA_NO_CHECKPOINT (build/fake_cuda_r550/) it is a CUDA 12.4 (r550)
 * driver, older than the checkpoint API: the cuCheckpoint* functions do not
 * exist in it at all. cuGetProcAddress resolves a base name and an API
 * version to the newest variant of the function introduced at or before that
 * version (cuDeviceTotalMem at 3020 -> cuDeviceTotalMem_v2), as the real
 * driver does for cuda-python and the plugin.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "gs_cuda.h"

#ifdef cuGetProcAddress
#undef cuGetProcAddress
#endif
#ifdef cuDeviceTotalMem
#undef cuDeviceTotalMem
#endif
#ifdef cuDeviceGetUuid
#undef cuDeviceGetUuid
#endif

#define EXPORT __attribute__((visibility("default")))

#ifdef FAKE_CUDA_NO_CHECKPOINT
#define FAKE_CUDA_VERSION 12040
#else
#define FAKE_CUDA_VERSION 13000
#endif

static bool inited;

static const char *fake_dir(void)
{
	const char *d = getenv("FAKE_CUDA_DIR");

	return d && d[0] ? d : NULL;
}

static void log_call(const char *call, int pid, CUresult rc, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));
static void log_call(const char *call, int pid, CUresult rc, const char *fmt, ...)
{
	char path[4096], line[2048];
	const char *dir = fake_dir();
	va_list ap;
	int fd = -1, len;

	if (dir == NULL)
		goto out;
	len = snprintf(line, sizeof(line), "%s pid=%d rc=%d caller=%d", call, pid, (int)rc, (int)getpid());
	if (fmt && fmt[0] && len > 0 && (size_t)len < sizeof(line) - 2) {
		int start = len, n;

		line[len++] = ' ';
		va_start(ap, fmt);
		n = vsnprintf(line + len, sizeof(line) - (size_t)len - 1, fmt, ap);
		va_end(ap);
		len = n > 0 ? len + n : start;
	}
	if (len < 0)
		goto out;
	if ((size_t)len > sizeof(line) - 2)
		len = sizeof(line) - 2;
	line[len++] = '\n';
	snprintf(path, sizeof(path), "%s/calls.log", dir);
	fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
	if (fd < 0)
		goto out;
	if (write(fd, line, (size_t)len) < 0)
		goto out;
out:
	if (fd >= 0)
		close(fd);
}

/*
 * Injected failure for call (and pid), or CUDA_SUCCESS. A "hang" spec blocks
 * here first (hung set) and then lets the call do its work.
 */
static CUresult injected_ex(const char *call, int pid, bool *hung)
{
	char path[4096], buf[128], *tok, *save = NULL;
	const char *dir = fake_dir();
	CUresult rc = CUDA_SUCCESS;
	int i, fd = -1, times = -1, hang = -1;
	ssize_t n;

	if (hung)
		*hung = false;
	if (dir == NULL)
		goto out;
	for (i = 0; i < 2; i++) {
		if (i == 0)
			snprintf(path, sizeof(path), "%s/fail/%s.%d", dir, call, pid);
		else
			snprintf(path, sizeof(path), "%s/fail/%s", dir, call);
		fd = open(path, O_RDONLY | O_CLOEXEC);
		if (fd >= 0)
			break;
	}
	if (fd < 0)
		goto out;
	n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	buf[n > 0 ? n : 0] = '\0';
	for (tok = strtok_r(buf, " \t\n", &save); tok; tok = strtok_r(NULL, " \t\n", &save)) {
		if (!strncmp(tok, "times=", 6))
			times = atoi(tok + 6);
		else if (!strcmp(tok, "hang"))
			hang = 60;
		else if (hang == 60 && isdigit((unsigned char)tok[0]))
			hang = atoi(tok);
		else if (rc == CUDA_SUCCESS)
			rc = (CUresult)atoi(tok);
	}
	if (times > 0) {
		/* count down; the last allowed one removes the file */
		if (times == 1) {
			unlink(path);
		} else {
			char nb[128];
			int len = snprintf(nb, sizeof(nb), "%s times=%d\n", hang >= 0 ? "hang" : "", times - 1);

			if (hang >= 0)
				len = snprintf(nb, sizeof(nb), "hang %d times=%d\n", hang, times - 1);
			else
				len = snprintf(nb, sizeof(nb), "%d times=%d\n", (int)rc, times - 1);
			fd = open(path, O_WRONLY | O_TRUNC | O_CLOEXEC);
			if (fd >= 0) {
				if (write(fd, nb, (size_t)len) < 0) {
				}
				close(fd);
			}
		}
	}
	if (hang >= 0) {
		struct timespec ts = { 0, 10000000 };
		struct stat sb;
		int t;

		rc = CUDA_SUCCESS;
		if (hung)
			*hung = true;
		log_call(call, pid, 0, "note=hanging secs=%d", hang);
		for (t = 0; t < hang * 100; t++) {
			if (times != 1 && stat(path, &sb))
				break;
			nanosleep(&ts, NULL);
		}
		goto out;
	}
	if (rc == CUDA_SUCCESS)
		rc = CUDA_ERROR_UNKNOWN;
out:
	return rc;
}

static CUresult injected(const char *call, int pid)
{
	return injected_ex(call, pid, NULL);
}

#ifndef FAKE_CUDA_NO_CHECKPOINT
/* ---- per-process state files -------------------------------------------- */

struct proc {
	int tid;
	int peer;
	CUprocessState state;
};

static const char *state_name(CUprocessState s)
{
	switch (s) {
	case CU_PROCESS_STATE_RUNNING:
		return "running";
	case CU_PROCESS_STATE_LOCKED:
		return "locked";
	case CU_PROCESS_STATE_CHECKPOINTED:
		return "checkpointed";
	default:
		return "failed";
	}
}

static int lock_dir(void)
{
	char path[4096];
	int fd;

	snprintf(path, sizeof(path), "%s/.lock", fake_dir());
	fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
	if (fd >= 0)
		flock(fd, LOCK_EX);
	return fd;
}

static void unlock_dir(int fd)
{
	if (fd >= 0)
		close(fd);
}

static bool pid_alive(int pid)
{
	char path[64];
	struct stat st;

	snprintf(path, sizeof(path), "/proc/%d", pid);
	return stat(path, &st) == 0;
}

/* 0: read; -1: not a declared CUDA process. */
static int read_proc(int pid, struct proc *p)
{
	char path[4096], buf[256], *tok, *save = NULL;
	int fd = -1, ret = -1;
	ssize_t n;

	if (fake_dir() == NULL || pid <= 0)
		goto out;
	snprintf(path, sizeof(path), "%s/procs/%d", fake_dir(), pid);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		goto out;
	n = read(fd, buf, sizeof(buf) - 1);
	if (n <= 0)
		goto out;
	buf[n] = '\0';
	p->tid = -1;
	p->peer = 0;
	p->state = CU_PROCESS_STATE_RUNNING;
	for (tok = strtok_r(buf, " \t\n", &save); tok; tok = strtok_r(NULL, " \t\n", &save)) {
		if (!strncmp(tok, "tid=", 4))
			p->tid = atoi(tok + 4);
		else if (!strncmp(tok, "peer=", 5))
			p->peer = atoi(tok + 5);
		else if (!strcmp(tok, "state=running"))
			p->state = CU_PROCESS_STATE_RUNNING;
		else if (!strcmp(tok, "state=locked"))
			p->state = CU_PROCESS_STATE_LOCKED;
		else if (!strcmp(tok, "state=checkpointed"))
			p->state = CU_PROCESS_STATE_CHECKPOINTED;
		else if (!strcmp(tok, "state=failed"))
			p->state = CU_PROCESS_STATE_FAILED;
	}
	if (p->tid > 0 && pid_alive(pid))
		ret = 0;
out:
	if (fd >= 0)
		close(fd);
	return ret;
}

static void write_proc(int pid, const struct proc *p)
{
	char path[4096], tmp[4096], buf[128];
	int fd, len;

	snprintf(path, sizeof(path), "%s/procs/%d", fake_dir(), pid);
	snprintf(tmp, sizeof(tmp), "%s/procs/.%d.tmp", fake_dir(), pid);
	if (p->peer > 0)
		len = snprintf(buf, sizeof(buf), "tid=%d state=%s peer=%d\n", p->tid, state_name(p->state), p->peer);
	else
		len = snprintf(buf, sizeof(buf), "tid=%d state=%s\n", p->tid, state_name(p->state));
	fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	if (fd < 0)
		return;
	if (write(fd, buf, (size_t)len) == len && close(fd) == 0)
		rename(tmp, path);
	else
		close(fd);
}

/* Are we the `criu restore` process? */
static bool in_criu_restore(void)
{
	static int cached = -1;
	char buf[4096];
	const char *arg, *base;
	int fd;
	ssize_t n;

	if (cached >= 0)
		goto out;
	cached = 0;
	fd = open("/proc/self/cmdline", O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		goto out;
	n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		goto out;
	buf[n] = '\0';
	base = strrchr(buf, '/');
	base = base ? base + 1 : buf;
	if (strcmp(base, "criu"))
		goto out;
	for (arg = buf + strlen(buf) + 1; arg < buf + n; arg += strlen(arg) + 1)
		if (!strcmp(arg, "restore"))
			cached = 1;
out:
	return cached == 1;
}

/* Inside criu restore, a process is CHECKPOINTED when first met. */
static void restore_incarnation(int pid, struct proc *p)
{
	static int seen[1024];
	static int nseen;
	int i;

	if (!in_criu_restore())
		return;
	for (i = 0; i < nseen; i++)
		if (seen[i] == pid)
			return;
	if (nseen < 1024)
		seen[nseen++] = pid;
	if (p->state != CU_PROCESS_STATE_FAILED && p->state != CU_PROCESS_STATE_CHECKPOINTED) {
		p->state = CU_PROCESS_STATE_CHECKPOINTED;
		write_proc(pid, p);
	}
}

/* /proc state letter of a thread, or 0. */
static char thread_state(int pid, int tid)
{
	char path[128], buf[1024], *rp;
	int fd;
	ssize_t n;

	snprintf(path, sizeof(path), "/proc/%d/task/%d/stat", pid, tid);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return 0;
	n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		return 0;
	buf[n] = '\0';
	rp = strrchr(buf, ')');
	if (rp == NULL || rp[1] != ' ')
		return 0;
	return rp[2];
}

/*
 * The real driver does its work in the restore thread: it must be running.
 * Polls briefly, as a thread just resumed may still read as stopped.
 */
static bool restore_thread_runs(int pid, int tid, char *st)
{
	struct timespec ts = { 0, 1000000 };
	int i;

	for (i = 0; i < 200; i++) {
		*st = thread_state(pid, tid);
		if (*st == 0)
			return false;
		if (*st != 't' && *st != 'T')
			return true;
		nanosleep(&ts, NULL);
	}
	return false;
}

/*
 * One state transition: from -> to, needing the restore thread.
 * extra: text appended to the log line.
 */
static CUresult transition(const char *call, int pid, CUprocessState from, CUprocessState to, bool need_init,
			   const char *extra)
{
	struct proc p;
	CUresult rc;
	char st = 0, note[64] = "";
	bool hung = false, commit = false;
	int lk = -1;

	if (fake_dir() == NULL) {
		rc = CUDA_ERROR_INVALID_VALUE;
		goto out;
	}
	lk = lock_dir();
	if (read_proc(pid, &p)) {
		rc = CUDA_ERROR_INVALID_VALUE;
		snprintf(note, sizeof(note), "note=not-a-cuda-process");
		goto out;
	}
	restore_incarnation(pid, &p);
	if (need_init && !inited) {
		char path[4096];
		struct stat sb;

		snprintf(path, sizeof(path), "%s/persistence", fake_dir());
		if (stat(path, &sb)) {
			rc = CUDA_ERROR_NOT_INITIALIZED;
			goto out;
		}
	}
	/* a hang must not hold the directory lock: other processes call too */
	unlock_dir(lk);
	rc = injected_ex(call, pid, &hung);
	lk = lock_dir();
	if (rc != CUDA_SUCCESS) {
		snprintf(note, sizeof(note), "note=injected");
		goto out;
	}
	if (read_proc(pid, &p)) {
		rc = CUDA_ERROR_INVALID_VALUE;
		snprintf(note, sizeof(note), "note=gone");
		goto out;
	}
	if (p.state != from) {
		rc = CUDA_ERROR_ILLEGAL_STATE;
		snprintf(note, sizeof(note), "note=state-%s", state_name(p.state));
		goto out;
	}
	if (!restore_thread_runs(pid, p.tid, &st)) {
		rc = CUDA_ERROR_OPERATING_SYSTEM;
		snprintf(note, sizeof(note), "note=restore-thread-stopped state=%c", st ? st : '?');
		goto out;
	}
	if (p.peer > 0) {
		struct proc pp;
		char pst = thread_state(p.peer, p.peer);

		if (from == CU_PROCESS_STATE_RUNNING && (pst == 't' || pst == 'T')) {
			rc = CUDA_ERROR_TIMEOUT;
			snprintf(note, sizeof(note), "note=peer-frozen peer=%d", p.peer);
			goto out;
		}
		if (to == CU_PROCESS_STATE_RUNNING && read_proc(p.peer, &pp) == 0) {
			restore_incarnation(p.peer, &pp);
			if (pp.state == CU_PROCESS_STATE_CHECKPOINTED) {
				rc = CUDA_ERROR_ILLEGAL_STATE;
				snprintf(note, sizeof(note), "note=peer-checkpointed peer=%d", p.peer);
				goto out;
			}
		}
	}
	p.state = to;
	commit = true;
out:
	/* the call is logged before its new state shows: whoever sees the state finds the call */
	if (extra && extra[0] && note[0])
		log_call(call, pid, rc, "%s %s", extra, note);
	else if (extra && extra[0])
		log_call(call, pid, rc, "%s", extra);
	else
		log_call(call, pid, rc, "%s", note);
	if (commit)
		write_proc(pid, &p);
	unlock_dir(lk);
	return rc;
}

#endif /* !FAKE_CUDA_NO_CHECKPOINT */

/* ---- the API -------------------------------------------------------------- */

EXPORT CUresult cuInit(unsigned int flags)
{
	CUresult rc = injected("cuInit", 0);

	if (rc == CUDA_SUCCESS && flags != 0)
		rc = CUDA_ERROR_INVALID_VALUE;
	if (rc == CUDA_SUCCESS)
		inited = true;
	log_call("cuInit", 0, rc, NULL);
	return rc;
}

EXPORT CUresult cuDriverGetVersion(int *version)
{
	if (version == NULL)
		return CUDA_ERROR_INVALID_VALUE;
	*version = FAKE_CUDA_VERSION;
	return CUDA_SUCCESS;
}

static const struct {
	CUresult rc;
	const char *name, *text;
} errors[] = {
	{ CUDA_SUCCESS, "CUDA_SUCCESS", "no error" },
	{ CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument" },
	{ CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error" },
	{ CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected" },
	{ CUDA_ERROR_OPERATING_SYSTEM, "CUDA_ERROR_OPERATING_SYSTEM", "OS call failed or operation not supported on this OS" },
	{ CUDA_ERROR_ILLEGAL_STATE, "CUDA_ERROR_ILLEGAL_STATE", "the operation cannot be performed in the present state" },
	{ CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found" },
	{ CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready" },
	{ CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported" },
	{ CUDA_ERROR_TIMEOUT, "CUDA_ERROR_TIMEOUT", "wait operation timed out" },
	{ CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error" },
};

EXPORT CUresult cuGetErrorName(CUresult err, const char **str)
{
	size_t i;

	if (str == NULL)
		return CUDA_ERROR_INVALID_VALUE;
	for (i = 0; i < sizeof(errors) / sizeof(errors[0]); i++)
		if (errors[i].rc == err) {
			*str = errors[i].name;
			return CUDA_SUCCESS;
		}
	*str = NULL;
	return CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuGetErrorString(CUresult err, const char **str)
{
	size_t i;

	if (str == NULL)
		return CUDA_ERROR_INVALID_VALUE;
	for (i = 0; i < sizeof(errors) / sizeof(errors[0]); i++)
		if (errors[i].rc == err) {
			*str = errors[i].text;
			return CUDA_SUCCESS;
		}
	*str = NULL;
	return CUDA_ERROR_INVALID_VALUE;
}

#ifndef FAKE_CUDA_NO_CHECKPOINT
EXPORT CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid)
{
	struct proc p;
	CUresult rc = CUDA_ERROR_INVALID_VALUE;
	int lk = -1;

	if (tid == NULL || fake_dir() == NULL)
		goto out;
	lk = lock_dir();
	if (read_proc(pid, &p))
		goto out;
	restore_incarnation(pid, &p);
	rc = injected("cuCheckpointProcessGetRestoreThreadId", pid);
	if (rc == CUDA_SUCCESS)
		*tid = p.tid;
out:
	unlock_dir(lk);
	log_call("cuCheckpointProcessGetRestoreThreadId", pid, rc, NULL);
	return rc;
}

/* Waits while the restore thread of pid is stopped, up to $FAKE_CUDA_BLOCK_S s. true: it blocked. */
static bool block_while_frozen(int pid)
{
	struct timespec ts = { 0, 10000000 };
	const char *v = getenv("FAKE_CUDA_BLOCK_S");
	int limit = (v && v[0] ? atoi(v) : 20) * 100, i, lk;
	struct proc p;
	char st;
	bool blocked = false;

	lk = lock_dir();
	i = read_proc(pid, &p);
	unlock_dir(lk);
	if (i)
		return false;
	for (i = 0; i < limit; i++) {
		st = thread_state(pid, p.tid);
		if (st != 't' && st != 'T')
			break;
		blocked = true;
		nanosleep(&ts, NULL);
	}
	return blocked;
}

EXPORT CUresult cuCheckpointProcessGetState(int pid, CUprocessState *state)
{
	struct proc p;
	CUresult rc = CUDA_ERROR_INVALID_VALUE;
	bool blocked = false;
	int lk = -1;

	if (state == NULL || fake_dir() == NULL)
		goto out;
	blocked = block_while_frozen(pid);
	lk = lock_dir();
	if (read_proc(pid, &p))
		goto out;
	restore_incarnation(pid, &p);
	rc = injected("cuCheckpointProcessGetState", pid);
	if (rc == CUDA_SUCCESS)
		*state = p.state;
out:
	unlock_dir(lk);
	log_call("cuCheckpointProcessGetState", pid, rc, "state=%s%s", rc == CUDA_SUCCESS ? state_name(*state) : "-",
		 blocked ? " note=blocked-while-frozen" : "");
	return rc;
}

EXPORT CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args)
{
	char extra[64];

	snprintf(extra, sizeof(extra), "timeout=%u", args ? args->timeoutMs : 0);
	return transition("cuCheckpointProcessLock", pid, CU_PROCESS_STATE_RUNNING, CU_PROCESS_STATE_LOCKED, false,
			  extra);
}

EXPORT CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args)
{
	return transition("cuCheckpointProcessCheckpoint", pid, CU_PROCESS_STATE_LOCKED,
			  CU_PROCESS_STATE_CHECKPOINTED, false, NULL);
}

static void fmt_uuid(const CUuuid *u, char *out, size_t len)
{
	const unsigned char *b = (const unsigned char *)u->bytes;

	snprintf(out, len, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1],
		 b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

EXPORT CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args)
{
	char extra[1024] = "gpus=";
	size_t len = strlen(extra);
	unsigned int i;

	if (args == NULL || args->gpuPairsCount == 0 || args->gpuPairs == NULL) {
		snprintf(extra + len, sizeof(extra) - len, "-");
	} else {
		for (i = 0; i < args->gpuPairsCount && len < sizeof(extra) - 100; i++) {
			char o[48], n[48];

			fmt_uuid(&args->gpuPairs[i].oldUuid, o, sizeof(o));
			fmt_uuid(&args->gpuPairs[i].newUuid, n, sizeof(n));
			len += (size_t)snprintf(extra + len, sizeof(extra) - len, "%s%s=%s", i ? "," : "", o, n);
		}
	}
	return transition("cuCheckpointProcessRestore", pid, CU_PROCESS_STATE_CHECKPOINTED, CU_PROCESS_STATE_LOCKED,
			  true, extra);
}

EXPORT CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args)
{
	return transition("cuCheckpointProcessUnlock", pid, CU_PROCESS_STATE_LOCKED, CU_PROCESS_STATE_RUNNING, false,
			  NULL);
}
#endif /* !FAKE_CUDA_NO_CHECKPOINT */

/* ---- device inventory ----------------------------------------------------- */

#define MAX_GPUS 16

struct gpu {
	unsigned char uuid[16];
	size_t mem;
	char name[128];
	int bus;
};

static int parse_uuid(const char *s, unsigned char out[16])
{
	int n = 0;

	if (!strncasecmp(s, "GPU-", 4))
		s += 4;
	for (; *s && n < 32; s++) {
		int v;

		if (*s == '-')
			continue;
		if (*s >= '0' && *s <= '9')
			v = *s - '0';
		else if (*s >= 'a' && *s <= 'f')
			v = *s - 'a' + 10;
		else if (*s >= 'A' && *s <= 'F')
			v = *s - 'A' + 10;
		else
			return -1;
		if (n % 2 == 0)
			out[n / 2] = (unsigned char)(v << 4);
		else
			out[n / 2] |= (unsigned char)v;
		n++;
	}
	return n == 32 ? 0 : -1;
}

static int by_bus(const void *a, const void *b)
{
	return ((const struct gpu *)a)->bus - ((const struct gpu *)b)->bus;
}

static int load_gpus(struct gpu *g)
{
	char path[4096], line[512];
	FILE *f = NULL;
	int n = 0;

	if (fake_dir()) {
		snprintf(path, sizeof(path), "%s/gpus", fake_dir());
		f = fopen(path, "re");
	}
	if (f == NULL) {
		parse_uuid("GPU-fa4ec0da-0000-4000-8000-000000000001", g[0].uuid);
		g[0].mem = (size_t)16 << 30;
		snprintf(g[0].name, sizeof(g[0].name), "Fake CUDA GPU");
		g[0].bus = 0x19;
		return 1;
	}
	while (n < MAX_GPUS && fgets(line, sizeof(line), f)) {
		char uuid[64], rest[160] = "", *name = rest;
		unsigned long long mem;
		int bus = 0x19 + n, used = 0;

		if (sscanf(line, "%63s %llu %159[^\n]", uuid, &mem, rest) < 2 || parse_uuid(uuid, g[n].uuid))
			continue;
		if (sscanf(rest, "bus=%x %n", (unsigned int *)&bus, &used) == 1)
			name = rest + used;
		g[n].mem = (size_t)mem;
		snprintf(g[n].name, sizeof(g[n].name), "%s", name[0] ? name : "Fake CUDA GPU");
		g[n].bus = bus;
		n++;
	}
	fclose(f);
	if (getenv("CUDA_DEVICE_ORDER") && !strcmp(getenv("CUDA_DEVICE_ORDER"), "PCI_BUS_ID"))
		qsort(g, (size_t)n, sizeof(*g), by_bus);
	return n;
}

static CUresult device_of(CUdevice dev, struct gpu *out)
{
	struct gpu g[MAX_GPUS];
	int n;

	if (!inited)
		return CUDA_ERROR_NOT_INITIALIZED;
	n = load_gpus(g);
	if (dev < 0 || dev >= n)
		return CUDA_ERROR_INVALID_VALUE; /* the real one says CUDA_ERROR_INVALID_DEVICE */
	*out = g[dev];
	return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetCount(int *count)
{
	struct gpu g[MAX_GPUS];

	if (count == NULL)
		return CUDA_ERROR_INVALID_VALUE;
	if (!inited)
		return CUDA_ERROR_NOT_INITIALIZED;
	*count = load_gpus(g);
	return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
	struct gpu g;
	CUresult rc;

	if (device == NULL)
		return CUDA_ERROR_INVALID_VALUE;
	rc = device_of(ordinal, &g);
	if (rc == CUDA_SUCCESS)
		*device = ordinal;
	return rc;
}

EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
	struct gpu g;
	CUresult rc;

	if (name == NULL || len <= 0)
		return CUDA_ERROR_INVALID_VALUE;
	rc = device_of(dev, &g);
	if (rc == CUDA_SUCCESS)
		snprintf(name, (size_t)len, "%s", g.name);
	return rc;
}

EXPORT CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev)
{
	struct gpu g;
	CUresult rc;

	if (uuid == NULL)
		return CUDA_ERROR_INVALID_VALUE;
	rc = device_of(dev, &g);
	if (rc == CUDA_SUCCESS)
		memcpy(uuid->bytes, g.uuid, 16);
	return rc;
}

EXPORT CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)
{
	return cuDeviceGetUuid_v2(uuid, dev);
}

EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
	struct gpu g;
	CUresult rc;

	if (bytes == NULL)
		return CUDA_ERROR_INVALID_VALUE;
	rc = device_of(dev, &g);
	if (rc == CUDA_SUCCESS)
		*bytes = g.mem;
	return rc;
}

/* CUDA 2.0's interface: a 32-bit size, which cannot say more than 4 GiB */
EXPORT CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev)
{
	size_t b;
	CUresult rc;

	if (bytes == NULL)
		return CUDA_ERROR_INVALID_VALUE;
	rc = cuDeviceTotalMem_v2(&b, dev);
	if (rc == CUDA_SUCCESS)
		*bytes = b > 0xffffffffu ? 0xffffffffu : (unsigned int)b;
	return rc;
}

EXPORT CUresult cuDeviceGetPCIBusId(char *bus, int len, CUdevice dev)
{
	struct gpu g;
	CUresult rc;

	if (bus == NULL || len <= 0)
		return CUDA_ERROR_INVALID_VALUE;
	rc = device_of(dev, &g);
	if (rc == CUDA_SUCCESS)
		snprintf(bus, (size_t)len, "00000000:%02X:00.0", g.bus);
	return rc;
}

/* ---- cuGetProcAddress ----------------------------------------------------- */

EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cuda_version, cuuint64_t flags,
				    CUdriverProcAddressQueryResult *status);
EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cuda_version, cuuint64_t flags);

/* Every function of this driver: base name, the CUDA version that introduced this variant. */
static const struct {
	const char *name;
	int since;
	void *fn;
} symbols[] = {
	{ "cuInit", 2000, (void *)cuInit },
	{ "cuDriverGetVersion", 2020, (void *)cuDriverGetVersion },
	{ "cuGetErrorName", 6000, (void *)cuGetErrorName },
	{ "cuGetErrorString", 6000, (void *)cuGetErrorString },
	{ "cuGetProcAddress", 11030, (void *)cuGetProcAddress },
	{ "cuGetProcAddress", 12000, (void *)cuGetProcAddress_v2 },
	{ "cuDeviceGetCount", 2000, (void *)cuDeviceGetCount },
	{ "cuDeviceGet", 2000, (void *)cuDeviceGet },
	{ "cuDeviceGetName", 2000, (void *)cuDeviceGetName },
	{ "cuDeviceGetUuid", 9020, (void *)cuDeviceGetUuid },
	{ "cuDeviceGetUuid", 11040, (void *)cuDeviceGetUuid_v2 },
	{ "cuDeviceTotalMem", 2000, (void *)cuDeviceTotalMem },
	{ "cuDeviceTotalMem", 3020, (void *)cuDeviceTotalMem_v2 },
	{ "cuDeviceGetPCIBusId", 4010, (void *)cuDeviceGetPCIBusId },
#ifndef FAKE_CUDA_NO_CHECKPOINT
	{ "cuCheckpointProcessGetRestoreThreadId", 12080, (void *)cuCheckpointProcessGetRestoreThreadId },
	{ "cuCheckpointProcessGetState", 12080, (void *)cuCheckpointProcessGetState },
	{ "cuCheckpointProcessLock", 12080, (void *)cuCheckpointProcessLock },
	{ "cuCheckpointProcessCheckpoint", 12080, (void *)cuCheckpointProcessCheckpoint },
	{ "cuCheckpointProcessRestore", 12080, (void *)cuCheckpointProcessRestore },
	{ "cuCheckpointProcessUnlock", 12080, (void *)cuCheckpointProcessUnlock },
#endif
};

/*
 * The newest variant of symbol introduced at or before cuda_version. A symbol
 * this driver does not have: CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND; one newer
 * than cuda_version asks for: CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT (both
 * CUDA_ERROR_NOT_FOUND). flags: CU_GET_PROC_ADDRESS_DEFAULT, _LEGACY_STREAM or
 * _PER_THREAD_DEFAULT_STREAM (no function here has a per-thread variant).
 */
EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cuda_version, cuuint64_t flags,
				    CUdriverProcAddressQueryResult *status)
{
	CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
	int best = -1;
	size_t i;

	if (symbol == NULL || pfn == NULL || flags > 2)
		return CUDA_ERROR_INVALID_VALUE;
	for (i = 0; i < sizeof(symbols) / sizeof(symbols[0]); i++) {
		if (strcmp(symbols[i].name, symbol))
			continue;
		if (symbols[i].since > cuda_version) {
			if (best < 0)
				st = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
			continue;
		}
		if (best < 0 || symbols[i].since > symbols[best].since)
			best = (int)i;
	}
	*pfn = best >= 0 ? symbols[best].fn : NULL;
	if (best >= 0)
		st = CU_GET_PROC_ADDRESS_SUCCESS;
	if (status)
		*status = st;
	return best >= 0 ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cuda_version, cuuint64_t flags)
{
	return cuGetProcAddress_v2(symbol, pfn, cuda_version, flags, NULL);
}
