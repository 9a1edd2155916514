"""Repository maintenance: prune, verify, repair, usage."""
