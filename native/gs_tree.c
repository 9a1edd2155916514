/* gpusnap: the processes of a tree (see gs_tree.h). */
#define _GNU_SOURCE
#include "gs_tree.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static size_t add_children(int pid, int *out, size_t n, size_t max)
{
	char path[512], buf[4096], *tok, *save = NULL;
	struct dirent *de;
	DIR *d;
	FILE *f;

	snprintf(path, sizeof(path), "/proc/%d/task", pid);
	d = opendir(path);
	if (d == NULL)
		return n;
	while ((de = readdir(d)) != NULL && n < max) {
		if (de->d_name[0] < '0' || de->d_name[0] > '9')
			continue;
		snprintf(path, sizeof(path), "/proc/%d/task/%s/children", pid, de->d_name);
		f = fopen(path, "re");
		if (f == NULL)
			continue;
		while (n < max && fgets(buf, sizeof(buf), f)) {
			for (tok = strtok_r(buf, " \n", &save); tok && n < max; tok = strtok_r(NULL, " \n", &save)) {
				int c = atoi(tok);
				size_t i;

				for (i = 0; i < n && out[i] != c; i++)
					;
				if (c > 0 && i == n)
					out[n++] = c;
			}
		}
		fclose(f);
	}
	closedir(d);
	return n;
}

int gs_tree_pids(int root, int *out, size_t max)
{
	char path[64];
	struct stat st;
	size_t n = 0, i;

	snprintf(path, sizeof(path), "/proc/%d", root);
	if (max == 0 || stat(path, &st))
		return -1;
	out[n++] = root;
	for (i = 0; i < n && n < max; i++)
		n = add_children(out[i], out, n, max);
	return (int)n;
}
