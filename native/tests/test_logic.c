/* gpusnap: host unit tests of the plugin's pure logic (GPU map, tracking). */
#include <stdio.h>
#include <string.h>

#include "gs_gpumap.h"
#include "gs_track.h"
#include "gs_tree.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

static int failures, checks;

#define CHECK(cond)                                                              \
	do {                                                                     \
		checks++;                                                        \
		if (!(cond)) {                                                   \
			failures++;                                              \
			fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
		}                                                                \
	} while (0)

#define U1 "GPU-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9"
#define U2 "GPU-11111111-2222-3333-4444-555555555555"
#define U3 "gpu-AAAAAAAA-BBBB-CCCC-DDDD-EEEEEEEEEEEE"

static void test_uuid(void)
{
	unsigned char u[GS_UUID_LEN];
	char s[GS_UUID_STR_SIZE];
	static const unsigned char want[GS_UUID_LEN] = { 0x0a, 0x1b, 0x2c, 0x3d, 0x4e, 0x5f, 0x60, 0x71,
							  0x82, 0x93, 0xa4, 0xb5, 0xc6, 0xd7, 0xe8, 0xf9 };

	CHECK(gs_parse_uuid(U1, strlen(U1), u) == 0);
	CHECK(memcmp(u, want, GS_UUID_LEN) == 0);
	gs_format_uuid(u, s);
	CHECK(strcmp(s, U1) == 0);
	/* without prefix, upper case, prefix in any case */
	CHECK(gs_parse_uuid(U1 + 4, strlen(U1) - 4, u) == 0 && memcmp(u, want, GS_UUID_LEN) == 0);
	CHECK(gs_parse_uuid(U3, strlen(U3), u) == 0 && u[0] == 0xaa && u[15] == 0xee);
	/* malformed */
	CHECK(gs_parse_uuid("", 0, u) == -1);
	CHECK(gs_parse_uuid("GPU-", 4, u) == -1);
	CHECK(gs_parse_uuid("GPU-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f", 39, u) == -1);	  /* short */
	CHECK(gs_parse_uuid("GPU-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f99", 41, u) == -1); /* long */
	CHECK(gs_parse_uuid("GPU-0a1b2c3d-4e5f-6071-8293xa4b5c6d7e8f9", 40, u) == -1);  /* dash */
	CHECK(gs_parse_uuid("GPU-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8fg", 40, u) == -1);  /* hex */
	CHECK(gs_parse_uuid("MIG-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9", 40, u) == -1);  /* prefix */
	CHECK(gs_parse_uuid("0", 1, u) == -1);						  /* index */
	/* length is honoured: trailing text after len is ignored */
	CHECK(gs_parse_uuid(U1 "=x", strlen(U1), u) == 0);
}

static void test_gpu_map(void)
{
	struct gs_gpu_pair p[GS_GPU_MAP_MAX + 1];
	char err[256], big[64 * 100];
	int i, n;

	CHECK(gs_parse_gpu_map(NULL, p, GS_GPU_MAP_MAX, err, sizeof(err)) == 0);
	CHECK(gs_parse_gpu_map("", p, GS_GPU_MAP_MAX, err, sizeof(err)) == 0);
	CHECK(gs_parse_gpu_map("  ", p, GS_GPU_MAP_MAX, err, sizeof(err)) == 0);

	n = gs_parse_gpu_map(U1 "=" U2, p, GS_GPU_MAP_MAX, err, sizeof(err));
	CHECK(n == 1);
	CHECK(p[0].old_uuid[0] == 0x0a && p[0].new_uuid[0] == 0x11);

	n = gs_parse_gpu_map(" " U1 " = " U2 " , " U2 "=" U1 " ", p, GS_GPU_MAP_MAX, err, sizeof(err));
	CHECK(n == 2);
	CHECK(p[1].old_uuid[0] == 0x11 && p[1].new_uuid[15] == 0xf9);

	/* identity mapping is allowed */
	CHECK(gs_parse_gpu_map(U1 "=" U1, p, GS_GPU_MAP_MAX, err, sizeof(err)) == 1);

	CHECK(gs_parse_gpu_map(U1 "=" U2 ",", p, GS_GPU_MAP_MAX, err, sizeof(err)) == -1);
	CHECK(strstr(err, "empty") != NULL);
	CHECK(gs_parse_gpu_map("," U1 "=" U2, p, GS_GPU_MAP_MAX, err, sizeof(err)) == -1);
	CHECK(gs_parse_gpu_map(U1 "=" U2 ",," U2 "=" U1, p, GS_GPU_MAP_MAX, err, sizeof(err)) == -1);
	CHECK(gs_parse_gpu_map(U1, p, GS_GPU_MAP_MAX, err, sizeof(err)) == -1);
	CHECK(strstr(err, "OLD=NEW") != NULL);
	CHECK(gs_parse_gpu_map(U1 "=", p, GS_GPU_MAP_MAX, err, sizeof(err)) == -1);
	CHECK(gs_parse_gpu_map("=" U1, p, GS_GPU_MAP_MAX, err, sizeof(err)) == -1);
	CHECK(gs_parse_gpu_map("0=1", p, GS_GPU_MAP_MAX, err, sizeof(err)) == -1);
	CHECK(strstr(err, "not a GPU UUID") != NULL);
	CHECK(gs_parse_gpu_map(U1 "=" U2 "=" U1, p, GS_GPU_MAP_MAX, err, sizeof(err)) == -1);
	/* same old GPU twice */
	CHECK(gs_parse_gpu_map(U1 "=" U2 "," U1 "=" U1, p, GS_GPU_MAP_MAX, err, sizeof(err)) == -1);
	CHECK(strstr(err, "twice") != NULL);

	/* capacity: max given by the caller */
	CHECK(gs_parse_gpu_map(U1 "=" U2 "," U2 "=" U1, p, 1, err, sizeof(err)) == -1);

	/* 64 distinct pairs fit, 65 do not */
	big[0] = '\0';
	for (i = 0; i < GS_GPU_MAP_MAX + 1; i++) {
		char item[100];

		snprintf(item, sizeof(item), "%sGPU-%08x-0000-0000-0000-000000000000=" U2, i ? "," : "", i);
		strcat(big, item);
		if (i == GS_GPU_MAP_MAX - 1)
			CHECK(gs_parse_gpu_map(big, p, GS_GPU_MAP_MAX + 1, err, sizeof(err)) == GS_GPU_MAP_MAX);
	}
	CHECK(gs_parse_gpu_map(big, p, GS_GPU_MAP_MAX + 1, err, sizeof(err)) == -1);
}

static void test_table(void)
{
	struct gs_table t;
	struct gs_proc *a, *b;
	int i;

	gs_table_init(&t);
	CHECK(gs_table_find(&t, 1) == NULL);
	a = gs_table_add(&t, 10, 11, GS_RUNNING);
	CHECK(a && a->pid == 10 && a->tid == 11 && a->initial == GS_RUNNING && a->current == GS_RUNNING);
	CHECK(!a->locked_by_us && !a->checkpointed_by_us);
	b = gs_table_add(&t, 10, 99, GS_LOCKED); /* same pid: existing entry */
	CHECK(b == a && b->tid == 11);
	for (i = 0; i < 100; i++)
		CHECK(gs_table_add(&t, 100 + i, 1, GS_LOCKED) != NULL);
	CHECK(t.n == 101);
	CHECK(gs_table_find(&t, 10)->tid == 11);
	CHECK(gs_table_find(&t, 199)->initial == GS_LOCKED);
	gs_table_free(&t);
	CHECK(t.n == 0 && t.v == NULL);

	CHECK(strcmp(gs_state_name(GS_CHECKPOINTED), "checkpointed") == 0);
	CHECK(strcmp(gs_state_name(gs_state_from_int(42)), "unknown") == 0);
	CHECK(gs_state_from_int(1) == GS_LOCKED);
}

static struct gs_proc mk(enum gs_state initial, enum gs_state current, int locked, int ckpt)
{
	struct gs_proc p;

	memset(&p, 0, sizeof(p));
	p.pid = 1;
	p.tid = 2;
	p.initial = initial;
	p.current = current;
	p.locked_by_us = locked;
	p.checkpointed_by_us = ckpt;
	return p;
}

static void test_dump_end_plan(void)
{
	struct gs_proc p;
	struct gs_plan pl;
	int failed, leave;

	/* locked and checkpointed by us */
	p = mk(GS_RUNNING, GS_CHECKPOINTED, 1, 1);
	pl = gs_dump_end_plan(&p, false, true); /* success, keeps running */
	CHECK(pl.restore && pl.unlock);
	CHECK(gs_plan_result(&p, pl) == GS_RUNNING);
	pl = gs_dump_end_plan(&p, true, false); /* failed --exit dump */
	CHECK(pl.restore && pl.unlock);
	pl = gs_dump_end_plan(&p, true, true);
	CHECK(pl.restore && pl.unlock);
	pl = gs_dump_end_plan(&p, false, false); /* success, job exits: leave it */
	CHECK(!pl.restore && !pl.unlock);
	CHECK(gs_plan_result(&p, pl) == GS_CHECKPOINTED);

	/* locked only (checkpoint failed or never reached) */
	p = mk(GS_RUNNING, GS_LOCKED, 1, 0);
	pl = gs_dump_end_plan(&p, true, false);
	CHECK(!pl.restore && pl.unlock);
	CHECK(gs_plan_result(&p, pl) == GS_RUNNING);

	/* lock timed out: still running, nothing to undo */
	p = mk(GS_RUNNING, GS_RUNNING, 0, 0);
	for (failed = 0; failed < 2; failed++)
		for (leave = 0; leave < 2; leave++) {
			pl = gs_dump_end_plan(&p, failed, leave);
			CHECK(!pl.restore && !pl.unlock);
		}

	/* found locked by someone else: restore what we checkpointed, keep the lock */
	p = mk(GS_LOCKED, GS_CHECKPOINTED, 0, 1);
	pl = gs_dump_end_plan(&p, false, true);
	CHECK(pl.restore && !pl.unlock);
	CHECK(gs_plan_result(&p, pl) == GS_LOCKED);

	/* found checkpointed: never touched */
	p = mk(GS_CHECKPOINTED, GS_CHECKPOINTED, 0, 0);
	for (failed = 0; failed < 2; failed++)
		for (leave = 0; leave < 2; leave++) {
			pl = gs_dump_end_plan(&p, failed, leave);
			CHECK(!pl.restore && !pl.unlock);
		}

	/* checkpoint failed but the driver left it checkpointed */
	p = mk(GS_RUNNING, GS_CHECKPOINTED, 1, 1);
	pl = gs_dump_end_plan(&p, true, true);
	CHECK(pl.restore && pl.unlock);

	/* failed state: nothing sensible to do */
	p = mk(GS_RUNNING, GS_FAILED, 1, 1);
	pl = gs_dump_end_plan(&p, true, true);
	CHECK(!pl.restore && !pl.unlock);
}

static void test_restore_plan(void)
{
	struct gs_plan pl;

	CHECK(gs_restore_plan(GS_CHECKPOINTED, &pl) == 0 && pl.restore && pl.unlock);
	CHECK(gs_restore_plan(GS_LOCKED, &pl) == 0 && !pl.restore && pl.unlock);
	CHECK(gs_restore_plan(GS_RUNNING, &pl) == 0 && !pl.restore && !pl.unlock);
	CHECK(gs_restore_plan(GS_FAILED, &pl) == -1);
	CHECK(gs_restore_plan(GS_UNKNOWN, &pl) == -1);
}

/* gs_tree_pids: a process, its child and grandchild, root first, each once. */
static void test_tree(void)
{
	int fds[2], pids[16], n, i, have_child = 0, have_grand = 0;
	pid_t child, grand = -1;

	CHECK(gs_tree_pids(0x3fffffff, pids, 16) == -1);
	CHECK(pipe(fds) == 0);
	child = fork();
	if (child == 0) {
		pid_t g = fork();

		if (g == 0) {
			pause();
			_exit(0);
		}
		if (write(fds[1], &g, sizeof(g)) != sizeof(g))
			_exit(1);
		pause();
		_exit(0);
	}
	CHECK(read(fds[0], &grand, sizeof(grand)) == sizeof(grand));
	n = gs_tree_pids(getpid(), pids, 16);
	CHECK(n >= 3);
	CHECK(pids[0] == getpid());
	for (i = 0; i < n; i++) {
		have_child += pids[i] == child;
		have_grand += pids[i] == grand;
	}
	CHECK(have_child == 1 && have_grand == 1);
	CHECK(gs_tree_pids(getpid(), pids, 1) == 1);
	kill(grand, SIGKILL);
	kill(child, SIGKILL);
	waitpid(child, NULL, 0);
	close(fds[0]);
	close(fds[1]);
}

int main(void)
{
	test_tree();
	test_uuid();
	test_gpu_map();
	test_table();
	test_dump_end_plan();
	test_restore_plan();
	printf("%d checks, %d failures\n", checks, failures);
	return failures ? 1 : 0;
}
