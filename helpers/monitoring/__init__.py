"""Memory over time: the sampling monitor and its chart, the Trainer callback, per-cell accounting."""
