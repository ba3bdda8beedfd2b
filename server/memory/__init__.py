"""The one device pool (KV pages, expert slots, workspaces) and the expert cache."""
