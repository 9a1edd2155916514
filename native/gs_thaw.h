/*
 * gpusnap: let one thread of a ptrace-frozen process run for a while, then
 * stop it again as CRIU had left it. Used on the CUDA restore thread while
 * the rest of the tree stays frozen. No CRIU dependency.
 */
#ifndef GPUSNAP_GS_THAW_H
#define GPUSNAP_GS_THAW_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

struct gs_thaw {
	pid_t tid;
	bool thawed;	  /* we resumed it and must stop it again */
	uint64_t sigmask; /* its signal mask as CRIU left it */
	int options;	  /* ptrace options to put back */
};

/*
 * Resumes tid if it is in a ptrace-stop of ours. A thread that is not traced
 * by us (the hook ran before CRIU seized the process, or after it let it go)
 * is left alone: t->thawed stays false and 0 is returned.
 * While it runs, every signal is blocked in it and seccomp suspension is off.
 * Returns 0 or -errno; the message goes to err.
 */
int gs_thaw_thread(pid_t tid, struct gs_thaw *t, char *err, size_t errlen);

/*
 * Stops a thread gs_thaw_thread resumed (PTRACE_INTERRUPT, wait for the
 * stop) and puts back its signal mask and ptrace options. No-op when it was
 * not thawed. Returns 0 or -errno.
 */
int gs_refreeze_thread(struct gs_thaw *t, char *err, size_t errlen);

#endif
