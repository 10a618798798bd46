"""Where a model goes: the device plan on the meta device, the fits table, and the one placement decision with its fixes past one card."""
