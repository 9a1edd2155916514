/* gpusnap: resume / re-stop one traced thread (see gs_thaw.h). */
#define _GNU_SOURCE
#include "gs_thaw.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ptrace.h>
#include <sys/wait.h>

#ifndef PTRACE_GETSIGMASK
#define PTRACE_GETSIGMASK 0x420a
#endif
#ifndef PTRACE_SETSIGMASK
#define PTRACE_SETSIGMASK 0x420b
#endif
#ifndef PTRACE_O_SUSPEND_SECCOMP
#define PTRACE_O_SUSPEND_SECCOMP (1 << 21)
#endif
#ifndef PTRACE_EVENT_STOP
#define PTRACE_EVENT_STOP 128
#endif

/* Seccomp mode of a thread from /proc, 0 when none or unknown. */
static int thread_seccomp_mode(pid_t tid)
{
	char path[64], line[256];
	FILE *f = NULL;
	int mode = 0;

	snprintf(path, sizeof(path), "/proc/%d/status", (int)tid);
	f = fopen(path, "re");
	if (f == NULL)
		goto out;
	while (fgets(line, sizeof(line), f)) {
		if (strncmp(line, "Seccomp:", 8) == 0) {
			mode = atoi(line + 8);
			break;
		}
	}
out:
	if (f)
		fclose(f);
	return mode;
}

int gs_thaw_thread(pid_t tid, struct gs_thaw *t, char *err, size_t errlen)
{
	uint64_t block = ~(uint64_t)0;
	int ret = 0;

	memset(t, 0, sizeof(*t));
	t->tid = tid;

	/* Fails with ESRCH unless tid is stopped under our ptrace. */
	if (ptrace(PTRACE_GETSIGMASK, tid, sizeof(t->sigmask), &t->sigmask)) {
		if (errno != ESRCH) {
			ret = -errno;
			snprintf(err, errlen, "PTRACE_GETSIGMASK %d: %s", (int)tid, strerror(errno));
		}
		goto out;
	}
	/* What CRIU (compel) sets on every seized thread. */
	t->options = PTRACE_O_TRACESYSGOOD;
	if (thread_seccomp_mode(tid) != 0)
		t->options |= PTRACE_O_SUSPEND_SECCOMP;

	if (ptrace(PTRACE_SETSIGMASK, tid, sizeof(block), &block)) {
		ret = -errno;
		snprintf(err, errlen, "PTRACE_SETSIGMASK %d: %s", (int)tid, strerror(errno));
		goto out;
	}
	/* Never let it run with its seccomp filter suspended. */
	if (ptrace(PTRACE_SETOPTIONS, tid, NULL, 0)) {
		ret = -errno;
		snprintf(err, errlen, "PTRACE_SETOPTIONS %d: %s", (int)tid, strerror(errno));
		goto undo_mask;
	}
	if (ptrace(PTRACE_CONT, tid, NULL, 0)) {
		ret = -errno;
		snprintf(err, errlen, "PTRACE_CONT %d: %s", (int)tid, strerror(errno));
		goto undo_opts;
	}
	t->thawed = true;
	goto out;

undo_opts:
	ptrace(PTRACE_SETOPTIONS, tid, NULL, t->options);
undo_mask:
	ptrace(PTRACE_SETSIGMASK, tid, sizeof(t->sigmask), &t->sigmask);
out:
	return ret;
}

int gs_refreeze_thread(struct gs_thaw *t, char *err, size_t errlen)
{
	int ret = 0, status, tries;

	if (!t->thawed)
		goto out;

	if (ptrace(PTRACE_INTERRUPT, t->tid, NULL, 0)) {
		ret = -errno;
		snprintf(err, errlen, "PTRACE_INTERRUPT %d: %s", (int)t->tid, strerror(errno));
		goto out;
	}
	for (tries = 0;; tries++) {
		pid_t w = waitpid(t->tid, &status, __WALL);

		if (w < 0) {
			if (errno == EINTR)
				continue;
			ret = -errno;
			snprintf(err, errlen, "waitpid %d: %s", (int)t->tid, strerror(errno));
			goto out;
		}
		if (!WIFSTOPPED(status)) {
			ret = -ESRCH;
			snprintf(err, errlen, "thread %d ended while it ran (status 0x%x)", (int)t->tid, status);
			goto out;
		}
		if ((status >> 16) == PTRACE_EVENT_STOP || tries >= 8)
			break;
		/*
		 * A signal-delivery stop came first (only unblockable signals
		 * can get here): hand the signal back and wait for our stop.
		 */
		if (ptrace(PTRACE_CONT, t->tid, NULL, WSTOPSIG(status))) {
			ret = -errno;
			snprintf(err, errlen, "PTRACE_CONT %d: %s", (int)t->tid, strerror(errno));
			goto out;
		}
	}
	t->thawed = false;
	if (ptrace(PTRACE_SETOPTIONS, t->tid, NULL, t->options)) {
		ret = -errno;
		snprintf(err, errlen, "PTRACE_SETOPTIONS %d: %s", (int)t->tid, strerror(errno));
		goto out;
	}
	if (ptrace(PTRACE_SETSIGMASK, t->tid, sizeof(t->sigmask), &t->sigmask)) {
		ret = -errno;
		snprintf(err, errlen, "PTRACE_SETSIGMASK %d: %s", (int)t->tid, strerror(errno));
		goto out;
	}
out:
	return ret;
}
