"""The reaper: hard-deletes what the tracker proves unreferenced past the grace window."""
