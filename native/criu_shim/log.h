/*
 * gpusnap: stand-in for the "log.h" that <criu/criu-log.h> includes but that
 * Debian's libcriu-dev does not ship. It declares only CRIU's public logging
 * entry point and its level numbers (both resolved from the criu binary when
 * the plugin is loaded). CMake adds this directory to the include path only
 * when <criu/criu-log.h> does not compile on its own.
 */
#ifndef GPUSNAP_CRIU_SHIM_LOG_H
#define GPUSNAP_CRIU_SHIM_LOG_H

#define LOG_MSG	  (0)
#define LOG_ERROR (1)
#define LOG_WARN  (2)
#define LOG_INFO  (3)
#define LOG_DEBUG (4)

extern void print_on_level(unsigned int loglevel, const char *format, ...)
	__attribute__((__format__(__printf__, 2, 3)));

#endif
