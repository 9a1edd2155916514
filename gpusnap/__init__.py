"""gpusnap: transparent CRIU snapshots of running processes, GPU state included."""

__version__ = "0.1.0"
