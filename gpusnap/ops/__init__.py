"""Operations: one module per command (or per part of one), each called by the thin CLI."""
