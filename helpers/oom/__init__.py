"""An OOM and after: reading any out-of-memory message, its causes and fixes, the IPython hook, getting memory back, retrying, batch search."""
