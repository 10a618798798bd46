"""Fine-tuning: the QLoRA plan, data, adapters, the training loop with kill-safe checkpoints, the live view, multi-GPU memory and launches."""
