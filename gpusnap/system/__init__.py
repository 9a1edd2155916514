"""Facts about this machine and its processes, shared by preflight, doctor and the runners."""
