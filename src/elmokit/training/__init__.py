"""Training the biLM: corpus preparation, vocabulary, data windows, the LM objective, the
training engine (recurrence, softmax), the loop, checkpoints, metrics and perplexity."""
