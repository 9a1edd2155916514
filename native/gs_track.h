/*
 * gpusnap: what the plugin did to each CUDA process, and what must be undone.
 * Pure logic: no CRIU, no ptrace, no driver.
 */
#ifndef GPUSNAP_GS_TRACK_H
#define GPUSNAP_GS_TRACK_H

#include <stdbool.h>
#include <stddef.h>

/* Same numbering as the driver's CUprocessState, plus "unknown". */
enum gs_state {
	GS_RUNNING = 0,
	GS_LOCKED = 1,
	GS_CHECKPOINTED = 2,
	GS_FAILED = 3,
	GS_UNKNOWN = 4,
};

const char *gs_state_name(enum gs_state s);
enum gs_state gs_state_from_int(int v);

struct gs_proc {
	int pid;
	int tid;		 /* CUDA restore thread */
	enum gs_state initial;	 /* as found by PAUSE_DEVICES */
	enum gs_state current;	 /* as last left by the plugin */
	bool locked_by_us;	 /* we took the lock (undo: unlock) */
	bool checkpointed_by_us; /* we checkpointed (undo: restore) */
	bool image_checkpointed; /* GPU memory was in host memory when dumped */
};

struct gs_table {
	struct gs_proc *v;
	size_t n, cap;
};

void gs_table_init(struct gs_table *t);
void gs_table_free(struct gs_table *t);
struct gs_proc *gs_table_find(struct gs_table *t, int pid);
/* Adds (or returns the existing) entry for pid; NULL when out of memory. */
struct gs_proc *gs_table_add(struct gs_table *t, int pid, int tid, enum gs_state initial);

/* Steps for the driver, in this order. */
struct gs_plan {
	bool restore;
	bool unlock;
};

/*
 * End of a dump. Nothing is undone when the dump succeeded and the job is
 * about to exit (leave_running false): it stays checkpointed and is killed.
 * Otherwise (success with the job running on, or any failure) everything the
 * plugin did is undone so that the process is back in the state it was
 * found in: restore what we checkpointed, unlock what we locked.
 */
struct gs_plan gs_dump_end_plan(const struct gs_proc *p, bool dump_failed, bool leave_running);

/* The state the process is in after gs_dump_end_plan's steps succeed. */
enum gs_state gs_plan_result(const struct gs_proc *p, struct gs_plan plan);

/*
 * RESUME_DEVICES_LATE on restore: from the state the driver reports, the
 * steps that bring the process to RUNNING. Returns -1 for states that cannot
 * be brought back (FAILED, UNKNOWN).
 */
int gs_restore_plan(enum gs_state s, struct gs_plan *plan);

#endif
