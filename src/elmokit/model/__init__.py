"""The ELMo biLM itself, no I/O beyond its weight files: config and presets, the character
ids, the token encoder, the LSTM stacks, the biLM, the scalar mix, and the weight formats."""
