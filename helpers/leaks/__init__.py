"""Leak hunting: which variable holds the memory, is it growing, and which pattern is to blame.

- :func:`census` lists every live tensor (views counted once by storage, tensors kept alive by an
  autograd graph included) and names who holds it: ``losses[12]``, ``cache["512x512"]``,
  ``trainer.model.layers[3].mlp.up_proj.weight``, ``Out[7]``.
- :func:`census_diff` says what appeared and survived between two censuses, by holder.
- :class:`GrowthDetector` / :func:`watch` follow memory step by step and tell a leak (sustained
  growth) from warm-up and from a cache that fills up and then stays flat.
- :func:`leak_checks` looks for the usual culprits and gives the fix for each.
- :func:`record_allocations` (CUDA) records allocation history for PyTorch's memory visualizer and
  summarizes the top allocation sites.

Memory for the detector is CUDA allocated on every card (``allocated("all")``) and, elsewhere, the bytes of
live tensors found by the census (so the detector works the same on a CPU-only machine).
"""
