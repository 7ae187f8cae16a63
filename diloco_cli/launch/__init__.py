"""Launchers: resolve a run, start its processes (here or over SSH), supervise and stop them."""
