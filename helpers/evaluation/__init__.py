"""Evaluation that never loses a result: prompts, the crash-safe results file, a result's identity, scoring, adaptive batches, the report."""
