/* gpusnap: GPU UUID and GPU map parsing (see gs_gpumap.h). */
#include "gs_gpumap.h"

#include <ctype.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

static int hexval(char c)
{
	if (c >= '0' && c <= '9')
		return c - '0';
	if (c >= 'a' && c <= 'f')
		return c - 'a' + 10;
	if (c >= 'A' && c <= 'F')
		return c - 'A' + 10;
	return -1;
}

int gs_parse_uuid(const char *s, size_t len, unsigned char out[GS_UUID_LEN])
{
	/* positions of the dashes in the 36-character body */
	static const size_t dash_at[] = { 8, 13, 18, 23 };
	unsigned char tmp[GS_UUID_LEN];
	size_t i, d = 0, nib = 0;
	int ret = -1;

	if (len >= 4 && strncasecmp(s, "GPU-", 4) == 0) {
		s += 4;
		len -= 4;
	}
	if (len != 36)
		goto out;

	for (i = 0; i < len; i++) {
		int v;

		if (d < 4 && i == dash_at[d]) {
			if (s[i] != '-')
				goto out;
			d++;
			continue;
		}
		v = hexval(s[i]);
		if (v < 0)
			goto out;
		if (nib % 2 == 0)
			tmp[nib / 2] = (unsigned char)(v << 4);
		else
			tmp[nib / 2] |= (unsigned char)v;
		nib++;
	}
	if (nib != 2 * GS_UUID_LEN)
		goto out;

	memcpy(out, tmp, GS_UUID_LEN);
	ret = 0;
out:
	return ret;
}

void gs_format_uuid(const unsigned char u[GS_UUID_LEN], char out[GS_UUID_STR_SIZE])
{
	snprintf(out, GS_UUID_STR_SIZE,
		 "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1], u[2],
		 u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
}

static void trim(const char **b, const char **e)
{
	while (*b < *e && isspace((unsigned char)**b))
		(*b)++;
	while (*e > *b && isspace((unsigned char)(*e)[-1]))
		(*e)--;
}

int gs_parse_gpu_map(const char *s, struct gs_gpu_pair *out, size_t max, char *err, size_t errlen)
{
	const char *p, *end;
	size_t n = 0, item = 0, i;
	int ret = -1;

	if (err && errlen)
		err[0] = '\0';
	if (s == NULL) {
		ret = 0;
		goto out;
	}

	p = s;
	end = s + strlen(s);
	trim(&p, &end);
	if (p == end) {
		ret = 0;
		goto out;
	}

	while (p <= end) {
		const char *comma = memchr(p, ',', (size_t)(end - p));
		const char *ib = p, *ie = comma ? comma : end, *eq, *ob, *oe, *nb, *ne;
		struct gs_gpu_pair pair;

		item++;
		trim(&ib, &ie);
		if (ib == ie) {
			snprintf(err, errlen, "item %zu is empty", item);
			goto out;
		}
		eq = memchr(ib, '=', (size_t)(ie - ib));
		if (eq == NULL) {
			snprintf(err, errlen, "item %zu '%.*s' is not OLD=NEW", item, (int)(ie - ib), ib);
			goto out;
		}
		ob = ib;
		oe = eq;
		nb = eq + 1;
		ne = ie;
		trim(&ob, &oe);
		trim(&nb, &ne);
		if (gs_parse_uuid(ob, (size_t)(oe - ob), pair.old_uuid)) {
			snprintf(err, errlen, "item %zu: '%.*s' is not a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)",
				 item, (int)(oe - ob), ob);
			goto out;
		}
		if (gs_parse_uuid(nb, (size_t)(ne - nb), pair.new_uuid)) {
			snprintf(err, errlen, "item %zu: '%.*s' is not a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)",
				 item, (int)(ne - nb), nb);
			goto out;
		}
		for (i = 0; i < n; i++) {
			if (memcmp(out[i].old_uuid, pair.old_uuid, GS_UUID_LEN) == 0) {
				snprintf(err, errlen, "item %zu: GPU '%.*s' is mapped twice", item, (int)(oe - ob), ob);
				goto out;
			}
		}
		if (n >= max || n >= GS_GPU_MAP_MAX) {
			snprintf(err, errlen, "more than %zu GPU pairs", max < GS_GPU_MAP_MAX ? max : (size_t)GS_GPU_MAP_MAX);
			goto out;
		}
		out[n++] = pair;
		if (comma == NULL)
			break;
		p = comma + 1;
	}
	ret = (int)n;
out:
	return ret;
}
