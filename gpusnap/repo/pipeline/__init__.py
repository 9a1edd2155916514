"""The dump side of the repository: staging, the page table and the per-image sinks."""
