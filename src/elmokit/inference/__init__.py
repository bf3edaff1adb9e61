"""How vectors are made fast: the streaming recurrence and packed kernels, the token cache,
the AllenNLP / TF-Hub modules, the embedder, and embedding files."""
