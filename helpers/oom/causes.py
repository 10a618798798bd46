"""What can make memory run out, and the fixes for each, in the order to try them: ``CAUSES``.

Data only. Which cause a message shows is decided in :mod:`helpers.oom.diagnosis`; the words for
each cause and its general fixes live here, so a new cause is one entry (and one rule there).
"""

from __future__ import annotations

__all__ = ["CAUSES", "GENERATION_STEADY"]

# Cause classes, each with its fixes in the order to try them.
CAUSES: dict[str, tuple[str, tuple[str, ...]]] = {
    "request_too_large": (
        "a single allocation is larger than the whole card",
        (
            "This one tensor can never fit: shrink the dimension that made it (batch size, sequence length, "
            "vocabulary-sized logits; e.g. compute the loss in chunks or keep only the last token's logits)",
            "Load the model quantized (4-bit or 8-bit) or offload layers with device_map='auto'",
        ),
    ),
    "fragmentation": (
        "fragmentation: PyTorch holds enough free cache, but not in one piece",
        (
            "Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before torch touches the GPU (first cell, "
            "then restart): segments grow in place instead of leaving holes between fixed blocks",
            "Call helpers.cleanup() to return the cached blocks, then retry",
            "Keep batch shapes steady (pad to a few fixed lengths): changing shapes fragment the cache",
        ),
    ),
    "held_elsewhere": (
        "memory is held outside this process's PyTorch tensors (another process, an old "
        "kernel, or CUDA context/library workspaces)",
        (
            "Find who holds it: `nvidia-smi` (or helpers.snapshot()); kill the other process, or shut down the "
            "other notebook's kernel (Colab: Runtime > Disconnect and delete runtime)",
            "Restart this runtime if the holder is this process's earlier state",
            "Then retry; if it still fails, follow the steady-state fixes",
        ),
    ),
    "process_cap": (
        "this process hit its own memory cap (torch.cuda.set_per_process_memory_fraction), not the card's limit",
        (
            "If the cap is not deliberate, remove it: torch.cuda.set_per_process_memory_fraction(1.0), or drop "
            "per_process_memory_fraction from PYTORCH_CUDA_ALLOC_CONF",
            "If it is (sharing the GPU, or acting as a smaller card such as a T4), the memory to save is under the "
            "cap: the fixes below apply to it",
        ),
    ),
    "other_gpu_room": (
        "this card ran out while another GPU of this machine has room: the work is not spread over the cards",
        (  # the generic wording; a live report names the cards (_move_fixes)
            "Split the model by each card's free memory: helpers.load(LoadPlan(model, gpus=<GPU count>)) places "
            "its layers so each card keeps room for its share of the KV cache and activations, checked before "
            "loading",
            "Or place it yourself: from_pretrained(..., device_map='sequential', max_memory={...}) with a lower "
            "cap for the card that ran out: 'sequential' fills the cards in order up to each cap, so the layers "
            "it loses go to the next card ('auto' balances the weights alone, leaving generation no room)",
        ),
    ),
    "steady_state": (
        "the model, activations and optimizer state together do not fit the card",
        (
            "Load the model in 4-bit or 8-bit (BitsAndBytesConfig), or a smaller model",
            "Use a smaller batch (helpers.find_max_batch_size), shorter sequences or max_new_tokens",
            "Enable gradient checkpointing (model.gradient_checkpointing_enable())",
            "Use an 8-bit or paged optimizer (optim='paged_adamw_8bit') or LoRA instead of full fine-tuning",
        ),
    ),
    "system_ram": (
        "system RAM, not GPU memory, ran out",
        (
            "Load with low_cpu_mem_usage=True / device_map='auto' so weights go straight to the GPU",
            "Load a safetensors checkpoint in a smaller dtype (torch_dtype=torch.float16 / bfloat16)",
            "Free what the notebook holds: helpers.free('name'), helpers.cleanup(); keep datasets streamed",
            "Check the requested size: a huge request usually means a wrong shape, not a small machine",
        ),
    ),
    "library_workspace": (
        "a CUDA library (cuBLAS/cuDNN) or the driver could not get memory for its workspace",
        (
            "The GPU is full; the library just hit it first: free memory (helpers.cleanup()) and follow the "
            "steady-state fixes",
            "If it happens at the first matmul, another process may hold the card: check nvidia-smi",
        ),
    ),
    "corrupted_size": (
        "the requested size is not a real request (an exabyte, or petabytes): a corrupted or overflowed size, "
        "a bug elsewhere, not a memory shortage",
        (
            "Look for the error before this one: after an NCCL timeout or a failed collective, tensors hold garbage "
            "and sizes computed from them are absurd; fix that first (NCCL_DEBUG=WARN, a longer timeout)",
            "Otherwise check the shape that made it: a negative or overflowed dimension (an int32 product, a size "
            "read from uninitialized memory) becomes a huge unsigned request",
            "No amount of quantization or batch shrinking helps: the size itself is wrong",
        ),
    ),
    "impossible_figures": (
        "the message's figures contradict each other (more in use than the card holds): they are not the card's "
        "real limits",
        (
            "On Windows, the NVIDIA driver lets CUDA spill into shared system RAM (the 'CUDA - Sysmem Fallback "
            "Policy'): allocations beyond the card succeed slowly until RAM runs out too; set 'Prefer No Sysmem "
            "Fallback' in the NVIDIA Control Panel to get an honest OOM at the card's size, then fix that",
            "Otherwise the figures come from a broken allocator or driver state: restart the runtime, update the "
            "driver and PyTorch, and read the figures again",
        ),
    ),
    "xpu_allocation_limit": (
        "an Intel GPU refuses any single allocation of 4 GiB or more, however much memory is free",
        (
            "Split the tensor: allocate and process it in chunks under 4 GiB (smaller batch or sequence per "
            "step, a chunked loss, weights loaded shard by shard); loading in 4-bit does not lift the limit",
            "Newer Intel drivers can lift it for some cards (UR_L0_ENABLE_RELAXED_ALLOCATION_LIMITS=1 with a "
            "recent oneAPI/PyTorch XPU build); check your driver's notes before relying on it",
        ),
    ),
    "other_processes": (
        "other processes hold memory on this GPU, at least as much as the failed request",
        (
            "Stop them: nvidia-smi lists each PID and its memory; an old notebook kernel (another notebook still "
            "open, or this one before a restart) keeps its memory until it is shut down",
            "Under DDP/torchrun, every rank must call torch.cuda.set_device(local_rank) before any CUDA work: "
            "ranks that touch GPU 0 each leave a CUDA context (a few hundred MiB) there",
        ),
    ),
    "page_file": (
        "Windows ran out of commit: RAM plus the page file are used up (not the GPU)",
        (
            "Enlarge the page file (System > Advanced system settings > Performance > Virtual memory: "
            "'System managed', or a fixed size of 1.5-2x RAM on a drive with that much free space), then reboot",
            "Use fewer DataLoader workers (num_workers=0 or 2): on Windows each worker is a new process that "
            "loads torch's CUDA DLLs and commits memory of its own",
            "Load with low_cpu_mem_usage=True and a 16-bit torch_dtype so loading does not commit the weights twice",
        ),
    ),
    "killed_by_os": (
        "the operating system killed the process (SIGKILL): system RAM, or the container's memory limit, ran out",
        (
            "Load with low_cpu_mem_usage=True / device_map='auto' and a 16-bit torch_dtype, from safetensors: "
            "weights go to the GPU shard by shard instead of being held twice in RAM",
            "Confirm it: `dmesg | grep -i -E 'killed process|oom'` (or `docker inspect` showing OOMKilled) names "
            "the OOM killer; in a container, raise its memory limit",
            "Use fewer DataLoader workers and keep datasets streamed or memory-mapped",
        ),
    ),
    "dataloader_worker_killed": (
        "a DataLoader worker was killed by the OS: the workers together used up system RAM",
        (
            "Use fewer workers (num_workers=2, or 0 to test) and a smaller prefetch_factor",
            "Keep the dataset in numpy arrays or memory-mapped files, not Python lists of objects: each worker's "
            "reads touch the objects' reference counts and copy them, so every worker grows to a full copy",
            "Watch RAM during an epoch (helpers.snapshot()); a steady climb is a leak in the dataset or collate",
        ),
    ),
    "shared_memory": (
        "shared memory (/dev/shm) ran out: DataLoader workers pass batches to the main process through it",
        (
            "In Docker, give the container more: --shm-size=8g (or --ipc=host); on Kubernetes, mount an emptyDir "
            "with medium: Memory at /dev/shm",
            "Use fewer workers or smaller batches per worker, or num_workers=0",
            "Or pass tensors through files instead: torch.multiprocessing.set_sharing_strategy('file_system')",
        ),
    ),
    "kernel_died": (
        "the notebook's kernel process died; while loading or training a model that is almost always the OS "
        "killing it for using up system RAM",
        (
            "Load with low_cpu_mem_usage=True / device_map='auto' and a 16-bit torch_dtype (or load_in_4bit) so "
            "the weights never sit in RAM in full",
            "Watch RAM before the cell that dies (helpers.snapshot()) and free what earlier cells hold "
            "(helpers.free('name'), helpers.cleanup())",
            "To see the real error, run the same code as a script: the shell prints 'Killed' for the OOM killer, "
            "or a native crash (segmentation fault) otherwise",
        ),
    ),
    "gguf_buffer": (
        "llama.cpp/ggml asked the driver for a buffer (weights, KV cache or compute) larger than the card had free",
        (
            "Offload fewer layers to the GPU: llama.cpp -ngl / --n-gpu-layers, ollama's num_gpu",
            "Shrink the context (-c / num_ctx): the KV cache and compute buffers grow with it",
            "Use a smaller quantization (e.g. Q4_K_M instead of Q8_0), or check nvidia-smi for other holders",
        ),
    ),
    "vllm_reservation": (
        "vLLM reserves gpu_memory_utilization x the card at startup, and that much is not free: another process "
        "(or an earlier engine in this one) holds the rest",
        (
            "Lower gpu_memory_utilization below free / total (the figures above), or free the card first",
            "An earlier LLM(...) in this notebook still holds its memory: del it, gc.collect(), "
            "torch.cuda.empty_cache(), or restart the runtime; otherwise nvidia-smi names the other process",
        ),
    ),
    "quantized_offload": (
        "the quantized model does not fit on the GPU: device_map put some of its modules on the CPU or disk, which "
        "transformers refuses for bitsandbytes weights unless offloading is asked for",
        (
            "Load it lighter: 4-bit (BitsAndBytesConfig(load_in_4bit=True)) instead of 8-bit, or a smaller model of the "
            "same family; helpers.fit(estimate(model, load=...), 'current') says which fits before loading",
            "Free the GPU first: a model loaded earlier in this notebook still holds memory (del it, helpers.cleanup()), "
            "or restart the runtime",
            "Or offload on purpose: BitsAndBytesConfig(..., llm_int8_enable_fp32_cpu_offload=True) with "
            "device_map='auto' (or a max_memory cap): the modules on the CPU stay 32-bit and run much slower",
        ),
    ),
    "vllm_kv_cache": (
        "vLLM's KV cache does not fit: what gpu_memory_utilization x the card leaves after the weights and "
        "activations cannot hold the cache blocks (or one request of max_model_len tokens)",
        (
            "Lower max_model_len to what fits (the tokens the message says the KV cache can hold)",
            "Raise gpu_memory_utilization (e.g. 0.95) when nothing else uses the card; lower max_num_seqs",
            "Make room: a quantized model (AWQ/GPTQ/fp8), kv_cache_dtype='fp8', or tensor_parallel_size over more GPUs",
        ),
    ),
    "device_memory": (
        "the accelerator ran out of memory; the message states the request but not what else held the card",
        (
            "Use a smaller batch (or shorter sequences, smaller images) per step",
            "Use a lower precision (mixed precision / bfloat16 or float16) and release models you no longer use",
            "Check that no other process holds the card (nvidia-smi; Task Manager > Performance > GPU on Windows)",
        ),
    ),
    "unknown": (
        "the message does not say enough to tell",
        ("Run helpers.snapshot() to see what the GPU and RAM hold now, then retry with a smaller batch",),
    ),
}


# The steady state of a generate() call (seen in the traceback, or simulated_budget's message): a KV cache and
# activations, no optimizer; the fixes in the order to try them (the notebook's knobs come first, named).
GENERATION_STEADY = (
    "generating: the weights, the KV cache (batch x (prompt + new tokens)) and the activations together do not "
    "fit the card",
    (
        "Generate fewer sequences at once or fewer new tokens (max_new_tokens): helpers.safe_generate finds the "
        "batch that fits by itself and retries after an OOM",
        "Shrink the KV cache: LoadPlan(..., kv_cache='int4') or 'fp8' quantizes it, kv_cache='offload' keeps it "
        "in CPU RAM",
        "Load the model in 4-bit or 8-bit (BitsAndBytesConfig, LoadPlan(load='nf4')), or a smaller model",
    ),
)
