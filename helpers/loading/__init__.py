"""Loading a model as planned: the plan, its checks before any weight loads, load(), the report, batched generation, host RAM per rank."""
