/*
 * gpusnap: parsing of GPU UUIDs and of the GPUSNAP_GPU_MAP restore remapping.
 * Pure logic: no CRIU, no ptrace, no driver.
 */
#ifndef GPUSNAP_GS_GPUMAP_H
#define GPUSNAP_GS_GPUMAP_H

#include <stddef.h>

#define GS_UUID_LEN	 16
#define GS_GPU_MAP_MAX	 64
/* "GPU-" + 36 characters + NUL */
#define GS_UUID_STR_SIZE 41

struct gs_gpu_pair {
	unsigned char old_uuid[GS_UUID_LEN];
	unsigned char new_uuid[GS_UUID_LEN];
};

/*
 * Parses one UUID of exactly len characters: either nvidia-smi's form
 * "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" or the same without the "GPU-"
 * prefix, hex digits in either case. Returns 0, or -1 when malformed.
 */
int gs_parse_uuid(const char *s, size_t len, unsigned char out[GS_UUID_LEN]);

/* Writes the nvidia-smi form (lower case) into out. */
void gs_format_uuid(const unsigned char uuid[GS_UUID_LEN], char out[GS_UUID_STR_SIZE]);

/*
 * Parses "OLD=NEW[,OLD=NEW...]" (blanks around items allowed). NULL or an
 * all-blank string gives zero pairs. Rejects empty items, malformed UUIDs,
 * the same OLD twice and more than GS_GPU_MAP_MAX pairs.
 * Returns the number of pairs written to out (at most max), or -1 with a
 * message in err.
 */
int gs_parse_gpu_map(const char *s, struct gs_gpu_pair *out, size_t max, char *err, size_t errlen);

#endif
