/*
 * gpusnap: the processes of a tree, read from /proc (children of every
 * thread). No CRIU, no driver.
 */
#ifndef GPUSNAP_GS_TREE_H
#define GPUSNAP_GS_TREE_H

#include <stddef.h>

/*
 * Writes root and its descendants into out (root first, then breadth-first),
 * at most max. Returns how many were written, or -1 when root does not exist.
 */
int gs_tree_pids(int root, int *out, size_t max);

#endif
