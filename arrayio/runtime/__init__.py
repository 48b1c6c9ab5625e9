"""Process-wide concerns of a transfer: pausing the garbage collector, the memory available
to a load, progress bars, and how sizes and counts are written."""
