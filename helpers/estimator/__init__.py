"""Memory estimator: exact weight bytes for every load mode, plus KV cache, activations and training.

The architecture is built once on the meta device (no memory, no download) and every parameter is
counted per module, so bitsandbytes' real layout applies layer by layer: which ``nn.Linear`` get
quantized (transformers' own skip rules), int8 row scales, 4-bit packing with absmax per block of
64 and the nested (double-quant) state. Everything else is a formula or a rule of thumb, and each
row of the breakdown says which.

    >>> est = estimate("mistralai/Mistral-7B-v0.1", load="nf4")   # doctest: +SKIP
    >>> fit_one_card(est, "t4")                                   # doctest: +SKIP

Modules: ``rows`` (the row type and error), ``configs`` (what the user named -> a config),
``layout`` (weights per module on the meta device), ``inference`` (generation rows: KV cache,
prefill and what kernels add to it), ``training`` (training-step rows), ``core`` (``estimate``),
``hub_headers`` (exact weights from a hub repo's safetensors headers), ``prequantized`` (a checkpoint's own
quantization_config), ``kernel_paths`` (mxfp4/fp8 kept or dequantized on a machine, and their weights),
``fitting`` (``fit_one_card``, the verdict on a card, and its ranked fixes; ``helpers.fit`` adds the fixes past one card), ``footprint`` (a loaded model), ``family_rows`` (encoder-decoder
and VLM generation rows), ``family_training`` (their LoRA steps' activations), ``families`` (decoder-only,
encoder-decoder, speech, vision-language: the Auto class and the modules kept unquantized).
"""
