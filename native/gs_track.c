/* gpusnap: per-process state tracking and undo decisions (see gs_track.h). */
#include "gs_track.h"

#include <stdlib.h>
#include <string.h>

const char *gs_state_name(enum gs_state s)
{
	switch (s) {
	case GS_RUNNING:
		return "running";
	case GS_LOCKED:
		return "locked";
	case GS_CHECKPOINTED:
		return "checkpointed";
	case GS_FAILED:
		return "failed";
	default:
		return "unknown";
	}
}

enum gs_state gs_state_from_int(int v)
{
	if (v >= GS_RUNNING && v <= GS_FAILED)
		return (enum gs_state)v;
	return GS_UNKNOWN;
}

void gs_table_init(struct gs_table *t)
{
	memset(t, 0, sizeof(*t));
}

void gs_table_free(struct gs_table *t)
{
	free(t->v);
	gs_table_init(t);
}

struct gs_proc *gs_table_find(struct gs_table *t, int pid)
{
	size_t i;

	for (i = 0; i < t->n; i++)
		if (t->v[i].pid == pid)
			return &t->v[i];
	return NULL;
}

struct gs_proc *gs_table_add(struct gs_table *t, int pid, int tid, enum gs_state initial)
{
	struct gs_proc *p = gs_table_find(t, pid);

	if (p)
		goto out;
	if (t->n == t->cap) {
		size_t cap = t->cap ? 2 * t->cap : 8;
		struct gs_proc *v = realloc(t->v, cap * sizeof(*v));

		if (v == NULL)
			goto out;
		t->v = v;
		t->cap = cap;
	}
	p = &t->v[t->n++];
	memset(p, 0, sizeof(*p));
	p->pid = pid;
	p->tid = tid;
	p->initial = initial;
	p->current = initial;
out:
	return p;
}

struct gs_plan gs_dump_end_plan(const struct gs_proc *p, bool dump_failed, bool leave_running)
{
	struct gs_plan plan = { false, false };

	if (!dump_failed && !leave_running)
		goto out;
	plan.restore = p->checkpointed_by_us && p->current == GS_CHECKPOINTED;
	plan.unlock = p->locked_by_us && (p->current == GS_LOCKED || plan.restore);
out:
	return plan;
}

enum gs_state gs_plan_result(const struct gs_proc *p, struct gs_plan plan)
{
	enum gs_state s = p->current;

	if (plan.restore && s == GS_CHECKPOINTED)
		s = GS_LOCKED;
	if (plan.unlock && s == GS_LOCKED)
		s = GS_RUNNING;
	return s;
}

int gs_restore_plan(enum gs_state s, struct gs_plan *plan)
{
	int ret = 0;

	plan->restore = false;
	plan->unlock = false;
	switch (s) {
	case GS_CHECKPOINTED:
		plan->restore = true;
		plan->unlock = true;
		break;
	case GS_LOCKED:
		plan->unlock = true;
		break;
	case GS_RUNNING:
		break;
	default:
		ret = -1;
	}
	return ret;
}
