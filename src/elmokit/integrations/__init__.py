"""Thin adapters that put elmokit's ELMo inside the libraries its users already work in.

One module per library; each imports its library itself (after `elmokit.extras.require` has
checked it is installed) and elmokit's public API, and nothing else in elmokit imports them, so
importing this package needs none of those libraries:

    elmokit.integrations.flair   `ELMoEmbeddings`, Flair's token embeddings    (pip install 'elmokit[flair]')
    elmokit.integrations.spacy   the `elmo` pipe of spaCy: nlp.add_pipe("elmo") (pip install 'elmokit[spacy]')
    elmokit.integrations.sentence_transformers  `ELMoSentenceEncoder`, the module of `elmo convert
                                 --to-sentence-transformers` folders (pip install 'elmokit[sentence-transformers]')
    elmokit.integrations.huggingface  `HuggingFaceBiLM`: save_pretrained / from_pretrained / push_to_hub of native
                                 folders, and the Hub's model card (the same extra)
    elmokit.integrations.langchain  `ELMoEmbeddings`, LangChain's Embeddings of elmo serve's sentence
                                 vectors, in-process or from a running server (pip install 'elmokit[langchain]')
    elmokit.integrations.llama_index  `ELMoEmbedding`, LlamaIndex's BaseEmbedding of the same vectors
                                 (pip install llama-index-core)
    elmokit.integrations.texts   the backend of those two: texts -> elmo serve's sentence vectors,
                                 here or from a server (no third-party import)

docs/integrations.md shows each in use, what is exact and how it is tested.
"""
