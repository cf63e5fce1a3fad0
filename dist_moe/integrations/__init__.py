"""Engine adapters (DeepSpeed, Megatron-core, transformers); one module per engine."""
