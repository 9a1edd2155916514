/* gpusnap's post-dump gate, CRIU's --action-script itself (gpusnap/criu/gate.py). It
 * runs inside the job's freeze, so it must start in a millisecond, not in the 20-150 ms
 * of a Python interpreter.
 *
 *     gpusnap-gate [SOCKET TIMEOUT_S]     (else $GPUSNAP_GATE_SOCK, $GPUSNAP_GATE_TIMEOUT)
 *
 * On CRTOOLS_SCRIPT_ACTION=post-dump: connect to SOCKET, wait for one byte; exit 0 only
 * if it is '1' (every pipe drained into staging). Any failure (gpusnap gone, timeout)
 * exits 1, and CRIU then resumes the job: the gate can delay the job, never keep it
 * frozen. Every other action: exit 0 at once. */
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

int main(int argc, char **argv)
{
	const char *action = getenv("CRTOOLS_SCRIPT_ACTION");
	const char *path = argc == 3 ? argv[1] : getenv("GPUSNAP_GATE_SOCK");
	const char *timeout = argc == 3 ? argv[2] : getenv("GPUSNAP_GATE_TIMEOUT");
	struct sockaddr_un addr;
	struct timeval tv;
	char c = 0;
	int fd;

	if (!action || strcmp(action, "post-dump") != 0)
		return 0;
	if (!path || !timeout || strlen(path) >= sizeof(addr.sun_path))
		return 1;
	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return 1;
	memset(&addr, 0, sizeof(addr));
	addr.sun_family = AF_UNIX;
	strcpy(addr.sun_path, path);
	tv.tv_sec = atol(timeout);
	tv.tv_usec = 0;
	if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) < 0)
		return 1;
	if (connect(fd, (struct sockaddr *)&addr, sizeof(addr)) < 0)
		return 1;
	if (recv(fd, &c, 1, 0) != 1)
		return 1;
	return c == '1' ? 0 : 1;
}
