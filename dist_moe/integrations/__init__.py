"""Engine adapters (DeepSpeed, Megatron-core); one module per engine."""
