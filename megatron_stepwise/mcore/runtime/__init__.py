"""Process groups and the CPU stand-ins for megatron-core and Megatron-LM."""
