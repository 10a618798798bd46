"""The widgets: the load panel and its states over one or several GPUs, and the training panel."""
