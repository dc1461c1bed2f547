"""One module per command noun; each exposes `COMMANDS`, a list of click commands."""
