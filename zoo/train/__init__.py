"""Training aids: LoRA and PEFT's layout (lora), QLoRA's 4-bit base (quant), FLOPs and MFU (flops),
swapping parameters without untying them (params)."""
